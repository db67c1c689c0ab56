// The recorder's common case in one C call (device/ops/recorder.py is the whole recorder,
// and the reference for everything here):
//
//   record(entry, args, kwargs) -> the op's result, or NotImplemented
//
// A kernel op whose signature hits the shape cache is recorded here: its signature built as
// recorder._record_call builds it (the same tuple, so one cache serves both paths), its
// output storages and tensors made, its OpRecord built and handed to the sink. In strict
// eager the record is launched here too: its native launch (executor.cpp, native_op_launch),
// then the queue's bookkeeping, account() and submit() below, which the Python queue calls
// as well (one implementation).
// Anything else answers NotImplemented before it has changed anything, and the caller runs
// the Python recorder: a cache miss, a host tensor, a storage Python has not met, an
// argument of a kind not handled here, a written storage that another argument shares, a
// cache entry with warnings or out= resizes, an out-of-memory, and whenever the device is
// observed (a trace, a profiler), runs kernels one by one (launch blocking, the Python
// reference path) or keeps a full stack per op.
//
// account(queue, counters, count, nbytes, time_us, by_key, stream, each, key, launch_us) and
// submit(queue, item, stream, nbytes, ops): the bodies of ExecutionQueue._account and
// ExecutionQueue.submit (device/hardware/execution_queue.py documents them), on the queue's
// own attributes, with Python's own arithmetic (so the clocks are the same to the bit).

#include "neuron.h"

#include <c10/core/DefaultDtype.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Layout.h>
#include <torch/csrc/MemoryFormat.h>
#include <torch/csrc/autograd/python_variable.h>

#include <unordered_set>

namespace neuron {

PyObject* describe(PyObject* module, PyObject* value);
PyObject* user_frame(PyObject* module, PyObject* is_internal);

namespace {

// An owned reference.
class Ref {
 public:
  Ref() = default;
  explicit Ref(PyObject* owned) : p_(owned) {}
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
  ~Ref() { Py_XDECREF(p_); }
  void reset(PyObject* owned) {
    Py_XDECREF(p_);
    p_ = owned;
  }
  PyObject* release() {
    PyObject* owned = p_;
    p_ = nullptr;
    return owned;
  }
  explicit operator bool() const { return p_ != nullptr; }
  PyObject* get() const { return p_; }

