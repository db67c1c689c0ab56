// The device worker and the kernels it runs in C++, without the GIL.
//
// The execution queue (device/hardware/execution_queue.py) is one FIFO drained by one
// worker thread, this file's. An item is either a Python object with `execute(queue)`
// (a fence, an event, a kernel the native path cannot run), which the worker runs under
// the GIL, or a native launch: a program of steps over a table of storages (cells.cpp),
// which it runs with no Python at all. A step is one aten op (an operator handle resolved
// once, its arguments bound by position) or one TorchScript function (a library kernel).
//
// Python builds a program from the ops it recorded (ProgramBuilder: the arguments are
// converted once, on the host), and a launch binds it to storages. Strict eager launches
// one op; an adaptive window's fused kernel is one launch of its ops, with the values it
// keeps in registers (dead intermediates) in a per-run environment; a compiled graph's
// program is built once and bound to each call's storages.
//
// The native path runs only the happy path. Before a launch runs, the worker checks what
// the queue's failure rules care about: a failure pending (an earlier kernel failed and
// the sync point has not raised it yet), fault injection, or a poisoned input. Any of
// them, or a step that raises, hands the launch to its Python fallback, which runs the
// same ops under the failure rules (device/hardware/op_record.py) from the step where the
// native run stopped, with its environment: so every error names the exact op and the
// user's line, as the Python path always did. A step whose op writes in place what its
// index or mask data decide (GUARDED_WRITES) is restored before the fallback runs it again.
//
// Python objects are never released on the worker: a finished native launch goes to a list
// the host empties with the GIL (queue_release), and tensors the worker touches never have
// a Python object (cells.cpp).

#include "neuron.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/stack.h>
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/as_strided.h>
#include <ATen/ops/empty_strided.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/api/compilation_unit.h>
#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <limits>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include <pthread.h>
#include <time.h>
#include <unordered_map>

namespace neuron {
namespace {

// -- programs ----------------------------------------------------------------------------

struct Ref {
  int32_t slot = -1;
  bool view = false;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  int64_t offset = 0;
};

struct Arg {
  enum Kind : uint8_t { Constant, Tensor, TensorList, OptionalTensorList };
  Kind kind = Constant;
  c10::IValue constant;    // Constant (a host tensor is a constant too)
  Ref ref;                 // Tensor
  std::vector<Arg> items;  // lists: each a Tensor or a Constant
};

// A generated kernel (compiled mode: a fused group compiled by Inductor's CPU code
// generator, adaptive_eager/generated.py): a Python callable of the group's input tensors
// (a list) returning its outputs, and, when Inductor wrote its wrapper in C++ with no
// Python in it, that wrapper's entry point (`native_entry`: inductor_entry_impl, input
// handles stolen, output handles returned), which the worker calls without the GIL. Else
// the worker calls the Python callable with the GIL, once per group. If it raises, the
// written inputs are restored, it is turned off, and the group's own steps run (which
// hand the launch to Python at the op that fails, as without it).
struct Generated {
  using Entry = void (*)(AtenTensorHandle* inputs, AtenTensorHandle* outputs);
  PyObject* callable = nullptr;  // owned (it keeps the entry's library loaded)
  Entry entry = nullptr;
  std::atomic<bool> off{false};
  ~Generated() {
    if (callable != nullptr && python_alive()) {
      py::gil_scoped_acquire gil;
      Py_DECREF(callable);
    }
  }
};

struct Step {
  std::optional<c10::OperatorHandle> op;                // an aten op, or
  std::shared_ptr<torch::jit::CompilationUnit> unit;    // a TorchScript function, or
  std::shared_ptr<Generated> generated;                 // a generated kernel standing for `group`
  std::vector<Step> group;                              // (a generated kernel's, an interleaved run's) own steps
  std::vector<Step> interleaved;                        // the run's steps parameter by parameter (see run_interleaved)
  torch::jit::Function* function = nullptr;
  std::vector<Arg> args;        // every schema argument, in order
  std::vector<int32_t> outs;    // the returned tensors, flattened: slot (-1: dropped)
  std::vector<char> dead;       // per out: kept in the environment, not written back
  std::vector<int32_t> guarded; // slots restored if the op raises
  std::vector<int32_t> frees;   // environment entries no later step reads
  int64_t resume = 0;           // where the Python fallback resumes for this step
};

struct Program {
  std::vector<Step> steps;
  int32_t slots = 0;
};

struct Launch {
  std::shared_ptr<Program> program;
  std::vector<c10::intrusive_ptr<Cell>> table;
  py::object storages;  // the table's DeviceStorages (a list), for the fallback's environment
  py::object fallback;  // what the Python fallback runs (the queue's run_fallback(fallback, resume, env))
};

// The classes a recorded argument may be, besides a DeviceStorage: set once by Python.
PyObject* view_ref_type = nullptr;
PyObject* reinterpret_ref_type = nullptr;
// A compiled graph's template names its storages by slot number instead: Slot (.n) and
// a view of one (.n, .shape, .stride, .offset); replay_records.py, set once by Python.
PyObject* slot_type = nullptr;
PyObject* view_slot_type = nullptr;

// A resume offset's flag (interleave.py: BROKEN, which is this): the launch was part of a
// run of multi-tensor ops the worker ran parameter by parameter, and a step raised after
// the run began, so its parameters are at different ops.
constexpr int64_t kBroken = int64_t{1} << 19;

struct NotNative : std::exception {
  const char* what() const noexcept override { return "not runnable natively"; }
};

// One operator handle per OpOverload (they live as long as the process).
std::unordered_map<PyObject*, c10::OperatorHandle>& handles() {
  static auto* map = new std::unordered_map<PyObject*, c10::OperatorHandle>();
  return *map;
}

const c10::OperatorHandle& handle_of(PyObject* op) {
  auto& map = handles();
  auto found = map.find(op);
  if (found != map.end()) {
    return found->second;
  }
  py::handle schema = py::handle(op).attr("_schema");
  auto name = schema.attr("name").cast<std::string>();
  auto overload = schema.attr("overload_name").cast<std::string>();
  auto handle = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
  Py_INCREF(op);  // kept: the map holds it by address
  return map.emplace(op, handle).first->second;
}

class Builder {
 public:
  Builder() : program_(std::make_shared<Program>()) {}

  // numbered(count): the storages are a template's slots 0..count-1, named by number
  // (a Slot, a view of one; an int for a result, a write or a freed value; -1: none),
  // bound to each call's storages by `bind`.
  void numbered(int32_t count) {
    numbered_ = true;
    program_->slots = count;
  }

  int32_t slot_of(PyObject* storage) {
    if (numbered_) {
      TORCH_CHECK(PyLong_Check(storage), "a numbered program names its storages by slot number");
      return static_cast<int32_t>(PyLong_AsLong(storage));
    }
    auto found = slots_.find(storage);
    if (found != slots_.end()) {
      return found->second;
    }
    auto slot = static_cast<int32_t>(storages_.size());
    slots_.emplace(storage, slot);
    storages_.append(py::handle(storage));
    cells_.push_back(cell_of(storage));
    return slot;
  }

  Ref ref_of(PyObject* value) {
    Ref ref;
    if (numbered_ && Py_TYPE(value) == reinterpret_cast<PyTypeObject*>(slot_type)) {
      ref.slot = py::handle(value).attr("n").cast<int32_t>();
      return ref;
    }
    if (numbered_ && Py_TYPE(value) == reinterpret_cast<PyTypeObject*>(view_slot_type)) {
      py::handle view(value);
      ref.slot = view.attr("n").cast<int32_t>();
      ref.view = true;
      ref.sizes = view.attr("shape").cast<std::vector<int64_t>>();
      ref.strides = view.attr("stride").cast<std::vector<int64_t>>();
      ref.offset = view.attr("offset").cast<int64_t>();
      return ref;
    }
    if (is_storage(value)) {
      ref.slot = slot_of(value);
      return ref;
    }
    if (view_ref_type != nullptr && Py_TYPE(value) == reinterpret_cast<PyTypeObject*>(view_ref_type)) {
      py::handle view(value);
      ref.slot = slot_of(view.attr("storage").ptr());
      ref.view = true;
      ref.sizes = view.attr("shape").cast<std::vector<int64_t>>();
      ref.strides = view.attr("stride").cast<std::vector<int64_t>>();
      ref.offset = view.attr("offset").cast<int64_t>();
      return ref;
    }
    throw NotNative();  // a ReinterpretRef (another dtype over the bytes): Python resolves it
  }

  static bool is_reference(PyObject* value) {
    PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(value));
    return is_storage(value) || type == view_ref_type || type == reinterpret_ref_type || type == slot_type ||
           type == view_slot_type;
  }

  // A Python number as a Tensor argument takes it: a 0-dim CPU tensor marked a wrapped
  // number (so type promotion treats it as the number), as torch::jit::toIValue makes it.
  static at::Tensor wrapped_number(double value) {
    at::Tensor tensor = at::detail::empty_cpu({}, c10::kDouble, std::nullopt, std::nullopt, std::nullopt, std::nullopt);
    *tensor.data_ptr<double>() = value;  // (c10::scalar_to_tensor's result, without two dispatches)
    tensor.unsafeGetTensorImpl()->set_wrapped_number(true);
    return tensor;
  }

