// A storage's bytes, reachable from C++ without the GIL: the Cell, and the Python type
// whose subclass is device/memory/storage.py's DeviceStorage, with the allocator's books.
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
#include <torch/csrc/DynamicTypes.h>
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

// The allocator's books (device/memory/storage.py's MEMORY reads them). A storage books its
// bytes when it is made and frees them in its dealloc, here, with no Python code: the host
// allocates, and whichever thread drops a storage's last reference frees (often the host
// releasing a launch the worker ran), so both update under this lock.
// Allocations are booked rounded up to this many bytes, as CUDA's caching allocator rounds
// them (c10/cuda/CUDACachingAllocator.cpp, kMinBlockSize = 512).
constexpr int64_t kAllocationGranularity = 512;

struct Books {
  std::mutex mutex;
  int64_t allocated = 0;
  int64_t peak = 0;
  int64_t reserved = 0;
  int64_t allocations = 0;
  int64_t frees = 0;
  int64_t ooms = 0;
  int64_t live_blocks = 0;
} books;

// Book `count` allocations of `nbytes` in all; false (an OOM counted, nothing booked) when
// they do not fit in `capacity`.
bool book(int64_t nbytes, int64_t count, int64_t capacity) {
  std::lock_guard<std::mutex> guard(books.mutex);
  int64_t allocated = books.allocated + nbytes;
  if (allocated > capacity) {
    books.ooms += 1;
    return false;
  }
  books.allocated = allocated;
  books.allocations += count;
  books.live_blocks += count;
  if (allocated > books.peak) {
    books.peak = allocated;
    if (allocated > books.reserved) {
      books.reserved = allocated;
    }
  }
  return true;
}

void unbook(int64_t nbytes) {
  std::lock_guard<std::mutex> guard(books.mutex);
  books.allocated -= nbytes;
  books.frees += 1;
  books.live_blocks -= 1;
}
}  // namespace

Cell::~Cell() {
  if (booked >= 0) {
    unbook(booked);
  }
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
  PyObject* shape;   // the layout it was made for (tuples, a torch.dtype), None until set
  PyObject* stride;
  PyObject* dtype;
  int64_t nbytes;  // the bytes it booked, freed in its dealloc; -1: nothing booked
  // Is its PrivateUse1 storage still referenced (memory.cpp clears it when freed)?
  bool alive;
};

StorageObject* as_storage(PyObject* self) {
  return reinterpret_cast<StorageObject*>(self);
}

PyObject* storage_new(PyTypeObject* type, PyObject* /*args*/, PyObject* /*kwargs*/) {
  PyObject* self = type->tp_alloc(type, 0);
  if (self == nullptr) {
    return nullptr;
  }
  auto* object = as_storage(self);
  object->cell = c10::make_intrusive<Cell>().release();
  for (PyObject** field : {&object->poison, &object->shape, &object->stride, &object->dtype}) {
    Py_INCREF(Py_None);
    *field = Py_None;
  }
  object->nbytes = -1;
  object->alive = true;
  return self;
}

int storage_traverse(PyObject* self, visitproc visit, void* arg) {
  auto* object = as_storage(self);
  Py_VISIT(object->poison);
  Py_VISIT(object->shape);
  Py_VISIT(object->stride);
  Py_VISIT(object->dtype);
  Py_VISIT(Py_TYPE(self));
  return 0;
}

int storage_clear(PyObject* self) {
  auto* object = as_storage(self);
  Py_CLEAR(object->poison);
  Py_CLEAR(object->shape);
  Py_CLEAR(object->stride);
  Py_CLEAR(object->dtype);
  return 0;
}

// A static base type: the subclass's dealloc (subtype_dealloc) releases the heap type.
void storage_dealloc(PyObject* self) {
  PyTypeObject* type = Py_TYPE(self);
  PyObject_GC_UnTrack(self);
  auto* object = as_storage(self);
  if (object->nbytes >= 0) {
    unbook(object->nbytes);
    object->nbytes = -1;
  }
  storage_clear(self);
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
  auto sizes = int_vector(args[0]);
  auto strides = int_vector(args[1]);
  cell->sizes.assign(sizes.begin(), sizes.end());
  cell->strides.assign(strides.begin(), strides.end());
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

// shape, stride, dtype: plain object fields (closure: the field's offset).
PyObject* get_field(PyObject* self, void* closure) {
  PyObject* value = *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(self) + reinterpret_cast<intptr_t>(closure));
  Py_INCREF(value);
  return value;
}

int set_field(PyObject* self, PyObject* value, void* closure) {
  if (value == nullptr) {
    value = Py_None;
  }
  Py_INCREF(value);
  Py_SETREF(*reinterpret_cast<PyObject**>(reinterpret_cast<char*>(self) + reinterpret_cast<intptr_t>(closure)), value);
  return 0;
}

#define FIELD(name) reinterpret_cast<void*>(offsetof(StorageObject, name))

