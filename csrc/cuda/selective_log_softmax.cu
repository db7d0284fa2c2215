// CUDA kernels of the selective log-softmax op (forward, backward, in-place
// backward), registered for the CUDA dispatch key of the schemas in csrc/ops.cpp.
// The math (online state, merge, finalize, gradient) comes from
// csrc/common/online_softmax.h, the argument checks from csrc/common/op_checks.h.
//
// Work decomposition (forward and backward alike):
//   task    = one vocab segment of one row; a block runs one task at a time
//             (grid-stride over tasks, so any N fits in the grid).
//   split   = segments per row, fixed by (N, V) alone (split_rows below): rows
//             are cut only when there are too few rows to fill the GPU. The
//             forward then writes one partial state per task and a second
//             kernel merges a row's states in segment order, so results are
//             bitwise reproducible and independent of the GPU model.
//   thread  = streams its share of the segment in chunks of kUnroll 16-byte
//             vectors (coalesced: vector u of a chunk is read by consecutive
//             threads). Nothing of the row is cached in registers beyond the
//             chunk in flight, which keeps 150k+ vocab rows spill-free.
//   edges   = a segment whose start is not 16-byte aligned is realigned: up to
//             one vector's worth of head and tail elements is handled with
//             scalar loads, the body with vector loads. This serves any row
//             stride and storage offset (unit stride on the vocab dim).
//
// Reductions: per-thread state -> warp (shuffle-down, lane 0 holds the result)
// -> block (lane 0 of each warp through shared memory, merged by warp 0), all
// with merge() from the shared header, in a fixed order.
//
// Out-of-range labels (not ignore_index, not in [0, vocab_size)): the kernels
// never index with them (local_target() maps them to "no target"). The forward
// records the first such row in a device word; the host reads it back after
// the launch (one stream synchronization per forward call) and raises a
// RuntimeError naming the row and the label. While the stream is being
// captured into a CUDA graph no synchronization is allowed: the check is then
// skipped and such rows get logp = NaN. The backward does not re-check labels:
// it treats them as "not on this shard" (no read or write outside the row).
#include "../common/online_softmax.h"

// TWINKLE_MEM_CUDA_EMULATION: csrc/cuda/emulation/ compiles this file's kernels
// as host C++ over a stand-in for the CUDA runtime, to test their indexing on a
// machine without a GPU; the torch-facing host code is left out there.
#ifndef TWINKLE_MEM_CUDA_EMULATION
#include "../common/forward_outputs.h"
#include "../common/op_checks.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/macros.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>

namespace twinkle_mem {
namespace cuda {

constexpr int kMaxThreads = 256;  // threads per block (a multiple of 32)
constexpr int kUnroll = 4;        // 16-byte vectors in flight per thread per chunk

// ------------------------------------------------------------ element types
template <typename scalar_t>
struct Elem {
  using acc_t = float;
  static constexpr int kVec = 16 / sizeof(scalar_t);  // elements per 16-byte vector
};
template <>
struct Elem<double> {
  using acc_t = double;
  static constexpr int kVec = 2;
};
template <typename scalar_t>
using acc_of = typename Elem<scalar_t>::acc_t;

__device__ __forceinline__ float to_acc(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_acc(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ double to_acc(double v) { return v; }

template <typename scalar_t>
__device__ __forceinline__ scalar_t from_acc(acc_of<scalar_t> v);
template <>
__device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_acc<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ float from_acc<float>(float v) { return v; }
template <>
__device__ __forceinline__ double from_acc<double>(double v) { return v; }

// 16 bytes of scalar_t <-> kVec accumulator values.
template <typename scalar_t>
__device__ __forceinline__ void unpack(const uint4& raw, acc_of<scalar_t> (&v)[Elem<scalar_t>::kVec]) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
  if constexpr (std::is_same_v<scalar_t, __nv_bfloat16>) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // a bf16 is the high half of an fp32
      v[2 * i] = __uint_as_float(w[i] << 16);
      v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  } else if constexpr (std::is_same_v<scalar_t, __half>) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[2 * i] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[i] & 0xffffu)));
      v[2 * i + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[i] >> 16)));
    }
  } else if constexpr (std::is_same_v<scalar_t, float>) {
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = __uint_as_float(w[i]);
  } else {
    v[0] = __hiloint2double(static_cast<int>(w[1]), static_cast<int>(w[0]));
    v[1] = __hiloint2double(static_cast<int>(w[3]), static_cast<int>(w[2]));
  }
}