  Arg tensor_arg(PyObject* value) {
    Arg arg;
    if (value == Py_None) {
      return arg;  // a None constant
    }
    if (THPVariable_Check(value)) {  // a host tensor (a snapshot): a constant of its own
      TORCH_CHECK(!numbered_, "a template's host tensors are slots");
      arg.constant = unshared(THPVariable_Unpack(value));
      return arg;
    }
    if (PyFloat_CheckExact(value)) {  // the common case of the one below, without toIValue's general path
      arg.constant = wrapped_number(PyFloat_AS_DOUBLE(value));
      return arg;
    }
    if (PyFloat_Check(value) || PyLong_Check(value) || PyComplex_Check(value)) {
      // a Python number for a Tensor argument (`x * 0.5`): a wrapped number, as the
      // dispatcher's own Python calls make it
      torch::jit::ToIValueAllowNumbersAsTensors numbers(true);
      arg.constant = torch::jit::toIValue(py::handle(value), c10::TensorType::get());
      return arg;
    }
    arg.kind = Arg::Tensor;
    arg.ref = ref_of(value);
    return arg;
  }

  Arg convert(PyObject* value, const c10::Argument& argument) {
    const c10::TypePtr& type = argument.type();
    auto kind = type->kind();
    if (kind == c10::TypeKind::TensorType ||
        (kind == c10::TypeKind::OptionalType &&
         type->expectRef<c10::OptionalType>().getElementType()->kind() == c10::TypeKind::TensorType)) {
      return tensor_arg(value);
    }
    if (kind == c10::TypeKind::ListType) {
      auto element = type->expectRef<c10::ListType>().getElementType();
      bool optional = element->kind() == c10::TypeKind::OptionalType &&
                      element->expectRef<c10::OptionalType>().getElementType()->kind() == c10::TypeKind::TensorType;
      if (element->kind() == c10::TypeKind::TensorType || optional) {
        Arg arg;
        arg.kind = optional ? Arg::OptionalTensorList : Arg::TensorList;
        py::sequence items = py::reinterpret_borrow<py::sequence>(value);
        for (py::handle item : items) {
          arg.items.push_back(tensor_arg(item.ptr()));
        }
        return arg;
      }
    }
    if (is_reference(value)) {
      throw NotNative();
    }
    Arg arg;
    if (!constant(value, type, arg.constant)) {
      arg.constant = torch::jit::toIValue(py::handle(value), type);
    }
    return arg;
  }

  // An int that fits in 64 bits (false, and no error set, for one that does not).
  static bool exact_int(PyObject* value, int64_t& out) {
    int overflow = 0;
    long long number = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (overflow != 0 || (number == -1 && PyErr_Occurred())) {
      PyErr_Clear();
      return false;
    }
    out = number;
    return true;
  }

  // The common constants of the per-op path (numbers, None, a list of ints) as
  // torch::jit::toIValue converts them, without its general machinery; false for any other
  // (toIValue converts it).
  static bool constant(PyObject* value, const c10::TypePtr& type, c10::IValue& out) {
    auto kind = type->kind();
    if (kind == c10::TypeKind::OptionalType) {
      if (value == Py_None) {
        out = c10::IValue();
        return true;
      }
      return constant(value, type->expectRef<c10::OptionalType>().getElementType(), out);
    }
    if (PyBool_Check(value)) {
      if (kind == c10::TypeKind::BoolType || kind == c10::TypeKind::NumberType) {
        out = c10::IValue(value == Py_True);
        return true;
      }
      return false;
    }
    if (PyLong_CheckExact(value)) {
      int64_t number = 0;
      if ((kind == c10::TypeKind::IntType || kind == c10::TypeKind::SymIntType || kind == c10::TypeKind::NumberType) &&
          exact_int(value, number)) {
        out = c10::IValue(number);  // (a SymInt too, as toIValue makes a plain int)
        return true;
      }
      return false;
    }
    if (PyFloat_CheckExact(value)) {
      if (kind == c10::TypeKind::FloatType || kind == c10::TypeKind::NumberType) {
        out = c10::IValue(PyFloat_AS_DOUBLE(value));
        return true;
      }
      return false;
    }
    if (kind == c10::TypeKind::ListType && (PyList_CheckExact(value) || PyTuple_CheckExact(value)) &&
        type->expectRef<c10::ListType>().getElementType()->kind() == c10::TypeKind::IntType) {
      PyObject* fast = value;  // a list or a tuple: PySequence_Fast_* read both
      Py_ssize_t size = PySequence_Fast_GET_SIZE(fast);
      c10::List<int64_t> items;
      items.reserve(static_cast<size_t>(size));
      for (Py_ssize_t i = 0; i < size; ++i) {
        PyObject* item = PySequence_Fast_GET_ITEM(fast, i);
        int64_t number = 0;
        if (!PyLong_CheckExact(item) || !exact_int(item, number)) {
          return false;
        }
        items.push_back(number);
      }
      out = c10::IValue(std::move(items));
      return true;
    }
    return false;
  }

  // The arguments of a call, by the schema: positional from `args`, the rest from
  // `kwargs` or their defaults.
  std::vector<Arg> arguments(const c10::FunctionSchema& schema, py::handle args, py::handle kwargs) {
    std::vector<Arg> converted;
    const auto& arguments = schema.arguments();
    converted.reserve(arguments.size());
    PyObject* positional = PySequence_Fast(args.ptr(), "a call's arguments must be a list or a tuple");
    if (positional == nullptr) {
      throw py::error_already_set();
    }
    py::object owned_positional = py::reinterpret_steal<py::object>(positional);
    auto count = static_cast<size_t>(PySequence_Fast_GET_SIZE(positional));
    PyObject* keywords = kwargs.ptr();
    if (keywords != nullptr && (keywords == Py_None || (PyDict_Check(keywords) && PyDict_GET_SIZE(keywords) == 0))) {
      keywords = nullptr;  // (most calls: looking each name up would make a string per argument)
    }
    for (size_t i = 0; i < arguments.size(); ++i) {
      const auto& argument = arguments[i];
      PyObject* value = nullptr;
      if (i < count && !argument.kwarg_only()) {
        value = PySequence_Fast_GET_ITEM(positional, static_cast<Py_ssize_t>(i));
        Py_INCREF(value);
      } else if (keywords != nullptr) {
        value = PyDict_GetItemString(keywords, argument.name().c_str());  // borrowed
        Py_XINCREF(value);
      }
      if (value == nullptr) {
        TORCH_CHECK(argument.default_value().has_value(), schema.name(), ": missing argument ", argument.name());
        Arg arg;
        arg.constant = *argument.default_value();
        converted.push_back(std::move(arg));
        continue;
      }
      py::object owned = py::reinterpret_steal<py::object>(value);
      converted.push_back(convert(value, argument));
    }
    return converted;
  }

  void outputs(Step& step, py::handle results, py::handle dead) {
    py::sequence sequence = py::reinterpret_borrow<py::sequence>(results);
    for (py::handle storage : sequence) {
      if (storage.is_none()) {
        step.outs.push_back(-1);
      } else {
        step.outs.push_back(slot_of(storage.ptr()));
      }
      step.dead.push_back(0);
    }
    if (!dead.is_none()) {
      for (py::handle position : dead) {
        auto index = position.cast<size_t>();
        if (index < step.dead.size()) {
          step.dead[index] = 1;
        }
      }
    }
  }

  void guard(Step& step, py::handle writes) {
    for (py::handle storage : writes) {
      step.guarded.push_back(slot_of(storage.ptr()));
    }
  }

  // op(op, args, kwargs, results, dead, guarded_writes, resume)
  void op(py::handle op, py::handle args, py::handle kwargs, py::handle results, py::handle dead,
          py::handle guarded, int64_t resume) {
    Step step;
    step.op = handle_of(op.ptr());
    step.args = arguments(step.op->schema(), args, kwargs);
    outputs(step, results, dead);
    if (!guarded.is_none()) {
      guard(step, guarded);
    }
    step.resume = resume;
    program_->steps.push_back(std::move(step));
  }

  // script(function, inputs, constants, results, dead, resume): a TorchScript function
  // (a library kernel) of input references and keyword constants.
  void script(py::handle function, py::handle inputs, py::handle constants, py::handle results, py::handle dead,
              int64_t resume) {
    auto strong = py::cast<torch::jit::StrongFunctionPtr>(function);
    Step step;
    step.unit = strong.cu_;
    step.function = strong.function_;
    const auto& schema = step.function->getSchema();
    step.args = arguments(schema, inputs, constants);
    outputs(step, results, dead);
    step.resume = resume;
    program_->steps.push_back(std::move(step));
  }

  // begin_group(): the steps added from now on are one group a generated kernel may stand for.
  void begin_group() { group_start_ = program_->steps.size(); }

  // generated(callable, inputs, results, written, resume): the steps added since
  // begin_group() become the group of one generated-kernel step: callable(list of the
  // input slots' tensors) -> the results' tensors, in order; `written`: input slots it
  // writes in place (restored if it raises).
  void generated(py::handle callable, py::handle inputs, py::handle results, py::handle written, int64_t resume) {
    TORCH_CHECK(group_start_ <= program_->steps.size(), "generated: no group begun");
    Step step;
    auto kernel = std::make_shared<Generated>();
    kernel->callable = callable.inc_ref().ptr();
    py::object entry = py::getattr(callable, "native_entry", py::none());
    if (!entry.is_none()) {
      kernel->entry = reinterpret_cast<Generated::Entry>(entry.cast<uintptr_t>());
    }
    step.generated = std::move(kernel);
    for (py::handle slot : inputs) {
      Arg arg;
      arg.kind = Arg::Tensor;
      arg.ref.slot = slot_of(slot.ptr());
      step.args.push_back(std::move(arg));
    }
    outputs(step, results, py::none());
    guard(step, written);
    step.resume = resume;
    auto& steps = program_->steps;
    step.group.assign(std::make_move_iterator(steps.begin() + static_cast<std::ptrdiff_t>(group_start_)),
                      std::make_move_iterator(steps.end()));
    steps.resize(group_start_);
    steps.push_back(std::move(step));
  }

