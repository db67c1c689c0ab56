// torch.profiler's device activity for the simulated device: a Kineto child activity
// profiler for PrivateUse1, so `torch.profiler.profile(activities=[CPU, PrivateUse1])`
// shows `neuron` kernels as it shows a GPU's (see module.cpp for the whole extension).
//
// Kineto side (what torch calls): REGISTER_PRIVATEUSE1_PROFILER(NeuronActivityProfiler)
// registers a factory when this extension loads; torch hands it to Kineto at the first
// profile. A profile that asks for ProfilerActivity.PrivateUse1 gets a NeuronSession:
// torch pushes the correlation id of every op it records on the op's thread
// (pushCorrelationId; pushUserCorrelationId for record_function ranges), start()/stop()
// bound the recording, and processTrace turns what the device recorded into Kineto
// activities whose `linked` activity is the torch op (key_averages gives the op the
// kernel's device time through that link; the Chrome trace draws a flow along it).
//
// Device side (what the Python device calls, device/hardware/profiler.py; each returns at
// once unless a session records):
// - profiler_op_issued(name): per op reaching the device, on the issuing host thread,
//   inside the aten op: keeps the innermost op's correlation id and the time; a handle.
// - profiler_kernel_launched(name, us, stream, handles, weights): per kernel launch, on
//   the host, in queue order: the kernel's slot on the device lane,
//   start = max(now, end of the previous kernel), end = start + simulated duration.
// - profiler_host_range(name, begin_ns): a host wait for the device (a sync).
// - report_memory (memory.cpp, C++ only): device allocations and frees as the profiler's
//   memory events (profile_memory).
//
// The kernel's slot is on the host's clock (c10::getTime, the trace's time axis): the
// simulated device's durations, in queue order, never before the host launched them. So
// flows go forward in time and device totals are the simulator's; the gaps between
// kernels are the real host's pace, not the simulated host's (NEURON_TRACE's "simulated
// time" track is the simulator's own picture).
//
// The Kineto headers ship with the torch wheel (torch/include/kineto, setup.py adds it).
// USE_KINETO: privateuse1_profiler.h is empty without it; KINETO_NAMESPACE: output_base.h
// needs it; FMT_HEADER_ONLY: GenericTraceActivity::addMetadata calls fmt::format, which
// libtorch does not export.
#ifndef USE_KINETO
#define USE_KINETO
#endif
#ifndef KINETO_NAMESPACE
#define KINETO_NAMESPACE libkineto
#endif
#ifndef FMT_HEADER_ONLY
#define FMT_HEADER_ONLY
#endif

#include "neuron.h"

#include <c10/core/Allocator.h>
#include <c10/util/ApproximateClock.h>
#include <c10/util/ThreadLocalDebugInfo.h>

#include <GenericTraceActivity.h>
#include <IActivityProfiler.h>
#include <libkineto.h>
#include <output_base.h>
#include <torch/csrc/profiler/standalone/privateuse1_profiler.h>

#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace neuron {
namespace profiler {
namespace {

using libkineto::ActivityType;
using libkineto::GenericTraceActivity;

// The device lane is one Kineto "device" (pid 0, named "neuron"): the simulated device has
// one in-order queue for every stream and every device index. Rows ("resources"): kernels
// on row `stream`; the per-op shares of fused kernels on row kOpsRow + stream.
constexpr int32_t kLane = 0;
constexpr int32_t kOpsRow = 1000000;

struct OpIssue {
  std::string name;   // the op (aten::mm)
  uint64_t corr;      // innermost torch op's correlation id at issue (0: none)
  int32_t tid;        // issuing thread (libkineto::systemThreadId)
  int64_t t_ns;       // issue time, host clock (c10::getTime)
  uint32_t flow = 0;  // set when a kernel of this session ran the op
};

struct HostRange {  // a host call with a duration: a sync's wait for the device
  std::string name;
  uint64_t corr;
  int32_t tid;
  int64_t begin_ns, end_ns, lane_end_ns;
};

struct KernelRec {
  std::string name;
  int64_t launch_ns, start_ns, end_ns;
  double simulated_us;
  int32_t stream;
  uint64_t sequence;
  std::vector<uint32_t> ops;  // indices into the session's issues
  std::vector<double> weights;
};

class NeuronSession;

// -- global state: guarded by g_mutex, except the atomics -------------------------------------
std::mutex g_mutex;
NeuronSession* g_recording = nullptr;      // the session between start() and stop()
std::atomic<bool> g_is_recording{false};   // the one check the device makes per call
std::atomic<uint32_t> g_generation{0};     // one per recording session: stale handles are ignored
int64_t g_lane_end_ns = 0;                 // end of the last kernel laid on the device lane
uint64_t g_sequence = 0;                   // kernels laid on the lane so far
std::atomic<int64_t> g_live_bytes{0};      // device memory allocated (memory events' totals)

// torch's correlation ids, per thread: pushes and pops come from every op's thread at once
// (Kineto walks its sessions without a lock). The generation drops what an earlier
// session left (an op in flight when a profiling cycle ended).
struct CorrelationStacks {
  uint32_t generation = 0;
  std::vector<uint64_t> ops;
  void check() {
    uint32_t now = g_generation.load(std::memory_order_relaxed);
    if (generation != now) {
      generation = now;
      ops.clear();
    }
  }
};
thread_local CorrelationStacks tls_stacks;

class NeuronSession final : public libkineto::IActivityProfilerSession {
 public:
  NeuronSession() : buffer_(std::make_unique<libkineto::CpuTraceBuffer>()) {}
  ~NeuronSession() override {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (g_recording == this) {
      g_recording = nullptr;
      g_is_recording.store(false);
    }
  }