 private:
  PyObject* p_ = nullptr;
};

PyObject* intern(const char* text) {
  return PyUnicode_InternFromString(text);
}

// Attribute and method names, interned once.
struct Names {
  PyObject* fast = intern("fast");
  PyObject* trace_recorder = intern("trace_recorder");
  PyObject* is_profiler_enabled = intern("_is_profiler_enabled");
  PyObject* native = intern("native");
  PyObject* launch_blocking = intern("launch_blocking");
  PyObject* full_stack = intern("full_stack");
  PyObject* live = intern("live");
  PyObject* sink = intern("_sink");
  PyObject* move_to_end = intern("move_to_end");
  PyObject* warnings = intern("warnings");
  PyObject* resized = intern("resized");
  PyObject* outputs = intern("outputs");
  PyObject* shape = intern("shape");
  PyObject* stride = intern("stride");
  PyObject* dtype = intern("dtype");
  PyObject* nbytes = intern("nbytes");
  PyObject* hbm_bytes = intern("_hbm_bytes");  // (DeviceConfig.hbm_bytes, as a slot)
  PyObject* issued = intern("issued");
  PyObject* host_us = intern("host_us");
  PyObject* host_us_per_op = intern("host_us_per_op");
  PyObject* ops_recorded = intern("ops_recorded");
  PyObject* current = intern("current");
  PyObject* signature = intern("signature");
  PyObject* signature_id = intern("signature_id");
  PyObject* cost = intern("cost");
  PyObject* structure = intern("structure");
  PyObject* record = intern("record");
  PyObject* bytes = intern("bytes");
  PyObject* time_us = intern("time_us");
  PyObject* launch_us = intern("launch_us");
  PyObject* ends = intern("_ends");
  PyObject* popleft = intern("popleft");
  PyObject* append = intern("append");
  PyObject* kernels_launched = intern("kernels_launched");
  PyObject* bytes_moved = intern("bytes_moved");
  PyObject* device_time_us = intern("device_time_us");
  PyObject* clock_us = intern("clock_us");
  PyObject* device_free_us = intern("device_free_us");
  PyObject* kernel_totals = intern("kernel_totals");
  PyObject* launches_by_stream = intern("launches_by_stream");
  PyObject* submitted = intern("submitted");
  PyObject* last_on_stream = intern("last_on_stream");
  PyObject* batch = intern("_batch");
  PyObject* batch_bytes = intern("_batch_bytes");
  PyObject* batch_ops = intern("_batch_ops");
  PyObject* batch_items_limit = intern("batch_items");
  PyObject* batch_bytes_limit = intern("batch_bytes");
  PyObject* ring = intern("ring");
  PyObject* zero = PyLong_FromLong(0);
  PyObject* one = PyLong_FromLong(1);
  PyObject* host_snapshots = intern("HOST_SNAPSHOTS");
  PyObject* host = intern("host");
  PyObject* neuron = intern("neuron");
  PyObject* cpu = intern("CPU");
};

Names& names() {
  static auto* interned = new Names();
  return *interned;
}

// object.name = object.name + amount, with Python's own addition
bool add_to(PyObject* object, PyObject* name, PyObject* amount) {
  Ref value(PyObject_GetAttr(object, name));
  if (!value) {
    return false;
  }
  Ref sum(PyNumber_Add(value.get(), amount));
  return sum && PyObject_SetAttr(object, name, sum.get()) == 0;
}

// item[i] = item[i] + amount
bool add_at(PyObject* sequence, Py_ssize_t i, PyObject* amount) {
  Ref item(PySequence_GetItem(sequence, i));
  if (!item) {
    return false;
  }
  Ref sum(PyNumber_Add(item.get(), amount));
  return sum && PySequence_SetItem(sequence, i, sum.get()) == 0;
}

// totals[key] = [launches, us, bytes], or each added to the list already there
bool add_totals(PyObject* totals_by_key, PyObject* key, PyObject* launches, PyObject* us, PyObject* bytes) {
  PyObject* totals = PyDict_GetItemWithError(totals_by_key, key);  // borrowed
  if (totals == nullptr) {
    if (PyErr_Occurred()) {
      return false;
    }
    Ref fresh(PyList_New(3));
    if (!fresh) {
      return false;
    }
    PyObject* parts[3] = {launches, us, bytes};
    for (Py_ssize_t i = 0; i < 3; ++i) {
      Py_INCREF(parts[i]);
      PyList_SET_ITEM(fresh.get(), i, parts[i]);
    }
    return PyDict_SetItem(totals_by_key, key, fresh.get()) == 0;
  }
  return add_at(totals, 0, launches) && add_at(totals, 1, us) && add_at(totals, 2, bytes);
}

// fn(item) for each item of an iterable (borrowed); false, with an error set, when the
// iteration or fn fails.
template <typename Fn>
bool each_item(PyObject* iterable, Fn&& fn) {
  Ref iterator(PyObject_GetIter(iterable));
  if (!iterator) {
    return false;
  }
  while (Ref item{PyIter_Next(iterator.get())}) {
    if (!fn(item.get())) {
      return false;
    }
  }
  return !PyErr_Occurred();
}

// ExecutionQueue._account: the first launch's simulated start (new reference), or nullptr.
PyObject* account_launches(PyObject* queue, PyObject* counters, PyObject* count, PyObject* nbytes, PyObject* time_us,
                           PyObject* by_key, PyObject* stream, PyObject* each, PyObject* key, PyObject* launch_us) {
  Names& n = names();
  Ref ends(PyObject_GetAttr(queue, n.ends));
  Ref host(ends ? PyObject_GetAttr(queue, n.host_us) : nullptr);
  if (!host) {
    return nullptr;
  }
  for (;;) {  // finished before the host issues these
    Py_ssize_t length = PyObject_Length(ends.get());
    if (length < 0) {
      return nullptr;
    }
    if (length == 0) {
      break;
    }
    Ref first(PySequence_GetItem(ends.get(), 0));
    int finished = first ? PyObject_RichCompareBool(first.get(), host.get(), Py_LE) : -1;
    if (finished < 0) {
      return nullptr;
    }
    if (!finished) {
      break;
    }
    Ref popped(PyObject_CallMethodNoArgs(ends.get(), n.popleft));
    if (!popped) {
      return nullptr;
    }
  }
  Ref overhead(PyNumber_Multiply(count, launch_us));
  Ref total(overhead ? PyNumber_Add(time_us, overhead.get()) : nullptr);
  if (!total || !add_to(counters, n.kernels_launched, count) || !add_to(counters, n.bytes_moved, nbytes) ||
      !add_to(counters, n.device_time_us, total.get()) || !add_to(queue, n.clock_us, total.get())) {
    return nullptr;
  }
  Ref device_free(PyObject_GetAttr(queue, n.device_free_us));
  int later = device_free ? PyObject_RichCompareBool(device_free.get(), host.get(), Py_GT) : -1;
  if (later < 0) {
    return nullptr;
  }
  PyObject* begin = later ? device_free.get() : host.get();  // borrowed
  Ref end(PyNumber_Add(begin, total.get()));
  if (!end || PyObject_SetAttr(queue, n.device_free_us, end.get()) < 0) {
    return nullptr;
  }
  if (each == Py_None) {
    Ref appended(PyObject_CallMethodOneArg(ends.get(), n.append, end.get()));
    if (!appended) {
      return nullptr;
    }
  } else {
    Ref running(Py_NewRef(begin));
    bool ok = each_item(each, [&](PyObject* item) {  // (key, bytes, time_us, ops)
      Ref item_us(PySequence_GetItem(item, 2));
      Ref step(item_us ? PyNumber_Add(item_us.get(), launch_us) : nullptr);
      running.reset(step ? PyNumber_Add(running.get(), step.get()) : nullptr);
      return running && Ref(PyObject_CallMethodOneArg(ends.get(), n.append, running.get()));
    });
    if (!ok) {
      return nullptr;
    }
  }
  Ref totals_by_key(PyObject_GetAttr(queue, n.kernel_totals));
  if (!totals_by_key) {
    return nullptr;
  }
  if (by_key == Py_None) {  // one launch: total is its time with the launch overhead
    if (!add_totals(totals_by_key.get(), key, n.one, total.get(), nbytes)) {
      return nullptr;
    }
  } else {
    bool ok = each_item(by_key, [&](PyObject* item) {  // (key, launches, us, bytes)
      if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 4) {
        PyErr_SetString(PyExc_TypeError, "account: by_key holds (key, launches, time_us, bytes) tuples");
        return false;
      }
      PyObject* launches = PyTuple_GET_ITEM(item, 1);
      Ref key_overhead(PyNumber_Multiply(launches, launch_us));
      Ref key_us(key_overhead ? PyNumber_Add(PyTuple_GET_ITEM(item, 2), key_overhead.get()) : nullptr);
      return key_us && add_totals(totals_by_key.get(), PyTuple_GET_ITEM(item, 0), launches, key_us.get(),
                                  PyTuple_GET_ITEM(item, 3));
    });
    if (!ok) {
      return nullptr;
    }
  }
  Ref by_stream(PyObject_GetAttr(counters, n.launches_by_stream));
  if (!by_stream) {
    return nullptr;
  }
  PyObject* launched = PyDict_GetItemWithError(by_stream.get(), stream);  // borrowed
  if (launched == nullptr && PyErr_Occurred()) {
    return nullptr;
  }
  Ref launched_now(PyNumber_Add(launched != nullptr ? launched : n.zero, count));
  if (!launched_now || PyDict_SetItem(by_stream.get(), stream, launched_now.get()) < 0) {
    return nullptr;
  }
  return Py_NewRef(begin);
}

// ExecutionQueue.submit: the item's sequence number (new reference), or nullptr.
PyObject* submit_item(PyObject* queue, PyObject* item, PyObject* stream, PyObject* nbytes, PyObject* ops) {
  Names& n = names();
  if (!add_to(queue, n.submitted, n.one)) {
    return nullptr;
  }
  Ref sequence(PyObject_GetAttr(queue, n.submitted));
  Ref last(sequence ? PyObject_GetAttr(queue, n.last_on_stream) : nullptr);
  if (!last || PyObject_SetItem(last.get(), stream, sequence.get()) < 0) {
    return nullptr;
  }
  Ref batch(PyObject_GetAttr(queue, n.batch));
  if (!batch || PyList_Append(batch.get(), item) < 0 || !add_to(queue, n.batch_bytes, nbytes) ||
      !add_to(queue, n.batch_ops, ops)) {
    return nullptr;
  }
  Ref batch_ops(PyObject_GetAttr(queue, n.batch_ops));
  Ref items_limit(batch_ops ? PyObject_GetAttr(queue, n.batch_items_limit) : nullptr);
  int full = items_limit ? PyObject_RichCompareBool(batch_ops.get(), items_limit.get(), Py_GE) : -1;
  if (full == 0) {
    Ref batch_bytes(PyObject_GetAttr(queue, n.batch_bytes));
    Ref bytes_limit(batch_bytes ? PyObject_GetAttr(queue, n.batch_bytes_limit) : nullptr);
    full = bytes_limit ? PyObject_RichCompareBool(batch_bytes.get(), bytes_limit.get(), Py_GE) : -1;
  }
  if (full < 0) {
    return nullptr;
  }
  if (full) {
    Ref rung(PyObject_CallMethodNoArgs(queue, n.ring));
    if (!rung) {
      return nullptr;
    }
  }
  return sequence.release();
}

PyObject* account(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 10) {
    PyErr_SetString(PyExc_TypeError, "account(queue, counters, count, nbytes, time_us, by_key, stream, each, key, launch_us)");
    return nullptr;
  }
  return account_launches(args[0], args[1], args[2], args[3], args[4], args[5], args[6], args[7], args[8], args[9]);
}

