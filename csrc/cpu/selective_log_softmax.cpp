// CPU kernels of the selective log-softmax op (forward, backward, in-place
// backward). Each row is cut into vocab segments of a fixed length (by V
// alone); (row, segment) tasks go across threads with the stable parallel_for
// and a row's segment states are merged in segment order. The row loops
// (row_kernels.h) are compiled three times: here, portable, and for AVX2+FMA+F16C
// and AVX-512 in their own translation units; cpu_row_kernels() picks one per call.
#include "../common/online_softmax.h"
#include "../common/forward_outputs.h"
#include "../common/layout.h"
#include "../common/op_checks.h"
#include "../common/op_entry.h"
#include "isa.h"

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
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
inline V hsum(V v) { return v; }
template <typename V>
inline int64_t count_equal(V x, V value) { return x == value; }
template <typename T>
inline auto max_start(const T* p) { return decltype(load_vec(p))(-std::numeric_limits<decltype(load_vec(p))>::infinity()); }
template <typename T, typename V>
inline V max_add_pair(V m, const T* p) { return max_(max_(m, load_vec(p)), load_vec(p + 1)); }
template <typename T, typename V>
inline V max_result(V m, const T*) { return m; }
template <typename V>
inline V add_below(V sum, V e, V x, V max) { return x != max ? sum + e : sum; }
constexpr bool kExp2TakesNegInf = true;  // exp2f(-inf) is 0
template <typename V>
inline V exp2_for_sums(V y) { return exp2_(y); }  // (16-bit gradients take exp_ here: no exp2_for_grads)
using RowVec = float;
using bf16_t = bf16;
using fp16_t = fp16;
#define TWINKLE_MEM_ROW_KERNELS_ISA portable  // the row loops, once, in this namespace
#include "row_kernels.h"
}  // namespace portable

const RowKernels portable_row_kernels = portable::kRowKernels;

// The CPU's own report (cpuid through libgcc, which also checks that the OS saves
// the wider registers), in this portable translation unit: nothing here runs an
// instruction the CPU may lack.
bool cpu_has(const char* path) {
#ifdef TWINKLE_MEM_CPU_X86
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                           __builtin_cpu_supports("f16c");
  static const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  static const bool avx512_bf16 = avx512 && __builtin_cpu_supports("avx512bf16");
  if (std::strcmp(path, "avx512_bf16") == 0) return avx512_bf16;
  if (std::strcmp(path, "avx512") == 0) return avx512;
  if (std::strcmp(path, "avx2") == 0) return avx2;
#endif
  return std::strcmp(path, "portable") == 0;
}

// The path for a cap (isa.h): the widest the CPU has at or below it; nullptr for an unknown cap.
const RowKernels* row_kernels_for(const char* cap) {
#ifdef TWINKLE_MEM_CPU_X86
  static const RowKernels* const widest_first[] = {&avx512_bf16_row_kernels, &avx512_row_kernels, &avx2_row_kernels,
                                                   &portable_row_kernels};
#else
  static const RowKernels* const widest_first[] = {&portable_row_kernels};
#endif
  bool capped = cap == nullptr || *cap == '\0';  // no cap: the widest the CPU has
  for (const RowKernels* k : widest_first) {
    capped = capped || std::strcmp(cap, k->name) == 0;
    if (capped && cpu_has(k->name)) return k;
  }
  return nullptr;
}

// The path an op call runs: the widest the CPU reports (cpuid), capped by the
// environment variable TWINKLE_MEM_CPU_ISA (avx512_bf16, avx512, avx2 or portable: the tests
// run every path's suite on one machine, a benchmark compares them). Read at
// each call; an unknown value raises.
const RowKernels& cpu_row_kernels() {
  const char* cap = std::getenv("TWINKLE_MEM_CPU_ISA");
  const RowKernels* k = row_kernels_for(cap);
  STD_TORCH_CHECK(k != nullptr, "twinkle_mem: TWINKLE_MEM_CPU_ISA=", cap, " names no CPU kernel path (avx512_bf16, "
                  "avx512, avx2 or portable; unset for the widest this CPU has)");
  return *k;
}

// ---------------------------------------------------------------- host code
using torch::headeronly::ScalarType;
using torch::stable::Tensor;

// Rows are cut into vocab segments of a fixed length: tasks for the threads
// when rows are few, and one reduction order for a row whatever N, the other
// rows or the thread count (its results are bitwise the same in any batch).
constexpr int64_t kSegment = 8 * portable::kBlock;

