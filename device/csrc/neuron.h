// What the translation units of the neuron extension share (device/csrc):
//
// - memory.cpp:   device indices, the callbacks into the Python device, device memory (the
//                 allocator, the address map, storage resizing) and pinned host memory;
// - host_pool.cpp: the caching pool of host memory the device worker's kernels allocate;
// - hooks.cpp:    generators, the PrivateUse1 hooks, the device guard, and init();
// - hot_path.cpp: the calls on the per-op hot path (`describe`, `empty`) and the kernel
//                 boundary (`user_facing`);
// - record.cpp:   the recorder's common case in one C call, the queue's bookkeeping;
// - views.cpp:    the view kernels run in C++ (`view`, `as_strided`, `_reshape_alias`);
// - sparse.cpp:   the sparse COO kernels that only read or re-point the structure;
// - profiler.cpp: torch.profiler's device activity (a Kineto child profiler for PrivateUse1);
// - module.cpp:   the Python module adaptive_eager_device._C.
//
// The overview of what the extension is for is at the top of module.cpp.

#pragma once

#include <Python.h>

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/Storage.h>
#include <c10/util/SmallVector.h>
#include <pybind11/pybind11.h>

#include <atomic>
#include <cstdint>
#include <vector>

namespace neuron {

namespace py = pybind11;

constexpr c10::DeviceType kDevice = c10::DeviceType::PrivateUse1;

// -- device indices (memory.cpp) ------------------------------------------------------------
extern c10::DeviceIndex device_count;   // set once by init()
extern c10::DeviceIndex initial_index;  // a thread's current device until it sets one
extern thread_local c10::DeviceIndex thread_index;  // -1: not set on this thread

c10::DeviceIndex current_index();
void check_index(c10::DeviceIndex index);
c10::DeviceIndex exchange_index(c10::DeviceIndex index);

// -- callbacks into the Python device (memory.cpp) ------------------------------------------
struct Callbacks {
  PyObject* synchronize = nullptr;  // () -> None: wait for every queued kernel
  PyObject* resize = nullptr;       // (side or None, nbytes) -> side: resize a storage's bytes
};
extern Callbacks callbacks;

bool python_alive();
void call_synchronize();

// -- device memory (memory.cpp) -------------------------------------------------------------
// The context of every device DataPtr: the storage's Python side (a DeviceStorage, or
// nullptr until Python first sees the storage), and the layout it was made for, so that
// `describe` can tell a tensor covering its storage exactly from a view of it.
struct Owner {
  PyObject* side = nullptr;
  PyObject* signature = nullptr;  // (shape, stride, dtype) of its layout, made on first use
  uintptr_t address = 0;  // its key in the address map (0: none, an empty allocation)
  size_t nbytes = 0;      // the allocation's size in bytes
  c10::DeviceIndex index = current_index();  // the device it lives on (the current one)
  bool has_layout = false;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
};

// A DataPtr of `nbytes` at a fresh device address, whose context `owner` it takes.
c10::DataPtr device_data_ptr(size_t nbytes, Owner* owner);
// The Owner of a device storage, also of one ATen made over an address inside another
// storage's allocation (a storage view, `storage[a:b]`, or `at::from_blob`), or nullptr
// for a storage the device did not allocate. `offset`, when given, receives the byte
// offset of the storage's data in the allocation (0 for the allocation's own storage).
Owner* owner_of(const c10::Storage& storage, size_t* offset = nullptr);
// The device index of the allocation holding `address`, or the current one for an unknown address.
c10::DeviceIndex index_of_address(void* address);
// storage.resize_(newsize): a new address of the new size; the Python side resizes the bytes.
void resize_storage_bytes(const c10::Storage& storage, size_t newsize);

c10::Allocator* device_allocator();
// Whether a DataPtr is one the device allocator made (its context an Owner).
bool is_owner_data_ptr(const c10::DataPtr& data_ptr);

// -- the device worker's host memory (host_pool.cpp) ----------------------------------------
// On a device worker's thread, at its start: its kernels' blocks come from the pool (the
// pool's allocator is installed over the CPU one the first time).
void enter_host_pool();
// On a worker: blocks of these sizes (of 64 KiB and more) set aside for its next
// allocations; false (none kept) if they cannot all be had.
bool reserve_host_blocks(const std::vector<size_t>& sizes);
void release_host_reservation();  // the reserved blocks not used, back to the cache
void release_host_pool();   // free the cached blocks (torch.neuron.empty_cache)
py::dict host_pool_stats();  // in use, peak, cached bytes; hits, misses, releases

// -- copy-on-write lazy clones (cow.cpp) ----------------------------------------------------
// A storage sharing its bytes copy-on-write gives up its share (copying them on the device
// unless it held the last share); any other storage is left as it is.
void materialize_storage(c10::StorageImpl* storage);
void add_cow_methods(py::module& m);
c10::Allocator* pinned_allocator();
bool is_pinned(const void* data);

// attach / side_of / regrow: the Python side of a storage (see memory.cpp).
py::object attach(const at::Tensor& tensor, py::object side);
py::object side_of(const at::Tensor& tensor);
void regrow(const at::Tensor& tensor, int64_t nbytes);

// -- generators, hooks, the device guard (hooks.cpp) ----------------------------------------
void init(py::object default_twin, py::object synchronize, py::object resize, int count, int initial);
py::object twin(py::object generator);

// -- the hot path (hot_path.cpp) -------------------------------------------------------------
extern PyMethodDef hot_methods[];
// The recorder's common case of one call: the result, NotImplemented, or nullptr (an error set).
PyObject* record_op(PyObject* entry, PyObject* args, PyObject* kwargs);
extern PyMethodDef record_methods[];  // record.cpp: the recorder's common case, the queue's bookkeeping
std::vector<int64_t> int_vector(PyObject* sequence);  // a Python sequence of ints
PyObject* int_tuple(c10::IntArrayRef values);          // and back (a new tuple)
// _C.empty's body: (shape, stride, dtype, side, nbytes) -> a device tensor over a fresh
// storage whose Python side is `side` (new reference; throws on an error).
PyObject* device_tensor(PyObject* const* args);

// -- a storage's bytes (cells.cpp) -----------------------------------------------------------
// The bytes of one device storage: a CPU tensor (undefined until written) that never has a
// Python object, so the device worker takes and drops references to it without the GIL.
struct Cell : c10::intrusive_ptr_target {
  // (inline up to 5 dimensions: a cell's layout costs no allocation of its own)
  using Dims = c10::SmallVector<int64_t, 5>;
  at::Tensor data;
  Dims sizes;  // the layout `materialize` makes and `adopt` takes whole
  Dims strides;
  c10::ScalarType dtype = c10::ScalarType::Float;
  std::atomic<bool> poisoned{false};  // a failed kernel left it without valid data
  // The bytes it booked itself, freed when it is (-1: none; a DeviceStorage's bytes are the
  // storage's): a compiled call's intermediate, which has no DeviceStorage (fresh_cells).
  int64_t booked = -1;