PyObject* submit(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 5) {
    PyErr_SetString(PyExc_TypeError, "submit(queue, item, stream, nbytes, ops)");
    return nullptr;
  }
  return submit_item(args[0], args[1], args[2], args[3], args[4]);
}

// -- recording ----------------------------------------------------------------------------------

// What install() was given (device/ops/fast_record.py), held for good.
struct Handles {
  PyObject* shape_cache;     // shapes.SHAPE_CACHE (an OrderedDict)
  PyObject* inference_type;  // shapes.Inference
  PyObject* queue;           // execution_queue.QUEUE
  PyObject* counters;        // counters.COUNTERS
  PyObject* config;          // config.CONFIG
  PyObject* sink_module;     // hardware.sink (its `_sink`)
  PyObject* strict_sink;     // sink.STRICT_SINK
  PyObject* profiler;        // hardware.profiler.PROFILER
  PyObject* streams;         // streams.STATE (its `current`)
  PyObject* cow;             // cow.COW (its `live`)
  PyObject* op_record;       // op_record.OpRecord
  PyObject* storage_type;    // storage.DeviceStorage
  PyObject* reference;       // memory.tensor.reference
  PyObject* view_ref;        // storage.ViewRef
  PyObject* is_internal;     // location.is_internal
  PyObject* no_user_frame;   // location._no_user_frame
  PyObject* new_storage;     // _C.new_storage
  PyObject* empty;           // _C.empty
  PyObject* guarded;         // op_record.GUARDED_WRITES (ids of ops)
  PyObject* recorder;        // ops.recorder (its HOST_SNAPSHOTS)
};
Handles* handles = nullptr;
long long fast_records = 0;  // calls recorded here (record_counts)

