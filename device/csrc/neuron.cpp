// The PrivateUse1 hooks Python cannot reach, for the simulated `neuron` device.
//
// Built by the README's install command (setup.py, torch.utils.cpp_extension) as
// adaptive_eager_device._C; device/backend.py calls init() when it registers the
// device. What is here, and only this:
//
// - device memory: an allocator of PrivateUse1 storages. A storage is an identity: a
//   unique, aligned address (never dereferenced: device memory is not host memory) and,
//   in its DataPtr's context, the Python DeviceStorage (device/storage.py) that holds the
//   bytes in a CPU tensor. The storage owns one reference to it, dropped when the
//   storage is freed. `torch.UntypedStorage(n, device="neuron")` and every storage ATen
//   allocates for the device come from here.
// - storage resizing (`storage.resize_`, FSDP2 frees parameters with resize_(0)):
//   a new address of the new size; the Python side resizes the bytes.
// - pinned host memory, which `pin_memory()` and `DataLoader(pin_memory=True)` ask the
//   current accelerator for: host memory whose allocations are remembered, so
//   `is_pinned()` answers.
// - generators: `torch.Generator(device="neuron")` and the device's default generator.
//   A neuron generator draws through a CPU generator of its own (its twin), which is
//   what the CPU kernels running the device's ops take; reading or changing its state
//   first waits for the kernels queued with it.
// - device indices and the device guard: `neuron:0` .. `neuron:<count-1>` (the count is
//   the simulated NeuronCores, device/indices.py), the current device per thread (as
//   CUDA's), and the DeviceGuardImplInterface c10 calls to switch devices. Every index
//   shares the process's one execution queue, so the guard's streams and events are the
//   default stream and no-ops, as PyTorch's Python device guard made them.
// - two calls on the per-op hot path: `empty` (a device tensor over a fresh storage)
//   and `describe` (what the dispatcher records of a tensor argument), one C call each.