template <typename scalar_t>
__device__ __forceinline__ uint4 pack(const acc_of<scalar_t> (&v)[Elem<scalar_t>::kVec]) {
  uint32_t w[4];
  if constexpr (std::is_same_v<scalar_t, __nv_bfloat16>) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const __nv_bfloat162 h = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);  // .x is the low half
      w[i] = static_cast<uint32_t>(__bfloat16_as_ushort(h.x)) |
             (static_cast<uint32_t>(__bfloat16_as_ushort(h.y)) << 16);
    }
  } else if constexpr (std::is_same_v<scalar_t, __half>) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const __half2 h = __floats2half2_rn(v[2 * i], v[2 * i + 1]);
      w[i] = static_cast<uint32_t>(__half_as_ushort(h.x)) | (static_cast<uint32_t>(__half_as_ushort(h.y)) << 16);
    }
  } else if constexpr (std::is_same_v<scalar_t, float>) {
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = __float_as_uint(v[i]);
  } else {
    w[0] = static_cast<uint32_t>(__double2loint(v[0]));
    w[1] = static_cast<uint32_t>(__double2hiint(v[0]));
    w[2] = static_cast<uint32_t>(__double2loint(v[1]));
    w[3] = static_cast<uint32_t>(__double2hiint(v[1]));
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// A vector of -inf: what the forward reads in place of a vector past the end.
template <typename scalar_t>
__device__ __forceinline__ uint4 neg_inf_vector() {
  if constexpr (std::is_same_v<scalar_t, __nv_bfloat16>) {
    return make_uint4(0xff80ff80u, 0xff80ff80u, 0xff80ff80u, 0xff80ff80u);
  } else if constexpr (std::is_same_v<scalar_t, __half>) {
    return make_uint4(0xfc00fc00u, 0xfc00fc00u, 0xfc00fc00u, 0xfc00fc00u);
  } else if constexpr (std::is_same_v<scalar_t, float>) {
    return make_uint4(0xff800000u, 0xff800000u, 0xff800000u, 0xff800000u);
  } else {
    return make_uint4(0u, 0xfff00000u, 0u, 0xfff00000u);
  }
}

// Elements before the first 16-byte boundary at or after p (p is element-aligned).
template <typename scalar_t>
__device__ __forceinline__ int64_t head_elems(const scalar_t* p) {
  return static_cast<int64_t>((16u - (reinterpret_cast<uintptr_t>(p) & 15u)) & 15u) / sizeof(scalar_t);
}

// ------------------------------------------------------------------ forward
template <typename scalar_t, typename label_t>
struct ForwardArgs {
  using acc_t = acc_of<scalar_t>;
  const scalar_t* logits;
  int64_t row_stride;
  int64_t rows;
  int64_t vocab;  // V, this shard's width
  int64_t segments;
  int64_t segment_len;
  const label_t* labels;
  int64_t label_stride;
  acc_t inv_T;
  int64_t ignore_index;
  int64_t vocab_start;
  int64_t vocab_size;
  acc_t* logp;
  acc_t* lse;
  acc_t* entropy;  // null unless with_entropy
  acc_t* mean;     // null unless with_entropy
  OnlineSoftmax<acc_t>* partial;  // [rows * segments], used when segments > 1
  unsigned long long* bad_row;    // 0, or rows - (first row with an out-of-range label)
};

// Adds z = x[k] * inv_T for k < K (raw logits of one thread's chunk) to
// (sum, zsum), the chunk's state against shift = -neg_shift (t = z - shift, one FMA).
template <bool kEntropy, typename acc_t, int K>
__device__ __forceinline__ void accumulate(const acc_t (&x)[K], acc_t inv_T, acc_t neg_shift, acc_t& sum,
                                           acc_t& zsum) {
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const acc_t t = shifted(x[k], inv_T, neg_shift);
    const acc_t e = exp_(t);
    sum += e;
    if constexpr (kEntropy) zsum = add_entropy_term<acc_t, acc_t>(zsum, t, e);
  }
}

