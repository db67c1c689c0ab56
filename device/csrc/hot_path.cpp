// The calls on the per-op hot path, one C call each (see module.cpp for the whole
// extension): `empty` (a device tensor over a fresh storage), `describe` (what the
// dispatcher records of a tensor argument) and `offset_of` (where a view starts in its
// storage's allocation); `user_facing`, the C function every
// Python kernel of the device is called through, which gives the user's errors no
// device frames; and `fast_kernel`, the same boundary doing the Python handler's work in C.

#include "neuron.h"

#include <c10/core/StorageImpl.h>
#include <c10/core/TensorImpl.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <unordered_map>

// The interpreter's own frames (CPython 3.11): the issuing frame is found without making
// a frame object for each frame walked (see user_frame below).
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
#define NEURON_INTERPRETER_FRAMES 1
#define Py_BUILD_CORE 1
#include <internal/pycore_frame.h>
#undef Py_BUILD_CORE
#endif

namespace neuron {

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

PyObject* int_tuple(c10::IntArrayRef values) {
  PyObject* tuple = PyTuple_New(static_cast<Py_ssize_t>(values.size()));
  for (size_t i = 0; i < values.size(); ++i) {
    PyTuple_SET_ITEM(tuple, i, PyLong_FromLongLong(values[i]));
  }
  return tuple;
}

namespace {


// empty(shape, stride, dtype, side, nbytes) -> a device tensor over a fresh storage of
// `nbytes` bytes whose Python side is `side`.
PyObject* empty(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK(nargs == 5, "empty(shape, stride, dtype, side, nbytes)");
  return device_tensor(args);
  END_HANDLE_TH_ERRORS
}

}  // namespace

PyObject* device_tensor(PyObject* const* args) {
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
      device_allocator(), /*resizable=*/true);
  auto tensor = at::detail::make_tensor<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
      c10::scalarTypeToTypeMeta(owner->dtype));
  tensor.unsafeGetTensorImpl()->set_sizes_and_strides(owner->sizes, owner->strides);
  return THPVariable_Wrap(std::move(tensor));
}

namespace {

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

}  // namespace

// (outside the anonymous namespace: record.cpp calls it)
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
  size_t into = 0;  // a storage view's offset in its allocation
  Owner* owner = owner_of(storage, &into);
  auto sizes = tensor.sizes();
  auto strides = tensor.strides();
  c10::ScalarType dtype = tensor.scalar_type();
  bool covers = owner != nullptr && owner->has_layout && into == 0 && tensor.storage_offset() == 0 && dtype == owner->dtype &&
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