struct RowSplit {
  int64_t segments;
  int64_t segment_len;
};
RowSplit split_rows(int64_t V) { return {std::max<int64_t>(1, ceil_div(V, kSegment)), kSegment}; }

// The leading dims as a RowIndex (layout.h): [N, ...] or [B, S, ...].
RowIndex row_index(const Tensor& t, int64_t lead_dims) {
  return twinkle_mem::row_index(lead_dims, t.sizes().data(), t.strides().data());
}

// Labels of any strides (layout.h's Labels), int64 or int32.
template <typename F>
void with_labels(const Tensor& labels, int64_t lead_dims, F&& f) {
  const LabelIndex index = label_index(lead_dims, labels.dim(), labels.sizes().data(), labels.strides().data());
  if (labels.scalar_type() == ScalarType::Long) {
    f(Labels<int64_t>{reinterpret_cast<const int64_t*>(labels.data_ptr()), index});
  } else {
    f(Labels<int32_t>{reinterpret_cast<const int32_t*>(labels.data_ptr()), index});
  }
}

// Out-of-range labels are an error, raised before any kernel runs.
void check_label_range(const Tensor& labels, int64_t lead_dims, int64_t N, int64_t ignore_index,
                       int64_t vocab_size) {
  with_labels(labels, lead_dims, [&](auto label) {
    for (int64_t row = 0; row < N; ++row) {
      for (int64_t j = 0; j < label.k(); ++j) {
        const int64_t y = label(row, j);
        if (!label_in_range(y, ignore_index, vocab_size)) fail_label_out_of_range(row * label.k() + j, y, vocab_size, ignore_index);
      }
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

// A segment through the path's entry points (fp64 logits: the portable double loops).
template <typename scalar_t, typename acc_t>
OnlineSoftmax<double> run_segment_state(const RowKernels& k, const scalar_t* x, int64_t n, acc_t inv_T,
                                        bool with_entropy) {
  if constexpr (std::is_same_v<scalar_t, bf16>) {
    return k.state_bf16(reinterpret_cast<const uint16_t*>(x), n, inv_T, with_entropy);
  } else if constexpr (std::is_same_v<scalar_t, fp16>) {
    return k.state_fp16(reinterpret_cast<const uint16_t*>(x), n, inv_T, with_entropy);
  } else if constexpr (std::is_same_v<scalar_t, float>) {
    return k.state_fp32(x, n, inv_T, with_entropy);
  } else {
    return portable::segment_state<acc_t>(x, n, inv_T, with_entropy);
  }
}

template <typename scalar_t, typename acc_t>
void run_segment_grad(const RowKernels& k, const scalar_t* x, scalar_t* d, int64_t n, const RowGrad<acc_t>& g) {
  if constexpr (std::is_same_v<scalar_t, bf16>) {
    k.grad_bf16(reinterpret_cast<const uint16_t*>(x), reinterpret_cast<uint16_t*>(d), n, g);
  } else if constexpr (std::is_same_v<scalar_t, fp16>) {
    k.grad_fp16(reinterpret_cast<const uint16_t*>(x), reinterpret_cast<uint16_t*>(d), n, g);
  } else if constexpr (std::is_same_v<scalar_t, float>) {
    k.grad_fp32(x, d, n, g);
  } else {
    portable::segment_grad<acc_t>(x, d, n, g);
  }
}

template <typename scalar_t, typename acc_t>
void forward_kernel(const Tensor& logits, const Tensor& labels, const OpOptions& o, Tensor& logp, Tensor& entropy,
                    Tensor& shift, Tensor& log_sum) {
  const acc_t inv_T = static_cast<acc_t>(o.inv_temperature);
  const int64_t ignore_index = o.ignore_index, vocab_start = o.vocab_start;
  const bool with_entropy = o.with_entropy;
  const int64_t lead_dims = logits.dim() - 1, V = logits.size(lead_dims);
  const int64_t N = shift.numel();
  const RowIndex row_at = row_index(logits, lead_dims);
  const scalar_t* x = reinterpret_cast<const scalar_t*>(logits.data_ptr());
  acc_t* out_logp = reinterpret_cast<acc_t*>(logp.data_ptr());
  acc_t* out_shift = reinterpret_cast<acc_t*>(shift.data_ptr());
  acc_t* out_log_sum = reinterpret_cast<acc_t*>(log_sum.data_ptr());
  acc_t* out_entropy = with_entropy ? reinterpret_cast<acc_t*>(entropy.data_ptr()) : nullptr;
  const RowSplit split = split_rows(V);
  const RowKernels& kernels = cpu_row_kernels();

  with_labels(labels, lead_dims, [&](auto label) {
    const int64_t k = label.k();
    std::vector<OnlineSoftmax<double>> states(N * split.segments);
    const int64_t grain = std::max<int64_t>(1, 65536 / split.segment_len);
    torch::stable::parallel_for(0, N * split.segments, grain, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t row = task / split.segments, seg = task % split.segments;
        if (row_skipped(label, row, ignore_index)) continue;
        const int64_t start = seg * split.segment_len, len = std::min(split.segment_len, V - start);
        states[task] = run_segment_state<scalar_t, acc_t>(kernels, x + row_at(row) + start, len, inv_T, with_entropy);
      }
    });
    for (int64_t row = 0; row < N; ++row) {
      if (row_skipped(label, row, ignore_index)) {
        for (int64_t j = 0; j < k; ++j) out_logp[row * k + j] = 0;
        out_shift[row] = out_log_sum[row] = 0;
        if (with_entropy) out_entropy[row] = 0;
        continue;
      }
      OnlineSoftmax<double> state = states[row * split.segments];
      for (int64_t seg = 1; seg < split.segments; ++seg) {
        state = merge(state, states[row * split.segments + seg], static_cast<double>(inv_T));
      }
      // Finished in double, rounded once.
      const RowStats<double> stats = finalize(state);
      output_shift(stats, static_cast<double>(inv_T), out_shift[row], out_log_sum[row]);
      if (with_entropy) out_entropy[row] = static_cast<acc_t>(stats.entropy);
      for (int64_t j = 0; j < k; ++j) {
        const int64_t y = label(row, j);
        const int64_t target = is_ignored(y, ignore_index) ? -1 : local_target(y, vocab_start, V);
        if (target < 0) {
          out_logp[row * k + j] = 0;
          continue;
        }
        const double x_y = static_cast<double>(static_cast<acc_t>(x[row_at(row) + target]));
        out_logp[row * k + j] = static_cast<acc_t>(log_prob(x_y, stats.shift, stats.log_sum, static_cast<double>(inv_T)));
      }
    }
  });
}

// A label position inside a segment and the upstream gradient of the labels there.
struct LabelHit {
  int64_t col;
  double g;
  double x;  // the logit, read before an in-place pass overwrites it
};

template <typename scalar_t, typename acc_t>
void backward_kernel(const BackwardInputs<Tensor>& args, const OpOptions& o, scalar_t* d, RowIndex d_row_at) {
  const Tensor& logits = args.logits;
  const acc_t inv_T = static_cast<acc_t>(o.inv_temperature);
  const int64_t ignore_index = o.ignore_index, vocab_start = o.vocab_start;
  const int64_t lead_dims = logits.dim() - 1, V = logits.size(lead_dims), N = args.shift.numel();
  const RowIndex row_at = row_index(logits, lead_dims);
  const scalar_t* x = reinterpret_cast<const scalar_t*>(logits.data_ptr());
  const BackwardRowInputs in = contiguous_row_inputs(args);
  const bool with_entropy = in.with_entropy;
  const acc_t* g_logp = reinterpret_cast<const acc_t*>(in.grad_logp.data_ptr());
  const acc_t* row_shift = reinterpret_cast<const acc_t*>(in.shift.data_ptr());
  const acc_t* row_log_sum = reinterpret_cast<const acc_t*>(in.log_sum.data_ptr());
  const acc_t* g_entropy = reinterpret_cast<const acc_t*>(in.grad_entropy.data_ptr());
  const acc_t* row_entropy = reinterpret_cast<const acc_t*>(in.entropy.data_ptr());
  const RowSplit split = split_rows(V);
  const RowKernels& kernels = cpu_row_kernels();

  with_labels(args.labels, lead_dims, [&](auto label) {
    const int64_t k = label.k();
    const int64_t grain = std::max<int64_t>(1, 65536 / split.segment_len);
    torch::stable::parallel_for(0, N * split.segments, grain, [&](int64_t begin, int64_t end) {
      std::vector<LabelHit> hits;
      for (int64_t task = begin; task < end; ++task) {
        const int64_t row = task / split.segments, seg = task % split.segments;
        const int64_t start = seg * split.segment_len, len = std::min(split.segment_len, V - start);
        scalar_t* d_seg = d + d_row_at(row) + start;
        if (row_skipped(label, row, ignore_index)) {
          std::fill(d_seg, d_seg + len, static_cast<scalar_t>(0.0f));
          continue;
        }
        const scalar_t* x_seg = x + row_at(row) + start;
        // The row's total upstream logp gradient, and the labels in this segment
        // (repeated labels summed), read before the pass may overwrite them.
        double g_total = 0;
        hits.clear();
        for (int64_t j = 0; j < k; ++j) {
          const int64_t y = label(row, j);
          if (is_ignored(y, ignore_index)) continue;
          const double g = g_logp[row * k + j];
          g_total += g;
          const int64_t col = local_target(y, vocab_start, V) - start;
          if (col < 0 || col >= len) continue;
          auto same = std::find_if(hits.begin(), hits.end(), [&](const LabelHit& h) { return h.col == col; });
          if (same != hits.end()) {
            same->g += g;
          } else {
            hits.push_back({col, g, static_cast<double>(static_cast<acc_t>(x_seg[col]))});
          }
        }
        const acc_t h_row = with_entropy ? row_entropy[row] : acc_t(0), g_h = with_entropy ? g_entropy[row] : acc_t(0);
        run_segment_grad<scalar_t, acc_t>(
            kernels, x_seg, d_seg, len,
            row_grad(row_shift[row], row_log_sum[row], h_row, static_cast<acc_t>(g_total), g_h, inv_T));
        // The few label positions in double, from the same statistics: where 1 - p
        // and the entropy term nearly cancel, a wider evaluation is all but free.
        const RowGrad<double> rg = row_grad<double>(row_shift[row], row_log_sum[row], h_row, g_total, g_h, inv_T);
        for (const LabelHit& h : hits) d_seg[h.col] = static_cast<scalar_t>(grad_at_label(h.x, rg, h.g, g_total - h.g));
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

// The CPU kernels behind forward_outputs.h's StableBackend (the arguments were
// checked by op_entry.h, the outputs allocated there).
struct Kernels {
  static void forward(const Tensor& logits, const Tensor& labels, const OpOptions& o, Tensor& logp, Tensor& entropy,
                      Tensor& shift, Tensor& log_sum) {
    check_label_range(labels, logits.dim() - 1, shift.numel(), o.ignore_index, o.vocab_size);
    dispatch_logits_dtype(logits.scalar_type(), [&](auto scalar, auto acc) {
      forward_kernel<decltype(scalar), decltype(acc)>(logits, labels, o, logp, entropy, shift, log_sum);
    });
  }

  static void backward(const BackwardInputs<Tensor>& in, const OpOptions& o, const Tensor& grad) {
    if (grad.data_ptr() != in.logits.data_ptr()) {  // a fresh gradient: huge pages before the first touch
      advise_huge_pages(grad.data_ptr(), in.logits.numel() * static_cast<int64_t>(grad.element_size()));
    }
    dispatch_logits_dtype(in.logits.scalar_type(), [&](auto scalar, auto acc) {
      using scalar_t = decltype(scalar);
      backward_kernel<scalar_t, decltype(acc)>(in, o, reinterpret_cast<scalar_t*>(grad.data_ptr()),
                                               row_index(grad, grad.dim() - 1));
    });
  }
};
using Ops = OpEntries<StableBackend<Kernels>>;

}  // namespace cpu
}  // namespace twinkle_mem

// For op/native.py (through ctypes): the CPU kernel path that TWINKLE_MEM_CPU_ISA = cap
// selects (nullptr or "": the widest this CPU has), or nullptr for an unknown cap.
extern "C" __attribute__((visibility("default"))) const char* twinkle_mem_cpu_kernel_path(const char* cap) {
  const twinkle_mem::cpu::RowKernels* k = twinkle_mem::cpu::row_kernels_for(cap);
  return k == nullptr ? nullptr : k->name;
}

STABLE_TORCH_LIBRARY_IMPL(twinkle_mem, CPU, m) {
  m.impl("selective_log_softmax_fwd", TORCH_BOX(&twinkle_mem::cpu::Ops::fwd));
  m.impl("selective_log_softmax_bwd", TORCH_BOX(&twinkle_mem::cpu::Ops::bwd));
  m.impl("selective_log_softmax_bwd_", TORCH_BOX(&twinkle_mem::cpu::Ops::bwd_));
}