  void start() override {
    std::lock_guard<std::mutex> lock(g_mutex);
    generation_ = g_generation.fetch_add(1) + 1;
    issues_.clear();
    kernels_.clear();
    host_ranges_.clear();
    start_ns_ = c10::getTime();
    g_recording = this;
    g_is_recording.store(true);
    status_ = libkineto::TraceStatus::RECORDING;
  }

  void stop() override {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (g_recording == this) {
      g_recording = nullptr;
      g_is_recording.store(false);
    }
    host_state_.reset();
    stop_ns_ = c10::getTime();
    status_ = libkineto::TraceStatus::PROCESSING;
  }

  std::vector<std::string> errors() override {
    return {};
  }

  void processTrace(libkineto::ActivityLogger& logger) override {
    processTrace(logger, nullptr, start_ns_, stop_ns_);
  }

  void processTrace(libkineto::ActivityLogger& logger, libkineto::getLinkedActivityCallback linked_of,
                    int64_t window_start, int64_t window_end) override;

  std::unique_ptr<libkineto::DeviceInfo> getDeviceInfo() override {
    // pid 0, as GPU 0 in a CUDA trace; sorted below the host's rows
    return std::make_unique<libkineto::DeviceInfo>(
        libkineto::DeviceInfo{kLane, libkineto::kExceedMaxPid + kLane, "neuron", "neuron (simulated device time)"});
  }

  std::vector<libkineto::ResourceInfo> getResourceInfos() override {
    std::vector<libkineto::ResourceInfo> rows;
    for (int32_t stream : streams_) {
      rows.push_back({stream, stream, kLane, "stream " + std::to_string(stream)});
      if (ops_streams_.count(stream)) {
        rows.push_back(
            {kOpsRow + stream, kOpsRow + stream, kLane, "stream " + std::to_string(stream) + ": ops in fused kernels"});
      }
    }
    return rows;
  }

  std::unique_ptr<libkineto::CpuTraceBuffer> getTraceBuffer() override {
    // The logger keeps copies of our activities, which point at this buffer's span:
    // Kineto keeps the buffer with the trace (it also names a "neuron" row under Spans).
    return std::move(buffer_);
  }

  void pushCorrelationId(uint64_t id) override {
    tls_stacks.check();
    tls_stacks.ops.push_back(id);
  }
  void popCorrelationId() override {
    tls_stacks.check();
    if (!tls_stacks.ops.empty()) {
      tls_stacks.ops.pop_back();
    }
  }
  // record_function ranges get their device time through the ops inside them
  void pushUserCorrelationId(uint64_t) override {}
  void popUserCorrelationId() override {}

  std::unordered_map<std::string, std::string> getMetadata() override {
    return {{"neuron_time_axis",
             "\"neuron kernels: start = max(host launch time, end of the previous kernel), "
             "duration = simulated (cost model)\""}};
  }

  // -- what the device wrote (g_mutex held until stop()) --
  uint32_t generation_ = 0;
  int64_t start_ns_ = 0, stop_ns_ = 0;
  std::vector<OpIssue> issues_;
  std::vector<KernelRec> kernels_;
  std::vector<HostRange> host_ranges_;
  std::shared_ptr<c10::ThreadLocalDebugInfo> host_state_;  // the profiler's state on a host thread