#include <torch/extension.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/TensorImpl.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/Generator.h>
#include <torch/csrc/autograd/python_variable.h>

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace neuron {

namespace py = pybind11;

constexpr c10::DeviceType kDevice = c10::DeviceType::PrivateUse1;
constexpr uintptr_t kAlignment = 512;

// -- device indices -----------------------------------------------------------------------
c10::DeviceIndex device_count = 1;  // set once by init()
c10::DeviceIndex initial_index = 0;  // a thread's current device until it sets one
thread_local c10::DeviceIndex thread_index = -1;  // -1: not set on this thread

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
struct Callbacks {
  PyObject* synchronize = nullptr;  // () -> None: wait for every queued kernel
  PyObject* resize = nullptr;       // (side or None, nbytes) -> side: resize a storage's bytes
};
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
// The context of every device DataPtr: the storage's Python side (a DeviceStorage, or
// nullptr until Python first sees the storage), and the layout it was made for, so that
// `describe` can tell a tensor covering its storage exactly from a view of it.
struct Owner {
  PyObject* side = nullptr;
  PyObject* signature = nullptr;  // (shape, stride, dtype) of its layout, made on first use
  uintptr_t address = 0;  // its key in owners_by_address (0: none, an empty allocation)
  c10::DeviceIndex index = current_index();  // the device it lives on (the current one)
  bool has_layout = false;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
};

std::atomic<uintptr_t> next_address{uintptr_t(1) << 44};

// Live allocations by address, for storages ATen makes over a device address it got from
// another storage (`at::from_blob(storage.data_ptr())`, as torch.save does to copy a
// storage to the host): they alias that allocation.
std::mutex addresses_mutex;
std::unordered_map<uintptr_t, Owner*> owners_by_address;

void release_owner(void* context) {
  auto* owner = static_cast<Owner*>(context);
  if (owner->address != 0) {
    std::lock_guard<std::mutex> lock(addresses_mutex);
    owners_by_address.erase(owner->address);
  }
  if ((owner->side != nullptr || owner->signature != nullptr) && python_alive()) {
    py::gil_scoped_acquire gil;
    if (owner->side != nullptr) {
      // the storage is gone: nothing can read this value any more (DeviceStorage.alive)
      if (PyObject_SetAttrString(owner->side, "alive", Py_False) != 0) {
        PyErr_Clear();
      }
      Py_DECREF(owner->side);
    }
    Py_XDECREF(owner->signature);
  }
  delete owner;
}

c10::DataPtr device_data_ptr(size_t nbytes, Owner* owner) {
  void* address = nullptr;
  if (nbytes > 0) {
    uintptr_t span = (nbytes + kAlignment - 1) / kAlignment * kAlignment;
    uintptr_t at = next_address.fetch_add(span);
    address = reinterpret_cast<void*>(at);
    owner->address = at;
    std::lock_guard<std::mutex> lock(addresses_mutex);
    owners_by_address[at] = owner;
  }
  return c10::DataPtr(address, owner, &release_owner, c10::Device(kDevice, owner->index));
}

Owner* owner_of(const c10::Storage& storage) {
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
  auto found = owners_by_address.find(reinterpret_cast<uintptr_t>(data_ptr.get()));
  return found == owners_by_address.end() ? nullptr : found->second;
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
DeviceAllocator device_allocator;

// -- pinned host memory -------------------------------------------------------------------
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
PinnedAllocator pinned_allocator;

// -- generators ---------------------------------------------------------------------------
struct NeuronGeneratorImpl final : c10::GeneratorImpl {
  NeuronGeneratorImpl(at::Generator twin, c10::DeviceIndex index)
      : c10::GeneratorImpl(c10::Device(kDevice, index), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
        twin_(std::move(twin)) {}

  void set_current_seed(uint64_t seed) override {
    call_synchronize();
    twin_.set_current_seed(seed);
  }
  void set_offset(uint64_t offset) override {
    call_synchronize();
    twin_.set_offset(offset);
  }
  uint64_t get_offset() const override {
    call_synchronize();
    return twin_.get_offset();
  }
  uint64_t current_seed() const override {
    return twin_.current_seed();
  }
  uint64_t seed() override {
    call_synchronize();
    return twin_.seed();
  }
  void set_state(const c10::TensorImpl& new_state) override {
    call_synchronize();
    twin_.unsafeGetGeneratorImpl()->set_state(new_state);
  }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    call_synchronize();
    return twin_.unsafeGetGeneratorImpl()->get_state();
  }
  const at::Generator& twin() const {
    return twin_;
  }

 private:
  NeuronGeneratorImpl* clone_impl() const override {
    call_synchronize();
    return new NeuronGeneratorImpl(twin_.clone(), device().index());
  }
  at::Generator twin_;
};

// one default generator per index, all drawing through the device's one CPU twin: the
// indices share one queue, so they share its one random stream too
std::vector<at::Generator> default_generators;

// -- hooks --------------------------------------------------------------------------------
struct NeuronHooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override {
    return true;
  }
  bool isAvailable() const override {
    return true;
  }
  bool hasPrimaryContext(c10::DeviceIndex device_index) const override {
    return true;
  }
  c10::DeviceIndex deviceCount() const override {
    return device_count;
  }
  c10::DeviceIndex getCurrentDevice() const override {
    return current_index();
  }
  void setCurrentDevice(c10::DeviceIndex device) const override {
    exchange_index(device);
  }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex device) const override {
    return exchange_index(device);
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex device) const override {
    return exchange_index(device);
  }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex device_index) const override {
    TORCH_CHECK(!default_generators.empty(), "the neuron device is not initialized");
    c10::DeviceIndex index = device_index < 0 ? current_index() : device_index;
    check_index(index);
    return default_generators[index];
  }
  at::Generator getNewGenerator(c10::DeviceIndex device_index) const override {
    c10::DeviceIndex index = device_index < 0 ? current_index() : device_index;
    check_index(index);
    return at::make_generator<NeuronGeneratorImpl>(at::detail::createCPUGenerator(), index);
  }
  at::Device getDeviceFromPtr(void* data) const override {
    std::lock_guard<std::mutex> lock(addresses_mutex);
    auto found = owners_by_address.find(reinterpret_cast<uintptr_t>(data));
    return at::Device(kDevice, found == owners_by_address.end() ? current_index() : found->second->index);
  }
  bool isPinnedPtr(const void* data) const override {
    std::lock_guard<std::mutex> lock(pinned_mutex);
    return pinned.count(data) > 0;
  }
  at::Allocator* getPinnedMemoryAllocator() const override {
    return &pinned_allocator;
  }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
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
};

