// Device indices, the callbacks into the Python device, device memory and pinned host
// memory (see module.cpp for the whole extension):
//
// - device memory: an allocator of PrivateUse1 storages. A storage is an identity: a
//   unique, aligned address (never dereferenced: device memory is not host memory) and,
//   in its DataPtr's context, the Python DeviceStorage (device/memory/storage.py) that holds the
//   bytes in a CPU tensor. The storage owns one reference to it, dropped when the
//   storage is freed. `torch.UntypedStorage(n, device="neuron")` and every storage ATen
//   allocates for the device come from here.
// - storage resizing (`storage.resize_`, FSDP2 frees parameters with resize_(0)):
//   a new address of the new size; the Python side resizes the bytes.
// - pinned host memory, which `pin_memory()` and `DataLoader(pin_memory=True)` ask the
//   current accelerator for: host memory whose allocations are remembered, so
//   `is_pinned()` answers.

#include "neuron.h"

#include <c10/core/CPUAllocator.h>
#include <c10/core/StorageImpl.h>
#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <unordered_set>

namespace neuron {

constexpr uintptr_t kAlignment = 512;

// -- device indices -----------------------------------------------------------------------
c10::DeviceIndex device_count = 1;
c10::DeviceIndex initial_index = 0;
thread_local c10::DeviceIndex thread_index = -1;

c10::DeviceIndex current_index() {
  return thread_index < 0 ? initial_index : thread_index;
}

void check_index(c10::DeviceIndex index) {
  TORCH_CHECK(index >= 0 && index < device_count, "neuron error: invalid device ordinal: neuron:",
              static_cast<int>(index), " does not exist; the neuron device count is ", static_cast<int>(device_count));
}

c10::DeviceIndex exchange_index(c10::DeviceIndex index) {
  c10::DeviceIndex previous = current_index();
  if (index >= 0) {
    check_index(index);
    thread_index = index;
  }
  return previous;
}

// -- callbacks into the Python device -----------------------------------------------------
Callbacks callbacks;

bool python_alive() {
  return Py_IsInitialized() && !_Py_IsFinalizing();
}

void call_synchronize() {
  if (callbacks.synchronize == nullptr || !python_alive()) {
    return;
  }
  py::gil_scoped_acquire gil;
  PyObject* result = PyObject_CallNoArgs(callbacks.synchronize);
  if (result == nullptr) {
    throw py::error_already_set();
  }
  Py_DECREF(result);
}

// -- device memory ------------------------------------------------------------------------
namespace {

std::atomic<uintptr_t> next_address{uintptr_t(1) << 44};

// Live allocations by start address, for storages ATen makes over a device address it got
// from another storage: `at::from_blob(storage.data_ptr())` (torch.save copies a storage
// to the host so) aliases the whole allocation, and a sliced UntypedStorage
// (`storage[a:b]`, a storage view) starts inside it. Ordered, so the allocation holding
// an address is the last one starting at or before it.
std::mutex addresses_mutex;
std::map<uintptr_t, Owner*> owners_by_address;

// The live allocation holding [address, address + nbytes), and the offset of `address` in
// it; nullptr when no allocation holds it. A storage of no bytes may start at the very end
// of its allocation (`storage[n:]`); one at an allocation's own address is that
// allocation's, whatever its size (as the exact-address map answered). The caller holds
// addresses_mutex.
Owner* containing(uintptr_t address, size_t nbytes, size_t* offset) {
  auto after = owners_by_address.upper_bound(address);
  if (after == owners_by_address.begin()) {
    return nullptr;
  }
  auto found = std::prev(after);
  Owner* owner = found->second;
  size_t into = address - found->first;
  if (into != 0 && (into > owner->nbytes || nbytes > owner->nbytes - into)) {
    return nullptr;
  }
  if (offset != nullptr) {
    *offset = into;
  }
  return owner;
}

void release_owner(void* context) {
  auto* owner = static_cast<Owner*>(context);
  if (owner->address != 0) {
    {
      std::lock_guard<std::mutex> lock(addresses_mutex);
      owners_by_address.erase(owner->address);
    }
    profiler::report_memory(owner->address, -static_cast<int64_t>(owner->nbytes), owner->index);
  }
  if ((owner->side != nullptr || owner->signature != nullptr) && python_alive()) {
    py::gil_scoped_acquire gil;
    // Often freed while an exception propagates (a temporary dropped as the frame unwinds):
    // nothing here may clear or replace it.
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    if (owner->side != nullptr) {
      // the storage is gone: nothing can read this value any more (DeviceStorage.alive)
      set_storage_alive(owner->side, false);
      Py_DECREF(owner->side);
    }
    Py_XDECREF(owner->signature);
    PyErr_Restore(type, value, traceback);
  }
  delete owner;
}

struct DeviceAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    return device_data_ptr(nbytes, new Owner());
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return nullptr;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    TORCH_CHECK(false, "neuron device memory cannot be read or written on the host; copy the tensor with .cpu()");
  }
};
DeviceAllocator the_device_allocator;

}  // namespace

c10::DataPtr device_data_ptr(size_t nbytes, Owner* owner) {
  void* address = nullptr;
  if (nbytes > 0) {
    uintptr_t span = (nbytes + kAlignment - 1) / kAlignment * kAlignment;
    uintptr_t at = next_address.fetch_add(span);
    address = reinterpret_cast<void*>(at);
    owner->address = at;
    owner->nbytes = nbytes;
    {
      std::lock_guard<std::mutex> lock(addresses_mutex);
      owners_by_address[at] = owner;
    }
    profiler::report_memory(at, static_cast<int64_t>(nbytes), owner->index);
  }
  return c10::DataPtr(address, owner, &release_owner, c10::Device(kDevice, owner->index));
}