 private:
  GenericTraceActivity& add(ActivityType type, const std::string& name) {
    buffer_->emplace_activity(buffer_->span, type, name);
    return *buffer_->activities.back();
  }

  std::unique_ptr<libkineto::CpuTraceBuffer> buffer_;
  std::set<int32_t> streams_;
  std::set<int32_t> ops_streams_;
};

void NeuronSession::processTrace(libkineto::ActivityLogger& logger, libkineto::getLinkedActivityCallback linked_of,
                                 int64_t window_start, int64_t window_end) {
  // stop() ran: nothing writes issues_ or kernels_ any more.
  buffer_->span = libkineto::TraceSpan(window_start, window_end, "neuron");
  buffer_->span.iteration = 0;
  buffer_->gpuOpCount = static_cast<int>(kernels_.size());
  auto linked = [&](uint64_t corr) -> const libkineto::ITraceActivity* {
    return (linked_of && corr != 0) ? linked_of(static_cast<int32_t>(corr)) : nullptr;
  };
  // Flow ids of type kLinkAsyncCpuGpu must be unique in a trace (torch asserts it): one per
  // op that reached a kernel of this session.
  uint32_t next_flow = 1;
  for (auto& kernel : kernels_) {
    for (uint32_t op : kernel.ops) {
      if (issues_[op].flow == 0) {
        issues_[op].flow = next_flow++;
      }
    }
  }
  int32_t pid = libkineto::processId();
  // Host side: a 0-ns runtime event where each op was issued, linked to the op: a flow starts here.
  for (const auto& issue : issues_) {
    auto& act = add(ActivityType::PRIVATEUSE1_RUNTIME, "neuron::enqueue");
    act.device = pid;
    act.resource = issue.tid;
    act.threadId = issue.tid;
    act.startTime = issue.t_ns;
    act.endTime = issue.t_ns;
    act.id = static_cast<int32_t>(issue.corr);
    act.linked = linked(issue.corr);
    act.addMetadataQuoted("op", issue.name);
    if (issue.flow) {
      act.addMetadata("correlation", issue.flow);  // as a CUDA launch's, on the kernel too
      act.flow.id = issue.flow;
      act.flow.type = libkineto::kLinkAsyncCpuGpu;
      act.flow.start = 1;
    }
    act.log(logger);
  }
  // Host waits for the device (syncs), on the waiting thread.
  for (const auto& range : host_ranges_) {
    auto& act = add(ActivityType::PRIVATEUSE1_RUNTIME, range.name);
    act.device = pid;
    act.resource = range.tid;
    act.threadId = range.tid;
    act.startTime = range.begin_ns;
    act.endTime = range.end_ns;
    act.id = static_cast<int32_t>(range.corr);
    act.linked = linked(range.corr);
    // the simulated device may still be busy when the real host stops waiting
    act.addMetadata("device lane ends after by ns", std::max<int64_t>(0, range.lane_end_ns - range.end_ns));
    act.log(logger);
  }
  // Device side: one event per kernel, in queue order.
  for (const auto& kernel : kernels_) {
    streams_.insert(kernel.stream);
    auto& act = add(ActivityType::CONCURRENT_KERNEL, kernel.name);
    act.device = kLane;
    act.resource = kernel.stream;
    act.startTime = kernel.start_ns;
    act.endTime = kernel.end_ns;
    act.addMetadata("device", kLane);  // the CUDA kernel's args tools read (TensorBoard, HTA)
    act.addMetadata("stream", kernel.stream);
    act.addMetadata("queue sequence", kernel.sequence);
    act.addMetadata("ops", kernel.ops.size());
    act.addMetadata("simulated us", kernel.simulated_us);
    act.addMetadata("queued us", (kernel.start_ns - kernel.launch_ns) / 1000.0);  // launch -> start
    if (kernel.ops.size() == 1) {
      // One op: the kernel is that op's (its device time in key_averages), the flow's end.
      const auto& issue = issues_[kernel.ops[0]];
      act.addMetadata("correlation", issue.flow);
      act.id = static_cast<int32_t>(issue.corr);
      act.linked = linked(issue.corr);
      act.flow.id = issue.flow;
      act.flow.type = libkineto::kLinkAsyncCpuGpu;
      act.flow.start = 0;
      act.log(logger);
      continue;
    }
    act.log(logger);  // a fused kernel: an activity has one link and one flow, so no single op
    if (kernel.ops.empty()) {
      continue;  // its ops were issued before the session started
    }
    // Each op of a fused kernel: its share of the kernel's slot (weighted by the ops' own
    // cost-model times), linked to the op, ending the op's flow. User annotations, so the
    // table's device total counts the kernel once while each op gets its share.
    ops_streams_.insert(kernel.stream);
    std::vector<double> weights(kernel.ops.size(), 1.0);
    double total = 0;
    if (kernel.weights.size() == kernel.ops.size()) {
      for (double w : kernel.weights) {
        total += w;
      }
    }
    if (total > 0) {
      weights = kernel.weights;
    } else {
      total = static_cast<double>(kernel.ops.size());  // no cost known: equal shares
    }
    // Exact durations (key_averages reads them), laid end to end from the kernel's start.
    // Kineto's Chrome writer widens every user annotation by 1 ns on each side
    // (output_json.cpp); 2 ns between shares keep them from overlapping in the file.
    int64_t span = kernel.end_ns - kernel.start_ns;
    double acc = 0;
    int64_t spacing = 0;
    for (size_t i = 0; i < kernel.ops.size(); ++i) {
      const auto& issue = issues_[kernel.ops[i]];
      double w = weights[i];
      int64_t begin = static_cast<int64_t>(std::llround(span * (acc / total)));
      acc += w;
      int64_t end = static_cast<int64_t>(std::llround(span * (acc / total)));
      auto& share = add(ActivityType::GPU_USER_ANNOTATION, issue.name + " in " + kernel.name);
      share.device = kLane;
      share.resource = kOpsRow + kernel.stream;
      share.startTime = kernel.start_ns + begin + spacing + 1;
      share.endTime = kernel.start_ns + end + spacing + 1;
      spacing += 2;
      share.id = static_cast<int32_t>(issue.corr);
      share.linked = linked(issue.corr);
      share.flow.id = issue.flow;
      share.flow.type = libkineto::kLinkAsyncCpuGpu;
      share.flow.start = 0;
      share.addMetadata("device", kLane);
      share.addMetadata("stream", kernel.stream);
      share.addMetadata("correlation", issue.flow);
      share.addMetadata("queue sequence", kernel.sequence);
      share.addMetadata("share", w / total);
      share.log(logger);
    }
  }
}

class NeuronActivityProfiler final : public libkineto::IActivityProfiler {
 public:
  const std::string& name() const override {
    return name_;
  }
  const std::set<ActivityType>& availableActivities() const override {
    return activities_;
  }
  std::unique_ptr<libkineto::IActivityProfilerSession> configure(const std::set<ActivityType>& activity_types,
                                                                 const libkineto::Config& /*config*/) override {
    // torch asks for CONCURRENT_KERNEL only with ProfilerActivity.PrivateUse1
    // (kPrivateUse1Types, kineto_shim.cpp); PRIVATEUSE1_RUNTIME is among the CPU types
    // too, so it cannot tell. A CPU-only profile gets no session: the device records nothing.
    if (!activity_types.count(ActivityType::CONCURRENT_KERNEL)) {
      return nullptr;
    }
    return std::make_unique<NeuronSession>();
  }
  std::unique_ptr<libkineto::IActivityProfilerSession> configure(int64_t /*ts_ms*/, int64_t /*duration_ms*/,
                                                                 const std::set<ActivityType>& activity_types,
                                                                 const libkineto::Config& config) override {
    return configure(activity_types, config);
  }