namespace {

// offset_of(tensor) -> where a neuron tensor starts in its storage's allocation, in its
// own elements: its storage offset, plus the offset of a storage view (`storage[a:b]`)
// in the allocation it is a view of; -1 when that offset is not a whole number of
// elements (a view at byte 3 under a float32 tensor).
PyObject* offset_of(PyObject* /*module*/, PyObject* value) {
  HANDLE_TH_ERRORS
  TORCH_CHECK(THPVariable_Check(value), "offset_of: a tensor expected");
  const at::Tensor& tensor = THPVariable_Unpack(value);
  size_t into = 0;
  if (tensor.has_storage()) {
    owner_of(tensor.storage(), &into);
  }
  auto itemsize = static_cast<size_t>(tensor.element_size());
  if (into % itemsize != 0) {
    return PyLong_FromLong(-1);
  }
  return PyLong_FromLongLong(tensor.storage_offset() + static_cast<int64_t>(into / itemsize));
  END_HANDLE_TH_ERRORS
}

// user_facing(kernel): the kernel as PyTorch calls it, a C function bound to the Python
// kernel. An error the device marked as the user's (``__neuron_user_error__``, set by
// errors.users_error: the CPU's own error for the user's arguments) leaves it without a
// traceback, so Python shows it raised from the user's line with no device frame, as on
// the CPU. Every other error (a bug of the device) keeps its whole traceback.
PyObject* user_facing_result(PyObject* result) {
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

PyObject* call_user_facing(PyObject* kernel, PyObject* args, PyObject* kwargs) {
  return user_facing_result(PyObject_Call(kernel, args, kwargs));
}

// fast_kernel(kernel, op): the kernel as PyTorch calls it, as user_facing's, which first
// does what device/backend.py's handler does, without its Python frames, when
// set_fast_path has switched it on: under the host lock, the recorder's common case
// (record.cpp: record_op) and else the whole recorder (`run(entry, args, kwargs)`). `op`:
// the kernel's op, or None for the boxed fallback, whose first argument is the op. Off
// (the handler's checks apply: a bad configuration, several device indices, no C
// recorder), or for an op whose entry cannot be made here, it calls the Python kernel.
struct FastPath {
  PyObject* acquire = nullptr;  // the host lock's acquire and release (None: off)
  PyObject* release = nullptr;
  PyObject* entry_of = nullptr;  // entry_of(op) -> the op's OpEntry
  PyObject* run = nullptr;       // run(entry, args, kwargs) -> the result: the whole recorder
};
FastPath fast_path;

std::unordered_map<PyObject*, PyObject*>& fast_entries() {
  static auto* entries = new std::unordered_map<PyObject*, PyObject*>();  // op -> its entry, both kept
  return *entries;
}

PyObject* fast_entry(PyObject* op) {
  auto& entries = fast_entries();
  auto found = entries.find(op);
  if (found != entries.end()) {
    return found->second;
  }
  PyObject* entry = PyObject_CallOneArg(fast_path.entry_of, op);
  if (entry == nullptr) {
    PyErr_Clear();  // the Python kernel makes it again, and raises what it raises
    return nullptr;
  }
  Py_INCREF(op);
  entries.emplace(op, entry);
  return entry;
}

// The recorder under the host lock: the result, or nullptr with the error set.
PyObject* record_locked(PyObject* entry, PyObject* args, PyObject* kwargs) {
  PyObject* locked = PyObject_CallNoArgs(fast_path.acquire);
  if (locked == nullptr) {
    return nullptr;
  }
  Py_DECREF(locked);
  PyObject* result = record_op(entry, args, kwargs);
  if (result == Py_NotImplemented) {
    Py_DECREF(result);
    PyObject* keywords = kwargs != nullptr ? Py_NewRef(kwargs) : PyDict_New();
    result = keywords == nullptr ? nullptr : PyObject_CallFunctionObjArgs(fast_path.run, entry, args, keywords, nullptr);
    Py_XDECREF(keywords);
  }
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);  // (the release must not see the op's error)
  PyObject* released = PyObject_CallNoArgs(fast_path.release);
  if (released == nullptr) {
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(traceback);
    Py_XDECREF(result);
    return nullptr;
  }
  Py_DECREF(released);
  PyErr_Restore(type, value, traceback);
  return result;
}

PyObject* call_fast_kernel(PyObject* self, PyObject* args, PyObject* kwargs) {
  PyObject* kernel = PyTuple_GET_ITEM(self, 0);
  PyObject* fixed = PyTuple_GET_ITEM(self, 1);
  if (fast_path.acquire == nullptr || (fixed == Py_None && PyTuple_GET_SIZE(args) == 0)) {
    return call_user_facing(kernel, args, kwargs);
  }
  PyObject* op = fixed != Py_None ? fixed : PyTuple_GET_ITEM(args, 0);
  PyObject* entry = fast_entry(op);
  if (entry == nullptr) {
    return call_user_facing(kernel, args, kwargs);
  }
  if (fixed != Py_None) {
    return user_facing_result(record_locked(entry, args, kwargs));
  }
  PyObject* rest = PyTuple_GetSlice(args, 1, PyTuple_GET_SIZE(args));
  if (rest == nullptr) {
    return nullptr;
  }
  PyObject* result = record_locked(entry, rest, kwargs);
  Py_DECREF(rest);
  return user_facing_result(result);
}

PyMethodDef fast_kernel_def = {
    "neuron_kernel", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(call_fast_kernel)),
    METH_VARARGS | METH_KEYWORDS, "A neuron kernel (device/backend.py), its common case in C (hot_path.cpp: fast_kernel)."};

PyObject* fast_kernel(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "fast_kernel(kernel, op or None)");
    return nullptr;
  }
  PyObject* self = PyTuple_Pack(2, args[0], args[1]);
  if (self == nullptr) {
    return nullptr;
  }
  PyObject* function = PyCFunction_NewEx(&fast_kernel_def, self, nullptr);
  Py_DECREF(self);
  return function;
}