PyObject* get_nbytes(PyObject* self, void* /*closure*/) {
  int64_t nbytes = as_storage(self)->nbytes;
  if (nbytes < 0) {
    Py_RETURN_NONE;
  }
  return PyLong_FromLongLong(nbytes);
}

// Setting nbytes changes what the dealloc frees, not the books (resize_bytes books the change).
int set_nbytes(PyObject* self, PyObject* value, void* /*closure*/) {
  if (value == nullptr || value == Py_None) {
    as_storage(self)->nbytes = -1;
    return 0;
  }
  int64_t nbytes = PyLong_AsLongLong(value);
  if (nbytes == -1 && PyErr_Occurred()) {
    return -1;
  }
  as_storage(self)->nbytes = nbytes;
  return 0;
}

PyObject* get_alive(PyObject* self, void* /*closure*/) {
  return PyBool_FromLong(as_storage(self)->alive);
}

int set_alive(PyObject* self, PyObject* value, void* /*closure*/) {
  int truth = value == nullptr ? 0 : PyObject_IsTrue(value);
  if (truth < 0) {
    return -1;
  }
  as_storage(self)->alive = truth != 0;
  return 0;
}

PyGetSetDef storage_getset[] = {
    {"shape", get_field, set_field, "The shape of the layout the storage was made for.", FIELD(shape)},
    {"stride", get_field, set_field, "The stride of that layout.", FIELD(stride)},
    {"dtype", get_field, set_field, "The dtype of that layout.", FIELD(dtype)},
    {"nbytes", get_nbytes, set_nbytes, "The bytes it booked (freed when it is), or None.", nullptr},
    {"alive", get_alive, set_alive,
     "Is its PrivateUse1 storage still referenced (a tensor, a view, a saved tensor, an optimizer's state)?", nullptr},
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

// -- the books and storage making, for device/memory/storage.py --------------------------

extern PyTypeObject StorageType;

bool is_storage_type(PyObject* type) {
  return PyType_Check(type) && PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(type), &StorageType);
}

int64_t as_int(PyObject* value) {
  int64_t result = PyLong_AsLongLong(value);
  if (result == -1 && PyErr_Occurred()) {
    throw python_error();
  }
  return result;
}

// A layout read from Python: (shape, stride, dtype) objects and their values, checked
// before anything is booked or made.
struct Layout {
  PyObject* shape;
  PyObject* stride;
  PyObject* dtype;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  int64_t nbytes;
};

Layout read_layout(PyObject* shape, PyObject* stride, PyObject* dtype, int64_t nbytes) {
  TORCH_CHECK(THPDtype_Check(dtype), "a storage's dtype must be a torch.dtype");
  return Layout{shape, stride, dtype, int_vector(shape), int_vector(stride), nbytes};
}

// A storage of `type` (DeviceStorage) for `layout`, its bytes already booked: its fields set
// and its Cell's layout, with no Python code run.
PyObject* make_storage(PyTypeObject* type, Layout& layout) {
  PyObject* self = storage_new(type, nullptr, nullptr);
  if (self == nullptr) {
    throw python_error();
  }
  auto* object = as_storage(self);
  for (auto [field, value] :
       {std::pair{&object->shape, layout.shape}, {&object->stride, layout.stride}, {&object->dtype, layout.dtype}}) {
    Py_INCREF(value);
    Py_SETREF(*field, value);
  }
  Cell* cell = object->cell;
  cell->sizes.assign(layout.sizes.begin(), layout.sizes.end());
  cell->strides.assign(layout.strides.begin(), layout.strides.end());
  cell->dtype = reinterpret_cast<THPDtype*>(layout.dtype)->scalar_type;
  object->nbytes = layout.nbytes;  // its dealloc frees them from now on
  return self;
}

int64_t rounded(int64_t nbytes) {
  return (nbytes + kAllocationGranularity - 1) / kAllocationGranularity * kAllocationGranularity;
}

// new_storage(type, shape, stride, dtype, nbytes, capacity) -> a storage of `nbytes` (rounded
// up to the allocation granularity) booked,
// or None (an OOM counted, nothing booked) when it does not fit.
PyObject* new_storage(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK(nargs == 6 && is_storage_type(args[0]),
              "new_storage(type, shape, stride, dtype, nbytes, capacity)");
  Layout layout = read_layout(args[1], args[2], args[3], rounded(as_int(args[4])));
  if (!book(layout.nbytes, 1, as_int(args[5]))) {
    Py_RETURN_NONE;
  }
  return make_storage(reinterpret_cast<PyTypeObject*>(args[0]), layout);
  END_HANDLE_TH_ERRORS
}

// book(nbytes, count, capacity) -> bool: book `count` allocations of `nbytes` in all (count 0
// and a difference of bytes: an allocation resized).
PyObject* book_bytes(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK(nargs == 3, "book(nbytes, count, capacity)");
  return PyBool_FromLong(book(as_int(args[0]), as_int(args[1]), as_int(args[2])));
  END_HANDLE_TH_ERRORS
}

