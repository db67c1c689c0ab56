// Copy-on-write lazy clones of device storages (`torch._lazy_clone`), with c10's own
// copy-on-write context (c10/core/impl/COWDeleter.h), so `torch._C._is_cow_tensor`
// answers as on the CPU (see module.cpp for the whole extension).
//
// c10's `lazy_clone_storage` wraps only a "simple" DataPtr, whose context is its data
// pointer; a device DataPtr's context is its Owner (memory.cpp), so c10 returns nullptr
// for it and the device does the wrapping here, the same way:
//
// - lazy_clone(t): t's storage gives its DataPtr's context (the Owner) to a
//   COWDeleterContext; t's storage and the clone's new storage each hold a DataPtr at
//   the same address whose context is that COWDeleterContext (deleter: c10's
//   cow_deleter). Two storages, one allocation: `_storage_address` differs,
//   `_data_address` is the same, and both are copy-on-write. Nothing runs: no kernel,
//   no byte moves. The Owner stays in the address map, so `owner_of` finds it (and its
//   DeviceStorage, the shared bytes) for either storage by address.
// - materialize(storage), before anything writes it (device/ops/cow.py calls it for every
//   tensor an op writes; c10 calls it, as the storage's materializer, for
//   `mutable_data_ptr()`; resizing calls it): the storage gives up its share. The last
//   share takes the Owner back (no copy: the address stays). Any other gets a fresh
//   allocation whose bytes are a copy of the shared ones, made by a clone kernel issued
//   now, in program order: after every kernel already issued that writes them (a queued
//   or windowed write before the lazy clone is in the copy), before the write that
//   materializes. The shared bytes are never written again while shared.

#include "neuron.h"

#include <c10/core/DeviceGuard.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/impl/COW.h>
#include <c10/core/impl/COWDeleter.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <variant>

namespace neuron {

namespace cow = c10::impl::cow;

namespace {

PyObject* copy_callback = nullptr;  // (tensor) -> a clone of it, issued on the device (device/ops/cow.py)
std::atomic<int64_t> clones_made{0};
std::atomic<int64_t> copies_made{0};

void materialize(c10::StorageImpl* storage);

c10::DataPtr shared_data_ptr(const c10::DataPtr& data_ptr, cow::COWDeleterContext* context) {
  return c10::DataPtr(data_ptr.get(), context, &cow::cow_deleter, data_ptr.device());
}

// A neuron tensor over the whole allocation of `storage`: in the layout its bytes were
// made in when that layout is dense and spans the storage (a clone keeps it), else as
// flat bytes. It holds its own reference to the storage.
at::Tensor whole_of(c10::StorageImpl* storage, const Owner* owner) {
  c10::Storage held(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(storage));
  const auto nbytes = static_cast<int64_t>(storage->nbytes());
  if (owner != nullptr && owner->has_layout) {
    auto tensor = at::detail::make_tensor<c10::TensorImpl>(
        c10::Storage(held), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), c10::scalarTypeToTypeMeta(owner->dtype));
    tensor.unsafeGetTensorImpl()->set_sizes_and_strides(owner->sizes, owner->strides);
    if (tensor.is_non_overlapping_and_dense() && tensor.numel() * tensor.element_size() == nbytes) {
      return tensor;
    }
  }
  auto tensor = at::detail::make_tensor<c10::TensorImpl>(
      std::move(held), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), c10::scalarTypeToTypeMeta(at::kByte));
  tensor.unsafeGetTensorImpl()->set_sizes_and_strides(c10::IntArrayRef{nbytes}, c10::IntArrayRef{int64_t{1}});
  return tensor;
}

// A fresh allocation holding a copy of `storage`'s bytes (a clone kernel, issued now):
// its DataPtr, taken from the clone's storage.
c10::DataPtr copied(c10::StorageImpl* storage) {
  TORCH_CHECK(copy_callback != nullptr, "the neuron device is not initialized");
  c10::DeviceGuard on_its_device(storage->data_ptr().device());  // the copy lives where the bytes do
  at::Tensor source = whole_of(storage, owner_of(c10::Storage(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(storage))));
  at::Tensor copy;
  {
    py::gil_scoped_acquire gil;
    PyObject* source_object = THPVariable_Wrap(source);
    if (source_object == nullptr) {
      throw py::error_already_set();
    }
    PyObject* result = PyObject_CallOneArg(copy_callback, source_object);
    Py_DECREF(source_object);
    if (result == nullptr) {
      throw py::error_already_set();
    }
    copy = THPVariable_Unpack(result);
    Py_DECREF(result);
  }
  c10::StorageImpl* made = copy.storage().unsafeGetStorageImpl();
  TORCH_INTERNAL_ASSERT(made->nbytes() == storage->nbytes() && made->data_ptr().get_context() != nullptr,
                        "neuron: the copy of a lazily cloned storage has ", made->nbytes(), " bytes, not ",
                        storage->nbytes());
  c10::DataPtr taken = std::move(made->_mutable_data_ptr_no_checks());
  made->set_data_ptr_noswap(c10::DataPtr(nullptr, taken.device()));
  copies_made.fetch_add(1, std::memory_order_relaxed);
  return taken;
}

