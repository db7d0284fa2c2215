// Runs the CUDA kernels of ../selective_log_softmax.cu on the CPU (fake_cuda.h)
// against a float64 reference: forward (split and unsplit rows), backward out of
// place (vector and scalar paths) and in place, for every logits and label dtype,
// misaligned rows, odd V, vocab shards, ignored rows, -inf logits and
// out-of-range labels. Built and run by .ci/check_cuda_build.py; exits non-zero
// on any mismatch.
//
//   g++ -std=c++20 -O1 -pthread -I csrc csrc/cuda/emulation/emulate_kernels.cpp && ./a.out
#define TWINKLE_MEM_CUDA_EMULATION 1
#include "fake_cuda.h"
// Keep the include after fake_cuda.h: the kernels use its stand-ins.
#include "../selective_log_softmax.cu"

#include <cstdio>
#include <random>
#include <string>

using namespace twinkle_mem;
using namespace twinkle_mem::cuda;

namespace {

int failures = 0;

template <typename T>
const char* dtype_name() {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return "bf16";
  else if constexpr (std::is_same_v<T, __half>) return "fp16";
  else if constexpr (std::is_same_v<T, float>) return "fp32";
  else if constexpr (std::is_same_v<T, double>) return "fp64";
  else if constexpr (std::is_same_v<T, int32_t>) return "int32";
  else return "int64";
}

template <typename T>
T from_double(double v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return __float2bfloat16_rn(float(v));
  else if constexpr (std::is_same_v<T, __half>) return __float2half_rn(float(v));
  else return T(v);
}
template <typename T>
double to_double(T v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return __bfloat162float(v);
  else if constexpr (std::is_same_v<T, __half>) return __half2float(v);
  else return double(v);
}

// 16-byte aligned storage of n elements of T.
template <typename T>
struct Buffer {
  std::vector<uint4> store;
  explicit Buffer(int64_t n) : store((n * int64_t(sizeof(T)) + 15) / 16 + 1) {}
  T* data() { return reinterpret_cast<T*>(store.data()); }
};

struct Case {
  std::string name;
  int64_t N, V;
  int64_t row_stride;    // >= V
  int64_t offset;        // elements before row 0 (misaligns every row when odd)
  int64_t grad_stride;   // row stride of the out-of-place gradient (V: contiguous)
  double inv_T = 1.0;
  int64_t vocab_start = 0;
  int64_t vocab_size = -1;  // -1: V
  bool with_entropy = true;
  std::vector<int64_t> labels;  // empty: random in [0, vocab_size)
  int64_t ignore_index = -100;
  bool neg_inf = false;         // put -inf runs into the rows
  int64_t bad_row = -1;         // first row whose label is out of range, or -1
};

struct Tol {
  double atol, rtol;
};
template <typename T>
Tol grad_tol() {  // the gradient is rounded to T once
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return {1e-5, 1e-2};
  else if constexpr (std::is_same_v<T, __half>) return {1e-7, 2e-3};
  else if constexpr (std::is_same_v<T, float>) return {1e-7, 1e-4};
  else return {1e-13, 1e-10};
}
template <typename T>
Tol stat_tol() {  // fp32 statistics (fp64 for fp64 logits)
  if constexpr (std::is_same_v<T, double>) return {1e-11, 1e-11};
  else return {2e-5, 2e-5};
}

bool close(double got, double want, Tol t) {
  if (std::isnan(want)) return std::isnan(got);
  if (std::isinf(want)) return got == want;
  return std::fabs(got - want) <= t.atol + t.rtol * std::fabs(want);
}

void expect(bool ok, const std::string& what) {
  if (!ok) {
    ++failures;
    if (failures < 40) std::printf("  FAIL %s\n", what.c_str());
  }
}

template <typename scalar_t, typename label_t>
void run_case(const Case& c, uint32_t seed) {
  using acc_t = acc_of<scalar_t>;
  const int64_t N = c.N, V = c.V, vocab_size = c.vocab_size < 0 ? V : c.vocab_size;
  const std::string tag = c.name + " [" + dtype_name<scalar_t>() + ", " + dtype_name<label_t>() + "]";
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal(0.0, 3.0);
  std::uniform_int_distribution<int64_t> pick(0, vocab_size - 1);

  const int64_t x_elems = c.offset + (N - 1) * c.row_stride + V;
  Buffer<scalar_t> x_buf(x_elems);
  scalar_t* x = x_buf.data() + c.offset;
  std::vector<double> xd(N * V);
  for (int64_t r = 0; r < N; ++r) {
    for (int64_t v = 0; v < V; ++v) {
      double val = normal(rng);
      if (c.neg_inf && ((r % 3 == 0 && v % 5 != 2) || (r % 3 == 1 && v >= V / 2))) val = -INFINITY;
      x[r * c.row_stride + v] = from_double<scalar_t>(val);
      xd[r * V + v] = to_double(x[r * c.row_stride + v]);
    }
  }
  std::vector<label_t> labels(N);
  for (int64_t r = 0; r < N; ++r) labels[r] = label_t(r < int64_t(c.labels.size()) ? c.labels[r] : pick(rng));

  // float64 reference
  std::vector<double> ref_logp(N), ref_lse(N), ref_mean(N), ref_ent(N), ref_grad(N * V);
  std::vector<double> g_logp(N), g_ent(N);
  for (int64_t r = 0; r < N; ++r) {
    g_logp[r] = normal(rng);
    g_ent[r] = c.with_entropy ? normal(rng) : 0.0;
    const int64_t y = labels[r];
    if (y == c.ignore_index) continue;  // all zero
    double m = -INFINITY;
    for (int64_t v = 0; v < V; ++v) m = std::max(m, xd[r * V + v] * c.inv_T);
    double s = 0, sz = 0;
    for (int64_t v = 0; v < V; ++v) {
      const double z = xd[r * V + v] * c.inv_T;
      const double e = std::exp(z - m);
      s += e;
      if (e > 0) sz += e * z;
    }
    const double lse = m + std::log(s), mean = sz / s;
    ref_lse[r] = lse;
    ref_mean[r] = mean;
    ref_ent[r] = lse - mean;
    const bool bad = y < 0 || y >= vocab_size;
    const int64_t t = bad ? -1 : local_target(y, c.vocab_start, V);
    ref_logp[r] = bad ? NAN : (t >= 0 ? xd[r * V + t] * c.inv_T - lse : 0.0);
    for (int64_t v = 0; v < V; ++v) {
      const double z = xd[r * V + v] * c.inv_T;
      const double p = std::exp(z - lse);
      const double pz = p > 0 ? p * (z - mean) : 0.0;
      ref_grad[r * V + v] = c.inv_T * (g_logp[r] * ((v == t ? 1.0 : 0.0) - p) - g_ent[r] * pz);
    }
  }

  // forward
  const RowSplit split = split_rows(N, V, Elem<scalar_t>::kVec);
  std::vector<acc_t> logp(N, acc_t(-7)), lse(N, acc_t(-7)), ent(N, acc_t(-7)), mean(N, acc_t(-7));
  std::vector<OnlineSoftmax<acc_t>> partial(N * split.segments);
  unsigned long long bad_row = 0;
  ForwardArgs<scalar_t, label_t> fa;
  fa.logits = x;
  fa.row_stride = c.row_stride;
  fa.rows = N;
  fa.vocab = V;
  fa.segments = split.segments;
  fa.segment_len = split.segment_len;
  fa.labels = labels.data();
  fa.label_stride = 1;
  fa.inv_T = acc_t(c.inv_T);
  fa.ignore_index = c.ignore_index;
  fa.vocab_start = c.vocab_start;
  fa.vocab_size = vocab_size;
  fa.logp = logp.data();
  fa.lse = lse.data();
  fa.entropy = c.with_entropy ? ent.data() : nullptr;
  fa.mean = c.with_entropy ? mean.data() : nullptr;
  fa.partial = partial.data();
  fa.bad_row = &bad_row;
  // A small grid makes each block loop over several tasks (the grid-stride path).
  const unsigned grid = unsigned(std::min<int64_t>(N * split.segments, 3));
  if (c.with_entropy) {
    emulate_launch(grid, split.threads, [&] { forward_kernel<scalar_t, label_t, true>(fa); });
  } else {
    emulate_launch(grid, split.threads, [&] { forward_kernel<scalar_t, label_t, false>(fa); });
  }
  if (split.segments > 1) {
    emulate_launch(unsigned(ceil_div(N, kMaxThreads)), kMaxThreads,
                   [&] { merge_segments_kernel<scalar_t, label_t>(fa); });
  }
  const Tol st = stat_tol<scalar_t>();
  for (int64_t r = 0; r < N; ++r) {
    const std::string at = tag + " row " + std::to_string(r);
    expect(close(logp[r], ref_logp[r], st), at + " logp " + std::to_string(double(logp[r])) + " vs " +
                                                 std::to_string(ref_logp[r]));
    expect(close(lse[r], ref_lse[r], st), at + " lse " + std::to_string(double(lse[r])) + " vs " +
                                              std::to_string(ref_lse[r]));
    if (c.with_entropy) {
      expect(close(ent[r], ref_ent[r], st), at + " entropy " + std::to_string(double(ent[r])) + " vs " +
                                                std::to_string(ref_ent[r]));
      expect(close(mean[r], ref_mean[r], st), at + " mean");
    }
  }
  const unsigned long long want_flag = c.bad_row < 0 ? 0ull : static_cast<unsigned long long>(N - c.bad_row);
  expect(bad_row == want_flag, tag + " bad-label flag " + std::to_string(bad_row) + " (want " +
                                   std::to_string(want_flag) + ")");

  // backward, out of place and in place, from the reference statistics
  std::vector<acc_t> s_lse(N), s_mean(N), s_gl(N), s_ge(N);
  for (int64_t r = 0; r < N; ++r) {
    s_lse[r] = acc_t(lse[r]);
    s_mean[r] = acc_t(c.with_entropy ? mean[r] : 0);
    s_gl[r] = acc_t(g_logp[r]);
    s_ge[r] = acc_t(g_ent[r]);
  }
  for (int pass = 0; pass < 2; ++pass) {
    const bool inplace = pass == 1;
    Buffer<scalar_t> d_buf(N * c.grad_stride + 1);
    scalar_t* d = inplace ? x : d_buf.data();
    const int64_t d_stride = inplace ? c.row_stride : c.grad_stride;
    BackwardArgs<scalar_t, label_t> ba;
    ba.logits = x;
    ba.row_stride = c.row_stride;
    ba.grad = d;
    ba.grad_row_stride = d_stride;
    ba.rows = N;
    ba.vocab = V;
    ba.segments = split.segments;
    ba.segment_len = split.segment_len;
    ba.labels = labels.data();
    ba.label_stride = 1;
    ba.grad_logp = s_gl.data();
    ba.grad_logp_stride = 1;
    ba.grad_entropy = c.with_entropy ? s_ge.data() : nullptr;
    ba.grad_entropy_stride = 1;
    ba.lse = s_lse.data();
    ba.lse_stride = 1;
    ba.mean = c.with_entropy ? s_mean.data() : nullptr;
    ba.mean_stride = 1;
    ba.inv_T = acc_t(c.inv_T);
    ba.ignore_index = c.ignore_index;
    ba.vocab_start = c.vocab_start;
    emulate_launch(grid, split.threads, [&] { backward_kernel<scalar_t, label_t>(ba); });
    const Tol gt = grad_tol<scalar_t>();
    int shown = 0;
    for (int64_t r = 0; r < N; ++r) {
      if (labels[r] != c.ignore_index && (labels[r] < 0 || labels[r] >= vocab_size)) continue;  // NaN logp row
      for (int64_t v = 0; v < V; ++v) {
        const double got = to_double(d[r * d_stride + v]);
        const double want = ref_grad[r * V + v];
        // The kernel used fp32 statistics: allow their error through p.
        const double p_err = std::fabs(std::exp(xd[r * V + v] * c.inv_T - ref_lse[r])) * 4e-5 * c.inv_T *
                             (std::fabs(g_logp[r]) + std::fabs(g_ent[r]) * 40);
        const bool ok = labels[r] == c.ignore_index ? got == 0.0 : close(got, want, {gt.atol + p_err, gt.rtol});
        if (!ok && shown++ < 3) {
          expect(false, tag + (inplace ? " in-place" : " out-of-place") + " grad[" + std::to_string(r) + ", " +
                            std::to_string(v) + "] " + std::to_string(got) + " vs " + std::to_string(want));
        } else if (!ok) {
          ++failures;
        }
      }
    }
  }
  std::printf("  %-58s segments=%lld threads=%d\n", tag.c_str(), (long long)split.segments, split.threads);
}

template <typename label_t>
void run_all_dtypes(const Case& c, uint32_t seed) {
  run_case<__nv_bfloat16, label_t>(c, seed);
  run_case<__half, label_t>(c, seed + 1);
  run_case<float, label_t>(c, seed + 2);
  run_case<double, label_t>(c, seed + 3);
}

}  // namespace

