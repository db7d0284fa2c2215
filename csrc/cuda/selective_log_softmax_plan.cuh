// The host plan of the CUDA kernels (selective_log_softmax_kernels.cuh): from
// raw pointers, sizes, strides and the op's options (csrc/common/op_options.h)
// to the launches: how rows are cut into segments, the block size, the
// workspaces, the kernels' arguments. Shared by the stable-ABI glue
// (selective_log_softmax.cu), which launches on the current stream, and the
// CPU emulation of the kernels (standins/cuda/), which runs them on fibers:
// each passes its launcher, launch(kernel, grid, threads, args).
#pragma once

#include "../common/op_options.h"
#include "selective_log_softmax_kernels.cuh"

#include <algorithm>
#include <cstdint>

namespace twinkle_mem {
namespace cuda {

enum class Dtype { kBFloat16, kHalf, kFloat, kDouble };

// How rows are cut into segments, and the block size: from V and the element
// size only (never N, never the GPU), so a row always reduces in the same order.
struct RowSplit {
  int64_t segments;
  int64_t segment_len;
  int threads;
};
inline RowSplit split_rows(int64_t V, int64_t elem_bytes, int64_t segment_bytes = kSegmentBytes) {
  const int64_t W = 16 / elem_bytes;
  const int64_t segment_len = segment_bytes / elem_bytes;  // a multiple of W: segments keep the row's alignment
  const int64_t segments = std::max<int64_t>(1, ceil_div(V, segment_len));
  // Enough threads for one chunk each over the longest segment, in whole warps.
  const int64_t chunks = ceil_div(ceil_div(std::min(V, segment_len), W), kUnroll);
  const int threads = static_cast<int>(std::min<int64_t>(kMaxThreads, std::max<int64_t>(32, ceil_div(chunks, 32) * 32)));
  return {segments, segment_len, threads};
}

// A tensor as the plan sees it.
struct TensorRef {
  void* ptr;
  int dim;
  int64_t sizes[4];
  int64_t strides[4];
};

// The leading dims of a [N, ...] or [B, S, ...] tensor as a RowIndex (layout.h).
inline RowIndex row_index(const TensorRef& t, int lead_dims) { return twinkle_mem::row_index(lead_dims, t.sizes, t.strides); }

inline int64_t rows_of(const TensorRef& logits) {
  int64_t n = 1;
  for (int d = 0; d + 1 < logits.dim; ++d) n *= logits.sizes[d];
  return n;
}

// Launch limits: real launches pass the hardware's; the emulation a small grid,
// so that its blocks loop over several tasks (and other segment sizes).
struct Launch {
  int64_t max_grid;
  int64_t segment_bytes;
};

inline unsigned grid_for(int64_t blocks, int64_t max_grid) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(blocks, max_grid)));
}

template <typename F>
void dispatch_dtype(Dtype dtype, F&& f) {
  switch (dtype) {
    case Dtype::kBFloat16: return f(__nv_bfloat16{});
    case Dtype::kHalf: return f(__half{});
    case Dtype::kFloat: return f(float{});
    default: return f(double{});
  }
}

template <typename F>
void dispatch_labels(bool int64_labels, F&& f) {
  if (int64_labels) return f(int64_t{});
  return f(int32_t{});
}

// Bytes of the forward's workspace (one state per task): the caller allocates it.
inline int64_t forward_workspace_bytes(Dtype dtype, const TensorRef& logits, const Launch& how) {
  int64_t bytes = 0;
  dispatch_dtype(dtype, [&](auto scalar) {
    using scalar_t = decltype(scalar);
    const RowSplit split = split_rows(logits.sizes[logits.dim - 1], sizeof(scalar_t), how.segment_bytes);
    bytes = rows_of(logits) * split.segments * static_cast<int64_t>(sizeof(OnlineSoftmax<acc_of<scalar_t>>));
  });
  return bytes;
}

// The forward's outputs, contiguous: logp [rows * k], entropy [rows] (read only
// with_entropy), shift, log_sum [rows].
struct ForwardOutputs {
  void* logp;
  void* entropy;
  void* shift;
  void* log_sum;
};

// What the forward's and backward's arguments share: the logits' rows, their
// split into segments, the labels (ForwardArgs / BackwardArgs, same names).
template <typename Args>
void set_rows(Args& a, const TensorRef& logits, const TensorRef& labels, const RowSplit& split) {
  const int lead = logits.dim - 1;
  a.logits = static_cast<decltype(a.logits)>(logits.ptr);
  a.row_at = row_index(logits, lead);
  a.rows = rows_of(logits);
  a.vocab = logits.sizes[lead];
  a.segments = split.segments;
  a.segment_len = split.segment_len;
  a.labels = {static_cast<decltype(a.labels.ptr)>(labels.ptr),
              label_index(lead, labels.dim, labels.sizes, labels.strides)};
}

