// CPU kernels of the selective log-softmax op (forward, backward, in-place
// backward). Rows go across threads with the stable parallel_for; when rows
// are too few, each row is cut into vocab segments whose online states are
// merged. The row loops (row_kernels.h) are compiled twice: here, portable,
// and in selective_log_softmax_avx2.cpp for AVX2+FMA+F16C, picked at run time.
#include "../common/online_softmax.h"
#include "../common/forward_outputs.h"
#include "../common/op_checks.h"
#include "isa.h"

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include <sys/mman.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

namespace twinkle_mem {
namespace cpu {

using bf16 = c10::BFloat16;
using fp16 = c10::Half;

// Portable row loops: Vec is a plain float (or double for fp64 logits).
namespace portable {
template <typename Vec>
struct VecTraits {
  using acc_t = Vec;
  static constexpr int64_t W = 1;
};
template <typename T>
inline float load_vec(const T* p) { return static_cast<float>(*p); }
inline double load_vec(const double* p) { return *p; }
template <typename T>
inline auto load_scalar(const T* p) { return load_vec(p); }
template <typename T, typename V>
inline void store_vec(T* p, V v) { *p = static_cast<T>(v); }
template <typename T, typename V>
inline void store_scalar(T* p, V v) { *p = static_cast<T>(v); }
template <typename T, typename V>
inline void store_pair(T* p, V a, V b) { p[0] = static_cast<T>(a); p[1] = static_cast<T>(b); }
template <typename V>
inline V hmax(V v) { return v; }
template <typename V>
inline V hsum(V v) { return v; }
#include "row_kernels.h"
}  // namespace portable

// ---------------------------------------------------------------- host code
using torch::headeronly::ScalarType;
using torch::stable::Tensor;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// How rows are cut into vocab segments. Depends on N and V only (never on the
// thread count), so results are bitwise identical for any number of threads.
struct RowSplit {
  int64_t segments;
  int64_t segment_len;
};
RowSplit split_rows(int64_t N, int64_t V) {
  constexpr int64_t kTasksWanted = 64;      // enough tasks for any thread count we expect
  constexpr int64_t kMinSegment = 16384;    // a segment must amortize its merge
  int64_t segments = 1;
  if (N > 0 && N < kTasksWanted) {
    segments = std::max<int64_t>(1, std::min(ceil_div(kTasksWanted, N), V / kMinSegment));
  }
  const int64_t segment_len = ceil_div(ceil_div(V, segments), portable::kBlock) * portable::kBlock;
  return {ceil_div(V, std::max<int64_t>(segment_len, 1)), std::max<int64_t>(segment_len, 1)};
}

// Reads a 1-D tensor of labels or per-row values whatever its dtype and stride.
template <typename T>
struct Strided {
  const T* ptr;
  int64_t stride;
  T operator[](int64_t i) const { return ptr[i * stride]; }
};
template <typename T>
Strided<T> strided(const Tensor& t) {
  return {reinterpret_cast<const T*>(t.data_ptr()), t.stride(0)};
}

template <typename F>
void with_labels(const Tensor& labels, F&& f) {
  if (labels.scalar_type() == ScalarType::Long) {
    f(strided<int64_t>(labels));
  } else {
    f(strided<int32_t>(labels));
  }
}

// Out-of-range labels are an error, raised before any kernel runs.
void check_label_range(const Tensor& labels, int64_t ignore_index, int64_t vocab_size) {
  with_labels(labels, [&](auto label) {
    for (int64_t i = 0; i < labels.size(0); ++i) {
      const int64_t y = label[i];
      if (!label_in_range(y, ignore_index, vocab_size)) fail_label_out_of_range(i, y, vocab_size, ignore_index);
    }
  });
}

// Large CPU outputs: ask for transparent huge pages before the first touch
// (first-touch page faults otherwise cost several times the kernel's time).
void advise_huge_pages(void* ptr, int64_t bytes) {
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  if (bytes < int64_t(8 * kHuge)) return;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(ptr) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(ptr) + bytes) & ~(kHuge - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);  // advisory
}

template <typename scalar_t, typename acc_t>
OnlineSoftmax<acc_t> run_segment_state(const scalar_t* x, int64_t n, acc_t inv_T, bool with_entropy) {
  if constexpr (std::is_same_v<acc_t, float>) {
    if (cpu_has_avx2()) {
      if constexpr (std::is_same_v<scalar_t, bf16>) {
        return avx2_segment_state_bf16(reinterpret_cast<const uint16_t*>(x), n, inv_T, with_entropy);
      } else if constexpr (std::is_same_v<scalar_t, fp16>) {
        return avx2_segment_state_fp16(reinterpret_cast<const uint16_t*>(x), n, inv_T, with_entropy);
      } else {
        return avx2_segment_state_fp32(x, n, inv_T, with_entropy);
      }
    }
  }
  return portable::segment_state<acc_t>(x, n, inv_T, with_entropy);
}

template <typename scalar_t, typename acc_t>
void run_segment_grad(const scalar_t* x, scalar_t* d, int64_t n, acc_t lse, acc_t mean, acc_t g_logp,
                      acc_t g_entropy, acc_t inv_T) {
  if constexpr (std::is_same_v<acc_t, float>) {
    if (cpu_has_avx2()) {
      if constexpr (std::is_same_v<scalar_t, bf16>) {
        return avx2_segment_grad_bf16(reinterpret_cast<const uint16_t*>(x), reinterpret_cast<uint16_t*>(d), n,
                                      lse, mean, g_logp, g_entropy, inv_T);
      } else if constexpr (std::is_same_v<scalar_t, fp16>) {
        return avx2_segment_grad_fp16(reinterpret_cast<const uint16_t*>(x), reinterpret_cast<uint16_t*>(d), n,
                                      lse, mean, g_logp, g_entropy, inv_T);
      } else {
        return avx2_segment_grad_fp32(x, d, n, lse, mean, g_logp, g_entropy, inv_T);
      }
    }
  }
  portable::segment_grad<acc_t>(x, d, n, lse, mean, g_logp, g_entropy, inv_T);
}

template <typename scalar_t, typename acc_t>
void forward_kernel(const Tensor& logits, const Tensor& labels, acc_t inv_T, int64_t ignore_index,
                    int64_t vocab_start, bool with_entropy, Tensor& logp, Tensor& entropy, Tensor& lse,
                    Tensor& mean) {
  const int64_t N = logits.size(0), V = logits.size(1), row_stride = logits.stride(0);
  const scalar_t* x = reinterpret_cast<const scalar_t*>(logits.data_ptr());
  acc_t* out_logp = reinterpret_cast<acc_t*>(logp.data_ptr());
  acc_t* out_lse = reinterpret_cast<acc_t*>(lse.data_ptr());
  acc_t* out_entropy = with_entropy ? reinterpret_cast<acc_t*>(entropy.data_ptr()) : nullptr;
  acc_t* out_mean = with_entropy ? reinterpret_cast<acc_t*>(mean.data_ptr()) : nullptr;
  const RowSplit split = split_rows(N, V);

  with_labels(labels, [&](auto label) {
    std::vector<OnlineSoftmax<acc_t>> states(N * split.segments);
    const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(split.segment_len, 1));
    torch::stable::parallel_for(0, N * split.segments, grain, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t row = task / split.segments, seg = task % split.segments;
        if (is_ignored(label[row], ignore_index)) continue;
        const int64_t start = seg * split.segment_len, len = std::min(split.segment_len, V - start);
        states[task] = run_segment_state<scalar_t, acc_t>(x + row * row_stride + start, len, inv_T,
                                                          with_entropy);
      }
    });
    for (int64_t row = 0; row < N; ++row) {
      const int64_t y = label[row];
      if (is_ignored(y, ignore_index)) {
        out_logp[row] = out_lse[row] = 0;
        if (with_entropy) out_entropy[row] = out_mean[row] = 0;
        continue;
      }
      OnlineSoftmax<acc_t> state = states[row * split.segments];
      for (int64_t seg = 1; seg < split.segments; ++seg) state = merge(state, states[row * split.segments + seg]);
      const RowStats<acc_t> stats = finalize(state);
      const int64_t target = local_target(y, vocab_start, V);
      out_lse[row] = stats.lse;
      out_logp[row] = target >= 0 ? static_cast<acc_t>(x[row * row_stride + target]) * inv_T - stats.lse : acc_t(0);
      if (with_entropy) {
        out_entropy[row] = stats.entropy;
        out_mean[row] = stats.mean;
      }
    }
  });
}

