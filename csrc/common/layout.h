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

#if defined(__CUDACC__) || defined(__HIPCC__)
#define TM_LAYOUT_FN __host__ __device__ __forceinline__
#else
#define TM_LAYOUT_FN inline
#endif

namespace twinkle_mem {

// Element offset of a row: (row / inner) * outer_stride + (row % inner) * inner_stride.
// A 2-D tensor [N, ...] is the case outer_stride = 0, inner = N.
struct RowIndex {
  int64_t inner;
  int64_t outer_stride;
  int64_t inner_stride;
  TM_LAYOUT_FN int64_t operator()(int64_t row) const {
    if (outer_stride == 0) return row * inner_stride;
    const int64_t outer = row / inner;
    return outer * outer_stride + (row - outer * inner) * inner_stride;
  }
};

// Labels: row offset plus j * k_stride for the j-th of k labels.
struct LabelIndex {
  RowIndex row;
  int64_t k;
  int64_t k_stride;
  TM_LAYOUT_FN int64_t operator()(int64_t r, int64_t j) const { return row(r) + j * k_stride; }
};

// Labels of any strides: [L] (k = 1) or [L, k]; label j of a row, widened to int64.
template <typename label_t>
struct Labels {
  const label_t* ptr;
  LabelIndex index;
  TM_LAYOUT_FN int64_t operator()(int64_t row, int64_t j) const { return static_cast<int64_t>(ptr[index(row, j)]); }
  TM_LAYOUT_FN int64_t k() const { return index.k; }
};

TM_LAYOUT_FN int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ------------------------------------------------------------------ host only
// The leading dims of a [N, ...] or [B, S, ...] tensor (lead_dims 1 or 2, its
// sizes and strides in elements) as a RowIndex.
inline RowIndex row_index(int64_t lead_dims, const int64_t* sizes, const int64_t* strides) {
  if (lead_dims == 1) return {std::max<int64_t>(sizes[0], 1), 0, strides[0]};
  return {std::max<int64_t>(sizes[1], 1), strides[0], strides[1]};
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
// (ops.py) applies the same rule.
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

}  // namespace twinkle_mem
