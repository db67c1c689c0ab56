// The view kernels the device runs in C++: `view`, `as_strided`, `_reshape_alias` and
// `_unsafe_view` (matmul's reshape of its result, a view autograd does not track; see
// module.cpp for the whole extension). A view is metadata only: new sizes, strides and
// offset over the same storage, made by the very function the CPU kernel is
// (at::native's, device-agnostic, as OpenReg registers them). Registered at the
// PrivateUse1 key by init(), so these views never enter Python: `transpose`, `t`,
// `split`, `narrow`, `expand` and the rest reach `as_strided` in C++, and a linear layer
// calls `view` on its input, so in a decode loop these are two ops of every three that
// reach the device. Every other view still runs through device/ops/views.py. Each counts in
// `view_count()`, which the device's `view_ops` statistic adds (device/core/counters.py).

#include "neuron.h"

#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/_unsafe_view_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/view_native.h>
#include <torch/library.h>

#include <atomic>
#include <memory>

namespace neuron {

namespace {

std::atomic<int64_t> views_made{0};

void count() {
  views_made.fetch_add(1, std::memory_order_relaxed);
}

at::Tensor view(const at::Tensor& self, at::IntArrayRef size) {
  count();
  return at::native::view(self, size);
}

at::Tensor as_strided(const at::Tensor& self, at::IntArrayRef size, at::IntArrayRef stride,
                      std::optional<int64_t> storage_offset) {
  count();
  return at::native::as_strided_tensorimpl(self, size, stride, storage_offset);
}

at::Tensor reshape_alias(const at::Tensor& self, at::IntArrayRef size, at::IntArrayRef stride) {
  count();
  return at::native::_reshape_alias(self, size, stride);
}

at::Tensor unsafe_view(const at::Tensor& self, at::IntArrayRef size) {
  count();
  return at::native::_unsafe_view(self, size);
}

std::unique_ptr<torch::Library> library;

}  // namespace

void register_views() {
  if (library != nullptr) {
    return;
  }
  library = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__,
                                             __LINE__);
  library->impl("view", TORCH_FN(view));
  library->impl("as_strided", TORCH_FN(as_strided));
  library->impl("_reshape_alias", TORCH_FN(reshape_alias));
  library->impl("_unsafe_view", TORCH_FN(unsafe_view));
}

int64_t view_count() {
  return views_made.load(std::memory_order_relaxed);
}

}  // namespace neuron