  // interleave(): the steps added since begin_group() are a run of multi-tensor ops in
  // PyTorch's order; the steps added from now on are the same ops one parameter at a time.
  void interleave() {
    TORCH_CHECK(group_start_ <= program_->steps.size(), "interleave: no group begun");
    interleave_start_ = program_->steps.size();
  }

  // interleaved(resume): the two become one step (run_interleaved), which frees what the
  // run's own steps free, after it. `resume`: where the Python fallback takes the window
  // over if a step raises after the run began (interleave.py: BROKEN).
  void interleaved(int64_t resume) {
    TORCH_CHECK(group_start_ <= interleave_start_ && interleave_start_ <= program_->steps.size(),
                "interleaved: no interleave() after begin_group()");
    auto& steps = program_->steps;
    Step step;
    step.resume = resume;
    auto begin = steps.begin();
    step.group.assign(std::make_move_iterator(begin + static_cast<std::ptrdiff_t>(group_start_)),
                      std::make_move_iterator(begin + static_cast<std::ptrdiff_t>(interleave_start_)));
    step.interleaved.assign(std::make_move_iterator(begin + static_cast<std::ptrdiff_t>(interleave_start_)),
                            std::make_move_iterator(steps.end()));
    for (const auto& own : step.group) {
      step.frees.insert(step.frees.end(), own.frees.begin(), own.frees.end());
    }
    steps.resize(group_start_);
    steps.push_back(std::move(step));
  }

  // free(storages): the environment entries of these storages are released after the
  // last step added so far.
  void free(py::handle storages) {
    TORCH_CHECK(!program_->steps.empty(), "free: no step yet");
    for (py::handle storage : storages) {
      program_->steps.back().frees.push_back(slot_of(storage.ptr()));
    }
  }

  // build() -> (program, storages): the program, and the storages its slots stand for.
  py::tuple build() {
    if (!numbered_) {
      program_->slots = static_cast<int32_t>(storages_.size());
    }
    auto program = std::exchange(program_, std::make_shared<Program>());
    py::list storages = std::exchange(storages_, py::list());
    slots_.clear();
    cells_.clear();
    return py::make_tuple(py::cast(program), storages);
  }

  // launch(fallback) -> a Launch of what was added, over the storages met.
  std::shared_ptr<Launch> launch(py::object fallback) {
    auto result = std::make_shared<Launch>();
    program_->slots = static_cast<int32_t>(storages_.size());
    result->program = std::exchange(program_, std::make_shared<Program>());
    result->table = std::exchange(cells_, {});
    result->storages = std::exchange(storages_, py::list());
    if (PyObject_GC_IsTracked(result->storages.ptr())) {  // storages hold nothing referring back to it:
      PyObject_GC_UnTrack(result->storages.ptr());        // no collection need scan it while it waits
    }
    result->fallback = std::move(fallback);
    slots_.clear();
    return result;
  }

 private:
  std::shared_ptr<Program> program_;
  size_t group_start_ = static_cast<size_t>(-1);
  size_t interleave_start_ = static_cast<size_t>(-1);
  bool numbered_ = false;
  std::unordered_map<PyObject*, int32_t> slots_;
  py::list storages_;
  std::vector<c10::intrusive_ptr<Cell>> cells_;
};

// A compiled call's intermediates (replay.py: Template.bind): the cells of the storages it
// makes that nothing outside the call sees, by slot (null elsewhere). They have no
// DeviceStorage unless Python needs one (wrap: the records' path; a launch's fallback).
struct FreshCells {
  std::vector<c10::intrusive_ptr<Cell>> cells;
};

// The type intermediates' storages are made of when Python needs them (DeviceStorage).
PyTypeObject* intermediate_type = nullptr;

// table[slot] = a DeviceStorage over the cell, wherever table[slot] is None and the cell
// books its own bytes (an intermediate without one yet).
void wrap_intermediates(PyObject* table, const std::vector<c10::intrusive_ptr<Cell>>& cells) {
  auto count = std::min(static_cast<size_t>(PyList_GET_SIZE(table)), cells.size());
  for (size_t slot = 0; slot < count; ++slot) {
    const auto& cell = cells[slot];
    if (cell && cell->booked >= 0 && PyList_GET_ITEM(table, static_cast<Py_ssize_t>(slot)) == Py_None) {
      PyList_SetItem(table, static_cast<Py_ssize_t>(slot), storage_over(intermediate_type, cell));
    }
  }
}

// A template's fresh storages, read once (FreshSlots(type, layouts, slots): layouts are
// (slot, shape, stride, dtype, booked bytes, escapes) each, in a table of `slots`), and
// made at each call by allocate(table, capacity) -> FreshCells, or None when they do not fit
// (an OOM counted, nothing booked).
struct FreshSlots {
  std::vector<FreshLayout> fresh;
  int64_t total = 0;  // the bytes they book
  int32_t slots = 0;
  py::list held;  // the layouts' Python objects
  py::object type;

  FreshSlots(py::object storage_type, py::list layouts, int32_t table_size)
      : slots(table_size), held(layouts), type(std::move(storage_type)) {
    TORCH_CHECK(PyType_Check(type.ptr()), "FreshSlots: a storage type expected");
    if (intermediate_type == nullptr) {
      intermediate_type = reinterpret_cast<PyTypeObject*>(py::object(type).release().ptr());
    }
    for (py::handle item : layouts) {
      auto layout = py::reinterpret_borrow<py::tuple>(item);
      TORCH_CHECK(layout.size() == 6 && THPDtype_Check(layout[3].ptr()),
                  "FreshSlots: (slot, shape, stride, dtype, nbytes, escapes) expected");
      auto slot = layout[0].cast<int32_t>();
      TORCH_CHECK(slot >= 0 && slot < slots, "FreshSlots: slot ", slot, " out of range");
      fresh.push_back(FreshLayout{slot, int_vector(layout[1].ptr()), int_vector(layout[2].ptr()),
                                  reinterpret_cast<THPDtype*>(layout[3].ptr())->scalar_type, layout[4].cast<int64_t>(),
                                  layout[1].ptr(), layout[2].ptr(), layout[3].ptr(), layout[5].cast<bool>()});
      total += fresh.back().nbytes;
    }
  }

  std::shared_ptr<FreshCells> allocate(py::list table, int64_t capacity) const {
    TORCH_CHECK(static_cast<int32_t>(table.size()) == slots, "FreshSlots.allocate: a table of ", slots, " expected");
    auto made = std::make_shared<FreshCells>();
    made->cells.resize(static_cast<size_t>(slots));
    if (!fresh_cells(reinterpret_cast<PyTypeObject*>(type.ptr()), fresh, total, capacity, table.ptr(), made->cells)) {
      return nullptr;
    }
    return made;
  }
};

// A compiled graph's template bound to a call in one C call (replay.py: GraphRunner._replay):
// ReplayBinder(fresh, constants, inputs, hosts, bases, outputs, written) with `fresh` a
// FreshSlots, `constants` the template's table (constants at their slots, None elsewhere),
// `inputs` and `hosts` (slot, argument index) pairs (a host input's slot gets a copy of it:
// the host may change it before the kernels run), `bases` (slot, shape, stride, dtype,
// nbytes) for the fresh storages an output is made over, `outputs` one spec each
// (replay.py: _output_specs), `written` the slots whose storage's `alive` makes the
// plan-cache key.
// call(args, storages, capacity) -> (table, cells, outputs), or None (nothing booked) when
// the fresh storages do not fit; alive_bits(table) -> an int, bit i the `alive` of the
// storage at written[i].
struct ReplayBinder {
  struct Base {
    int32_t slot;
    py::object shape, stride, dtype, nbytes;
  };
  struct Output {
    enum Kind { Input, Same, Value, Tensor } kind;
    int32_t index = 0;  // Input: the argument; Same: the output; Tensor: the slot
    py::object value;   // Value
    std::vector<int64_t> sizes, strides;
    int64_t offset = 0;
    bool whole = false;  // Tensor: the whole base (the first time a fresh slot's is returned)
  };
  std::shared_ptr<FreshSlots> fresh;
  py::list constants;
  std::vector<std::pair<int32_t, int32_t>> inputs;
  std::vector<std::pair<int32_t, int32_t>> hosts;
  std::vector<Base> bases;
  std::vector<Output> outputs;
  std::vector<int32_t> written;
  std::vector<bool> fresh_slot;  // by slot: a fresh storage's