// -- the hot path -------------------------------------------------------------------------
PyObject* int_tuple(c10::IntArrayRef values) {
  PyObject* tuple = PyTuple_New(static_cast<Py_ssize_t>(values.size()));
  for (size_t i = 0; i < values.size(); ++i) {
    PyTuple_SET_ITEM(tuple, i, PyLong_FromLongLong(values[i]));
  }
  return tuple;
}

std::vector<int64_t> int_vector(PyObject* sequence) {
  PyObject* fast = PySequence_Fast(sequence, "expected a sequence of ints");
  if (fast == nullptr) {
    throw py::error_already_set();
  }
  Py_ssize_t size = PySequence_Fast_GET_SIZE(fast);
  std::vector<int64_t> values(static_cast<size_t>(size));
  for (Py_ssize_t i = 0; i < size; ++i) {
    values[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
  }
  Py_DECREF(fast);
  if (PyErr_Occurred()) {
    throw py::error_already_set();
  }
  return values;
}

// empty(shape, stride, dtype, side, nbytes) -> a device tensor over a fresh storage of
// `nbytes` bytes whose Python side is `side`.
PyObject* empty(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK(nargs == 5, "empty(shape, stride, dtype, side, nbytes)");
  TORCH_CHECK(THPDtype_Check(args[2]), "empty: dtype expected");
  auto* owner = new Owner();
  owner->sizes = int_vector(args[0]);
  owner->strides = int_vector(args[1]);
  owner->dtype = reinterpret_cast<THPDtype*>(args[2])->scalar_type;
  owner->has_layout = true;
  Py_INCREF(args[3]);
  owner->side = args[3];
  int64_t nbytes = PyLong_AsLongLong(args[4]);
  auto storage = c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), nbytes, device_data_ptr(static_cast<size_t>(nbytes), owner),
      &device_allocator, /*resizable=*/true);
  auto tensor = at::detail::make_tensor<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
      c10::scalarTypeToTypeMeta(owner->dtype));
  tensor.unsafeGetTensorImpl()->set_sizes_and_strides(owner->sizes, owner->strides);
  return THPVariable_Wrap(std::move(tensor));
  END_HANDLE_TH_ERRORS
}

// describe(value) -> None when `value` is not a neuron tensor, else
// ((shape, stride, dtype), side, covers): `side` is the storage's DeviceStorage (None when
// Python has not seen the storage yet), `covers` whether the tensor is exactly the
// layout its storage was made for (offset 0, same sizes, strides and dtype, no
// conjugate or negative bit): then the storage alone stands for it.
PyObject* signature_of(c10::IntArrayRef sizes, c10::IntArrayRef strides, c10::ScalarType dtype) {
  PyObject* dtype_object = reinterpret_cast<PyObject*>(torch::getTHPDtype(dtype));
  PyObject* shape = int_tuple(sizes);
  PyObject* stride = int_tuple(strides);
  PyObject* signature = PyTuple_Pack(3, shape, stride, dtype_object);
  Py_DECREF(shape);
  Py_DECREF(stride);
  return signature;
}