// Max of the logits in a chunk of raw vectors, with the hardware max (bf16x2 /
// half2 / fp32 / fp64 max instructions: half an instruction per 16-bit
// element). It ignores NaN; a NaN logit still reaches the row's state through
// its exp, so the row's results are NaN either way.
template <typename scalar_t, int U>
__device__ __forceinline__ acc_of<scalar_t> chunk_max(const uint4 (&raw)[U]) {
  if constexpr (std::is_same_v<scalar_t, __nv_bfloat16> || std::is_same_v<scalar_t, __half>) {
    using pair_t = std::conditional_t<std::is_same_v<scalar_t, __half>, __half2, __nv_bfloat162>;
    auto as_pair = [](uint32_t w) {
      pair_t p;
      memcpy(&p, &w, sizeof(p));
      return p;
    };
    pair_t m = as_pair(raw[0].x);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (u > 0) m = __hmax2(m, as_pair(raw[u].x));
      m = __hmax2(m, as_pair(raw[u].y));
      m = __hmax2(m, as_pair(raw[u].z));
      m = __hmax2(m, as_pair(raw[u].w));
    }
    return fmaxf(to_acc(m.x), to_acc(m.y));
  } else {
    using acc_t = acc_of<scalar_t>;
    constexpr int W = Elem<scalar_t>::kVec;
    acc_t x[W];
    acc_t m = -std::numeric_limits<acc_t>::infinity();
#pragma unroll
    for (int u = 0; u < U; ++u) {
      unpack<scalar_t>(raw[u], x);
#pragma unroll
      for (int k = 0; k < W; ++k) m = fmax(m, x[k]);
    }
    return m;
  }
}

// The state of one chunk of raw vectors, merged into `state`. The shift is
// taken from max(x) (x * inv_T is monotonic in x for inv_T > 0, so
// max(x) * inv_T == max(x * inv_T) exactly); values are converted to acc_t
// as they are used rather than held as U * kVec fp32 registers.
template <typename scalar_t, bool kEntropy, int U>
__device__ __forceinline__ void merge_chunk(OnlineSoftmax<acc_of<scalar_t>>& state, const uint4 (&raw)[U],
                                            acc_of<scalar_t> inv_T) {
  using acc_t = acc_of<scalar_t>;
  constexpr int W = Elem<scalar_t>::kVec;
  const acc_t shift = finite_shift(chunk_max<scalar_t>(raw) * inv_T);
  acc_t x[W];
  acc_t sum = 0, zsum = 0;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    unpack<scalar_t>(raw[u], x);
    accumulate<kEntropy>(x, inv_T, -shift, sum, zsum);
  }
  state = merge(state, OnlineSoftmax<acc_t>{shift, sum, zsum});
}

// This thread's share of the online state of z = x[0, n) * inv_T.
template <typename scalar_t, bool kEntropy>
__device__ __forceinline__ OnlineSoftmax<acc_of<scalar_t>> thread_state(const scalar_t* __restrict__ x, int64_t n,
                                                                         acc_of<scalar_t> inv_T) {
  using acc_t = acc_of<scalar_t>;
  constexpr int W = Elem<scalar_t>::kVec;
  constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();
  const int tid = threadIdx.x, threads = blockDim.x;
  const int64_t head = min(n, head_elems(x));
  const int64_t nvec = (n - head) / W;
  const int64_t tail = head + nvec * W;  // first element of the scalar tail

  OnlineSoftmax<acc_t> state = empty_state<acc_t>();
  {  // scalar edges: thread t takes head element t and tail element tail + t (each fewer than W)
    acc_t ends[2] = {kNegInf, kNegInf};
    if (tid < head) ends[0] = to_acc(x[tid]);
    if (tail + tid < n) ends[1] = to_acc(x[tail + tid]);
    const acc_t shift = finite_shift(max_(ends[0], ends[1]) * inv_T);
    acc_t sum = 0, zsum = 0;
    accumulate<kEntropy>(ends, inv_T, -shift, sum, zsum);
    state = merge(state, OnlineSoftmax<acc_t>{shift, sum, zsum});
  }

  const uint4* __restrict__ xv = reinterpret_cast<const uint4*>(x + head);
  const int64_t step = static_cast<int64_t>(kUnroll) * threads;
  int64_t base = tid;
  for (; base + step - tid <= nvec; base += step) {  // full chunks: no bounds checks
    uint4 raw[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) raw[u] = __ldcs(xv + base + u * threads);
    merge_chunk<scalar_t, kEntropy>(state, raw, inv_T);
  }
  if (base - tid < nvec) {  // the last, partial chunk: vectors past the end read as -inf
    uint4 raw[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * threads;
      raw[u] = i < nvec ? __ldcs(xv + i) : neg_inf_vector<scalar_t>();
    }
    merge_chunk<scalar_t, kEntropy>(state, raw, inv_T);
  }
  return state;
}

template <typename acc_t>
__device__ __forceinline__ OnlineSoftmax<acc_t> warp_merge(OnlineSoftmax<acc_t> s) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const OnlineSoftmax<acc_t> other{__shfl_down_sync(0xffffffffu, s.max, offset),
                                     __shfl_down_sync(0xffffffffu, s.sum, offset),
                                     __shfl_down_sync(0xffffffffu, s.zsum, offset)};
    s = merge(s, other);  // lane i merges lane i + offset: lane 0 ends with lanes 0..31 in a fixed tree
  }
  return s;
}