// Not handled here: the caller runs the Python recorder. Nothing has changed yet.
struct Miss {};

void check(bool ok) {
  if (!ok) {
    throw py::error_already_set();
  }
}

PyObject* checked(PyObject* result) {
  if (result == nullptr) {
    throw py::error_already_set();
  }
  return result;
}

bool truth_of(PyObject* object, PyObject* name) {
  Ref value(checked(PyObject_GetAttr(object, name)));
  int truth = PyObject_IsTrue(value.get());
  check(truth >= 0);
  return truth != 0;
}

// The common case's conditions, read live (device/ops/recorder.py: record_kernel).
bool observed_or_special(Handles& h, Names& n) {
  Ref trace(checked(PyObject_GetAttr(h.queue, n.trace_recorder)));
  return trace.get() != Py_None || truth_of(h.profiler, n.is_profiler_enabled) ||
         truth_of(h.config, n.full_stack);
}

struct Call {
  Handles& h;
  bool values_matter;  // entry.scalar_values_matter
  PyObject* parts;     // the signature's parts (a list)
  PyObject* reads;     // storages read (a list)
  bool nested = false;

  // One neuron tensor (`described`: describe's answer): its reference (new).
  PyObject* device_argument(PyObject* value, PyObject* described, PyObject* into) {
    PyObject* signature = PyTuple_GET_ITEM(described, 0);
    PyObject* storage = PyTuple_GET_ITEM(described, 1);
    bool covers = PyTuple_GET_ITEM(described, 2) == Py_True;
    if (storage == Py_None) {
      throw Miss();  // a storage Python has not met (recorder.storage_of attaches one)
    }
    check(PyList_Append(into, signature) == 0);
    check(PyList_Append(reads, storage) == 0);
    if (covers) {
      return Py_NewRef(storage);
    }
    nested = true;  // a view's reference resolves with as_strided
    return view_reference(value, signature, storage);
  }

  // memory.tensor.reference of a tensor that does not cover its storage: a ViewRef of its
  // place in the storage's allocation, made here in the common case (the storage's dtype,
  // no conjugate or negative bit, a whole-element offset); Python's otherwise.
  PyObject* view_reference(PyObject* value, PyObject* signature, PyObject* storage) {
    const at::Tensor& tensor = THPVariable_Unpack(value);
    size_t into = 0;  // a storage view's offset in its allocation
    owner_of(tensor.storage(), &into);
    auto itemsize = static_cast<size_t>(tensor.element_size());
    Ref storage_dtype(checked(PyObject_GetAttr(storage, names().dtype)));
    if (tensor.is_conj() || tensor.is_neg() || into % itemsize != 0 ||
        storage_dtype.get() != PyTuple_GET_ITEM(signature, 2)) {
      return checked(PyObject_CallFunctionObjArgs(h.reference, value, signature, storage, Py_False, nullptr));
    }
    Ref offset(checked(PyLong_FromLongLong(tensor.storage_offset() + static_cast<int64_t>(into / itemsize))));
    PyObject* parts[4] = {storage, PyTuple_GET_ITEM(signature, 0), PyTuple_GET_ITEM(signature, 1), offset.get()};
    return checked(PyObject_Vectorcall(h.view_ref, parts, 4, nullptr));
  }

  // Any argument (recorder._convert, and _device_argument for a neuron tensor): its
  // reference (new); its signature into `into`.
  PyObject* convert(PyObject* value, PyObject* into) {
    Ref described(checked(describe(nullptr, value)));
    if (described.get() != Py_None) {
      return device_argument(value, described.get(), into);
    }
    PyTypeObject* type = Py_TYPE(value);
    if (type == &PyList_Type || type == &PyTuple_Type) {
      nested = true;
      Ref sub(checked(PyList_New(0)));
      Py_ssize_t size = PySequence_Fast_GET_SIZE(value);
      Ref refs(checked(PyList_New(size)));
      for (Py_ssize_t i = 0; i < size; ++i) {
        PyList_SET_ITEM(refs.get(), i, convert(PySequence_Fast_GET_ITEM(value, i), sub.get()));
      }
      Ref signature(checked(PyList_AsTuple(sub.get())));
      check(PyList_Append(into, signature.get()) == 0);
      return type == &PyList_Type ? refs.release() : checked(PyList_AsTuple(refs.get()));
    }
    if (type == &PyLong_Type || type == &PyBool_Type || type == &PyFloat_Type) {
      check(PyList_Append(into, reinterpret_cast<PyObject*>(type)) == 0);
      if (type != &PyFloat_Type || values_matter) {
        check(PyList_Append(into, value) == 0);
      } else {  // recorder.float_class: the sign
        double number = PyFloat_AS_DOUBLE(value);
        Ref sign(checked(PyLong_FromLong(number > 0.0 ? 1 : number < 0.0 ? -1 : number == 0.0 ? 0 : 2)));
        check(PyList_Append(into, sign.get()) == 0);
      }
      return Py_NewRef(value);
    }
    if (value == Py_None || THPDtype_Check(value) || THPLayout_Check(value) || THPMemoryFormat_Check(value) ||
        PyUnicode_CheckExact(value)) {
      check(PyList_Append(into, value) == 0);
      return Py_NewRef(value);
    }
    if (THPVariable_Check(value)) {
      return host_scalar(value, into);
    }
    if (THPDevice_Check(value)) {  // a factory's device=: the kernel makes it on the CPU
      const c10::Device& device = reinterpret_cast<THPDevice*>(value)->device;
      if (device.type() != kDevice || (device.has_index() && device.index() >= device_count)) {
        throw Miss();  // another device's (CUDA's error), or an index out of range (check_ordinal's)
      }
      check(PyList_Append(into, names().neuron) == 0);
      return checked(PyObject_GetAttr(h.recorder, names().cpu));
    }
    throw Miss();  // a generator, anything rarer
  }