 private:
  std::string name_{"neuron"};
  std::set<ActivityType> activities_{ActivityType::CONCURRENT_KERNEL, ActivityType::GPU_USER_ANNOTATION,
                                     ActivityType::PRIVATEUSE1_RUNTIME};
};

}  // namespace

REGISTER_PRIVATEUSE1_PROFILER(NeuronActivityProfiler);

// -- what the device calls ----------------------------------------------------------------------
bool recording() {
  return g_is_recording.load(std::memory_order_relaxed);
}

uint64_t op_issued(const std::string& name) {
  if (!g_is_recording.load(std::memory_order_relaxed)) {
    return 0;
  }
  tls_stacks.check();
  uint64_t corr = tls_stacks.ops.empty() ? 0 : tls_stacks.ops.back();
  int32_t tid = libkineto::systemThreadId();
  int64_t now = c10::getTime();
  std::lock_guard<std::mutex> lock(g_mutex);
  NeuronSession* session = g_recording;
  if (session == nullptr) {
    return 0;
  }
  if (!session->host_state_) {
    // the profiler's thread-local state, for memory freed on a thread without it
    session->host_state_ = c10::ThreadLocalDebugInfo::current();
  }
  session->issues_.push_back({name, corr, tid, now});
  return (uint64_t(session->generation_) << 32) | uint64_t(session->issues_.size());
}

bool kernel_launched(const std::string& name, double duration_us, int32_t stream, const std::vector<uint64_t>& handles,
                     const std::vector<double>& weights) {
  if (!g_is_recording.load(std::memory_order_relaxed)) {
    return false;
  }
  int64_t now = c10::getTime();
  std::lock_guard<std::mutex> lock(g_mutex);
  NeuronSession* session = g_recording;
  if (session == nullptr) {
    return false;
  }
  KernelRec kernel;
  kernel.name = name;
  kernel.launch_ns = now;
  kernel.start_ns = std::max(now, g_lane_end_ns);
  kernel.end_ns = kernel.start_ns + static_cast<int64_t>(std::llround(duration_us * 1000.0));
  kernel.simulated_us = duration_us;
  g_lane_end_ns = kernel.end_ns;
  kernel.stream = stream;
  kernel.sequence = ++g_sequence;
  bool weighted = weights.size() == handles.size();
  for (size_t i = 0; i < handles.size(); ++i) {
    uint64_t handle = handles[i];
    uint32_t index = static_cast<uint32_t>(handle & 0xffffffffu);
    if ((handle >> 32) != session->generation_ || index == 0 || index > session->issues_.size()) {
      continue;  // an op issued before this recording session
    }
    kernel.ops.push_back(index - 1);
    if (weighted) {
      kernel.weights.push_back(weights[i]);
    }
  }
  session->kernels_.push_back(std::move(kernel));
  return true;
}

void host_range(const std::string& name, int64_t begin_ns) {
  if (!g_is_recording.load(std::memory_order_relaxed)) {
    return;
  }
  tls_stacks.check();
  uint64_t corr = tls_stacks.ops.empty() ? 0 : tls_stacks.ops.back();
  int32_t tid = libkineto::systemThreadId();
  int64_t now = c10::getTime();
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_recording != nullptr) {
    g_recording->host_ranges_.push_back({name, corr, tid, begin_ns, now, g_lane_end_ns});
  }
}