// The block's state, valid in thread 0. `smem` holds kMaxThreads / 32 states.
template <typename acc_t>
__device__ __forceinline__ OnlineSoftmax<acc_t> block_merge(OnlineSoftmax<acc_t> s, OnlineSoftmax<acc_t>* smem) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  s = warp_merge(s);
  if (lane == 0) smem[warp] = s;
  __syncthreads();
  if (warp == 0) {
    s = lane < static_cast<int>(blockDim.x / 32) ? smem[lane] : empty_state<acc_t>();
    s = warp_merge(s);
  }
  __syncthreads();  // smem is reused by the block's next task
  return s;
}

template <typename scalar_t, typename label_t>
__device__ __forceinline__ void write_ignored_row(const ForwardArgs<scalar_t, label_t>& a, int64_t row) {
  a.logp[row] = 0;
  a.lse[row] = 0;
  if (a.entropy != nullptr) {
    a.entropy[row] = 0;
    a.mean[row] = 0;
  }
}

// Outputs of a row that is not ignored, from its complete state.
template <typename scalar_t, typename label_t>
__device__ __forceinline__ void finish_row(const ForwardArgs<scalar_t, label_t>& a, int64_t row, int64_t label,
                                           const OnlineSoftmax<acc_of<scalar_t>>& state) {
  using acc_t = acc_of<scalar_t>;
  const RowStats<acc_t> stats = finalize(state);
  acc_t logp = 0;  // 0 when the label lies on another vocab shard
  if (label < 0 || label >= a.vocab_size) {
    atomicMax(a.bad_row, static_cast<unsigned long long>(a.rows - row));  // the first bad row wins
    logp = std::numeric_limits<acc_t>::quiet_NaN();
  } else {
    const int64_t target = local_target(label, a.vocab_start, a.vocab);
    if (target >= 0) logp = to_acc(a.logits[row * a.row_stride + target]) * a.inv_T - stats.lse;
  }
  a.logp[row] = logp;
  a.lse[row] = stats.lse;
  if (a.entropy != nullptr) {
    a.entropy[row] = stats.entropy;
    a.mean[row] = stats.mean;
  }
}

template <typename scalar_t, typename label_t, bool kEntropy>
__global__ void __launch_bounds__(kMaxThreads) forward_kernel(const ForwardArgs<scalar_t, label_t> a) {
  using acc_t = acc_of<scalar_t>;
  __shared__ OnlineSoftmax<acc_t> smem[kMaxThreads / 32];
  const int64_t tasks = a.rows * a.segments;
  for (int64_t task = blockIdx.x; task < tasks; task += gridDim.x) {
    const int64_t row = task / a.segments, seg = task - row * a.segments;
    const int64_t label = static_cast<int64_t>(a.labels[row * a.label_stride]);
    if (is_ignored(label, a.ignore_index)) {  // uniform across the block: skip the row's bytes
      if (a.segments == 1 && threadIdx.x == 0) write_ignored_row(a, row);
      continue;
    }
    const int64_t start = seg * a.segment_len;
    const int64_t len = min(a.segment_len, a.vocab - start);
    OnlineSoftmax<acc_t> state =
        thread_state<scalar_t, kEntropy>(a.logits + row * a.row_stride + start, len, a.inv_T);
    state = block_merge(state, smem);
    if (threadIdx.x == 0) {
      if (a.segments == 1) {
        finish_row(a, row, label, state);
      } else {
        a.partial[task] = state;
      }
    }
  }
}

// Split rows: merge each row's segment states in segment order, then finish it.
template <typename scalar_t, typename label_t>
__global__ void __launch_bounds__(kMaxThreads) merge_segments_kernel(const ForwardArgs<scalar_t, label_t> a) {
  using acc_t = acc_of<scalar_t>;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= a.rows) return;
  const int64_t label = static_cast<int64_t>(a.labels[row * a.label_stride]);
  if (is_ignored(label, a.ignore_index)) {
    write_ignored_row(a, row);
    return;
  }
  const OnlineSoftmax<acc_t>* partial = a.partial + row * a.segments;
  OnlineSoftmax<acc_t> state = partial[0];
  for (int64_t seg = 1; seg < a.segments; ++seg) state = merge(state, partial[seg]);
  finish_row(a, row, label, state);
}