  // A 0-dim host tensor (a Python number the dispatcher wrapped, `x * 2.0`): its snapshot
  // (recorder._host_tensor: the host may change it before the kernel runs).
  PyObject* host_scalar(PyObject* value, PyObject* into) {
    const at::Tensor& tensor = THPVariable_Unpack(value);
    if (!tensor.defined() || tensor.device().type() == kDevice || tensor.dim() != 0) {
      throw Miss();  // a host tensor of elements (CUDA's error, or an op taking them), a storage-less one
    }
    Ref snapshots(checked(PyObject_GetAttr(h.recorder, names().host_snapshots)));
    if (snapshots.get() != Py_None) {
      throw Miss();  // a compiled graph's call is being recorded: its snapshots are tracked
    }
    Ref empty(checked(PyTuple_New(0)));
    Ref signature(checked(PyTuple_Pack(4, names().host, empty.get(), empty.get(),
                                       reinterpret_cast<PyObject*>(torch::getTHPDtype(tensor.scalar_type())))));
    check(PyList_Append(into, signature.get()) == 0);
    return THPVariable_Wrap(tensor.clone());
  }
};

// A neuron tensor's storage among the call's arguments (None: not one), borrowed from `keep`.
PyObject* storage_or_none(PyObject* value, Ref& keep) {
  keep.reset(checked(describe(nullptr, value)));
  if (keep.get() == Py_None) {
    if (THPVariable_Check(value)) {
      throw Miss();  // a host tensor written: CUDA's error, from the Python recorder
    }
    return Py_None;
  }
  PyObject* storage = PyTuple_GET_ITEM(keep.get(), 1);
  if (storage == Py_None) {
    throw Miss();
  }
  return storage;
}

// recorder._mutated_storages: the storages the call writes (a new tuple).
PyObject* written_storages(PyObject* mutated, PyObject* args, PyObject* kwargs) {
  Ref writes(checked(PyList_New(0)));
  Py_ssize_t nargs = PyTuple_GET_SIZE(args);
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(mutated); ++i) {
    PyObject* where = PyTuple_GET_ITEM(mutated, i);  // (index, name)
    Py_ssize_t index = PyLong_AsSsize_t(PyTuple_GET_ITEM(where, 0));
    PyObject* value = index < nargs ? PyTuple_GET_ITEM(args, index)
                      : kwargs != nullptr ? PyDict_GetItemWithError(kwargs, PyTuple_GET_ITEM(where, 1))
                                          : nullptr;
    if (value == nullptr) {
      check(!PyErr_Occurred());
      continue;
    }
    Ref keep;
    if (PyList_Check(value) || PyTuple_Check(value)) {  // (isinstance, as recorder._mutated_storages)
      for (Py_ssize_t j = 0; j < PySequence_Fast_GET_SIZE(value); ++j) {
        PyObject* storage = storage_or_none(PySequence_Fast_GET_ITEM(value, j), keep);
        if (storage != Py_None) {
          check(PyList_Append(writes.get(), storage) == 0);
        }
      }
    } else {
      PyObject* storage = storage_or_none(value, keep);
      if (storage != Py_None) {
        check(PyList_Append(writes.get(), storage) == 0);
      }
    }
  }
  return checked(PyList_AsTuple(writes.get()));
}

// overlap.aliased and overlap.writes_shared: a written storage appears twice among the reads
bool writes_shared(PyObject* reads, PyObject* writes) {
  Py_ssize_t count = PyList_GET_SIZE(reads);
  if (count < 2 || PyTuple_GET_SIZE(writes) == 0) {
    return false;
  }
  std::unordered_set<PyObject*> seen;
  std::unordered_set<PyObject*> shared;
  for (Py_ssize_t i = 0; i < count; ++i) {
    PyObject* storage = PyList_GET_ITEM(reads, i);
    if (!seen.insert(storage).second) {
      shared.insert(storage);
    }
  }
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(writes); ++i) {
    if (shared.count(PyTuple_GET_ITEM(writes, i)) != 0) {
      return true;
    }
  }
  return false;
}

// The argument an aliased return is (return_alias: (index, name)), new reference.
PyObject* aliased_argument(PyObject* alias, PyObject* args, PyObject* kwargs) {
  Py_ssize_t index = PyLong_AsSsize_t(PyTuple_GET_ITEM(alias, 0));
  if (index < PyTuple_GET_SIZE(args)) {
    return Py_NewRef(PyTuple_GET_ITEM(args, index));
  }
  PyObject* value = kwargs != nullptr ? PyDict_GetItemWithError(kwargs, PyTuple_GET_ITEM(alias, 1)) : nullptr;
  if (value == nullptr && !PyErr_Occurred()) {
    PyErr_SetObject(PyExc_KeyError, PyTuple_GET_ITEM(alias, 1));
  }
  return Py_XNewRef(checked(value));
}