  ~Cell() override;
  at::Tensor materialize();  // the bytes, allocated now if nothing wrote them yet
  at::Tensor value();        // the same, without the lock when they exist
  void adopt(const at::Tensor& result);  // a kernel's result becomes the bytes (or is copied in)
};
at::Tensor unshared(const at::Tensor& tensor);  // a tensor over the same bytes with no Python object
bool is_storage(PyObject* value);                // a DeviceStorage?
void set_storage_alive(PyObject* storage, bool alive);  // DeviceStorage.alive, set with no attribute lookup
bool storage_alive(PyObject* storage);                  // and read (a DeviceStorage's)
c10::intrusive_ptr<Cell> cell_of(PyObject* storage);
void add_storage_type(PyObject* module);        // _C.StorageBase, DeviceStorage's base
// A compiled call's fresh storages (executor.cpp: FreshSlots), booked at once, as making
// them one by one books them: the escaping ones as DeviceStorages of `type` put into
// `table` at their slots, the others as cells only, by slot in `cells` (each books its own
// bytes). False (an OOM counted, nothing booked or made) when they do not fit.
struct FreshLayout {
  int32_t slot;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  c10::ScalarType dtype;
  int64_t nbytes;  // booked (rounded up)
  PyObject* shape;   // (escaping ones) the layout's Python objects, held by the caller
  PyObject* stride;
  PyObject* dtype_object;
  bool escapes;
};
bool fresh_cells(PyTypeObject* type, const std::vector<FreshLayout>& fresh, int64_t total, int64_t capacity,
                 PyObject* table, std::vector<c10::intrusive_ptr<Cell>>& cells);
// A DeviceStorage of `type` over an intermediate's cell (when Python needs the storage: a
// fallback, the records' path); its booked bytes become the storage's. New reference.
PyObject* storage_over(PyTypeObject* type, const c10::intrusive_ptr<Cell>& cell);

// -- the device worker and native launches (executor.cpp) -------------------------------------
void register_executor(py::module& m);
// One op's native launch as a Python object (see executor.cpp), for the C recorder.
PyObject* native_op_launch(PyObject* op, PyObject* args, PyObject* kwargs, PyObject* results, PyObject* guarded,
                           PyObject* fallback);

// -- the view kernels (views.cpp) ------------------------------------------------------------
void register_views();  // once, from init()
void register_sparse();  // once, from init(): the sparse COO kernels of sparse.cpp
int64_t view_count();   // views the C++ kernels made so far

// -- torch.profiler's device activity (profiler.cpp) -------------------------------------------
namespace profiler {
void add_methods(py::module& m);  // the profiler_* functions of the Python module
// An allocation (delta > 0) or free (delta < 0) of device memory at `address`: a memory
// event when the profiler records memory (profile_memory).
void report_memory(uintptr_t address, int64_t delta, c10::DeviceIndex index);
}  // namespace profiler

}  // namespace neuron