  ReplayBinder(std::shared_ptr<FreshSlots> fresh_slots, py::list table, py::list input_slots, py::list host_slots,
               py::list base_specs, py::list output_specs, py::list written_slots)
      : fresh(std::move(fresh_slots)), constants(table) {
    TORCH_CHECK(static_cast<int32_t>(table.size()) == fresh->slots, "ReplayBinder: a table of ", fresh->slots,
                " expected");
    fresh_slot.assign(static_cast<size_t>(fresh->slots), false);
    for (const auto& layout : fresh->fresh) {
      fresh_slot[static_cast<size_t>(layout.slot)] = true;
    }
    for (auto [from, into] : {std::pair{&input_slots, &inputs}, {&host_slots, &hosts}}) {
      for (py::handle item : *from) {
        auto pair = py::reinterpret_borrow<py::tuple>(item);
        into->emplace_back(checked_slot(pair[0].cast<int32_t>()), pair[1].cast<int32_t>());
      }
    }
    for (py::handle item : base_specs) {
      auto spec = py::reinterpret_borrow<py::tuple>(item);
      bases.push_back(Base{checked_slot(spec[0].cast<int32_t>()), spec[1], spec[2], spec[3], spec[4]});
    }
    for (py::handle item : output_specs) {
      auto spec = py::reinterpret_borrow<py::tuple>(item);
      auto kind = spec[0].cast<std::string>();
      Output out;
      if (kind == "input") {
        out.kind = Output::Input;
        out.index = spec[1].cast<int32_t>();
      } else if (kind == "same") {
        out.kind = Output::Same;
        out.index = spec[1].cast<int32_t>();
        TORCH_CHECK(out.index >= 0 && out.index < static_cast<int32_t>(outputs.size()), "ReplayBinder: same as what?");
      } else if (kind == "value") {
        out.kind = Output::Value;
        out.value = spec[1];
      } else {
        TORCH_CHECK(kind == "tensor" && spec.size() == 6, "ReplayBinder: an output spec of kind ", kind);
        out.kind = Output::Tensor;
        out.index = checked_slot(spec[1].cast<int32_t>());
        out.sizes = int_vector(spec[2].ptr());
        out.strides = int_vector(spec[3].ptr());
        out.offset = spec[4].cast<int64_t>();
        out.whole = spec[5].cast<bool>();
      }
      outputs.push_back(std::move(out));
    }
    for (py::handle item : written_slots) {
      written.push_back(checked_slot(item.cast<int32_t>()));
    }
  }

  int32_t checked_slot(int32_t slot) const {
    TORCH_CHECK(slot >= 0 && slot < fresh->slots, "ReplayBinder: slot ", slot, " out of range");
    return slot;
  }

  py::object call(py::list args, py::list storages, int64_t capacity) const {
    PyObject* table = PyList_GetSlice(constants.ptr(), 0, PyList_GET_SIZE(constants.ptr()));
    if (table == nullptr) {
      throw py::error_already_set();
    }
    py::list owned = py::reinterpret_steal<py::list>(table);
    auto cells = fresh->allocate(owned, capacity);
    if (!cells) {
      return py::none();
    }
    // the bases outputs are made over: the fresh storages' tensors, the inputs themselves
    std::vector<PyObject*> base_of(static_cast<size_t>(fresh->slots), nullptr);
    std::vector<py::object> made_bases;
    made_bases.reserve(bases.size());
    for (const auto& base : bases) {
      PyObject* parts[5] = {base.shape.ptr(), base.stride.ptr(), base.dtype.ptr(),
                            PyList_GET_ITEM(table, base.slot), base.nbytes.ptr()};
      made_bases.push_back(py::reinterpret_steal<py::object>(device_tensor(parts)));
      base_of[static_cast<size_t>(base.slot)] = made_bases.back().ptr();
    }
    const Py_ssize_t nargs = PyList_GET_SIZE(args.ptr());
    for (const auto& [slot, k] : inputs) {
      TORCH_CHECK(k < nargs && k < static_cast<int32_t>(storages.size()), "ReplayBinder: argument ", k, " missing");
      PyObject* storage = PyList_GET_ITEM(storages.ptr(), k);
      Py_INCREF(storage);
      PyList_SetItem(table, slot, storage);
      base_of[static_cast<size_t>(slot)] = PyList_GET_ITEM(args.ptr(), k);
    }
    for (const auto& [slot, k] : hosts) {
      TORCH_CHECK(k < nargs, "ReplayBinder: argument ", k, " missing");
      PyList_SetItem(table, slot, THPVariable_Wrap(THPVariable_Unpack(PyList_GET_ITEM(args.ptr(), k)).clone()));
    }
    py::list results(outputs.size());
    std::vector<bool> returned(static_cast<size_t>(fresh->slots), false);
    for (size_t i = 0; i < outputs.size(); ++i) {
      const Output& out = outputs[i];
      py::object value;
      switch (out.kind) {
        case Output::Input:
          TORCH_CHECK(out.index < nargs, "ReplayBinder: argument ", out.index, " missing");
          value = py::reinterpret_borrow<py::object>(PyList_GET_ITEM(args.ptr(), out.index));
          break;
        case Output::Same:
          value = results[static_cast<size_t>(out.index)];
          break;
        case Output::Value:
          value = out.value;
          break;
        case Output::Tensor: {
          auto slot = static_cast<size_t>(out.index);
          PyObject* base = base_of[slot];
          TORCH_CHECK(base != nullptr, "ReplayBinder: an output over slot ", out.index, ", which has no base");
          if (out.whole && !returned[slot] && fresh_slot[slot]) {
            returned[slot] = true;
            value = py::reinterpret_borrow<py::object>(base);
          } else {
            value = py::reinterpret_steal<py::object>(
                THPVariable_Wrap(at::as_strided(THPVariable_Unpack(base), out.sizes, out.strides, out.offset)));
          }
          break;
        }
      }
      results[i] = std::move(value);
    }
    return py::make_tuple(owned, cells, results);
  }

  int64_t alive_bits(py::list table) const {
    if (written.size() > 62) {
      return -1;  // (no key: the caller builds the whole plan-cache key)
    }
    int64_t bits = 0;
    for (size_t i = 0; i < written.size(); ++i) {
      PyObject* storage = PyList_GET_ITEM(table.ptr(), written[i]);
      if (!is_storage(storage) || storage_alive(storage)) {
        bits |= int64_t{1} << i;
      }
    }
    return bits;
  }
};

// bind(program, storages, fallback, cells=None) -> a Launch of `program` over these
// storages; a None storage is its slot's cell in `cells` where it has one.
std::shared_ptr<Launch> bind(std::shared_ptr<Program> program, py::list storages, py::object fallback,
                             std::shared_ptr<FreshCells> fresh) {
  TORCH_CHECK(static_cast<int32_t>(py::len(storages)) == program->slots, "bind: ", program->slots,
              " storages expected, got ", py::len(storages));
  auto result = std::make_shared<Launch>();
  result->table.reserve(program->slots);
  for (Py_ssize_t slot = 0; slot < program->slots; ++slot) {
    PyObject* storage = PyList_GET_ITEM(storages.ptr(), slot);
    if (is_storage(storage)) {
      result->table.push_back(cell_of(storage));
    } else if (storage == Py_None && fresh && static_cast<size_t>(slot) < fresh->cells.size() &&
               fresh->cells[static_cast<size_t>(slot)]) {
      result->table.push_back(fresh->cells[static_cast<size_t>(slot)]);
    } else {  // a host tensor (a snapshot taken for this call), or an unused slot (None)
      auto cell = c10::make_intrusive<Cell>();
      if (THPVariable_Check(storage)) {
        cell->data = unshared(THPVariable_Unpack(storage));
        cell->sizes.assign(cell->data.sizes().begin(), cell->data.sizes().end());
        cell->strides.assign(cell->data.strides().begin(), cell->data.strides().end());
        cell->dtype = cell->data.scalar_type();
      }
      result->table.push_back(std::move(cell));
    }
  }
  result->program = std::move(program);
  result->storages = std::move(storages);
  result->fallback = std::move(fallback);
  return result;
}

// One op, launched alone (strict eager): native_op(op, args, kwargs, results, guarded, fallback).
std::shared_ptr<Launch> native_op(py::handle op, py::handle args, py::handle kwargs, py::handle results,
                                  py::handle guarded, py::object fallback) {
  Builder builder;
  builder.op(op, args, kwargs, results, py::none(), guarded, 0);
  return builder.launch(std::move(fallback));
}

// -- running a launch (the worker, no GIL) -------------------------------------------------

struct Run {
  Launch& launch;
  std::vector<at::Tensor> env;  // values kept in registers, by slot

  at::Tensor value(int32_t slot) {
    const at::Tensor& kept = env[slot];
    if (kept.defined()) {
      return kept;
    }
    return launch.table[slot]->value();
  }

  c10::IValue resolve(const Arg& arg) {
    switch (arg.kind) {
      case Arg::Constant:
        return arg.constant;
      case Arg::Tensor: {
        at::Tensor base = value(arg.ref.slot);
        if (arg.ref.view) {
          return base.as_strided(arg.ref.sizes, arg.ref.strides, arg.ref.offset);
        }
        return base;
      }
      case Arg::TensorList: {
        std::vector<at::Tensor> items;
        items.reserve(arg.items.size());
        for (const auto& item : arg.items) {
          items.push_back(resolve(item).toTensor());
        }
        return c10::IValue(items);
      }
      case Arg::OptionalTensorList: {
        c10::List<std::optional<at::Tensor>> items;
        for (const auto& item : arg.items) {
          c10::IValue value = resolve(item);
          items.push_back(value.isNone() ? std::optional<at::Tensor>() : std::optional<at::Tensor>(value.toTensor()));
        }
        return c10::IValue(items);
      }
    }
    return c10::IValue();
  }