// recorder._build_return
PyObject* build_return(PyObject* return_alias, PyObject* structure, PyObject* outputs, PyObject* args,
                       PyObject* kwargs) {
  if (PyUnicode_CompareWithASCIIString(structure, "tensor") == 0) {
    PyObject* alias = PyTuple_GET_ITEM(return_alias, 0);
    return alias == Py_None ? Py_NewRef(PyList_GET_ITEM(outputs, 0)) : aliased_argument(alias, args, kwargs);
  }
  if (PyUnicode_CompareWithASCIIString(structure, "none") == 0) {
    Py_RETURN_NONE;
  }
  if (PyUnicode_CompareWithASCIIString(structure, "list") == 0) {
    return Py_NewRef(outputs);
  }
  Py_ssize_t count = std::min(PyList_GET_SIZE(outputs), PyTuple_GET_SIZE(return_alias));
  Ref values(checked(PyTuple_New(count)));
  for (Py_ssize_t i = 0; i < count; ++i) {
    PyObject* alias = PyTuple_GET_ITEM(return_alias, i);
    PyTuple_SET_ITEM(values.get(), i,
                     alias == Py_None ? Py_NewRef(PyList_GET_ITEM(outputs, i)) : aliased_argument(alias, args, kwargs));
  }
  return values.release();
}

// recorder._draws: does a call with this dropout argument ((index, name)) draw?
bool draws(PyObject* dropout, PyObject* args, PyObject* kwargs) {
  Py_ssize_t index = PyLong_AsSsize_t(PyTuple_GET_ITEM(dropout, 0));
  PyObject* value = index < PyTuple_GET_SIZE(args) ? PyTuple_GET_ITEM(args, index)
                    : kwargs != nullptr ? PyDict_GetItemWithError(kwargs, PyTuple_GET_ITEM(dropout, 1))
                                        : nullptr;
  if (value == nullptr) {
    check(!PyErr_Occurred());
    return false;  // the default, 0.0
  }
  int nonzero = PyObject_RichCompareBool(value, names().zero, Py_NE);
  check(nonzero >= 0);
  return nonzero != 0;
}