template <typename scalar_t, typename acc_t>
void backward_kernel(const Tensor& grad_logp, const std::optional<Tensor>& grad_entropy, const Tensor& logits,
                     const Tensor& labels, const Tensor& lse, const std::optional<Tensor>& mean, acc_t inv_T,
                     int64_t ignore_index, int64_t vocab_start, scalar_t* d, int64_t d_row_stride) {
  const int64_t N = logits.size(0), V = logits.size(1), row_stride = logits.stride(0);
  const scalar_t* x = reinterpret_cast<const scalar_t*>(logits.data_ptr());
  const Strided<acc_t> g_logp = strided<acc_t>(grad_logp), row_lse = strided<acc_t>(lse);
  const bool with_entropy = grad_entropy.has_value();
  const Strided<acc_t> g_entropy = with_entropy ? strided<acc_t>(*grad_entropy) : Strided<acc_t>{nullptr, 0};
  const Strided<acc_t> row_mean = with_entropy ? strided<acc_t>(*mean) : Strided<acc_t>{nullptr, 0};
  const RowSplit split = split_rows(N, V);

  with_labels(labels, [&](auto label) {
    const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(split.segment_len, 1));
    torch::stable::parallel_for(0, N * split.segments, grain, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t row = task / split.segments, seg = task % split.segments;
        const int64_t start = seg * split.segment_len, len = std::min(split.segment_len, V - start);
        scalar_t* d_seg = d + row * d_row_stride + start;
        const int64_t y = label[row];
        if (is_ignored(y, ignore_index)) {
          std::fill(d_seg, d_seg + len, static_cast<scalar_t>(0.0f));
          continue;
        }
        const acc_t gl = g_logp[row], ge = with_entropy ? g_entropy[row] : acc_t(0);
        const acc_t m = with_entropy ? row_mean[row] : acc_t(0), l = row_lse[row];
        const scalar_t* x_seg = x + row * row_stride + start;
        const int64_t target = local_target(y, vocab_start, V) - start;
        // Read the label's logit before the in-place pass overwrites it.
        const acc_t z_target = (target >= 0 && target < len) ? static_cast<acc_t>(x_seg[target]) * inv_T : acc_t(0);
        run_segment_grad<scalar_t, acc_t>(x_seg, d_seg, len, l, m, gl, ge, inv_T);
        if (target >= 0 && target < len) {
          d_seg[target] = static_cast<scalar_t>(grad_logit<acc_t, acc_t>(z_target, acc_t(1), l, m, gl, ge, inv_T));
        }
      }
    });
  });
}