  void store(const Step& step, torch::jit::Stack& stack) {
    size_t position = 0;
    auto put = [&](const at::Tensor& tensor) {
      if (position < step.outs.size()) {
        int32_t slot = step.outs[position];
        if (slot >= 0 && tensor.defined()) {
          if (step.dead[position]) {
            Cell& cell = *launch.table[slot];
            if (tensor.storage_offset() != 0 || !tensor.strides().equals(cell.strides)) {
              env[slot] = at::empty_strided(cell.sizes, cell.strides, tensor.options()).copy_(tensor);
            } else {
              env[slot] = tensor;
            }
          } else {
            launch.table[slot]->adopt(tensor);
          }
        }
      }
      ++position;
    };
    for (auto& returned : stack) {
      if (returned.isTensor()) {
        put(returned.toTensor());
      } else if (returned.isTensorList()) {
        for (const at::Tensor& item : returned.toTensorVector()) {
          put(item);
        }
      } else if (returned.isList()) {  // a TorchScript function's List[Tensor]
        for (const c10::IValue& item : returned.toListRef()) {
          put(item.isTensor() ? item.toTensor() : at::Tensor());
        }
      } else {
        put(at::Tensor());
      }
    }
  }

  void step(const Step& step) {
    torch::jit::Stack stack;
    stack.reserve(step.args.size());
    for (const auto& arg : step.args) {
      stack.push_back(resolve(arg));
    }
    if (step.op) {
      step.op->callBoxed(stack);
    } else {
      step.function->run(stack);
    }
    store(step, stack);
    for (int32_t slot : step.frees) {
      env[slot].reset();
    }
  }
};

// -- strict eager's multi-tensor launches ---------------------------------------------------

// Strict eager launches an optimizer step's multi-tensor ops (`_foreach_mul_`, `_foreach_lerp_`,
// ...) one launch each. The worker runs consecutive such launches parameter by parameter
// (Queue::run_strict_interleaved), as run_interleaved runs them inside an adaptive window,
// by the same rules (interleave.py). Each such launch of a large model fills a batch's
// bytes and rings alone; a run reaching the end of its batch takes the batches the host
// has rung since (Queue::take_pending), as a training step's host, far ahead of the
// worker, has rung the whole optimizer step by then.

// The multi-tensor ops a run may hold (each of aten::_foreach_<name>, in place or not):
// elementwise, and on the CPU each is the per-tensor op applied tensor by tensor. Python's
// interleave.py reads them from here (_C.INTERLEAVED_NAMES).
const std::set<std::string>& interleaved_names() {
  static const std::set<std::string> names = {
      "add", "sub", "mul", "div", "addcmul", "addcdiv", "lerp", "sqrt", "neg", "abs", "exp", "reciprocal", "sign",
      "maximum", "minimum", "clamp_min", "clamp_max", "zero", "copy"};
  return names;
}

// The parameter count of a launch that may join such a run, else 0: one step of
// aten::_foreach_<name> of interleaved_names() whose list arguments (tensor
// lists, number lists) are each n >= 2 long, whose other arguments are numbers, its tensors
// of one floating dtype, returning nothing or one tensor per parameter.
int64_t strict_parameters(const Launch& launch) {
  const auto& steps = launch.program->steps;
  if (steps.size() != 1 || !steps[0].op || steps[0].generated || !steps[0].group.empty() ||
      !steps[0].interleaved.empty() || !steps[0].guarded.empty()) {
    return 0;
  }
  const Step& step = steps[0];
  const std::string& name = step.op->schema().name();
  static const std::string prefix = "aten::_foreach_";
  if (name.compare(0, prefix.size(), prefix) != 0) {
    return 0;
  }
  std::string base = name.substr(prefix.size());
  while (!base.empty() && base.back() == '_') {
    base.pop_back();
  }
  if (interleaved_names().count(base) == 0) {
    return 0;
  }
  int64_t count = -1;
  std::optional<c10::ScalarType> dtype;
  auto same = [&](int64_t length) {
    if (count < 0) {
      count = length;
    }
    return length == count;
  };
  auto typed = [&](c10::ScalarType type) {
    if (!dtype) {
      dtype = type;
    }
    return *dtype == type;
  };
  for (const auto& arg : step.args) {
    if (arg.kind == Arg::TensorList) {
      if (!same(static_cast<int64_t>(arg.items.size()))) {
        return 0;
      }
      for (const auto& item : arg.items) {
        if (item.kind != Arg::Tensor || !typed(launch.table[item.ref.slot]->dtype)) {
          return 0;
        }
      }
    } else if (arg.kind == Arg::Constant) {
      const c10::IValue& value = arg.constant;
      if (value.isList()) {
        if (!same(static_cast<int64_t>(value.toListRef().size()))) {
          return 0;
        }
        for (const auto& item : value.toListRef()) {
          if (!item.isDouble() && !item.isInt() && !item.isBool()) {
            return 0;
          }
        }
      } else if (value.isDoubleList() || value.isIntList() || value.isBoolList()) {
        return 0;  // (a specialized list: not an argument these ops take)
      } else if (!value.isScalar() && !value.isNone()) {
        return 0;
      }
    } else {
      return 0;  // a single tensor argument (a tensor of scalars): kept whole, not per parameter
    }
  }
  if (count < 2 || !dtype || !c10::isFloatingType(*dtype)) {
    return 0;
  }
  if (!step.outs.empty()) {
    if (static_cast<int64_t>(step.outs.size()) != count) {
      return 0;
    }
    for (int32_t slot : step.outs) {
      if (slot < 0 || launch.table[slot]->dtype != *dtype) {
        return 0;
      }
    }
  }
  return count;
}

// -- the queue -----------------------------------------------------------------------------

// A strict op's launch from the C recorder travels as a capsule holding its shared_ptr, not
// a pybind11 NativeLaunch: wrapping registers every instance in pybind11's instance map and
// unregisters it on release, about 7% of the host's time per op in a chain of small ops.
// Nothing in Python reads it (the recorder's C path is off while profiling or observing).
constexpr const char* kLaunchCapsule = "neuron.launch";

void delete_launch_capsule(PyObject* capsule) {
  delete static_cast<std::shared_ptr<Launch>*>(PyCapsule_GetPointer(capsule, kLaunchCapsule));
}

// One step of a polling loop: tells the core it is spinning.
inline void pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

struct Item {
  PyObject* python = nullptr;      // a Python item (owned), or
  std::shared_ptr<Launch> native;  // a native launch
  PyObject* wrapper = nullptr;     // the launch's Python object (owned: released by the host)
};

// One execution queue's worker: a FIFO of batches and the thread that drains it. Each
// Python ExecutionQueue owns one (the device's is QUEUE). The thread keeps its Queue
// alive: a queue is never freed while its worker may wait on it.
struct Queue : std::enable_shared_from_this<Queue> {
  std::mutex mutex;
  std::condition_variable ready;
  std::deque<std::vector<Item>> batches;
  std::atomic<int64_t> completed{0};
  std::atomic<bool> failure_pending{false};
  std::atomic<bool> faults{false};
  std::atomic<bool> poison_seen{false};
  std::atomic<int64_t> native_launches{0};
  std::atomic<int64_t> fallbacks{0};
  std::atomic<int64_t> generated_runs{0};      // generated kernels run
  std::atomic<int64_t> generated_failures{0};  // generated kernels that raised (then off)
  std::atomic<int64_t> generated_without_gil{0};  // of generated_runs: the C++ entry, no GIL taken
  std::atomic<int64_t> native_ns{0};  // time the worker spent running native launches
  std::atomic<int64_t> interleaved_runs{0};  // multi-tensor runs run parameter by parameter
  std::atomic<int64_t> python_items{0};  // items the worker ran in Python (with the GIL)
  std::atomic<int> worker_threads{0};
  std::atomic<bool> has_thread{false};
  pthread_t thread{};  // the worker's, once it runs (has_thread): for its CPU clock
  std::atomic<int> threads{0};  // the host's intra-op threads: kernels run under what they were issued with
  // How long the worker polls for the next batch before it sleeps (flags; 0: never), and
  // the batches pushed so far, which it polls: a host ringing a polling worker makes no
  // system call, and the worker starts at once.
  std::atomic<int64_t> spin_us{0};
  std::atomic<int64_t> pushed{0};
  std::mutex done_mutex;
  std::vector<PyObject*> done;       // released by the host, with the GIL
  // Host threads waiting for the worker (wait_completed: a sync point, an event): each
  // waits until `completed` reaches its target; the worker wakes them when it reaches the
  // lowest (wake_at), without the GIL: a sync runs no Python on the worker.
  std::mutex waiters_mutex;
  std::condition_variable waiters_cv;
  std::multiset<int64_t> targets;  // guarded by waiters_mutex
  std::atomic<int64_t> wake_at{std::numeric_limits<int64_t>::max()};
  PyObject* run_python = nullptr;    // run_python(item): a Python item
  PyObject* run_fallback = nullptr;  // run_fallback(fallback, resume, env): a native launch's, in Python
  bool started = false;

  void finished(PyObject* object) {
    if (object != nullptr) {
      std::lock_guard<std::mutex> guard(done_mutex);
      done.push_back(object);
    }
  }

  bool anomalous(const Launch& launch) const {
    if (failure_pending.load(std::memory_order_acquire) || faults.load(std::memory_order_acquire)) {
      return true;
    }
    if (poison_seen.load(std::memory_order_acquire)) {
      for (const auto& cell : launch.table) {
        if (cell->poisoned.load(std::memory_order_acquire)) {
          return true;
        }
      }
    }
    return false;
  }