bool is_owner_data_ptr(const c10::DataPtr& data_ptr) {
  return data_ptr.get_deleter() == &release_owner;
}

Owner* owner_of(const c10::Storage& storage, size_t* offset) {
  if (offset != nullptr) {
    *offset = 0;
  }
  if (!storage) {
    return nullptr;
  }
  const c10::DataPtr& data_ptr = storage.data_ptr();
  if (data_ptr.get_deleter() == &release_owner) {
    return static_cast<Owner*>(data_ptr.get_context());
  }
  if (data_ptr.get() == nullptr) {
    return nullptr;
  }
  std::lock_guard<std::mutex> lock(addresses_mutex);
  return containing(reinterpret_cast<uintptr_t>(data_ptr.get()), storage.nbytes(), offset);
}

c10::DeviceIndex index_of_address(void* address) {
  std::lock_guard<std::mutex> lock(addresses_mutex);
  Owner* owner = containing(reinterpret_cast<uintptr_t>(address), 0, nullptr);
  return owner == nullptr ? current_index() : owner->index;
}

void resize_storage_bytes(const c10::Storage& storage, size_t newsize) {
  // the CPU's error (resize_bytes_cpu): a storage view (`storage[a:b]`) or one made over
  // another storage's address does not own its allocation
  TORCH_CHECK(storage.resizable(), "Trying to resize storage that is not resizable");
  materialize_storage(storage.unsafeGetStorageImpl());  // a lazy clone's shared bytes are copied first
  Owner* old_owner = owner_of(storage);
  TORCH_CHECK(old_owner != nullptr, "resize_: this storage was not allocated by the neuron device");
  TORCH_CHECK(callbacks.resize != nullptr, "the neuron device is not initialized");
  auto* owner = new Owner();
  owner->index = old_owner->index;
  {
    py::gil_scoped_acquire gil;
    PyObject* side = PyObject_CallFunction(
        callbacks.resize, "On", old_owner->side ? old_owner->side : Py_None, static_cast<Py_ssize_t>(newsize));
    if (side == nullptr) {
      delete owner;
      throw py::error_already_set();
    }
    owner->side = side;  // the new reference the storage owns
  }
  auto* impl = storage.unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(device_data_ptr(newsize, owner));
  impl->set_nbytes(newsize);
}

c10::Allocator* device_allocator() {
  return &the_device_allocator;
}

// attach(tensor, make_side): give a storage Python has not seen yet (allocated by ATen, or
// a storage view of such a one) its Python side, `make_side(nbytes)` of its whole
// allocation. Returns the side the storage now has (an earlier one wins).
py::object attach(const at::Tensor& tensor, py::object make_side) {
  Owner* owner = owner_of(tensor.storage());
  TORCH_CHECK(owner != nullptr, "this storage was not allocated by the neuron device");
  if (owner->side == nullptr) {
    py::object side = make_side(static_cast<Py_ssize_t>(owner->nbytes));
    if (owner->side == nullptr) {  // make_side ran Python: another thread may have attached one
      owner->side = side.release().ptr();
    }
  }
  return py::reinterpret_borrow<py::object>(owner->side);
}

py::object side_of(const at::Tensor& tensor) {
  Owner* owner = tensor.has_storage() ? owner_of(tensor.storage()) : nullptr;
  if (owner == nullptr || owner->side == nullptr) {
    return py::none();
  }
  return py::reinterpret_borrow<py::object>(owner->side);
}

// regrow(tensor, nbytes): the tensor's storage gets a new address of `nbytes` (its Python
// side, which the caller has resized, stays).
void regrow(const at::Tensor& tensor, int64_t nbytes) {
  // (a copy-on-write storage gave up its share before its bytes were resized: views._grow)
  Owner* old_owner = owner_of(tensor.storage());
  TORCH_CHECK(old_owner != nullptr, "this storage was not allocated by the neuron device");
  auto* owner = new Owner();
  owner->index = old_owner->index;
  if (old_owner->side != nullptr) {
    Py_INCREF(old_owner->side);
    owner->side = old_owner->side;
  }
  auto* impl = tensor.storage().unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(device_data_ptr(static_cast<size_t>(nbytes), owner));
  impl->set_nbytes(static_cast<size_t>(nbytes));
}

// -- pinned host memory -------------------------------------------------------------------
namespace {

std::mutex pinned_mutex;
std::unordered_set<const void*> pinned;

void free_pinned(void* pointer) {
  {
    std::lock_guard<std::mutex> lock(pinned_mutex);
    pinned.erase(pointer);
  }
  std::free(pointer);
}

struct PinnedAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    void* pointer = nbytes > 0 ? std::aligned_alloc(64, (nbytes + 63) / 64 * 64) : nullptr;
    if (pointer != nullptr) {
      std::lock_guard<std::mutex> lock(pinned_mutex);
      pinned.insert(pointer);
    }
    return c10::DataPtr(pointer, pointer, &free_pinned, c10::Device(c10::DeviceType::CPU));
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return &free_pinned;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};
PinnedAllocator the_pinned_allocator;

}  // namespace

c10::Allocator* pinned_allocator() {
  return &the_pinned_allocator;
}

bool is_pinned(const void* data) {
  std::lock_guard<std::mutex> lock(pinned_mutex);
  return pinned.count(data) > 0;
}

}  // namespace neuron