PyObject* describe(PyObject* /*module*/, PyObject* value) {
  PyTypeObject* type = Py_TYPE(value);
  if (!THPVariable_CheckTypeExact(type)) {
    // the common arguments that are not tensors, answered without an isinstance walk
    if (type == &PyFloat_Type || type == &PyLong_Type || type == &PyBool_Type || value == Py_None ||
        type == &PyList_Type || type == &PyTuple_Type || !THPVariable_Check(value)) {
      Py_RETURN_NONE;
    }
  }
  const at::Tensor& tensor = THPVariable_Unpack(value);
  if (!tensor.defined() || tensor.device().type() != kDevice || !tensor.has_storage()) {
    Py_RETURN_NONE;
  }
  const c10::Storage& storage = tensor.storage();
  Owner* owner = owner_of(storage);
  auto sizes = tensor.sizes();
  auto strides = tensor.strides();
  c10::ScalarType dtype = tensor.scalar_type();
  bool covers = owner != nullptr && owner->has_layout && tensor.storage_offset() == 0 && dtype == owner->dtype &&
                sizes.equals(owner->sizes) && strides.equals(owner->strides) && !tensor.is_conj() &&
                !tensor.is_neg();
  PyObject* signature;
  if (covers) {  // the storage's own layout: its signature is made once
    if (owner->signature == nullptr) {
      owner->signature = signature_of(sizes, strides, dtype);
    }
    signature = owner->signature;
    Py_INCREF(signature);
  } else {
    signature = signature_of(sizes, strides, dtype);
  }
  PyObject* side = owner != nullptr && owner->side != nullptr ? owner->side : Py_None;
  PyObject* result = PyTuple_Pack(3, signature, side, covers ? Py_True : Py_False);
  Py_DECREF(signature);
  return result;
}

// user_facing(kernel): the kernel as PyTorch calls it, a C function bound to the Python
// kernel. An error the device marked as the user's (``__neuron_user_error__``, set by
// errors.users_error: the CPU's own error for the user's arguments) leaves it without a
// traceback, so Python shows it raised from the user's line with no device frame, as on
// the CPU. Every other error (a bug of the device) keeps its whole traceback.
PyObject* call_user_facing(PyObject* kernel, PyObject* args, PyObject* kwargs) {
  PyObject* result = PyObject_Call(kernel, args, kwargs);
  if (result != nullptr) {
    return result;
  }
  PyObject* type = nullptr;
  PyObject* value = nullptr;
  PyObject* traceback = nullptr;
  PyErr_Fetch(&type, &value, &traceback);
  PyErr_NormalizeException(&type, &value, &traceback);
  if (value != nullptr && PyObject_HasAttrString(value, "__neuron_user_error__")) {
    Py_CLEAR(traceback);
    PyException_SetTraceback(value, Py_None);
  }
  PyErr_Restore(type, value, traceback);
  return nullptr;
}

PyMethodDef user_facing_def = {
    "neuron_kernel", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(call_user_facing)),
    METH_VARARGS | METH_KEYWORDS, "A neuron kernel (device/backend.py): the user's errors leave it without device frames."};

PyObject* user_facing(PyObject* /*module*/, PyObject* kernel) {
  return PyCFunction_NewEx(&user_facing_def, kernel, nullptr);
}

PyMethodDef hot_methods[] = {
    {"user_facing", user_facing, METH_O, "Wrap a Python kernel so the user's errors leave it without device frames."},
    {"describe", describe, METH_O, "What the dispatcher records of a tensor argument (see neuron.cpp)."},
    {"empty", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(empty)), METH_FASTCALL,
     "A device tensor over a fresh storage (see neuron.cpp)."},
    {nullptr, nullptr, 0, nullptr},
};

