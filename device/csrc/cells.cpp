// A storage's bytes, reachable from C++ without the GIL: the Cell, and the Python type
// whose subclass is device/memory/storage.py's DeviceStorage.
//
// A DeviceStorage keeps its bytes in a CPU tensor, `data`, made lazily (the first kernel's
// result becomes it). The device worker runs kernels in C++ (executor.cpp) and must not
// take the GIL, so the tensor lives here, in a Cell the worker holds by an atomic
// reference. One rule keeps the worker clear of Python: a tensor a Cell holds never has a
// Python object. Python reads `storage.data` as a fresh tensor over the same bytes (a
// shallow copy, sharing the storage), and `storage.data = t` keeps a shallow copy of t:
// so no C++ reference the worker takes or drops ever touches a Python reference count
// (PyTorch keeps a tensor's Python object alive while C++ holds the tensor, and releasing
// it needs the GIL).

#include "neuron.h"

#include <ATen/ops/empty_strided.h>
#include <c10/core/TensorImpl.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <mutex>

namespace neuron {

at::Tensor unshared(const at::Tensor& tensor) {
  if (!tensor.defined()) {
    return tensor;
  }
  return at::Tensor(tensor.unsafeGetTensorImpl()->shallow_copy_and_detach(
      /*version_counter=*/c10::VariableVersion(/*version=*/0), /*allow_tensor_metadata_change=*/true));
}

namespace {
std::mutex cell_mutex;  // materialize and adopt race between the host and the worker
}

at::Tensor Cell::materialize() {
  std::lock_guard<std::mutex> guard(cell_mutex);
  if (!data.defined()) {
    data = at::empty_strided(sizes, strides, at::TensorOptions().dtype(dtype));
  }
  return data;
}

at::Tensor Cell::value() {
  {
    std::lock_guard<std::mutex> guard(cell_mutex);
    if (data.defined()) {
      return data;
    }
  }
  return materialize();
}

void Cell::adopt(const at::Tensor& result) {
  {
    std::lock_guard<std::mutex> guard(cell_mutex);
    if (!data.defined() && result.storage_offset() == 0 && result.scalar_type() == dtype &&
        result.sizes().equals(sizes) && result.strides().equals(strides)) {
      data = result;
      return;
    }
  }
  TORCH_CHECK(result.sizes().equals(sizes) && result.scalar_type() == dtype,
              "the kernel produced a tensor of shape ", result.sizes(), " and dtype ", result.scalar_type(),
              " where shape inference predicted ", c10::IntArrayRef(sizes), " and ", dtype,
              "; this is a bug in the device's shape inference for this op (device/ops/meta_overrides.py, "
              "META_OVERRIDES)");
  materialize().copy_(result);
}

// -- the Python type ---------------------------------------------------------------------

namespace {

struct StorageObject {
  PyObject_HEAD
  Cell* cell;  // one reference, released with the object
  PyObject* poison;  // the KernelFailure that left the storage without valid data, or None
};

PyObject* storage_new(PyTypeObject* type, PyObject* /*args*/, PyObject* /*kwargs*/) {
  PyObject* self = type->tp_alloc(type, 0);
  if (self == nullptr) {
    return nullptr;
  }
  auto* object = reinterpret_cast<StorageObject*>(self);
  object->cell = c10::make_intrusive<Cell>().release();
  Py_INCREF(Py_None);
  object->poison = Py_None;
  return self;
}

int storage_traverse(PyObject* self, visitproc visit, void* arg) {
  Py_VISIT(reinterpret_cast<StorageObject*>(self)->poison);
  Py_VISIT(Py_TYPE(self));
  return 0;
}

int storage_clear(PyObject* self) {
  Py_CLEAR(reinterpret_cast<StorageObject*>(self)->poison);
  return 0;
}

// A static base type: the subclass's dealloc (subtype_dealloc) releases the heap type.
void storage_dealloc(PyObject* self) {
  PyTypeObject* type = Py_TYPE(self);
  PyObject_GC_UnTrack(self);
  auto* object = reinterpret_cast<StorageObject*>(self);
  Py_CLEAR(object->poison);
  if (object->cell != nullptr) {
    c10::intrusive_ptr<Cell>::reclaim(object->cell);  // released here
    object->cell = nullptr;
  }
  type->tp_free(self);
}

PyObject* get_data(PyObject* self, void* /*closure*/) {
  HANDLE_TH_ERRORS
  Cell* cell = reinterpret_cast<StorageObject*>(self)->cell;
  at::Tensor data;
  {
    std::lock_guard<std::mutex> guard(cell_mutex);
    data = cell->data;
  }
  if (!data.defined()) {
    Py_RETURN_NONE;
  }
  return THPVariable_Wrap(unshared(data));
  END_HANDLE_TH_ERRORS
}

int set_data(PyObject* self, PyObject* value, void* /*closure*/) {
  HANDLE_TH_ERRORS
  Cell* cell = reinterpret_cast<StorageObject*>(self)->cell;
  at::Tensor data;
  if (value != nullptr && value != Py_None) {
    TORCH_CHECK(THPVariable_Check(value), "DeviceStorage.data: a tensor or None expected");
    data = unshared(THPVariable_Unpack(value));
  }
  std::lock_guard<std::mutex> guard(cell_mutex);
  cell->data = std::move(data);
  return 0;
  END_HANDLE_TH_ERRORS_RET(-1)
}

PyObject* get_poison(PyObject* self, void* /*closure*/) {
  PyObject* poison = reinterpret_cast<StorageObject*>(self)->poison;
  Py_INCREF(poison);
  return poison;
}

int set_poison(PyObject* self, PyObject* value, void* /*closure*/) {
  auto* object = reinterpret_cast<StorageObject*>(self);
  if (value == nullptr) {
    value = Py_None;
  }
  Py_INCREF(value);
  Py_SETREF(object->poison, value);
  object->cell->poisoned.store(value != Py_None, std::memory_order_release);
  return 0;
}

// _layout(shape, stride, dtype): the layout `materialize` makes and `adopt` takes whole.
PyObject* set_layout(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK(nargs == 3 && THPDtype_Check(args[2]), "_layout(shape, stride, dtype)");
  Cell* cell = reinterpret_cast<StorageObject*>(self)->cell;
  cell->sizes = int_vector(args[0]);
  cell->strides = int_vector(args[1]);
  cell->dtype = reinterpret_cast<THPDtype*>(args[2])->scalar_type;
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

PyObject* materialize(PyObject* self, PyObject* /*unused*/) {
  HANDLE_TH_ERRORS
  return THPVariable_Wrap(unshared(reinterpret_cast<StorageObject*>(self)->cell->materialize()));
  END_HANDLE_TH_ERRORS
}

PyObject* adopt(PyObject* self, PyObject* result) {
  HANDLE_TH_ERRORS
  TORCH_CHECK(THPVariable_Check(result), "adopt: a tensor expected");
  reinterpret_cast<StorageObject*>(self)->cell->adopt(unshared(THPVariable_Unpack(result)));
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

PyGetSetDef storage_getset[] = {
    {"data", get_data, set_data, "The CPU tensor holding the bytes, or None until something writes them.", nullptr},
    {"poison", get_poison, set_poison, "The KernelFailure that left the storage without valid data, or None.",
     nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

PyMethodDef storage_methods[] = {
    {"_layout", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(set_layout)), METH_FASTCALL,
     "Set the layout of the storage's bytes (shape, stride, dtype)."},
    {"materialize", materialize, METH_NOARGS, "The CPU tensor of the bytes, made now if nothing wrote them yet."},
    {"adopt", adopt, METH_O, "Make a kernel's result the storage's bytes (no copy when the layout matches)."},
    {nullptr, nullptr, 0, nullptr},
};

PyTypeObject StorageType = {
    PyVarObject_HEAD_INIT(nullptr, 0)
    "adaptive_eager_device._C.StorageBase",  // tp_name
    sizeof(StorageObject),                    // tp_basicsize
};

}  // namespace

PyTypeObject* storage_type() {
  return &StorageType;
}

c10::intrusive_ptr<Cell> cell_of(PyObject* storage) {
  TORCH_INTERNAL_ASSERT(PyObject_TypeCheck(storage, &StorageType), "cell_of: a DeviceStorage expected");
  return c10::intrusive_ptr<Cell>::reclaim_copy(reinterpret_cast<StorageObject*>(storage)->cell);
}

bool is_storage(PyObject* value) {
  return PyObject_TypeCheck(value, &StorageType);
}

void add_storage_type(PyObject* module) {
  StorageType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC;
  StorageType.tp_doc = "The C side of a device storage: its bytes (device/csrc/cells.cpp).";
  StorageType.tp_new = storage_new;
  StorageType.tp_alloc = PyType_GenericAlloc;
  StorageType.tp_free = PyObject_GC_Del;
  StorageType.tp_dealloc = storage_dealloc;
  StorageType.tp_traverse = storage_traverse;
  StorageType.tp_clear = storage_clear;
  StorageType.tp_getset = storage_getset;
  StorageType.tp_methods = storage_methods;
  if (PyType_Ready(&StorageType) < 0) {
    throw py::error_already_set();
  }
  Py_INCREF(&StorageType);
  if (PyModule_AddObject(module, "StorageBase", reinterpret_cast<PyObject*>(&StorageType)) < 0) {
    Py_DECREF(&StorageType);
    throw py::error_already_set();
  }
}

}  // namespace neuron