int64_t now_ns() {
  return c10::getTime();
}

bool registered() {
  return torch::profiler::impl::PrivateUse1ProfilerRegistry::instance().hasFactory();
}

// The allocator's allocations (delta > 0) and frees (delta < 0): memory events when the
// profiler records memory (profile_memory). On a thread without the profiler's
// thread-local state (not the host thread, nor the autograd engine's during backward:
// a thread the user started, the device worker) it reports through the state a host
// thread had when it issued an op in this session. When nothing profiles: one atomic add
// and one thread-local lookup.
void report_memory(uintptr_t address, int64_t delta, c10::DeviceIndex index) {
  int64_t live = g_live_bytes.fetch_add(delta, std::memory_order_relaxed) + delta;
  c10::Device device(kDevice, index);
  void* ptr = reinterpret_cast<void*>(address);
  size_t total = static_cast<size_t>(std::max<int64_t>(live, 0));
  if (c10::memoryProfilingEnabled()) {
    c10::reportMemoryUsageToProfiler(ptr, delta, total, total, device);
    return;
  }
  if (!g_is_recording.load(std::memory_order_relaxed)) {
    return;
  }
  std::shared_ptr<c10::ThreadLocalDebugInfo> state;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (g_recording != nullptr) {
      state = g_recording->host_state_;
    }
  }
  if (!state) {
    return;
  }
  c10::DebugInfoGuard guard(state);
  if (c10::memoryProfilingEnabled()) {
    c10::reportMemoryUsageToProfiler(ptr, delta, total, total, device);
  }
}

void add_methods(py::module& m) {
  m.def("profiler_recording", &recording, "Is a torch.profiler session recording the device?");
  m.def("profiler_op_issued", &op_issued, py::arg("name"),
        "An op reached the device (host thread, inside the aten op): a handle, 0 when not recording");
  m.def("profiler_kernel_launched", &kernel_launched, py::arg("name"), py::arg("duration_us"), py::arg("stream"),
        py::arg("handles"), py::arg("weights"),
        "A kernel launch (host side, queue order): its slot on the device lane; False when not recording");
  m.def("profiler_host_range", &host_range, py::arg("name"), py::arg("begin_ns"),
        "A host wait for the device, [begin_ns, now]");
  m.def("profiler_now_ns", &now_ns, "The trace's clock (c10::getTime)");
  m.def("profiler_registered", &registered, "Is the device's profiler registered with torch?");
}

}  // namespace profiler
}  // namespace neuron