void materialize(c10::StorageImpl* storage) {
  c10::DataPtr& data_ptr = storage->_mutable_data_ptr_no_checks();
  auto* context = data_ptr.cast_context<cow::COWDeleterContext>(&cow::cow_deleter);
  if (context == nullptr) {
    return;
  }
  auto share = context->decrement_refcount();
  if (std::holds_alternative<cow::COWDeleterContext::LastReference>(share)) {
    // the last share: the allocation (its Owner) is this storage's again, at its address
    auto original = std::get<cow::COWDeleterContext::LastReference>(std::move(share));
    c10::DeleterFnPtr deleter = original.get_deleter();
    void* owner = original.release();
    c10::DataPtr own(data_ptr.get(), owner, deleter, data_ptr.device());
    data_ptr.release_context();  // the context is gone with its last share
    storage->set_data_ptr_noswap(std::move(own));
    return;
  }
  // Other shares remain, and keep the shared bytes alive while the copy is issued.
  c10::DataPtr fresh;
  try {
    fresh = copied(storage);
  } catch (...) {
    context->increment_refcount();  // the storage keeps its share: still copy-on-write
    throw;
  }
  data_ptr.release_context();  // its share was given up above
  storage->set_data_ptr_noswap(std::move(fresh));
}

}  // namespace

// Before resizing: a storage that shares its bytes copy-on-write gives up its share.
void materialize_storage(c10::StorageImpl* storage) {
  if (!cow::is_cow_data_ptr(storage->_mutable_data_ptr_no_checks())) {
    return;
  }
  materialize(storage);
  storage->clear_materializer();
}

namespace {

// lazy_clone(tensor) -> a tensor of the same metadata over a new storage sharing the
// tensor's allocation copy-on-write (see the top of this file). A storage the device did
// not allocate itself (a storage view, `storage[a:b]`: its context is not an Owner) is
// refused as c10 refuses it on the CPU.
at::Tensor lazy_clone(const at::Tensor& self) {
  TORCH_CHECK(self.device().type() == kDevice && self.has_storage(), "lazy_clone: a neuron tensor expected");
  c10::StorageImpl* storage = self.storage().unsafeGetStorageImpl();
  c10::DataPtr& data_ptr = storage->_mutable_data_ptr_no_checks();
  c10::DataPtr shared;
  if (is_owner_data_ptr(data_ptr) && data_ptr.get() != nullptr) {
    auto* context = new cow::COWDeleterContext(data_ptr.move_context());
    context->increment_refcount();  // two shares: this storage's and the clone's
    c10::DataPtr mine = shared_data_ptr(data_ptr, context);
    shared = shared_data_ptr(data_ptr, context);
    storage->set_data_ptr_noswap(std::move(mine));  // the old DataPtr gave its context away
    storage->set_materializer(&materialize);
  } else if (cow::is_cow_data_ptr(data_ptr)) {
    auto* context = data_ptr.cast_context<cow::COWDeleterContext>(&cow::cow_deleter);
    context->increment_refcount();
    shared = shared_data_ptr(data_ptr, context);
  } else if (is_owner_data_ptr(data_ptr)) {
    // no bytes (an empty allocation has no address to share): a new empty allocation
    shared = device_allocator()->allocate(0);
  } else {
    TORCH_CHECK(false, "Expected storage != nullptr to be true, but got false.  (Could this error message be improved?  "
                       "If so, please report an enhancement request to PyTorch.)");
  }
  bool is_shared = cow::is_cow_data_ptr(shared);
  auto clone_storage = c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), storage->sym_nbytes(), std::move(shared), storage->allocator(),
      storage->resizable());
  if (is_shared) {
    clone_storage->set_materializer(&materialize);
    clones_made.fetch_add(1, std::memory_order_relaxed);
  }
  auto result = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(std::move(clone_storage)), self.key_set(),
                                                         self.dtype());
  result.unsafeGetTensorImpl()->set_sizes_and_strides(self.sizes(), self.strides(), self.storage_offset());
  return result;
}

}  // namespace

// materialize_cow(value) -> True when `value` is a neuron tensor whose storage was
// copy-on-write and is no longer (its share given up: see above), else False.
bool materialize_tensor(const at::Tensor& tensor) {
  if (!tensor.defined() || !tensor.has_storage() || tensor.device().type() != kDevice) {
    return false;
  }
  c10::StorageImpl* storage = tensor.storage().unsafeGetStorageImpl();
  if (!cow::is_cow_data_ptr(storage->_mutable_data_ptr_no_checks())) {
    return false;
  }
  materialize(storage);
  storage->clear_materializer();
  return true;
}

void add_cow_methods(py::module& m) {
  m.def("lazy_clone", &lazy_clone, "A copy-on-write clone of a neuron tensor (see cow.cpp).");
  m.def("materialize_cow", [](py::handle value) {
    if (!THPVariable_Check(value.ptr())) {
      return false;
    }
    return materialize_tensor(THPVariable_Unpack(value.ptr()));
  }, "Give up a copy-on-write storage's share before a write (see cow.cpp).");
  m.def("set_cow_copy", [](py::object fn) {
    PyObject* previous = copy_callback;
    copy_callback = fn.release().ptr();
    Py_XDECREF(previous);
  });
  m.def("cow_counts", []() {
    return py::make_tuple(clones_made.load(std::memory_order_relaxed), copies_made.load(std::memory_order_relaxed));
  }, "(copy-on-write clones made, copies made to materialize one) since the process started.");
}

}  // namespace neuron