// ----------------------------------------------------------------- backward
template <typename scalar_t, typename label_t>
struct BackwardArgs {
  using acc_t = acc_of<scalar_t>;
  const scalar_t* logits;
  int64_t row_stride;
  scalar_t* grad;  // may equal logits (in-place backward)
  int64_t grad_row_stride;
  int64_t rows;
  int64_t vocab;
  int64_t segments;
  int64_t segment_len;
  const label_t* labels;
  int64_t label_stride;
  const acc_t* grad_logp;
  int64_t grad_logp_stride;
  const acc_t* grad_entropy;  // null: no entropy term
  int64_t grad_entropy_stride;
  const acc_t* lse;
  int64_t lse_stride;
  const acc_t* mean;  // null when grad_entropy is null
  int64_t mean_stride;
  acc_t inv_T;
  int64_t ignore_index;
  int64_t vocab_start;
};

template <typename acc_t>
struct RowGrad {
  acc_t lse, mean, g_logp, g_entropy, inv_T;
  __device__ __forceinline__ acc_t operator()(acc_t x, bool is_target) const {
    return grad_logit<acc_t, acc_t>(x * inv_T, is_target ? acc_t(1) : acc_t(0), lse, mean, g_logp, g_entropy,
                                    inv_T);
  }
};

// Zeros d[0, n) (an ignored row: its logits are not read).
template <typename scalar_t>
__device__ __forceinline__ void zero_segment(scalar_t* d, int64_t n) {
  constexpr int W = Elem<scalar_t>::kVec;
  const int tid = threadIdx.x, threads = blockDim.x;
  const int64_t head = min(n, head_elems(d));
  const int64_t nvec = (n - head) / W;
  const int64_t tail = head + nvec * W;
  const scalar_t zero = from_acc<scalar_t>(acc_of<scalar_t>(0));
  if (tid < head) d[tid] = zero;
  if (tail + tid < n) d[tail + tid] = zero;
  uint4* dv = reinterpret_cast<uint4*>(d + head);
  for (int64_t i = tid; i < nvec; i += threads) __stcs(dv + i, make_uint4(0u, 0u, 0u, 0u));
}

// d[0, n) = gradient for logits x[0, n); `target` is the label's column in this
// segment (any value outside [0, n) when the label is elsewhere). d may alias x:
// every element is read and written by the same thread, read first.
template <typename scalar_t>
__device__ __forceinline__ void grad_segment(const scalar_t* x, scalar_t* d, int64_t n, int64_t target,
                                             const RowGrad<acc_of<scalar_t>>& g) {
  using acc_t = acc_of<scalar_t>;
  constexpr int W = Elem<scalar_t>::kVec;
  const int tid = threadIdx.x, threads = blockDim.x;
  const int64_t head = head_elems(x);
  if (head != head_elems(d)) {
    // x and d are misaligned differently (out-of-place grad of a row whose
    // stride differs in alignment from the logits'): scalar loads and stores.
    for (int64_t i = tid; i < n; i += threads) d[i] = from_acc<scalar_t>(g(to_acc(x[i]), i == target));
    return;
  }
  const int64_t h = min(n, head);
  const int64_t nvec = (n - h) / W;
  const int64_t tail = h + nvec * W;
  if (tid < h) d[tid] = from_acc<scalar_t>(g(to_acc(x[tid]), tid == target));
  if (tail + tid < n) d[tail + tid] = from_acc<scalar_t>(g(to_acc(x[tail + tid]), tail + tid == target));

  const uint4* xv = reinterpret_cast<const uint4*>(x + h);
  uint4* dv = reinterpret_cast<uint4*>(d + h);
  // The target as a vector index and lane, so that each element compares ints.
  const int64_t target_body = target - h;
  const int64_t target_vec = target_body >= 0 ? target_body / W : -1;
  const int target_lane = target_body >= 0 ? static_cast<int>(target_body % W) : -1;
  const int64_t step = static_cast<int64_t>(kUnroll) * threads;
  for (int64_t base = tid; base - tid < nvec; base += step) {
    uint4 raw[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * threads;
      if (i < nvec) raw[u] = __ldcs(xv + i);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * threads;
      if (i < nvec) {
        acc_t v[W];
        unpack<scalar_t>(raw[u], v);
        const int lane = i == target_vec ? target_lane : -1;
#pragma unroll
        for (int k = 0; k < W; ++k) v[k] = g(v[k], k == lane);
        __stcs(dv + i, pack<scalar_t>(v));
      }
    }
  }
}