// books() -> (allocated, peak, reserved, allocations, frees, ooms, live_blocks)
PyObject* get_books(PyObject* /*module*/, PyObject* /*unused*/) {
  std::lock_guard<std::mutex> guard(books.mutex);
  return Py_BuildValue("(LLLLLLL)", static_cast<long long>(books.allocated), static_cast<long long>(books.peak),
                       static_cast<long long>(books.reserved), static_cast<long long>(books.allocations),
                       static_cast<long long>(books.frees), static_cast<long long>(books.ooms),
                       static_cast<long long>(books.live_blocks));
}

// set_books(peak, reserved): torch.neuron.reset_peak_memory_stats and empty_cache.
PyObject* set_books(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK(nargs == 2, "set_books(peak, reserved)");
  int64_t peak = as_int(args[0]);
  int64_t reserved = as_int(args[1]);
  std::lock_guard<std::mutex> guard(books.mutex);
  books.peak = peak;
  books.reserved = reserved;
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

#define FASTCALL(function) reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(function)), METH_FASTCALL

PyMethodDef book_methods[] = {
    {"new_storage", FASTCALL(new_storage), "One storage, booked (None: it does not fit)."},
    {"book", FASTCALL(book_bytes), "Book allocations of bytes (False: they do not fit)."},
    {"books", get_books, METH_NOARGS, "(allocated, peak, reserved, allocations, frees, ooms, live_blocks)"},
    {"set_books", FASTCALL(set_books), "Set the peak and reserved bytes."},
    {nullptr, nullptr, 0, nullptr},
};

PyTypeObject StorageType = {
    PyVarObject_HEAD_INIT(nullptr, 0)
    "adaptive_eager_device._C.StorageBase",  // tp_name
    sizeof(StorageObject),                    // tp_basicsize
};

}  // namespace

bool fresh_cells(PyTypeObject* type, const std::vector<FreshLayout>& fresh, int64_t total, int64_t capacity,
                 PyObject* table, std::vector<c10::intrusive_ptr<Cell>>& cells) {
  if (!book(total, static_cast<int64_t>(fresh.size()), capacity)) {
    return false;
  }
  size_t made = 0;
  try {
    for (; made < fresh.size(); ++made) {
      const FreshLayout& layout = fresh[made];
      if (layout.escapes) {
        Layout own{layout.shape, layout.stride, layout.dtype_object, layout.sizes, layout.strides, layout.nbytes};
        PyObject* storage = make_storage(type, own);  // its dealloc frees its bytes
        if (PyList_SetItem(table, layout.slot, storage) < 0) {
          throw python_error();
        }
      } else {
        auto cell = c10::make_intrusive<Cell>();
        cell->sizes.assign(layout.sizes.begin(), layout.sizes.end());
        cell->strides.assign(layout.strides.begin(), layout.strides.end());
        cell->dtype = layout.dtype;
        cell->booked = layout.nbytes;  // freed with the cell
        cells[static_cast<size_t>(layout.slot)] = std::move(cell);
      }
    }
  } catch (...) {  // those made free their own bytes; the rest are unbooked here
    std::lock_guard<std::mutex> guard(books.mutex);
    for (size_t rest = made; rest < fresh.size(); ++rest) {
      books.allocated -= fresh[rest].nbytes;
    }
    books.allocations -= static_cast<int64_t>(fresh.size() - made);
    books.live_blocks -= static_cast<int64_t>(fresh.size() - made);
    throw;
  }
  return true;
}

PyObject* storage_over(PyTypeObject* type, const c10::intrusive_ptr<Cell>& cell) {
  py::object shape = py::reinterpret_steal<py::object>(int_tuple(cell->sizes));
  py::object stride = py::reinterpret_steal<py::object>(int_tuple(cell->strides));
  PyObject* self = storage_new(type, nullptr, nullptr);
  if (self == nullptr) {
    throw py::error_already_set();
  }
  auto* object = as_storage(self);
  c10::intrusive_ptr<Cell>::reclaim(object->cell);  // (the one storage_new made)
  object->cell = c10::intrusive_ptr<Cell>(cell).release();
  PyObject* dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(cell->dtype));
  for (auto [field, value] : {std::pair{&object->shape, shape.release().ptr()}, {&object->stride, stride.release().ptr()},
                              {&object->dtype, Py_NewRef(dtype)}}) {
    Py_SETREF(*field, value);
  }
  object->nbytes = cell->booked;  // its dealloc frees them from now on
  cell->booked = -1;
  object->alive = false;  // an intermediate: no PrivateUse1 storage references it
  return self;
}

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

bool storage_alive(PyObject* storage) {
  return as_storage(storage)->alive;
}

void set_storage_alive(PyObject* storage, bool alive) {
  if (is_storage(storage)) {
    as_storage(storage)->alive = alive;
  }
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
  if (PyModule_AddFunctions(module, book_methods) < 0 ||
      PyModule_AddIntConstant(module, "ALLOCATION_GRANULARITY", kAllocationGranularity) < 0) {
    throw py::error_already_set();
  }
}

}  // namespace neuron