  void fallback(Run& run, int64_t resume) {
    fallbacks.fetch_add(1, std::memory_order_relaxed);
    if (!python_alive()) {
      return;
    }
    py::gil_scoped_acquire gil;
    try {
      py::dict env;
      py::list storages = py::reinterpret_borrow<py::list>(run.launch.storages);
      if (intermediate_type != nullptr) {
        wrap_intermediates(storages.ptr(), run.launch.table);  // the fallback's records name them
      }
      for (size_t slot = 0; slot < run.env.size(); ++slot) {
        if (run.env[slot].defined()) {
          env[storages[slot]] = py::reinterpret_steal<py::object>(THPVariable_Wrap(unshared(run.env[slot])));
        }
      }
      for (auto& kept : run.env) {
        kept.reset();
      }
      py::reinterpret_borrow<py::object>(run_fallback)(run.launch.fallback, resume, env);
    } catch (py::error_already_set& error) {
      error.discard_as_unraisable("neuron device worker (a native launch's fallback)");
    } catch (const std::exception& error) {  // (never out of the worker thread: that would abort)
      PyErr_SetString(PyExc_RuntimeError, error.what());
      PyErr_WriteUnraisable(nullptr);
    }
  }

  void run_native(Launch& launch) {
    auto began = std::chrono::steady_clock::now();
    struct Timed {
      std::atomic<int64_t>& total;
      std::chrono::steady_clock::time_point began;
      ~Timed() {
        total.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - began).count(),
                        std::memory_order_relaxed);
      }
    } timed{native_ns, began};
    worker_threads.store(at::get_num_threads());
    Run run{launch, std::vector<at::Tensor>(static_cast<size_t>(launch.program->slots))};
    if (anomalous(launch)) {
      fallback(run, 0);
      return;
    }
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    std::vector<at::Tensor> saved;
    // one step natively; false when it raised and the launch went to the Python fallback
    auto run_step = [&](const Step& step) {
      saved.clear();
      for (int32_t slot : step.guarded) {
        saved.push_back(run.value(slot).clone());
      }
      try {
        run.step(step);
      } catch (const std::exception&) {
        for (size_t i = 0; i < step.guarded.size(); ++i) {
          launch.table[step.guarded[i]]->value().copy_(saved[i]);
        }
        fallback(run, step.resume);
        return false;
      }
      return true;
    };
    for (const auto& step : launch.program->steps) {
      if (!step.generated && step.interleaved.empty()) {
        if (!run_step(step)) {
          return;
        }
        continue;
      }
      if (!step.interleaved.empty()) {
        Interleaved outcome = run_interleaved(run, step);
        if (outcome == Interleaved::HandedBack) {
          return;
        }
        if (outcome == Interleaved::Ran) {
          continue;
        }
      } else if (!step.generated->off.load(std::memory_order_acquire) && run_generated(run, step)) {
        continue;
      }
      // the group's own steps: the generated kernel is off or raised, or the run's memory
      // could not be reserved (the run in PyTorch's order)
      for (const auto& own : step.group) {
        if (!run_step(own)) {
          return;
        }
      }
    }
    native_launches.fetch_add(1, std::memory_order_relaxed);
  }

  // A run of multi-tensor ops (interleave.py: interleaved_runs), parameter by parameter:
  // the same kernels on the same elements, each element's ops in the same order, so the
  // same bits as PyTorch's order, with each parameter's state in cache across the ops. The
  // run holds only ops that cannot raise once the host has checked them, but for an
  // allocation; so every block of 64 KiB or more its steps allocate is reserved from the
  // pool first (host_pool.cpp), and if that fails nothing has been written: NotRun, and the
  // run's own steps run in PyTorch's order. A step raising after the run began (no known
  // cause) hands the window to Python at the run (`step.resume`), which fails it with every
  // tensor the run writes poisoned: some parameters are further on than others.
  enum class Interleaved { Ran, NotRun, HandedBack };

  Interleaved run_interleaved(Run& run, const Step& step) {
    std::vector<size_t> sizes;
    for (const auto& each : step.interleaved) {
      for (int32_t slot : each.outs) {
        if (slot >= 0) {
          const Cell& cell = *run.launch.table[slot];
          sizes.push_back(at::detail::computeStorageNbytes(cell.sizes, cell.strides, c10::elementSize(cell.dtype)));
        }
      }
    }
    if (!reserve_host_blocks(sizes)) {
      return Interleaved::NotRun;
    }
    struct Release {
      ~Release() { release_host_reservation(); }
    } release;
    try {
      for (const auto& each : step.interleaved) {
        run.step(each);
      }
    } catch (const std::exception&) {
      fallback(run, step.resume);
      return Interleaved::HandedBack;
    }
    for (int32_t slot : step.frees) {
      run.env[slot].reset();
    }
    interleaved_runs.fetch_add(1, std::memory_order_relaxed);
    return Interleaved::Ran;
  }

  // Strict eager's multi-tensor launches parameter by parameter (see strict_parameters).
  // Each launch is still its own kernel (accounted, completed and released as one); only the
  // order of their per-parameter kernels on the CPU changes, so the results are PyTorch's
  // order's bit for bit, with each parameter's state in cache across the ops.

  // The next batch the host has rung, appended to `batch` (a run of strict multi-tensor
  // launches reached its end); false when there is none yet.
  bool take_pending(std::vector<Item>& batch, int64_t& taken) {
    std::lock_guard<std::mutex> lock(mutex);
    if (batches.empty()) {
      return false;
    }
    std::vector<Item>& next = batches.front();
    batch.insert(batch.end(), std::make_move_iterator(next.begin()), std::make_move_iterator(next.end()));
    batches.pop_front();
    ++taken;
    return true;
  }

  // Where the run that may start at batch[begin] ends (begin + 1 when there is none), and
  // its parameter count (`count`); a run reaching the end of `batch` takes the batches rung
  // since (take_pending) and goes on through them.
  size_t strict_run_end(std::vector<Item>& batch, size_t begin, int64_t& taken, int64_t& count) {
    count = strict_parameters(*batch[begin].native);
    size_t end = begin + 1;
    if (count == 0) {
      return end;
    }
    while (true) {
      while (end < batch.size() && batch[end].native && strict_parameters(*batch[end].native) == count) {
        ++end;
      }
      if (end < batch.size() || !take_pending(batch, taken)) {
        return end;
      }
    }
  }

  // A launch's step at one parameter: each list argument's element there, as a list of one.
  static Step at_parameter(const Step& step, size_t index) {
    Step one;
    one.op = step.op;
    for (const auto& arg : step.args) {
      if (arg.kind == Arg::TensorList) {
        Arg item;
        item.kind = Arg::TensorList;
        item.items.push_back(arg.items[index]);
        one.args.push_back(std::move(item));
      } else if (arg.constant.isList()) {
        Arg item;
        c10::impl::GenericList list(arg.constant.toList().elementType());
        list.push_back(arg.constant.toListRef()[index]);
        item.constant = c10::IValue(std::move(list));
        one.args.push_back(std::move(item));
      } else {
        one.args.push_back(arg);
      }
    }
    if (!step.outs.empty()) {
      one.outs.push_back(step.outs[index]);
      one.dead.push_back(step.dead[index]);
    }
    return one;
  }

  // Whether batch[begin:end] may run parameter by parameter; if so, the sizes of the blocks
  // its results take and each launch's step at each parameter.
  bool plan_strict_run(const std::vector<Item>& batch, size_t begin, size_t end, size_t count,
                       std::vector<size_t>& sizes, std::vector<std::vector<Step>>& steps) const {
    std::unordered_map<const Cell*, int64_t> at;  // cell -> its parameter (-1: at two)
    std::set<const Cell*> written;
    for (size_t k = begin; k < end; ++k) {
      const Launch& launch = *batch[k].native;
      if (anomalous(launch)) {
        return false;
      }
      const Step& step = launch.program->steps[0];
      const auto& schema = step.op->schema().arguments();
      auto note = [&](int32_t slot, int64_t index) {
        const Cell* cell = launch.table[slot].get();
        auto found = at.emplace(cell, index);
        if (!found.second && found.first->second != index) {
          found.first->second = -1;
        }
        return cell;
      };
      for (size_t a = 0; a < step.args.size(); ++a) {
        const Arg& arg = step.args[a];
        if (arg.kind != Arg::TensorList) {
          continue;
        }
        bool writes = a < schema.size() && schema[a].alias_info() != nullptr && schema[a].alias_info()->isWrite();
        for (size_t index = 0; index < arg.items.size(); ++index) {
          const Cell* cell = note(arg.items[index].ref.slot, static_cast<int64_t>(index));
          if (writes) {
            written.insert(cell);
          }
        }
      }
      for (size_t index = 0; index < step.outs.size(); ++index) {
        const Cell& cell = *launch.table[step.outs[index]];
        written.insert(note(step.outs[index], static_cast<int64_t>(index)));
        sizes.push_back(at::detail::computeStorageNbytes(cell.sizes, cell.strides, c10::elementSize(cell.dtype)));
      }
    }
    for (const Cell* cell : written) {
      if (at[cell] < 0) {
        return false;
      }
    }
    for (size_t k = begin; k < end; ++k) {
      for (size_t index = 0; index < count; ++index) {
        steps[k - begin].push_back(at_parameter(batch[k].native->program->steps[0], index));
      }
    }
    return true;
  }

  // The run batch[begin:end] parameter by parameter: true if it ran (or raised after it
  // began: every launch of it handed to Python as broken, interleave.py BROKEN), false
  // (nothing run) when a launch is anomalous, a tensor is written at two parameters or
  // the run's memory cannot be reserved: the launches then run one by one.
  bool run_strict_interleaved(std::vector<Item>& batch, size_t begin, size_t end, size_t count) {
    std::vector<size_t> sizes;
    std::vector<std::vector<Step>> steps(end - begin);  // [launch][parameter]
    std::vector<Run> runs;
    try {
      if (!plan_strict_run(batch, begin, end, count, sizes, steps)) {
        return false;
      }
      runs.reserve(end - begin);
      for (size_t k = begin; k < end; ++k) {
        runs.push_back(Run{*batch[k].native, std::vector<at::Tensor>(static_cast<size_t>(batch[k].native->program->slots))});
      }
    } catch (const std::exception&) {  // (nothing has run: the launches run one by one)
      return false;
    }
    if (!reserve_host_blocks(sizes)) {
      return false;
    }
    struct Release {
      ~Release() { release_host_reservation(); }
    } release;
    auto began = std::chrono::steady_clock::now();
    try {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      for (size_t index = 0; index < count; ++index) {
        for (size_t k = 0; k < runs.size(); ++k) {
          runs[k].step(steps[k][index]);
        }
      }
    } catch (const std::exception&) {
      for (auto& run : runs) {
        fallback(run, kBroken);
      }
      return true;
    }
    native_ns.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - began).count(),
                        std::memory_order_relaxed);
    native_launches.fetch_add(static_cast<int64_t>(end - begin), std::memory_order_relaxed);
    interleaved_runs.fetch_add(1, std::memory_order_relaxed);
    return true;
  }

  // A generated kernel (struct Generated): true if it ran and its results are stored;
  // false (its written inputs restored, the kernel turned off) if it raised.
  bool run_generated(Run& run, const Step& step) {
    if (!python_alive()) {
      return false;
    }
    std::vector<at::Tensor> inputs;
    std::vector<at::Tensor> saved;
    torch::jit::Stack results;
    bool ran = false;
    try {
      inputs.reserve(step.args.size());
      for (const auto& arg : step.args) {
        inputs.push_back(run.resolve(arg).toTensor());
      }
      for (int32_t slot : step.guarded) {
        saved.push_back(run.value(slot).clone());
      }
      if (step.generated->entry != nullptr) {
        ran = run_entry(step, inputs, results);
        if (ran) {
          generated_without_gil.fetch_add(1, std::memory_order_relaxed);
        }
      } else {
        py::gil_scoped_acquire gil;
        ran = run_callable(step, inputs, results);
      }
    } catch (const std::exception&) {
      ran = false;
    }
    if (ran) {
      run.store(step, results);
      generated_runs.fetch_add(1, std::memory_order_relaxed);
      return true;
    }
    for (size_t i = 0; i < saved.size(); ++i) {
      launch_value(run, step.guarded[i]).copy_(saved[i]);
    }
    step.generated->off.store(true, std::memory_order_release);
    generated_failures.fetch_add(1, std::memory_order_relaxed);
    return false;
  }

  // The C++ wrapper's entry, without the GIL: each input a new handle (the entry steals
  // it), each output handle taken back. False (nothing stored) if it throws.
  static bool run_entry(const Step& step, const std::vector<at::Tensor>& inputs, torch::jit::Stack& results) {
    std::vector<AtenTensorHandle> in(inputs.size(), nullptr);
    std::vector<AtenTensorHandle> out(step.outs.size(), nullptr);
    for (size_t i = 0; i < inputs.size(); ++i) {
      in[i] = torch::aot_inductor::new_tensor_handle(at::Tensor(inputs[i]));
    }
    bool ran = true;
    try {
      step.generated->entry(in.data(), out.data());
    } catch (const std::exception&) {
      ran = false;
    }
    for (AtenTensorHandle handle : out) {
      if (handle == nullptr) {
        ran = false;
        continue;
      }
      at::Tensor* tensor = torch::aot_inductor::tensor_handle_to_tensor_pointer(handle);
      if (ran) {
        results.emplace_back(std::move(*tensor));
      }
      delete tensor;
    }
    if (!ran) {
      results.clear();
    }
    return ran;
  }

  // The Python callable, with the GIL held by the caller.
  static bool run_callable(const Step& step, const std::vector<at::Tensor>& inputs, torch::jit::Stack& results) {
    try {
      py::list list(inputs.size());
      for (size_t i = 0; i < inputs.size(); ++i) {
        PyObject* wrapped = THPVariable_Wrap(unshared(inputs[i]));
        if (wrapped == nullptr) {
          throw py::error_already_set();
        }
        PyList_SET_ITEM(list.ptr(), static_cast<Py_ssize_t>(i), wrapped);
      }
      py::object returned = py::reinterpret_borrow<py::object>(step.generated->callable)(list);
      for (py::handle item : returned) {
        TORCH_CHECK(THPVariable_Check(item.ptr()), "a generated kernel returned a non-tensor");
        results.emplace_back(unshared(THPVariable_Unpack(item.ptr())));
      }
      TORCH_CHECK(results.size() == step.outs.size(), "a generated kernel returned ", results.size(),
                  " tensors, ", step.outs.size(), " expected");
      return true;
    } catch (py::error_already_set&) {
      results.clear();  // (the error is dropped with the GIL held)
    } catch (const std::exception&) {
      results.clear();
    }
    return false;
  }

  static at::Tensor launch_value(Run& run, int32_t slot) { return run.launch.table[slot]->value(); }

  void run_python_item(PyObject* item) {
    if (!python_alive()) {
      return;  // finalizing: leak it rather than touch Python
    }
    py::gil_scoped_acquire gil;
    PyObject* result = PyObject_CallOneArg(run_python, item);
    if (result == nullptr) {
      PyErr_WriteUnraisable(item);
    }
    Py_XDECREF(result);
    Py_DECREF(item);
  }

  static void work(std::shared_ptr<Queue> self) {
    Queue& q = *self;
    q.thread = pthread_self();
    q.has_thread.store(true, std::memory_order_release);
    at::init_num_threads();  // the intra-op threads torch.set_num_threads asks for, on this thread too
    enter_host_pool();       // its kernels' blocks come from the pool (host_pool.cpp)
    int64_t taken = 0;       // batches taken (q.pushed counts those pushed)
    while (true) {
      std::vector<Item> batch;
      {
        int64_t spin = q.spin_us.load(std::memory_order_acquire);
        if (spin > 0 && q.pushed.load(std::memory_order_acquire) == taken) {
          auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin);
          while (q.pushed.load(std::memory_order_acquire) == taken && std::chrono::steady_clock::now() < until) {
            pause();
          }
        }
        std::unique_lock<std::mutex> lock(q.mutex);
        q.ready.wait(lock, [&] { return !q.batches.empty(); });
        ++taken;
        batch = std::move(q.batches.front());
        q.batches.pop_front();
      }
      for (size_t i = 0; i < batch.size();) {
        int wanted = q.threads.load(std::memory_order_acquire);
        if (wanted > 0 && wanted != at::get_num_threads()) {
          at::set_num_threads(wanted);
        }
        size_t end = i + 1;
        if (batch[i].native) {
          int64_t count = 0;
          end = q.strict_run_end(batch, i, taken, count);
          if (end - i < 2 || !q.run_strict_interleaved(batch, i, end, static_cast<size_t>(count))) {
            end = i + 1;
            q.run_native(*batch[i].native);
          }
        } else {
          q.python_items.fetch_add(1, std::memory_order_relaxed);
          q.run_python_item(batch[i].python);  // released under the GIL there
          batch[i].python = nullptr;
        }
        for (; i < end; ++i) {
          Item& item = batch[i];
          if (item.native) {
            // Released by the host: the launch holds Python objects (its fallback, storages).
            item.native.reset();  // the wrapper keeps it alive until then
            q.finished(item.wrapper);
          }
          // (sequentially consistent, as wait_completed's store of wake_at and its read of
          // completed: one of the two threads sees the other's write, so no wake-up is lost)
          int64_t now = q.completed.fetch_add(1) + 1;
          if (now >= q.wake_at.load()) {
            std::lock_guard<std::mutex> guard(q.waiters_mutex);
            q.waiters_cv.notify_all();
          }
        }
      }
    }
  }

  // A host waiting for the worker past its polling wakes every this many items the worker
  // runs and releases the launches that ran (release): their records, and the bytes only
  // they still held, the step's dead intermediates (an autograd graph's saved tensors, freed
  // by the host when it issued the backward op that reads them). Released only at the sync,
  // a training step's every intermediate stayed allocated until its end: the worker's
  // kernels wrote each result to memory no kernel had touched for a whole step, where CPU
  // eager reuses a block still in the caches. 16 is an assumption: a wake-up costs the
  // worker a notify (a few microseconds) against kernels of tens to hundreds here.
  static constexpr int64_t kReleaseEvery = 16;

  // wait_completed(target, spin_us): block (without the GIL) until the worker has run `target`
  // items. First polls for up to spin_us (the host's core is otherwise idle while it waits,
  // and a futex sleep costs a wake-up on each side); then sleeps, waking every kReleaseEvery
  // items the worker runs (to release them) or after 100 ms, and runs Python's signal
  // handlers each time (a Ctrl-C raises KeyboardInterrupt here, the items staying queued,
  // as a Python wait would).
  void wait_completed(int64_t target, int64_t spin_us) {
    if (spin_us > 0 && completed.load() < target) {
      py::gil_scoped_release no_gil;
      auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us);
      while (completed.load(std::memory_order_acquire) < target && std::chrono::steady_clock::now() < until) {
        pause();
      }
    }
    while (true) {
      // (every kReleaseEvery items, the launches the worker ran are released here)
      int64_t until = std::min(target, completed.load() + kReleaseEvery);
      bool reached = false;
      {
        py::gil_scoped_release no_gil;
        std::unique_lock<std::mutex> lock(waiters_mutex);
        auto mine = targets.insert(until);
        wake_at.store(*targets.begin());
        reached = waiters_cv.wait_for(lock, std::chrono::milliseconds(100), [&] { return completed.load() >= until; });
        targets.erase(mine);
        wake_at.store(targets.empty() ? std::numeric_limits<int64_t>::max() : *targets.begin());
      }
      if (reached && until == target) {
        return;
      }
      if (reached) {
        release();
      }
      if (PyErr_CheckSignals() != 0) {
        throw py::error_already_set();
      }
    }
  }

  // -- Python API (the host, with the GIL) --
  void start(py::object python, py::object fallback_runner) {
    if (started) {
      return;
    }
    run_python = python.release().ptr();
    run_fallback = fallback_runner.release().ptr();
    started = true;
    std::thread(&Queue::work, shared_from_this()).detach();
  }

  void push(py::list batch) {
    std::vector<Item> items;
    items.reserve(py::len(batch));
    for (py::handle value : batch) {
      Item item;
      if (PyCapsule_IsValid(value.ptr(), kLaunchCapsule)) {  // a strict op's, from the C recorder
        item.native = *static_cast<std::shared_ptr<Launch>*>(PyCapsule_GetPointer(value.ptr(), kLaunchCapsule));
        item.wrapper = value.inc_ref().ptr();
      } else if (py::isinstance<Launch>(value)) {
        item.native = value.cast<std::shared_ptr<Launch>>();
        item.wrapper = value.inc_ref().ptr();
      } else {
        item.python = value.inc_ref().ptr();
      }
      items.push_back(std::move(item));
    }
    {
      std::lock_guard<std::mutex> lock(mutex);
      batches.push_back(std::move(items));
      pushed.fetch_add(1, std::memory_order_release);
    }
    ready.notify_one();
  }

  // release(): drop the Python objects of finished native launches. Returns how many.
  size_t release() {
    std::vector<PyObject*> taken;
    {
      std::lock_guard<std::mutex> guard(done_mutex);
      if (done.empty()) {
        return 0;
      }
      taken.swap(done);
    }
    for (PyObject* object : taken) {
      Py_DECREF(object);
    }
    return taken.size();
  }

  void flags(std::optional<bool> pending, std::optional<bool> faulting, std::optional<bool> poisoned,
             std::optional<int> intra_op_threads, std::optional<int64_t> idle_spin_us) {
    if (intra_op_threads) {
      threads.store(*intra_op_threads, std::memory_order_release);
    }
    if (idle_spin_us) {
      spin_us.store(*idle_spin_us, std::memory_order_release);
    }
    if (pending) {
      failure_pending.store(*pending, std::memory_order_release);
    }
    if (faulting) {
      faults.store(*faulting, std::memory_order_release);
    }
    if (poisoned) {
      poison_seen.store(*poisoned, std::memory_order_release);
    }
  }
};

