// Generators, the PrivateUse1 hooks, the device guard, and init() (see module.cpp for the
// whole extension):
//
// - generators: `torch.Generator(device="neuron")` and the device's default generator.
//   A neuron generator draws through a CPU generator of its own (its twin), which is
//   what the CPU kernels running the device's ops take; reading or changing its state
//   first waits for the kernels queued with it.
// - the hooks PyTorch asks the PrivateUse1 backend (device count, current device,
//   generators, pinned memory, storage resizing).
// - the device guard: `neuron:0` .. `neuron:<count-1>` (the count is the simulated
//   NeuronCores, device/memory/indices.py), the current device per thread (as CUDA's), and the
//   DeviceGuardImplInterface c10 calls to switch devices. Every index shares the
//   process's one execution queue, so the guard's streams and events are the default
//   stream and no-ops, as PyTorch's Python device guard made them.

#include "neuron.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/Generator.h>
#include <torch/csrc/utils/pybind.h>

namespace neuron {

// -- generators ---------------------------------------------------------------------------
namespace {

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
    return at::Device(kDevice, index_of_address(data));
  }
  bool isPinnedPtr(const void* data) const override {
    return is_pinned(data);
  }
  at::Allocator* getPinnedMemoryAllocator() const override {
    return pinned_allocator();
  }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    resize_storage_bytes(storage, newsize);
  }
};

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

}  // namespace

// init(default_twin, synchronize, resize, count, initial): register the allocators, hooks,
// device guard and C++ view kernels (once), for `count` devices with `initial` current on every thread
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
  c10::SetAllocator(kDevice, device_allocator());
  static NeuronGuardImpl guard;
  c10::impl::registerDeviceGuard(kDevice, &guard);
  hooks = new NeuronHooks();
  at::RegisterPrivateUse1HooksInterface(hooks);
  register_views();
  register_sparse();
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

}  // namespace neuron