template <typename F>
void dispatch_logits_dtype(ScalarType t, F&& f) {
  switch (t) {
    case ScalarType::BFloat16: return f(bf16{}, float{});
    case ScalarType::Half: return f(fp16{}, float{});
    case ScalarType::Float: return f(float{}, float{});
    case ScalarType::Double: return f(double{}, double{});
    default: STD_TORCH_CHECK(false, "twinkle_mem: unsupported logits dtype");
  }
}

std::tuple<Tensor, Tensor, Tensor, Tensor> selective_log_softmax_fwd(
    const Tensor& logits, const Tensor& labels, double inv_temperature, int64_t ignore_index,
    int64_t vocab_start, int64_t vocab_size, bool with_entropy, bool /*inplace_backward*/) {
  check_forward_args(logits, labels, inv_temperature, vocab_start, vocab_size);
  check_label_range(labels, ignore_index, vocab_size);
  auto outputs = new_forward_outputs(logits, with_entropy);
  Tensor &logp = std::get<0>(outputs), &entropy = std::get<1>(outputs), &lse = std::get<2>(outputs),
         &mean = std::get<3>(outputs);
  dispatch_logits_dtype(logits.scalar_type(), [&](auto scalar, auto acc) {
    using scalar_t = decltype(scalar);
    using acc_t = decltype(acc);
    forward_kernel<scalar_t, acc_t>(logits, labels, static_cast<acc_t>(inv_temperature), ignore_index,
                                    vocab_start, with_entropy, logp, entropy, lse, mean);
  });
  return outputs;
}