template <typename scalar_t, typename label_t>
__global__ void __launch_bounds__(kMaxThreads) backward_kernel(const BackwardArgs<scalar_t, label_t> a) {
  using acc_t = acc_of<scalar_t>;
  const int64_t tasks = a.rows * a.segments;
  for (int64_t task = blockIdx.x; task < tasks; task += gridDim.x) {
    const int64_t row = task / a.segments, seg = task - row * a.segments;
    const int64_t start = seg * a.segment_len;
    const int64_t len = min(a.segment_len, a.vocab - start);
    scalar_t* d = a.grad + row * a.grad_row_stride + start;
    const int64_t label = static_cast<int64_t>(a.labels[row * a.label_stride]);
    if (is_ignored(label, a.ignore_index)) {
      zero_segment(d, len);
      continue;
    }
    RowGrad<acc_t> g;
    g.lse = a.lse[row * a.lse_stride];
    g.g_logp = a.grad_logp[row * a.grad_logp_stride];
    g.g_entropy = a.grad_entropy != nullptr ? a.grad_entropy[row * a.grad_entropy_stride] : acc_t(0);
    g.mean = a.grad_entropy != nullptr ? a.mean[row * a.mean_stride] : acc_t(0);
    g.inv_T = a.inv_T;
    // -1 (any negative) when the label is on another shard or out of range.
    const int64_t target = local_target(label, a.vocab_start, a.vocab);
    grad_segment(a.logits + row * a.row_stride + start, d, len, target >= 0 ? target - start : -1, g);
  }
}

// ---------------------------------------------------------------- host code
inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// How rows are cut into vocab segments, and the block size. Depends on N and V
// only (never on the GPU), so a given shape always reduces in the same order.
struct RowSplit {
  int64_t segments;
  int64_t segment_len;
  int threads;
};
RowSplit split_rows(int64_t N, int64_t V, int vec) {
  constexpr int64_t kBlocksWanted = 1024;  // ~8 resident blocks on each of ~132 SMs
  constexpr int64_t kMinSegment = 8192;    // a segment must amortize its block reduction and merge
  constexpr int64_t kSegmentAlign = 64;    // segment starts stay 16-byte aligned for aligned rows
  int64_t segments = 1;
  if (N > 0 && N < kBlocksWanted) {
    segments = std::max<int64_t>(1, std::min(ceil_div(kBlocksWanted, N), V / kMinSegment));
  }
  int64_t segment_len = ceil_div(ceil_div(V, segments), kSegmentAlign) * kSegmentAlign;
  segment_len = std::max<int64_t>(segment_len, 1);
  segments = ceil_div(V, segment_len);
  // Enough threads for one vector each, in whole warps, at most kMaxThreads.
  const int64_t vectors = ceil_div(segment_len, vec);
  const int threads = static_cast<int>(std::min<int64_t>(kMaxThreads, std::max<int64_t>(32, ceil_div(vectors, 32) * 32)));
  return {segments, segment_len, threads};
}

inline unsigned grid_for(int64_t tasks) {
  return static_cast<unsigned>(std::min<int64_t>(tasks, std::numeric_limits<int32_t>::max()));
}

#ifndef TWINKLE_MEM_CUDA_EMULATION
using torch::headeronly::ScalarType;
using torch::stable::Tensor;

cudaStream_t current_stream(int32_t device_index) {
  void* stream = nullptr;
  STD_TORCH_CHECK(aoti_torch_get_current_cuda_stream(device_index, &stream) == AOTI_TORCH_SUCCESS,
                  "twinkle_mem: could not get the current CUDA stream of device ", device_index);
  return static_cast<cudaStream_t>(stream);
}

template <typename T>
struct Tag {
  using type = T;
};

template <typename F>
void dispatch_logits_dtype(ScalarType t, F&& f) {
  switch (t) {
    case ScalarType::BFloat16: return f(Tag<__nv_bfloat16>{});
    case ScalarType::Half: return f(Tag<__half>{});
    case ScalarType::Float: return f(Tag<float>{});
    case ScalarType::Double: return f(Tag<double>{});
    default: STD_TORCH_CHECK(false, "twinkle_mem: unsupported logits dtype");
  }
}

template <typename F>
void dispatch_labels_dtype(ScalarType t, F&& f) {
  if (t == ScalarType::Long) return f(Tag<int64_t>{});
  return f(Tag<int32_t>{});
}