// attach(tensor, side): give a storage Python has not seen yet (allocated by ATen) its
// Python side. Returns the side the storage now has (an earlier one wins).
py::object attach(const at::Tensor& tensor, py::object side) {
  Owner* owner = owner_of(tensor.storage());
  TORCH_CHECK(owner != nullptr, "this storage was not allocated by the neuron device");
  if (owner->side == nullptr) {
    owner->side = side.release().ptr();
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

// twin(generator) -> the CPU generator a neuron generator draws through (the same object
// for the same generator), or None for any other generator.
py::object twin(py::object generator) {
  if (!THPGenerator_Check(generator.ptr())) {
    return py::none();
  }
  at::Generator gen = THPGenerator_Unwrap(generator.ptr());
  auto* impl = dynamic_cast<NeuronGeneratorImpl*>(gen.unsafeGetGeneratorImpl());
  if (impl == nullptr) {
    return py::none();
  }
  return py::reinterpret_steal<py::object>(THPGenerator_Wrap(impl->twin()));
}

// -- the device guard ---------------------------------------------------------------------
// What c10::DeviceGuard, the autograd engine's device threads and torch.accelerator call.
// Streams: every index has only its default stream here (torch.neuron.Stream, Python,
// names the rest), and events are no-ops: one in-order queue keeps every order.
struct NeuronGuardImpl final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override {
    return kDevice;
  }
  c10::Device exchangeDevice(c10::Device device) const override {
    return c10::Device(kDevice, exchange_index(device.index()));
  }
  c10::Device getDevice() const override {
    return c10::Device(kDevice, current_index());
  }
  void setDevice(c10::Device device) const override {
    exchange_index(device.index());
  }
  void uncheckedSetDevice(c10::Device device) const noexcept override {
    if (device.index() >= 0 && device.index() < device_count) {
      thread_index = device.index();
    }
  }
  c10::Stream getStream(c10::Device device) const override {
    return c10::Stream(c10::Stream::DEFAULT, on_index(device));
  }
  c10::Stream getNewStream(c10::Device device, int /*priority*/) const override {
    return c10::Stream(c10::Stream::DEFAULT, on_index(device));
  }
  c10::Stream exchangeStream(c10::Stream stream) const override {
    return c10::Stream(c10::Stream::DEFAULT, on_index(stream.device()));
  }
  c10::DeviceIndex deviceCount() const noexcept override {
    return device_count;
  }
  void record(void** /*event*/, const c10::Stream& /*stream*/, const c10::DeviceIndex /*device_index*/,
              const c10::EventFlag /*flag*/) const override {}
  void block(void* /*event*/, const c10::Stream& /*stream*/) const override {}
  bool queryEvent(void* /*event*/) const override {
    return true;
  }
  void destroyEvent(void* /*event*/, const c10::DeviceIndex /*device_index*/) const noexcept override {}
  bool queryStream(const c10::Stream& /*stream*/) const override {
    return true;
  }
  void synchronizeStream(const c10::Stream& /*stream*/) const override {
    call_synchronize();
  }
  void synchronizeDevice(const c10::DeviceIndex /*device_index*/) const override {
    call_synchronize();
  }

 private:
  static c10::Device on_index(c10::Device device) {
    return c10::Device(kDevice, device.index() < 0 ? current_index() : device.index());
  }
};

NeuronHooks* hooks = nullptr;

// init(default_twin, synchronize, resize, count, initial): register the allocators, hooks
// and device guard (once), for `count` devices with `initial` current on every thread
// that sets none.
void init(py::object default_twin, py::object synchronize, py::object resize, int count, int initial) {
  if (hooks != nullptr) {
    return;
  }
  TORCH_CHECK(count >= 1 && count <= 64, "neuron: the device count must be 1..64, not ", count);
  TORCH_CHECK(initial >= 0 && initial < count, "neuron: the initial device must be below the count");
  device_count = static_cast<c10::DeviceIndex>(count);
  initial_index = static_cast<c10::DeviceIndex>(initial);
  callbacks.synchronize = synchronize.release().ptr();
  callbacks.resize = resize.release().ptr();
  at::Generator twin = THPGenerator_Unwrap(default_twin.ptr());
  for (int index = 0; index < count; ++index) {
    default_generators.push_back(at::make_generator<NeuronGeneratorImpl>(twin, static_cast<c10::DeviceIndex>(index)));
  }
  c10::SetAllocator(kDevice, &device_allocator);
  static NeuronGuardImpl guard;
  c10::impl::registerDeviceGuard(kDevice, &guard);
  hooks = new NeuronHooks();
  at::RegisterPrivateUse1HooksInterface(hooks);
}

// current_device() / exchange_device(index) -> previous: the calling thread's device.
int current_device() {
  return current_index();
}

int exchange_device(int index) {
  return exchange_index(static_cast<c10::DeviceIndex>(index));
}

}  // namespace neuron

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "The PrivateUse1 hooks of the simulated neuron device that Python cannot reach (see neuron.cpp)";
  m.def("init", &neuron::init);
  m.def("attach", &neuron::attach);
  m.def("side_of", &neuron::side_of);
  m.def("regrow", &neuron::regrow);
  m.def("twin", &neuron::twin);
  m.def("current_device", &neuron::current_device);
  m.def("exchange_device", &neuron::exchange_device);
  PyModule_AddFunctions(m.ptr(), neuron::hot_methods);
}