int main() {
  std::vector<Case> cases;
  // name, N, V, row_stride, offset, grad_stride
  cases.push_back({"aligned rows, T=0.7, ignored row", 5, 1024, 1024, 0, 1024, 1 / 0.7, 0, -1, true,
                   {3, -100, 7, 1023, 0}});
  cases.push_back({"misaligned rows (stride V+3, offset 3)", 4, 1037, 1040, 3, 1037});
  cases.push_back({"odd V < one vector", 3, 7, 9, 5, 7});
  cases.push_back({"V = 1", 7, 1, 1, 0, 1});
  cases.push_back({"vocab shard [500, 1537) of 3000", 6, 1037, 1037, 0, 1037, 1.0, 500, 3000, true,
                   {0, 499, 500, 1536, 1537, 2999}});
  cases.push_back({"-inf runs, no entropy", 6, 2053, 2053, 1, 2053, 1.0, 0, -1, false});
  cases.push_back({"-inf runs, entropy", 6, 2053, 2056, 0, 2053, 1.3, 0, -1, true});
  cases.push_back({"out-of-range labels", 6, 300, 300, 0, 300, 1.0, 0, -1, true, {1, 2, -100, 300, -2, 5},
                   -100, false, 3});
  cases.push_back({"split rows (N=2, V=20000)", 2, 20000, 20000, 0, 20000, 0.5, 0, -1, true});
  cases.push_back({"split rows, misaligned (N=1, V=40001)", 1, 40001, 40001, 1, 40001, 1.0, 0, -1, true});
  cases.push_back({"split rows, no entropy, ignored", 3, 17000, 17008, 8, 17000, 1.0, 0, -1, false, {5, -1, 16999},
                   -1});

  uint32_t seed = 1234;
  for (const Case& c : cases) {
    run_all_dtypes<int64_t>(c, seed);
    seed += 10;
  }
  run_all_dtypes<int32_t>(cases[1], 99);
  run_all_dtypes<int32_t>(cases[7], 98);
  if (failures) {
    std::printf("emulated CUDA kernels: %d mismatches\n", failures);
    return 1;
  }
  std::printf("emulated CUDA kernels: all cases match the float64 reference\n");
  return 0;
}