// set_fast_path(acquire, release, entry_of, run), or (None, None, None, None): off.
PyObject* set_fast_path(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4) {
    PyErr_SetString(PyExc_TypeError, "set_fast_path(acquire, release, entry_of, run)");
    return nullptr;
  }
  PyObject** fields[4] = {&fast_path.acquire, &fast_path.release, &fast_path.entry_of, &fast_path.run};
  for (int i = 0; i < 4; ++i) {
    Py_XSETREF(*fields[i], args[i] == Py_None ? nullptr : Py_NewRef(args[i]));
  }
  if (fast_path.acquire == nullptr || fast_path.release == nullptr || fast_path.entry_of == nullptr ||
      fast_path.run == nullptr) {
    Py_CLEAR(fast_path.acquire);  // all or nothing
  }
  Py_RETURN_NONE;
}

PyMethodDef user_facing_def = {
    "neuron_kernel", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(call_user_facing)),
    METH_VARARGS | METH_KEYWORDS, "A neuron kernel (device/backend.py): the user's errors leave it without device frames."};

PyObject* user_facing(PyObject* /*module*/, PyObject* kernel) {
  return PyCFunction_NewEx(&user_facing_def, kernel, nullptr);
}

}  // namespace

// user_frame(is_internal) -> (code, instruction offset in bytes) of the innermost Python
// frame whose code is not internal (is_internal(code.co_filename), asked once per code
// object), None when every frame is, or NotImplemented where this interpreter's frames
// cannot be read (then core/location.py walks the frame objects itself). The same pair
// `frame.f_code, frame.f_lasti` gives, without making a frame object for every frame on the
// way (each one an allocation that lives as long as its frame, and counts towards a garbage
// collection): in the per-op path they cost more than the walk itself.
std::unordered_map<PyObject*, bool>& internal_codes() {
  static auto* codes = new std::unordered_map<PyObject*, bool>();  // code -> internal?; holds a reference
  return *codes;
}

PyObject* user_frame(PyObject* /*module*/, PyObject* is_internal) {
#ifdef NEURON_INTERPRETER_FRAMES
  auto& codes = internal_codes();
  _PyInterpreterFrame* frame = PyThreadState_Get()->cframe->current_frame;
  for (; frame != nullptr; frame = frame->previous) {
    if (_PyFrame_IsIncomplete(frame)) {  // as PyFrame_GetBack skips them
      continue;
    }
    PyObject* code = reinterpret_cast<PyObject*>(frame->f_code);
    auto found = codes.find(code);
    bool internal;
    if (found != codes.end()) {
      internal = found->second;
    } else {
      PyObject* verdict = PyObject_CallOneArg(is_internal, frame->f_code->co_filename);
      if (verdict == nullptr) {
        return nullptr;
      }
      int truth = PyObject_IsTrue(verdict);
      Py_DECREF(verdict);
      if (truth < 0) {
        return nullptr;
      }
      internal = truth != 0;
      Py_INCREF(code);
      codes.emplace(code, internal);
    }
    if (!internal) {
      int lasti = _PyInterpreterFrame_LASTI(frame);
      return Py_BuildValue("(Oi)", code, lasti < 0 ? -1 : lasti * static_cast<int>(sizeof(_Py_CODEUNIT)));
    }
  }
  Py_RETURN_NONE;
#else
  Py_RETURN_NOTIMPLEMENTED;
#endif
}

// user_frame_reset(): forget which codes are internal (the internal directories changed).
PyObject* user_frame_reset(PyObject* /*module*/, PyObject* /*unused*/) {
  auto& codes = internal_codes();
  for (auto& entry : codes) {
    Py_DECREF(entry.first);
  }
  codes.clear();
  Py_RETURN_NONE;
}

