// Where rows live: the indexing that every backend shares.
//
// The op takes logits [N, V] or [B, S, V] with unit stride on the vocab and any
// strides on the one or two leading dims (logits[:, :-1] of a batch is a view,
// not a copy), and labels of the same leading shape, optionally with a trailing
// dim of k labels per row, again with any strides. Rows are numbered
// row = b * S + s; every per-row output is contiguous in that order.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "row_index.h"  // also TM_INDEX_FN, the qualifiers of the functions below

namespace twinkle_mem {

// Rows of the CPU and CUDA kernels: int64 element offsets (row_index.h).
using RowIndex = RowIndexOf<int64_t>;

// Labels: row offset plus j * k_stride for the j-th of k labels.
struct LabelIndex {
  RowIndex row;
  int64_t k;
  int64_t k_stride;
  TM_INDEX_FN int64_t operator()(int64_t r, int64_t j) const { return row(r) + j * k_stride; }
};

// Labels of any strides: [L] (k = 1) or [L, k]; label j of a row, widened to int64.
template <typename label_t>
struct Labels {
  const label_t* ptr;
  LabelIndex index;
  TM_INDEX_FN int64_t operator()(int64_t row, int64_t j) const { return static_cast<int64_t>(ptr[index(row, j)]); }
  TM_INDEX_FN int64_t k() const { return index.k; }
};

// ------------------------------------------------------------------ host only
// The leading dims of a [N, ...] or [B, S, ...] tensor (lead_dims 1 or 2, its
// sizes and strides in elements) as a RowIndex (the NPU glue asks for its i64 one).
template <typename index_t = int64_t>
RowIndexOf<index_t> row_index(int64_t lead_dims, const int64_t* sizes, const int64_t* strides) {
  if (lead_dims == 1) return {static_cast<index_t>(std::max<int64_t>(sizes[0], 1)), 0, static_cast<index_t>(strides[0])};
  return {static_cast<index_t>(std::max<int64_t>(sizes[1], 1)), static_cast<index_t>(strides[0]),
          static_cast<index_t>(strides[1])};
}

// Labels [leading dims] (k = 1) or [leading dims, k] (dim labels_dim) as a LabelIndex.
inline LabelIndex label_index(int64_t lead_dims, int64_t labels_dim, const int64_t* sizes, const int64_t* strides) {
  const bool has_k = labels_dim > lead_dims;
  return {row_index(lead_dims, sizes, strides), has_k ? sizes[lead_dims] : 1, has_k ? strides[lead_dims] : 0};
}

// The out-of-place gradient's layout. It takes the logits' strides when they
// nest (each leading stride a whole multiple of the next, the innermost >= V)
// and the storage that costs is at most 1/8 more than the gradient's elements:
// a padded vocab (x[:, :V] of [N, Vp]) or a sliced sequence (x[:, :-1] of
// [B, S, V]) then keeps each row's alignment, so a kernel's vector loads and
// stores line up. Otherwise the gradient is contiguous. The Python fake kernel
// (op/ops.py) applies the same rule.
//
// Writes the sizes to allocate (then narrowed to `sizes`) into alloc and
// returns true, or returns false for "contiguous".
inline bool strided_grad_alloc(int ndim, const int64_t* sizes, const int64_t* strides, int64_t* alloc) {
  if (ndim < 2 || ndim > 3) return false;
  int64_t numel = 1;
  for (int d = 0; d < ndim; ++d) {
    if (sizes[d] < 1) return false;
    numel *= sizes[d];
  }
  const int64_t vocab = sizes[ndim - 1];
  if (vocab > 1 && strides[ndim - 1] != 1) return false;
  if (strides[ndim - 2] < vocab) return false;
  alloc[ndim - 1] = strides[ndim - 2];
  for (int d = ndim - 2; d >= 1; --d) {
    if (strides[d] <= 0 || strides[d - 1] % strides[d] != 0) return false;
    alloc[d] = strides[d - 1] / strides[d];
    if (alloc[d] < sizes[d]) return false;
  }
  alloc[0] = sizes[0];
  int64_t span = 1;
  for (int d = 0; d < ndim; ++d) span *= alloc[d];
  return span > numel && span - numel <= numel / 8;
}

// The out-of-place gradient by that rule, for any tensor API: new_empty(like,
// sizes) allocates on the logits' device in their dtype, narrow(t, dim, len)
// keeps the first len entries of a dim. The stable-ABI backends (CPU, CUDA)
// pass torch::stable's (forward_outputs.h), the torch_npu glue ATen's.
template <typename TensorT, typename NewEmpty, typename Narrow>
TensorT new_grad_like(const TensorT& logits, NewEmpty&& new_empty, Narrow&& narrow) {
  const int ndim = static_cast<int>(logits.dim());  // 2 or 3: the argument checks ran
  int64_t sizes[3], strides[3], alloc[3];
  for (int d = 0; d < ndim; ++d) {
    sizes[d] = logits.size(d);
    strides[d] = logits.stride(d);
  }
  if (!strided_grad_alloc(ndim, sizes, strides, alloc)) return new_empty(logits, std::vector<int64_t>(sizes, sizes + ndim));
  TensorT grad = new_empty(logits, std::vector<int64_t>(alloc, alloc + ndim));
  for (int d = 0; d < ndim; ++d) {
    if (alloc[d] != sizes[d]) grad = narrow(grad, d, sizes[d]);
  }
  return grad;
}

}  // namespace twinkle_mem