void run_backward(const Tensor& grad_logp, const std::optional<Tensor>& grad_entropy, const Tensor& logits,
                  const Tensor& labels, const Tensor& lse, const std::optional<Tensor>& mean,
                  double inv_temperature, int64_t ignore_index, int64_t vocab_start, void* d,
                  int64_t d_row_stride) {
  dispatch_logits_dtype(logits.scalar_type(), [&](auto scalar, auto acc) {
    using scalar_t = decltype(scalar);
    using acc_t = decltype(acc);
    backward_kernel<scalar_t, acc_t>(grad_logp, grad_entropy, logits, labels, lse, mean,
                                     static_cast<acc_t>(inv_temperature), ignore_index, vocab_start,
                                     reinterpret_cast<scalar_t*>(d), d_row_stride);
  });
}

Tensor selective_log_softmax_bwd(const Tensor& grad_logp, const std::optional<Tensor>& grad_entropy,
                                 const Tensor& logits, const Tensor& labels, const Tensor& lse,
                                 const std::optional<Tensor>& mean, double inv_temperature,
                                 int64_t ignore_index, int64_t vocab_start) {
  check_backward_args(grad_logp, grad_entropy, logits, labels, lse, mean, inv_temperature);
  const int64_t N = logits.size(0), V = logits.size(1);
  Tensor grad = torch::stable::new_empty(logits, {N, V});
  advise_huge_pages(grad.data_ptr(), N * V * static_cast<int64_t>(grad.element_size()));
  run_backward(grad_logp, grad_entropy, logits, labels, lse, mean, inv_temperature, ignore_index,
               vocab_start, grad.data_ptr(), V);
  return grad;
}

void selective_log_softmax_bwd_(const Tensor& grad_logp, const std::optional<Tensor>& grad_entropy,
                                Tensor& logits, const Tensor& labels, const Tensor& lse,
                                const std::optional<Tensor>& mean, double inv_temperature,
                                int64_t ignore_index, int64_t vocab_start) {
  check_backward_args(grad_logp, grad_entropy, logits, labels, lse, mean, inv_temperature);
  run_backward(grad_logp, grad_entropy, logits, labels, lse, mean, inv_temperature, ignore_index,
               vocab_start, logits.data_ptr(), logits.stride(0));
}

}  // namespace cpu
}  // namespace twinkle_mem

STABLE_TORCH_LIBRARY_IMPL(twinkle_mem, CPU, m) {
  m.impl("selective_log_softmax_fwd", TORCH_BOX(&twinkle_mem::cpu::selective_log_softmax_fwd));
  m.impl("selective_log_softmax_bwd", TORCH_BOX(&twinkle_mem::cpu::selective_log_softmax_bwd));
  m.impl("selective_log_softmax_bwd_", TORCH_BOX(&twinkle_mem::cpu::selective_log_softmax_bwd_));
}