void executor_types(py::object view_ref, py::object reinterpret_ref) {
  view_ref_type = view_ref.release().ptr();
  reinterpret_ref_type = reinterpret_ref.release().ptr();
}

void slot_types(py::object slot, py::object view_slot) {
  slot_type = slot.release().ptr();
  view_slot_type = view_slot.release().ptr();
}

}  // namespace

// native_op for record.cpp, without the Python call: the Launch as a Python object (a new
// reference: a capsule, kLaunchCapsule); nullptr and no error set when the op cannot run natively (NotNative: the
// record itself is then the launch), nullptr and an error set on any other failure.
PyObject* native_op_launch(PyObject* op, PyObject* args, PyObject* kwargs, PyObject* results, PyObject* guarded,
                           PyObject* fallback) {
  try {
    auto* launch = new std::shared_ptr<Launch>(
        native_op(op, args, kwargs, results, guarded, py::reinterpret_borrow<py::object>(fallback)));
    PyObject* capsule = PyCapsule_New(launch, kLaunchCapsule, delete_launch_capsule);
    if (capsule == nullptr) {
      delete launch;
    }
    return capsule;
  } catch (const NotNative&) {
    return nullptr;
  } catch (py::error_already_set& error) {
    error.restore();
    return nullptr;
  } catch (const std::exception& error) {
    PyErr_SetString(PyExc_RuntimeError, error.what());
    return nullptr;
  }
}

