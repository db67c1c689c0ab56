// The sparse COO kernels the device runs in C++ (see module.cpp for the whole
// extension): a sparse neuron tensor is ATen's own SparseTensorImpl whose indices and
// values are dense neuron tensors. What only reads or re-points that structure
// (construction from indices and values, `_indices`, `_values`, `_nnz`, `sparse_dim`,
// `is_coalesced`, `_coalesced_`, resizing, `copy_` between sparse tensors, `empty`,
// `zero_`) is at::native's device-generic function, the very one SparseCPU and
// SparseCUDA register, at the SparsePrivateUse1 key: so `grad._values()` is the values
// tensor itself (Adagrad's `std._values().sqrt_()` updates it in place, as on the CPU),
// and no data moves. Every other sparse op reaches the device's boxed fallback at that
// key (device/ops/sparse.py: the CPU's sparse kernel on host copies, after a sync point).

#include "neuron.h"

#include <ATen/ops/_coalesced_native.h>
#include <ATen/ops/_indices_native.h>
#include <ATen/ops/_nnz_native.h>
#include <ATen/ops/_sparse_coo_tensor_with_dims_and_tensors_native.h>
#include <ATen/ops/_sparse_coo_tensor_with_dims_native.h>
#include <ATen/ops/_values_native.h>
#include <ATen/ops/copy_sparse_to_sparse_native.h>
#include <ATen/ops/dense_dim_native.h>
#include <ATen/ops/empty_like_native.h>
#include <ATen/ops/empty_native.h>
#include <ATen/ops/indices_native.h>
#include <ATen/ops/is_coalesced_native.h>
#include <ATen/ops/sparse_dim_native.h>
#include <ATen/ops/sparse_resize_and_clear_native.h>
#include <ATen/ops/sparse_resize_native.h>
#include <ATen/ops/values_native.h>
#include <ATen/ops/zero_native.h>
#include <torch/library.h>

#include <memory>

namespace neuron {

namespace {

std::unique_ptr<torch::Library> library;

}  // namespace

void register_sparse() {
  if (library != nullptr) {
    return;
  }
  library = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", c10::DispatchKey::SparsePrivateUse1,
                                             __FILE__, __LINE__);
  library->impl("_sparse_coo_tensor_with_dims", TORCH_FN(at::native::new_with_dims_sparse));
  library->impl("_sparse_coo_tensor_with_dims_and_tensors",
                TORCH_FN(at::native::new_with_dims_and_tensor_sparse_symint));
  library->impl("_indices", TORCH_FN(at::native::_indices_sparse));
  library->impl("_values", TORCH_FN(at::native::_values_sparse));
  library->impl("indices", TORCH_FN(at::native::indices_sparse));
  library->impl("values", TORCH_FN(at::native::values_sparse));
  library->impl("_nnz", TORCH_FN(at::native::_nnz_sparse));
  library->impl("sparse_dim", TORCH_FN(at::native::sparse_dim_sparse));
  library->impl("_dimI", TORCH_FN(at::native::sparse_dim_sparse));
  library->impl("dense_dim", TORCH_FN(at::native::dense_dim_sparse));
  library->impl("_dimV", TORCH_FN(at::native::dense_dim_sparse));
  library->impl("is_coalesced", TORCH_FN(at::native::is_coalesced_sparse));
  library->impl("_coalesced_", TORCH_FN(at::native::_coalesced_sparse_));
  library->impl("sparse_resize_", TORCH_FN(at::native::sparse_resize_));
  library->impl("sparse_resize_and_clear_", TORCH_FN(at::native::sparse_resize_and_clear_));
  library->impl("copy_sparse_to_sparse_", TORCH_FN(at::native::copy_sparse_));
  library->impl("empty.memory_format", TORCH_FN(at::native::empty_sparse));
  library->impl("empty_like", TORCH_FN(at::native::empty_like_sparse_coo));
  library->impl("zero_", TORCH_FN(at::native::zero_sparse_));
}

}  // namespace neuron