PyObject* record_call(Handles& h, Names& n, PyObject* entry, PyObject* args, PyObject* kwargs) {
  // entry.fast: (op, serial, scalar_values_matter, mutated, return_alias, dropout, copy), or
  // None (never here); dropout: the (index, name) of a host-random op's dropout_p, which must
  // be 0; copy: a copy, taken when its first argument is a neuron tensor (dispatch.run_copy)
  Ref fast(checked(PyObject_GetAttr(entry, n.fast)));
  if (fast.get() == Py_None) {
    throw Miss();
  }
  PyObject* op = PyTuple_GET_ITEM(fast.get(), 0);
  PyObject* mutated = PyTuple_GET_ITEM(fast.get(), 3);
  PyObject* return_alias = PyTuple_GET_ITEM(fast.get(), 4);
  PyObject* dropout = PyTuple_GET_ITEM(fast.get(), 5);
  if (!PyTuple_CheckExact(args) || (kwargs != nullptr && !PyDict_CheckExact(kwargs)) ||
      observed_or_special(h, n) || (PyTuple_GET_SIZE(mutated) != 0 && truth_of(h.cow, n.live)) ||
      (dropout != Py_None && draws(dropout, args, kwargs))) {  // (drawing: on the host, recorder._draws)
    throw Miss();
  }
  if (PyTuple_GET_ITEM(fast.get(), 6) == Py_True) {
    Ref first(checked(PyTuple_GET_SIZE(args) != 0 ? describe(nullptr, PyTuple_GET_ITEM(args, 0)) : Py_NewRef(Py_None)));
    if (first.get() == Py_None) {
      throw Miss();  // an upload, or a download into a host tensor
    }
  }

  // The signature, as recorder._record_call makes it.
  Ref parts(checked(PyList_New(0)));
  Ref reads(checked(PyList_New(0)));
  Call call{h, PyTuple_GET_ITEM(fast.get(), 2) == Py_True, parts.get(), reads.get()};
  check(PyList_Append(parts.get(), PyTuple_GET_ITEM(fast.get(), 1)) == 0);
  PyObject* default_dtype =
      reinterpret_cast<PyObject*>(torch::getTHPDtype(c10::typeMetaToScalarType(c10::get_default_dtype())));
  check(PyList_Append(parts.get(), default_dtype) == 0);
  Py_ssize_t nargs = PyTuple_GET_SIZE(args);
  Ref refs(checked(PyList_New(nargs)));
  for (Py_ssize_t i = 0; i < nargs; ++i) {
    PyList_SET_ITEM(refs.get(), i, call.convert(PyTuple_GET_ITEM(args, i), parts.get()));
  }
  Ref kwrefs(checked(PyDict_New()));
  if (kwargs != nullptr) {
    Py_ssize_t position = 0;
    PyObject* name;
    PyObject* value;
    while (PyDict_Next(kwargs, &position, &name, &value)) {
      check(PyList_Append(parts.get(), name) == 0);
      Ref ref(call.convert(value, parts.get()));
      check(PyDict_SetItem(kwrefs.get(), name, ref.get()) == 0);
    }
  }
  Ref signature(checked(PyList_AsTuple(parts.get())));
  Ref writes(PyTuple_GET_SIZE(mutated) != 0 ? written_storages(mutated, args, kwargs) : PyTuple_New(0));
  check(bool(writes));
  if (writes_shared(reads.get(), writes.get())) {
    throw Miss();  // overlap.py decides
  }
  PyObject* inference = PyDict_GetItemWithError(h.shape_cache, signature.get());  // borrowed
  if (inference == nullptr) {
    check(!PyErr_Occurred());
    throw Miss();
  }
  Py_INCREF(inference);
  Ref hold(inference);
  Ref moved(checked(PyObject_CallMethodOneArg(h.shape_cache, n.move_to_end, signature.get())));  // the LRU's order
  if (Py_TYPE(inference) != reinterpret_cast<PyTypeObject*>(h.inference_type) ||
      truth_of(inference, n.warnings) || truth_of(inference, n.resized)) {
    throw Miss();
  }

  // Outputs: fresh storages and tensors (an out-of-memory is the Python recorder's to raise).
  Ref specs(checked(PyObject_GetAttr(inference, n.outputs)));
  Ref specs_fast(checked(PySequence_Fast(specs.get(), "outputs")));
  Py_ssize_t count = PySequence_Fast_GET_SIZE(specs_fast.get());
  Ref results(checked(PyList_New(count)));
  Ref outputs(checked(PyList_New(count)));
  Ref capacity(checked(PyObject_GetAttr(h.config, n.hbm_bytes)));
  for (Py_ssize_t i = 0; i < count; ++i) {
    PyObject* spec = PySequence_Fast_GET_ITEM(specs_fast.get(), i);
    if (spec == Py_None) {
      PyList_SET_ITEM(results.get(), i, Py_NewRef(Py_None));
      PyList_SET_ITEM(outputs.get(), i, Py_NewRef(Py_None));
      continue;
    }
    Ref shape(checked(PyObject_GetAttr(spec, n.shape)));
    Ref stride(checked(PyObject_GetAttr(spec, n.stride)));
    Ref dtype(checked(PyObject_GetAttr(spec, n.dtype)));
    Ref nbytes(checked(PyObject_GetAttr(spec, n.nbytes)));
    PyObject* storage_args[6] = {h.storage_type, shape.get(), stride.get(), dtype.get(), nbytes.get(), capacity.get()};
    Ref storage(checked(PyObject_Vectorcall(h.new_storage, storage_args, 6, nullptr)));
    if (storage.get() == Py_None) {
      throw Miss();
    }
    PyObject* tensor_args[5] = {shape.get(), stride.get(), dtype.get(), storage.get(), nbytes.get()};
    PyList_SET_ITEM(outputs.get(), i, checked(PyObject_Vectorcall(h.empty, tensor_args, 5, nullptr)));
    PyList_SET_ITEM(results.get(), i, storage.release());
  }

  // From here on the call is recorded: nothing answers Miss.
  ++fast_records;
  if (!add_to(h.queue, n.issued, n.one)) {
    throw py::error_already_set();
  }
  Ref issue(checked(PyObject_GetAttr(h.queue, n.issued)));
  Ref location(checked(user_frame(nullptr, h.is_internal)));
  if (location.get() == Py_None) {
    location.reset(checked(PyObject_CallNoArgs(h.no_user_frame)));
  }
  Ref cost(checked(PyObject_GetAttr(inference, n.cost)));
  Ref canonical(checked(PyObject_GetAttr(inference, n.signature)));
  Ref signature_id(checked(PyObject_GetAttr(inference, n.signature_id)));
  Ref stream(checked(PyObject_GetAttr(h.streams, n.current)));
  PyObject* record_args[13] = {op, refs.get(), kwrefs.get(), call.nested ? Py_True : Py_False, reads.get(),
                               writes.get(), results.get(), location.get(), cost.get(), canonical.get(),
                               signature_id.get(), stream.get(), issue.get()};
  Ref record(checked(PyObject_Vectorcall(h.op_record, record_args, 13, nullptr)));
  // The record and its containers lie in no reference cycle (they hold storages, references
  // and numbers; nothing they hold refers back): the garbage collector need not scan them.
  // They live until the worker has run the launch, long enough to reach an older
  // generation, whose every collection would walk them again.
  for (PyObject* container : {record.get(), refs.get(), kwrefs.get(), reads.get(), writes.get(), results.get(),
                              location.get()}) {
    if (PyObject_GC_IsTracked(container)) {
      PyObject_GC_UnTrack(container);
    }
  }
  Ref per_op(checked(PyObject_GetAttr(h.config, n.host_us_per_op)));
  check(add_to(h.counters, n.ops_recorded, n.one) && add_to(h.queue, n.host_us, per_op.get()));

  Ref sink(checked(PyObject_GetAttr(h.sink_module, n.sink)));
  if (sink.get() == h.strict_sink && truth_of(h.config, n.native) && !truth_of(h.config, n.launch_blocking)) {
    // StrictSink.record: one native launch (op_record.native_launch), accounted and submitted
    Ref op_id(checked(PyLong_FromVoidPtr(op)));
    int guarded = PySet_Contains(h.guarded, op_id.get());
    check(guarded >= 0);
    Ref item(native_op_launch(op, refs.get(), kwrefs.get(), results.get(), guarded ? writes.get() : Py_None,
                              record.get()));
    if (!item) {
      check(!PyErr_Occurred());
      item.reset(Py_NewRef(record.get()));  // not native: the record is the launch (a Python item)
    }
    Ref nbytes(checked(PyObject_GetAttr(cost.get(), n.bytes)));
    Ref time_us(checked(PyObject_GetAttr(cost.get(), n.time_us)));
    Ref launch_us(checked(PyObject_GetAttr(h.config, n.launch_us)));
    Ref begin(checked(account_launches(h.queue, h.counters, n.one, nbytes.get(), time_us.get(), Py_None,
                                       stream.get(), Py_None, op, launch_us.get())));
    Ref sequence(checked(submit_item(h.queue, item.get(), stream.get(), nbytes.get(), n.one)));
  } else {
    Ref recorded(checked(PyObject_CallMethodOneArg(sink.get(), n.record, record.get())));
  }
  Ref structure(checked(PyObject_GetAttr(inference, n.structure)));
  return build_return(return_alias, structure.get(), outputs.get(), args, kwargs);
}

}  // namespace