// Calls f(a, split, scalar_t{}, label_t{}) with the kernels' arguments a
// (Args = ForwardArgs or BackwardArgs) for the logits' dtype and the labels'
// integer type, their rows already set (set_rows), and the rows' split.
template <template <typename, typename> class Args, typename F>
void with_args(Dtype dtype, bool int64_labels, const TensorRef& logits, const TensorRef& labels, const Launch& how,
               F&& f) {
  dispatch_dtype(dtype, [&](auto scalar) {
    using scalar_t = decltype(scalar);
    const RowSplit split = split_rows(logits.sizes[logits.dim - 1], sizeof(scalar_t), how.segment_bytes);
    dispatch_labels(int64_labels, [&](auto label) {
      Args<scalar_t, decltype(label)> a;
      set_rows(a, logits, labels, split);
      f(a, split, scalar, label);
    });
  });
}

template <typename Launcher>
void run_forward(Dtype dtype, const TensorRef& logits, const TensorRef& labels, bool int64_labels, const OpOptions& o,
                 const ForwardOutputs& out, void* workspace, const Launch& how, Launcher&& launch) {
  const int64_t N = rows_of(logits);
  if (N == 0) return;
  with_args<ForwardArgs>(dtype, int64_labels, logits, labels, how, [&](auto& a, const RowSplit& split, auto scalar,
                                                                       auto label) {
    using scalar_t = decltype(scalar);
    using label_t = decltype(label);
    using acc_t = acc_of<scalar_t>;
    a.inv_T = static_cast<acc_t>(o.inv_temperature);
    a.scale = Base2::scale(a.inv_T);
    a.ignore_index = o.ignore_index;
    a.vocab_start = o.vocab_start;
    a.vocab_size = o.vocab_size;
    a.logp = static_cast<acc_t*>(out.logp);
    a.entropy = o.with_entropy ? static_cast<acc_t*>(out.entropy) : nullptr;
    a.shift = static_cast<acc_t*>(out.shift);
    a.log_sum = static_cast<acc_t*>(out.log_sum);
    a.partial = static_cast<OnlineSoftmax<acc_t>*>(workspace);
    const unsigned grid = grid_for(N * split.segments, how.max_grid);
    if (o.with_entropy) {
      launch(segment_state_kernel<scalar_t, label_t, true>, grid, split.threads, a);
    } else {
      launch(segment_state_kernel<scalar_t, label_t, false>, grid, split.threads, a);
    }
    launch(finish_rows_kernel<scalar_t, label_t>, grid_for(ceil_div(N, kRowThreads), how.max_grid), kRowThreads, a);
  });
}

// Bytes of the backward's workspace: the logits at the labels, in place only.
inline int64_t backward_workspace_bytes(Dtype dtype, const TensorRef& labels, bool inplace) {
  if (!inplace) return 0;
  int64_t n = 1;
  for (int d = 0; d < labels.dim; ++d) n *= labels.sizes[d];
  int64_t bytes = 0;
  dispatch_dtype(dtype, [&](auto scalar) { bytes = n * static_cast<int64_t>(sizeof(acc_of<decltype(scalar)>)); });
  return bytes;
}

// The backward's per-row inputs, contiguous: grad_logp [rows * k], grad_entropy
// and entropy [rows] (read only with_entropy), shift, log_sum [rows].
struct BackwardRows {
  const void* grad_logp;
  const void* grad_entropy;
  const void* entropy;
  const void* shift;
  const void* log_sum;
};

// grad may be logits.ptr (in place: then the workspace of backward_workspace_bytes).
template <typename Launcher>
void run_backward(Dtype dtype, const TensorRef& logits, const TensorRef& grad, const TensorRef& labels,
                  bool int64_labels, const BackwardRows& in, const OpOptions& o, void* workspace, const Launch& how,
                  Launcher&& launch) {
  const int lead = logits.dim - 1;
  const int64_t N = rows_of(logits), V = logits.sizes[lead];
  if (N == 0 || V == 0) return;
  with_args<BackwardArgs>(dtype, int64_labels, logits, labels, how, [&](auto& a, const RowSplit& split, auto scalar,
                                                                        auto label) {
    using scalar_t = decltype(scalar);
    using label_t = decltype(label);
    using acc_t = acc_of<scalar_t>;
    a.grad = static_cast<scalar_t*>(grad.ptr);
    a.grad_row_at = row_index(grad, lead);
    a.grad_logp = static_cast<const acc_t*>(in.grad_logp);
    a.grad_entropy = o.with_entropy ? static_cast<const acc_t*>(in.grad_entropy) : nullptr;
    a.entropy = o.with_entropy ? static_cast<const acc_t*>(in.entropy) : nullptr;
    a.shift = static_cast<const acc_t*>(in.shift);
    a.log_sum = static_cast<const acc_t*>(in.log_sum);
    a.inv_T = static_cast<acc_t>(o.inv_temperature);
    a.ignore_index = o.ignore_index;
    a.vocab_start = o.vocab_start;
    a.label_x = o.inplace_backward ? static_cast<acc_t*>(workspace) : nullptr;
    launch(backward_kernel<scalar_t, label_t>, grid_for(N * split.segments, how.max_grid), split.threads, a);
  });
}

}  // namespace cuda
}  // namespace twinkle_mem
