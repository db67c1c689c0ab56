// The PrivateUse1 hooks Python cannot reach, for the simulated `neuron` device.
//
// Built by the README's install command (setup.py, torch.utils.cpp_extension) as
// adaptive_eager_device._C; device/backend.py calls init() when it registers the
// device. What is here, and only this, by translation unit (neuron.h declares what they
// share):
//
// - memory.cpp: device memory, an allocator of PrivateUse1 storages (a storage is an
//   identity: a unique, aligned address, never dereferenced, and in its DataPtr's context
//   the Python DeviceStorage, device/memory/storage.py, whose bytes are in its cell);
//   storage resizing (`storage.resize_`); pinned host memory (`pin_memory()`,
//   `is_pinned()`); the device indices and the current device per thread; the
//   callbacks into the Python device.
// - host_pool.cpp: the host memory the device worker's kernels allocate, a caching pool
//   (glibc would map and fault in a fresh heap for a step's temporaries every step).
// - hooks.cpp: generators (`torch.Generator(device="neuron")` draws through a CPU twin,
//   whose state waits for the queue), the PrivateUse1 hooks and the device guard
//   (`neuron:0` .. `neuron:<count-1>`, one shared queue, so default streams and no-op
//   events), and init().
// - hot_path.cpp: two calls on the per-op hot path, `empty` (a device tensor over a
//   fresh storage) and `describe` (what the dispatcher records of a tensor argument),
//   one C call each; `user_facing`, the kernel boundary the user's errors leave
//   through without device frames; and `fast_kernel`, that boundary doing the Python
//   handler's work (the host lock, `record`, else the whole recorder) in C.
// - record.cpp: the recorder's common case in one C call (`record`: a kernel whose
//   signature hits the shape cache, recorded and, in strict eager, launched), and the
//   execution queue's bookkeeping (`account`, `submit`).
// - views.cpp: the view kernels that never enter Python (`view`, `as_strided`,
//   `_reshape_alias`: metadata only, at::native's own functions, as the CPU runs them).
// - sparse.cpp: the sparse COO kernels that only read or re-point a sparse tensor (its
//   construction, `_indices`, `_values`, `copy_`, resizing: at::native's device-generic
//   functions) at SparsePrivateUse1.
// - cells.cpp: `_C.StorageBase`, the C part of DeviceStorage: the cell holding a storage's
//   bytes (a CPU tensor that never gets a Python object) and its data/materialize/adopt/
//   poison accessors.
// - cow.cpp: copy-on-write lazy clones (`torch._lazy_clone`): two storages sharing one
//   allocation through c10's copy-on-write context, until a write gives up a share.
// - executor.cpp: the device worker (`_C.Worker`, one per execution queue) and native
//   launches: `_C.native_op` (one op), `_C.ProgramBuilder` (a window's or a compiled
//   graph's ops as one program), `_C.bind`; what the worker cannot run in C++ it hands
//   back to Python.
// - profiler.cpp: torch.profiler's device activity: a Kineto child profiler registered for
//   PrivateUse1 (REGISTER_PRIVATEUSE1_PROFILER), the calls the device makes per op and per
//   kernel launch (profiler_*), and the allocator's memory events (profile_memory).
// - module.cpp (this file): the Python module, `call_quietly` (a call whose C++
//   warnings are dropped: the device's meta runs of an op) and `call_recording` (a call
//   whose C++ warnings are returned: the one-element CPU trial's, given to the user).

#include "neuron.h"

#include <c10/util/Exception.h>
#include <torch/csrc/utils/pybind.h>

#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace neuron {
namespace {

// call_quietly(prefix, fn, *args, **kwargs) -> fn(*args, **kwargs), dropping the C++
// warnings (TORCH_WARN) raised meanwhile whose message starts with `prefix` ("": all).
// The device's trials on the CPU and its meta runs call ATen ops through pybind11, which
// hands their C++ warnings to the boundary of the user's call: they would reach the user
// after `warnings.catch_warnings()` ended, besides the warning of the real call.
class Dropping final : public c10::WarningHandler {
 public:
  Dropping(std::string prefix, c10::WarningHandler* next) : prefix_(std::move(prefix)), next_(next) {}
  void process(const c10::Warning& warning) override {
    if (warning.msg().compare(0, prefix_.size(), prefix_) == 0) {
      return;
    }
    next_->process(warning);
  }

 private:
  std::string prefix_;
  c10::WarningHandler* next_;
};

py::object call_quietly(const std::string& prefix, const py::function& fn, const py::args& args,
                        const py::kwargs& kwargs) {
  Dropping handler(prefix, c10::WarningUtils::get_warning_handler());
  c10::WarningUtils::WarningHandlerGuard guard(&handler);
  return fn(*args, **kwargs);
}

// call_recording(fn, *args, **kwargs) -> (fn(*args, **kwargs), [(message, deprecation)]):
// the C++ warnings raised meanwhile, kept instead of handed on. The device's one-element
// CPU trial (shapes.check_on_cpu) keeps the warnings the CPU gives for the op's arguments,
// which the recorder gives the user at each call, as the CPU kernel would.
class Recording final : public c10::WarningHandler {
 public:
  void process(const c10::Warning& warning) override {
    bool deprecation = std::holds_alternative<c10::Warning::DeprecationWarning>(warning.type());
    kept_.emplace_back(warning.msg(), deprecation);
  }
  std::vector<std::pair<std::string, bool>> kept_;
};

py::tuple call_recording(const py::function& fn, const py::args& args, const py::kwargs& kwargs) {
  Recording handler;
  py::object result;
  {
    c10::WarningUtils::WarningHandlerGuard guard(&handler);
    result = fn(*args, **kwargs);
  }
  py::list kept;
  for (const auto& [message, deprecation] : handler.kept_) {
    kept.append(py::make_tuple(message, deprecation));
  }
  return py::make_tuple(result, kept);
}

// current_device() / exchange_device(index) -> previous: the calling thread's device.
int current_device() {
  return current_index();
}

int exchange_device(int index) {
  return exchange_index(static_cast<c10::DeviceIndex>(index));
}

}  // namespace
}  // namespace neuron

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "The PrivateUse1 hooks of the simulated neuron device that Python cannot reach (see device/csrc/module.cpp)";
  m.def("init", &neuron::init);
  m.def("attach", &neuron::attach);
  m.def("release_host_pool", &neuron::release_host_pool);
  m.def("host_pool_stats", &neuron::host_pool_stats);
  m.def("side_of", &neuron::side_of);
  m.def("regrow", &neuron::regrow);
  m.def("twin", &neuron::twin);
  m.def("current_device", &neuron::current_device);
  m.def("exchange_device", &neuron::exchange_device);
  m.def("view_count", &neuron::view_count);
  m.def("call_quietly", &neuron::call_quietly);
  m.def("call_recording", &neuron::call_recording);
  neuron::profiler::add_methods(m);
  PyModule_AddFunctions(m.ptr(), neuron::hot_methods);
  PyModule_AddFunctions(m.ptr(), neuron::record_methods);
  neuron::add_storage_type(m.ptr());
  neuron::register_executor(m);
  neuron::add_cow_methods(m);
}