// The common case of one call (record below; the device's kernels call it from C,
// hot_path.cpp: fast_kernel): the op's result, or NotImplemented, or nullptr with an error set.
PyObject* record_op(PyObject* entry, PyObject* args, PyObject* kwargs) {
  if (handles == nullptr) {
    Py_RETURN_NOTIMPLEMENTED;
  }
  try {
    return record_call(*handles, names(), entry, args, kwargs);
  } catch (const Miss&) {
    Py_RETURN_NOTIMPLEMENTED;
  } catch (py::error_already_set& error) {
    error.restore();
    return nullptr;
  } catch (const std::exception& error) {  // (a C++ error must never leave into the interpreter)
    PyErr_SetString(PyExc_RuntimeError, error.what());
    return nullptr;
  }
}

namespace {

// record(entry, args, kwargs) -> the result, or NotImplemented (see the top of this file)
PyObject* record(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "record(entry, args, kwargs)");
    return nullptr;
  }
  return record_op(args[0], args[1], args[2] == Py_None ? nullptr : args[2]);
}

void uninstall() {
  if (handles == nullptr) {
    return;
  }
  auto** slots = reinterpret_cast<PyObject**>(handles);
  for (size_t i = 0; i < sizeof(Handles) / sizeof(PyObject*); ++i) {
    Py_DECREF(slots[i]);
  }
  delete handles;
  handles = nullptr;
}

// install_record(handles: a dict of the names of Handles, or None: record() answers
// NotImplemented to every call) -> None
PyObject* install(PyObject* /*module*/, PyObject* given) {
  if (given == Py_None) {
    uninstall();
    Py_RETURN_NONE;
  }
  if (!PyDict_Check(given)) {
    PyErr_SetString(PyExc_TypeError, "install(dict)");
    return nullptr;
  }
  const char* keys[] = {"shape_cache", "inference_type", "queue", "counters", "config", "sink_module",
                        "strict_sink", "profiler", "streams", "cow", "op_record", "storage_type",
                        "reference", "view_ref", "is_internal", "no_user_frame",
                        "new_storage", "empty", "guarded", "recorder"};
  constexpr size_t kCount = sizeof(keys) / sizeof(keys[0]);
  static_assert(kCount * sizeof(PyObject*) == sizeof(Handles), "one key per handle");
  PyObject* values[kCount];
  for (size_t i = 0; i < kCount; ++i) {
    values[i] = PyDict_GetItemString(given, keys[i]);
    if (values[i] == nullptr) {
      PyErr_Format(PyExc_KeyError, "install: %s missing", keys[i]);
      return nullptr;
    }
  }
  Handles given_handles;
  auto** slots = reinterpret_cast<PyObject**>(&given_handles);
  for (size_t i = 0; i < kCount; ++i) {
    slots[i] = values[i];
  }
  if (!PyDict_Check(given_handles.shape_cache) || !PyAnySet_Check(given_handles.guarded)) {
    PyErr_SetString(PyExc_TypeError, "install: shape_cache is a dict, guarded a set");
    return nullptr;
  }
  for (size_t i = 0; i < kCount; ++i) {
    Py_INCREF(slots[i]);
  }
  auto* installed = new Handles(given_handles);
  uninstall();
  handles = installed;
  Py_RETURN_NONE;
}

// record_counts() -> calls recorded in C so far
PyObject* record_counts(PyObject* /*module*/, PyObject* /*unused*/) {
  return PyLong_FromLongLong(fast_records);
}

#define FASTCALL(function) reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(function)), METH_FASTCALL

}  // namespace

PyMethodDef record_methods[] = {
    {"record", FASTCALL(record), "A kernel op's common case, recorded in one C call (see record.cpp)."},
    {"install_record", install, METH_O, "What record() reads: the recorder's modules' objects."},
    {"record_counts", record_counts, METH_NOARGS, "Calls record() recorded so far."},
    {"account", FASTCALL(account), "ExecutionQueue._account's body (see record.cpp)."},
    {"submit", FASTCALL(submit), "ExecutionQueue.submit's body (see record.cpp)."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace neuron