// input_signature(args, autocast_enabled, autocast_dtype, storage_of) -> (key, storages), or
// None when an argument is neither a neuron tensor nor an int, float, bool or None (the
// Python version, adaptive_eager/replay.py: input_signature, answers those: host tensors,
// inputs a template cannot bind). The key as the Python version makes it: the autocast
// state, then per argument (signature, storage number) for a tensor its storage's layout
// covers, (signature, number, storage offset, conj, neg) for any other neuron tensor,
// (type, value) for a number; storages[k] is argument k's DeviceStorage (None for a number).
// A compiled graph's every call computes it over its ~50 inputs (its parameters too).
PyObject* input_signature(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK(nargs == 4 && PyList_Check(args[0]), "input_signature(args, autocast_enabled, autocast_dtype, storage_of)");
  PyObject* values = args[0];
  Py_ssize_t count = PyList_GET_SIZE(values);
  py::object key = py::reinterpret_steal<py::object>(PyTuple_New(count + 2));
  py::object storages = py::reinterpret_steal<py::object>(PyList_New(count));
  if (!key || !storages) {
    return nullptr;
  }
  PyTuple_SET_ITEM(key.ptr(), 0, Py_NewRef(args[1]));
  PyTuple_SET_ITEM(key.ptr(), 1, Py_NewRef(args[2]));
  std::vector<PyObject*> numbered;  // storages in order of first appearance (borrowed: held by `storages`)
  for (Py_ssize_t k = 0; k < count; ++k) {
    PyObject* value = PyList_GET_ITEM(values, k);
    PyTypeObject* type = Py_TYPE(value);
    PyObject* item = nullptr;
    PyObject* storage = Py_None;
    if (type == &PyLong_Type || type == &PyFloat_Type || type == &PyBool_Type || value == Py_None) {
      item = PyTuple_Pack(2, reinterpret_cast<PyObject*>(type), value);
      Py_INCREF(storage);
    } else {
      py::object described = py::reinterpret_steal<py::object>(describe(nullptr, value));
      if (!described) {
        return nullptr;
      }
      if (described.ptr() == Py_None) {
        Py_RETURN_NONE;  // a host tensor or an input a template cannot bind: Python's to say
      }
      PyObject* signature = PyTuple_GET_ITEM(described.ptr(), 0);
      storage = PyTuple_GET_ITEM(described.ptr(), 1);
      if (storage == Py_None) {
        storage = PyObject_CallOneArg(args[3], value);
        if (storage == nullptr) {
          return nullptr;
        }
      } else {
        Py_INCREF(storage);
      }
      size_t number = 0;
      while (number < numbered.size() && numbered[number] != storage) {
        ++number;
      }
      if (number == numbered.size()) {
        numbered.push_back(storage);
      }
      py::object index = py::reinterpret_steal<py::object>(PyLong_FromSize_t(number));
      if (PyTuple_GET_ITEM(described.ptr(), 2) == Py_True) {
        item = PyTuple_Pack(2, signature, index.ptr());
      } else {
        const at::Tensor& tensor = THPVariable_Unpack(value);
        py::object offset = py::reinterpret_steal<py::object>(PyLong_FromLongLong(tensor.storage_offset()));
        item = PyTuple_Pack(5, signature, index.ptr(), offset.ptr(), tensor.is_conj() ? Py_True : Py_False,
                            tensor.is_neg() ? Py_True : Py_False);
      }
    }
    PyList_SET_ITEM(storages.ptr(), k, storage);  // (owned)
    if (item == nullptr) {
      return nullptr;
    }
    PyTuple_SET_ITEM(key.ptr(), k + 2, item);
  }
  return PyTuple_Pack(2, key.ptr(), storages.ptr());
  END_HANDLE_TH_ERRORS
}

PyMethodDef hot_methods[] = {
    {"user_frame", user_frame, METH_O, "The issuing frame's (code, f_lasti), walked in C (see hot_path.cpp)."},
    {"user_frame_reset", user_frame_reset, METH_NOARGS, "Forget which codes are internal."},
    {"user_facing", user_facing, METH_O, "Wrap a Python kernel so the user's errors leave it without device frames."},
    {"fast_kernel", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_kernel)), METH_FASTCALL,
     "user_facing, with the handler's common case in C (see hot_path.cpp)."},
    {"set_fast_path", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(set_fast_path)), METH_FASTCALL,
     "What fast_kernel calls: the host lock's acquire and release, entry_of(op), run (None: off)."},
    {"describe", describe, METH_O, "What the dispatcher records of a tensor argument (see hot_path.cpp)."},
    {"input_signature", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(input_signature)), METH_FASTCALL,
     "A compiled call's input signature and storages, or None for Python's version (see hot_path.cpp)."},
    {"offset_of", offset_of, METH_O, "Where a neuron tensor starts in its storage's allocation, in elements (see hot_path.cpp)."},
    {"empty", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(empty)), METH_FASTCALL,
     "A device tensor over a fresh storage (see hot_path.cpp)."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace neuron