void register_executor(py::module& m) {
  py::register_exception<NotNative>(m, "NotNative");
  py::class_<Program, std::shared_ptr<Program>>(m, "Program")
      .def_property_readonly("steps", [](const Program& program) { return program.steps.size(); })
      .def_property_readonly("slots", [](const Program& program) { return program.slots; });
  py::class_<Launch, std::shared_ptr<Launch>>(m, "NativeLaunch")
      .def_property_readonly("steps", [](const Launch& launch) { return launch.program->steps.size(); })
      // what the Python fallback would run: its records (the profiler reads them at launch)
      .def_property_readonly("fallback", [](const Launch& launch) { return launch.fallback; });
  py::class_<Builder>(m, "ProgramBuilder")
      .def(py::init<>())
      .def("numbered", &Builder::numbered)
      .def("op", &Builder::op)
      .def("script", &Builder::script)
      .def("free", &Builder::free)
      .def("begin_group", &Builder::begin_group)
      .def("interleave", &Builder::interleave)
      .def("interleaved", &Builder::interleaved)
      .def("generated", &Builder::generated)
      .def("build", &Builder::build)
      .def("launch", &Builder::launch);
  py::class_<Queue, std::shared_ptr<Queue>>(m, "Worker")
      .def(py::init<>())
      .def("start", &Queue::start)
      .def("push", &Queue::push)
      .def("release", &Queue::release)
      .def("wait_completed", &Queue::wait_completed, py::arg("target"), py::arg("spin_us") = 0)
      .def_property_readonly("completed", [](const Queue& q) { return q.completed.load(std::memory_order_acquire); })
      .def("flags", &Queue::flags, py::arg("failure_pending") = py::none(), py::arg("faults") = py::none(),
           py::arg("poison_seen") = py::none(), py::arg("threads") = py::none(), py::arg("spin_us") = py::none())
      .def("counts", [](const Queue& q) {
        py::dict counts;
        counts["native_launches"] = q.native_launches.load();
        counts["fallbacks"] = q.fallbacks.load();
        counts["generated_runs"] = q.generated_runs.load();
        counts["generated_failures"] = q.generated_failures.load();
        counts["generated_runs_without_gil"] = q.generated_without_gil.load();
        counts["native_us"] = q.native_ns.load() / 1000.0;
        counts["interleaved_runs"] = q.interleaved_runs.load();
        counts["python_items"] = q.python_items.load();
        counts["idle_spin_us"] = q.spin_us.load();
        counts["worker_threads"] = q.worker_threads.load();
        return counts;
      })
      .def("cpu_seconds", [](const Queue& q) {
        // CPU time the worker thread has used so far (0 before it runs): bench/measure.py
        // subtracts it from the process's to get the host thread's.
        clockid_t clock;
        timespec now{};
        if (!q.has_thread.load(std::memory_order_acquire) || pthread_getcpuclockid(q.thread, &clock) != 0 ||
            clock_gettime(clock, &now) != 0) {
          return 0.0;
        }
        return static_cast<double>(now.tv_sec) + static_cast<double>(now.tv_nsec) * 1e-9;
      });
  m.attr("BROKEN") = kBroken;
  m.attr("INTERLEAVED_NAMES") = py::frozenset(py::cast(interleaved_names()));
  m.def("bind", &bind, py::arg("program"), py::arg("storages"), py::arg("fallback"), py::arg("cells") = nullptr);
  py::class_<FreshCells, std::shared_ptr<FreshCells>>(m, "FreshCells")
      .def("wrap", [](const FreshCells& fresh, py::list table) { wrap_intermediates(table.ptr(), fresh.cells); },
           "table[slot] = a DeviceStorage over each intermediate's cell where table[slot] is None");
  py::class_<FreshSlots, std::shared_ptr<FreshSlots>>(m, "FreshSlots")
      .def(py::init<py::object, py::list, int32_t>())
      .def_readonly("total", &FreshSlots::total)
      .def("allocate", &FreshSlots::allocate);
  py::class_<ReplayBinder>(m, "ReplayBinder")
      .def(py::init<std::shared_ptr<FreshSlots>, py::list, py::list, py::list, py::list, py::list, py::list>())
      .def("call", &ReplayBinder::call)
      .def("alive_bits", &ReplayBinder::alive_bits);
  m.def("native_op", &native_op);
  m.def("executor_types", &executor_types);
  m.def("slot_types", &slot_types);
}

}  // namespace neuron