// Raises if the forward recorded an out-of-range label: one stream sync.
void raise_on_bad_label(const Tensor& bad_row, const Tensor& labels, int64_t N, int64_t ignore_index,
                        int64_t vocab_size, cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  STD_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) return;  // no sync while capturing: such rows hold NaN
  unsigned long long flag = 0;
  STD_CUDA_CHECK(cudaMemcpyAsync(&flag, bad_row.data_ptr(), sizeof(flag), cudaMemcpyDeviceToHost, stream));
  STD_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (flag == 0) return;
  const int64_t row = N - static_cast<int64_t>(flag);
  int64_t label = 0;
  const char* src = static_cast<const char*>(labels.data_ptr()) + row * labels.stride(0) * labels.element_size();
  if (labels.scalar_type() == ScalarType::Long) {
    STD_CUDA_CHECK(cudaMemcpy(&label, src, sizeof(int64_t), cudaMemcpyDeviceToHost));
  } else {
    int32_t label32 = 0;
    STD_CUDA_CHECK(cudaMemcpy(&label32, src, sizeof(int32_t), cudaMemcpyDeviceToHost));
    label = label32;
  }
  fail_label_out_of_range(row, label, vocab_size, ignore_index);
}

std::tuple<Tensor, Tensor, Tensor, Tensor> selective_log_softmax_fwd(
    const Tensor& logits, const Tensor& labels, double inv_temperature, int64_t ignore_index,
    int64_t vocab_start, int64_t vocab_size, bool with_entropy, bool /*inplace_backward*/) {
  check_forward_args(logits, labels, inv_temperature, vocab_start, vocab_size);
  const int64_t N = logits.size(0), V = logits.size(1);
  const ScalarType out_dtype = stats_dtype(logits.scalar_type());
  auto outputs = new_forward_outputs(logits, with_entropy);
  Tensor &logp = std::get<0>(outputs), &entropy = std::get<1>(outputs), &lse = std::get<2>(outputs),
         &mean = std::get<3>(outputs);
  if (N == 0) return outputs;

  const int32_t device = logits.get_device_index();
  torch::stable::accelerator::DeviceGuard guard(device);
  const cudaStream_t stream = current_stream(device);
  Tensor bad_row = torch::stable::new_empty(logits, {1}, ScalarType::Long);
  STD_CUDA_CHECK(cudaMemsetAsync(bad_row.data_ptr(), 0, sizeof(int64_t), stream));

  dispatch_logits_dtype(logits.scalar_type(), [&](auto scalar_tag) {
    using scalar_t = typename decltype(scalar_tag)::type;
    using acc_t = acc_of<scalar_t>;
    const RowSplit split = split_rows(N, V, Elem<scalar_t>::kVec);
    std::optional<Tensor> partial;
    if (split.segments > 1) {
      partial = torch::stable::new_empty(logits, {N * split.segments * 3}, out_dtype);
    }
    dispatch_labels_dtype(labels.scalar_type(), [&](auto label_tag) {
      using label_t = typename decltype(label_tag)::type;
      ForwardArgs<scalar_t, label_t> a;
      a.logits = static_cast<const scalar_t*>(logits.data_ptr());
      a.row_stride = logits.stride(0);
      a.rows = N;
      a.vocab = V;
      a.segments = split.segments;
      a.segment_len = split.segment_len;
      a.labels = static_cast<const label_t*>(labels.data_ptr());
      a.label_stride = labels.stride(0);
      a.inv_T = static_cast<acc_t>(inv_temperature);
      a.ignore_index = ignore_index;
      a.vocab_start = vocab_start;
      a.vocab_size = vocab_size;
      a.logp = static_cast<acc_t*>(logp.data_ptr());
      a.lse = static_cast<acc_t*>(lse.data_ptr());
      a.entropy = with_entropy ? static_cast<acc_t*>(entropy.data_ptr()) : nullptr;
      a.mean = with_entropy ? static_cast<acc_t*>(mean.data_ptr()) : nullptr;
      a.partial = partial ? static_cast<OnlineSoftmax<acc_t>*>(partial->data_ptr()) : nullptr;
      a.bad_row = static_cast<unsigned long long*>(bad_row.data_ptr());
      const unsigned grid = grid_for(N * split.segments);
      if (with_entropy) {
        forward_kernel<scalar_t, label_t, true><<<grid, split.threads, 0, stream>>>(a);
      } else {
        forward_kernel<scalar_t, label_t, false><<<grid, split.threads, 0, stream>>>(a);
      }
      STD_CUDA_KERNEL_LAUNCH_CHECK();
      if (split.segments > 1) {
        merge_segments_kernel<scalar_t, label_t>
            <<<grid_for(ceil_div(N, kMaxThreads)), kMaxThreads, 0, stream>>>(a);
        STD_CUDA_KERNEL_LAUNCH_CHECK();
      }
    });
  });
  raise_on_bad_label(bad_row, labels, N, ignore_index, vocab_size, stream);
  return outputs;
}

void run_backward(const Tensor& grad_logp, const std::optional<Tensor>& grad_entropy, const Tensor& logits,
                  const Tensor& labels, const Tensor& lse, const std::optional<Tensor>& mean,
                  double inv_temperature, int64_t ignore_index, int64_t vocab_start, void* grad,
                  int64_t grad_row_stride) {
  const int64_t N = logits.size(0), V = logits.size(1);
  if (N == 0 || V == 0) return;
  const int32_t device = logits.get_device_index();
  torch::stable::accelerator::DeviceGuard guard(device);
  const cudaStream_t stream = current_stream(device);
  dispatch_logits_dtype(logits.scalar_type(), [&](auto scalar_tag) {
    using scalar_t = typename decltype(scalar_tag)::type;
    using acc_t = acc_of<scalar_t>;
    const RowSplit split = split_rows(N, V, Elem<scalar_t>::kVec);
    dispatch_labels_dtype(labels.scalar_type(), [&](auto label_tag) {
      using label_t = typename decltype(label_tag)::type;
      BackwardArgs<scalar_t, label_t> a;
      a.logits = static_cast<const scalar_t*>(logits.data_ptr());
      a.row_stride = logits.stride(0);
      a.grad = static_cast<scalar_t*>(grad);
      a.grad_row_stride = grad_row_stride;
      a.rows = N;
      a.vocab = V;
      a.segments = split.segments;
      a.segment_len = split.segment_len;
      a.labels = static_cast<const label_t*>(labels.data_ptr());
      a.label_stride = labels.stride(0);
      a.grad_logp = static_cast<const acc_t*>(grad_logp.data_ptr());
      a.grad_logp_stride = grad_logp.stride(0);
      a.grad_entropy = grad_entropy ? static_cast<const acc_t*>(grad_entropy->data_ptr()) : nullptr;
      a.grad_entropy_stride = grad_entropy ? grad_entropy->stride(0) : 0;
      a.lse = static_cast<const acc_t*>(lse.data_ptr());
      a.lse_stride = lse.stride(0);
      a.mean = grad_entropy ? static_cast<const acc_t*>(mean->data_ptr()) : nullptr;
      a.mean_stride = grad_entropy ? mean->stride(0) : 0;
      a.inv_T = static_cast<acc_t>(inv_temperature);
      a.ignore_index = ignore_index;
      a.vocab_start = vocab_start;
      backward_kernel<scalar_t, label_t><<<grid_for(N * split.segments), split.threads, 0, stream>>>(a);
      STD_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

Tensor selective_log_softmax_bwd(const Tensor& grad_logp, const std::optional<Tensor>& grad_entropy,
                                 const Tensor& logits, const Tensor& labels, const Tensor& lse,
                                 const std::optional<Tensor>& mean, double inv_temperature, int64_t ignore_index,
                                 int64_t vocab_start) {
  check_backward_args(grad_logp, grad_entropy, logits, labels, lse, mean, inv_temperature);
  const int64_t N = logits.size(0), V = logits.size(1);
  Tensor grad = torch::stable::new_empty(logits, {N, V});
  run_backward(grad_logp, grad_entropy, logits, labels, lse, mean, inv_temperature, ignore_index, vocab_start,
               grad.data_ptr(), V);
  return grad;
}

void selective_log_softmax_bwd_(const Tensor& grad_logp, const std::optional<Tensor>& grad_entropy,
                                Tensor& logits, const Tensor& labels, const Tensor& lse,
                                const std::optional<Tensor>& mean, double inv_temperature, int64_t ignore_index,
                                int64_t vocab_start) {
  check_backward_args(grad_logp, grad_entropy, logits, labels, lse, mean, inv_temperature);
  run_backward(grad_logp, grad_entropy, logits, labels, lse, mean, inv_temperature, ignore_index, vocab_start,
               logits.data_ptr(), logits.stride(0));
}

#endif  // TWINKLE_MEM_CUDA_EMULATION
}  // namespace cuda
}  // namespace twinkle_mem

#ifndef TWINKLE_MEM_CUDA_EMULATION
STABLE_TORCH_LIBRARY_IMPL(twinkle_mem, CUDA, m) {
  m.impl("selective_log_softmax_fwd", TORCH_BOX(&twinkle_mem::cuda::selective_log_softmax_fwd));
  m.impl("selective_log_softmax_bwd", TORCH_BOX(&twinkle_mem::cuda::selective_log_softmax_bwd));
  m.impl("selective_log_softmax_bwd_", TORCH_BOX(&twinkle_mem::cuda::selective_log_softmax_bwd_));
}
#endif  // TWINKLE_MEM_CUDA_EMULATION
