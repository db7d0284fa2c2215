// CPU unit test of the NPU host logic that needs no CANN: the plan
// (csrc/npu/tiling.h), the row indexing it shares (csrc/common/row_index.h),
// its restatements of online_softmax.h for the AI core, the SoC's bf16 matching,
// and the kernel's scalar helpers (csrc/npu/scalar_math.h) against the C library. Built and run by
// tests/backends/npu/test_npu_tiling.py:
//   g++ -std=c++17 -Wall -Wextra -Werror -I csrc tests/backends/npu/npu_tiling_test.cpp && ./a.out
// Prints one line per failed check and "npu tiling: N checks passed" at the end.
#include "common/layout.h"
#include "common/online_softmax.h"
#include "npu/scalar_math.h"
#include "npu/tiling.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

using namespace twinkle_mem::npu;

static int g_checks = 0, g_failures = 0;
#define CHECK(cond, ...)                                           \
  do {                                                             \
    ++g_checks;                                                    \
    if (!(cond)) {                                                 \
      ++g_failures;                                                \
      std::printf("FAIL %s:%d: %s | ", __FILE__, __LINE__, #cond); \
      std::printf(__VA_ARGS__);                                    \
      std::printf("\n");                                           \
    }                                                              \
  } while (0)

constexpr int64_t kCores910B = 40;  // vector cores of a 910B3 (20 AI cores x 2 AIV)

static TilingRequest request(int64_t n, int64_t v, int64_t elem_bytes, int64_t mode = kForward) {
  TilingRequest r;
  r.n_rows = n;
  r.vocab = v;
  r.x_rows = RowIndexNpu{n > 0 ? n : 1, 0, v};
  r.y_rows = RowIndexNpu{n > 0 ? n : 1, 0, 1};
  r.elem_bytes = elem_bytes;
  r.vocab_size = v;
  r.ignore_index = -100;
  r.with_entropy = true;
  r.mode = mode;
  r.ub_bytes = kUbBudget220;
  r.core_count = kCores910B;
  return r;
}

// Every invariant the kernel relies on, for one accepted plan.
static void check_plan(const TilingRequest& r, const Tiling& t, const char* what) {
  CHECK(t.tile_len % kAlignElems == 0, "%s: tile_len %lld not a multiple of 64", what, (long long)t.tile_len);
  CHECK(t.tile_len * t.elem_bytes % kUbBlockBytes == 0, "%s: tile bytes not 32-byte aligned", what);
  CHECK(t.ub_bytes_used <= r.ub_bytes, "%s: UB %lld > %lld", what, (long long)t.ub_bytes_used, (long long)r.ub_bytes);
  CHECK(t.ub_bytes_used <= kUbBudget220 || r.ub_bytes > kUbBudget220, "%s: UB %lld > 184 KiB", what,
        (long long)t.ub_bytes_used);
  CHECK(t.ub_bytes_used == ub_bytes_for(t.tile_len, t.elem_bytes, t.mode), "%s: ub_bytes_used", what);
  // The next larger tile would not fit, unless the tile is capped by the row or max_tile_len.
  const bool capped = t.tile_len >= align_up(r.vocab, kAlignElems) ||
                      (r.max_tile_len > 0 && t.tile_len == align_down(r.max_tile_len, kAlignElems));
  CHECK(capped || ub_bytes_for(t.tile_len + kAlignElems, t.elem_bytes, t.mode) > r.ub_bytes,
        "%s: tile %lld is not the largest that fits", what, (long long)t.tile_len);
  CHECK(t.tile_len <= align_up(r.vocab > 0 ? r.vocab : 1, kAlignElems), "%s: tile longer than the row", what);
  CHECK(t.reduce_work_elems * 4 % kUbBlockBytes == 0, "%s: reduce scratch not whole blocks", what);
  if (r.vocab > 0) {
    CHECK(t.num_tiles == ceil_div(r.vocab, t.tile_len), "%s: num_tiles", what);
    CHECK(t.tail_len >= 1 && t.tail_len <= t.tile_len, "%s: tail_len %lld", what, (long long)t.tail_len);
    int64_t covered = 0;
    for (int64_t k = 0; k < t.num_tiles; ++k) {
      CHECK(tile_begin(t, k) == covered, "%s: tile %lld begins at %lld", what, (long long)k, (long long)covered);
      covered += tile_elems(t, k);
    }
    CHECK(covered == r.vocab, "%s: tiles cover %lld of V = %lld", what, (long long)covered, (long long)r.vocab);
  }
  // Rows: contiguous, disjoint, all covered; front cores take one more.
  CHECK(t.used_cores == (r.n_rows < r.core_count ? r.n_rows : r.core_count), "%s: used_cores", what);
  int64_t next = 0;
  for (int64_t c = 0; c < t.used_cores; ++c) {
    CHECK(core_row_begin(t, c) == next, "%s: core %lld begins at row %lld", what, (long long)c, (long long)next);
    const int64_t rows = core_row_count(t, c);
    CHECK(rows >= 1, "%s: core %lld has no row", what, (long long)c);
    CHECK(rows == t.rows_per_core + (c < t.front_cores ? 1 : 0), "%s: core %lld rows", what, (long long)c);
    next += rows;
  }
  CHECK(next == r.n_rows, "%s: cores cover %lld of N = %lld rows", what, (long long)next, (long long)r.n_rows);
  CHECK(core_row_count(t, t.used_cores) == 0, "%s: a core past used_cores owns rows", what);
}

static Tiling plan(const TilingRequest& r, const char* what) {
  const TilingResult res = make_tiling(r);
  CHECK(res.error == nullptr, "%s: refused: %s", what, res.error ? res.error : "");
  if (res.error == nullptr) check_plan(r, res.tiling, what);
  return res.tiling;
}

static void expect_refused(const TilingRequest& r, const char* needle, const char* what) {
  const TilingResult res = make_tiling(r);
  CHECK(res.error != nullptr && std::strstr(res.error, needle) != nullptr, "%s: want an error naming '%s', got '%s'",
        what, needle, res.error ? res.error : "(accepted)");
}

// The plan's tiles through online_softmax.h (block_state of each tile without
// its max element, merged in order): the row's log_sum and entropy as float64.
static void check_streamed_row(const Tiling& t, const std::vector<float>& x, float inv_t, const char* what) {
  using namespace twinkle_mem;
  OnlineSoftmax<float> state = empty_state<float>();
  for (int64_t k = 0; k < t.num_tiles; ++k) {
    const int64_t b = tile_begin(t, k), n = tile_elems(t, k);
    float m = -INFINITY;
    int64_t at = n;
    for (int64_t i = 0; i < n; ++i) {
      if (x[b + i] > m) {
        m = x[b + i];
        at = i;
      }
    }
    float s = 0, zs = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (i == at) continue;
      const float tt = scaled_gap(x[b + i], -finite_shift(m), inv_t), e = exp_(tt);
      s += e;
      zs = add_entropy_term<float, float>(zs, tt, e);
    }
    state = merge(state, block_state(m, s, zs), inv_t);
  }
  const RowStats<float> stats = finalize(state);
  double mx = -INFINITY;
  for (float v : x) mx = std::fmax(mx, double(v));
  double sum = 0, zsum = 0;
  for (float v : x) {
    const double z = (double(v) - mx) * inv_t, e = std::exp(z);
    sum += e;
    if (e > 0) zsum += z * e;
  }
  const double log_sum = std::log(sum), entropy = log_sum - zsum / sum;
  CHECK(double(stats.shift) == mx, "%s: shift", what);
  CHECK(std::fabs(stats.log_sum - log_sum) <= 1e-5 * (1 + std::fabs(log_sum)), "%s: log_sum %.8g vs %.8g", what,
        stats.log_sum, log_sum);
  CHECK(std::fabs(stats.entropy - entropy) <= 1e-4 * (1 + std::fabs(entropy)), "%s: entropy %.8g vs %.8g", what,
        stats.entropy, entropy);
}

static double ulps(float got, double want) {
  const double u = std::ldexp(1.0, std::ilogb(want == 0 ? 1e-38 : want) - 23);
  return std::fabs(double(got) - want) / u;
}

int main() {
  // ---- V = 151936 (Qwen3), the shape the kernel is for: bf16 / fp16 / fp32, forward and backward.
  for (int64_t elem : {2, 4}) {
    for (int64_t mode : {int64_t(kForward), int64_t(kBackward)}) {
      TilingRequest r = request(16384, 151936, elem, mode);
      const Tiling t = plan(r, "qwen");
      CHECK(t.used_cores == 40 && t.rows_per_core == 409 && t.front_cores == 24, "qwen rows: %lld %lld %lld",
            (long long)t.used_cores, (long long)t.rows_per_core, (long long)t.front_cores);
      CHECK(t.num_tiles > 1, "qwen: a 151936 row does not fit one tile of UB");
      CHECK(logits_offset(t, 16383, 151935) == int64_t(16383) * 151936 + 151935, "qwen offset");
      CHECK(logits_offset(t, 16383, 151935) > (int64_t(1) << 31), "qwen offset is 64-bit");
      const int64_t col = label_column(t, 151935);
      CHECK(col == 151935 && col / t.tile_len == t.num_tiles - 1 && col % t.tile_len == t.tail_len - 1,
            "qwen tail label");
    }
  }
  {
    // bf16 forward: 2 x 2 B (queue) + 2 x 4 B (fp32 tiles) = 12 B per element of 184 KiB, less scratch.
    const Tiling f = plan(request(8, 151936, 2, kForward), "fwd bf16");
    const Tiling b = plan(request(8, 151936, 2, kBackward), "bwd bf16");
    const Tiling f32 = plan(request(8, 151936, 4, kForward), "fwd fp32");
    CHECK(f.tile_len > b.tile_len && f.tile_len > f32.tile_len, "tile lengths %lld %lld %lld", (long long)f.tile_len,
          (long long)b.tile_len, (long long)f32.tile_len);
    CHECK(f.tile_len >= 15 * 1024 && f.tile_len < 184 * 1024 / 12, "fwd bf16 tile %lld", (long long)f.tile_len);
  }

  // ---- The UB budget: on the 220 architecture the kernel gets 192 KiB less the library's 8 KiB.
  CHECK(kUbBudget220 == 184 * 1024, "the 220 budget is 184 KiB");
  {
    // Every plan fits: V from 1 to past Qwen3's, every dtype and mode, with and without tile caps.
    std::mt19937 gen(1);
    std::vector<int64_t> vs = {1, 2, 63, 64, 65, 127, 128, 129, 1000, 4099, 5003, 16384, 16385, 32000, 65536,
                               131072, 151936, 151937, 152064, 262144, 1 << 20};
    for (int i = 0; i < 300; ++i) vs.push_back(1 + int64_t(gen() % 400000));
    int64_t worst = 0;
    for (int64_t v : vs) {
      for (int64_t elem : {2, 4}) {
        for (int64_t mode : {int64_t(kForward), int64_t(kBackward)}) {
          for (int64_t cap : {0, 64, 1000, 8192}) {
            TilingRequest r = request(5, v, elem, mode);
            r.max_tile_len = cap;
            const TilingResult res = make_tiling(r);
            CHECK(res.error == nullptr, "V=%lld refused", (long long)v);
            if (res.error) continue;
            check_plan(r, res.tiling, "sweep");
            worst = res.tiling.ub_bytes_used > worst ? res.tiling.ub_bytes_used : worst;
          }
        }
      }
    }
    CHECK(worst <= 184 * 1024 && worst > 180 * 1024, "the largest plan uses %lld bytes", (long long)worst);
  }

  // ---- The tile depends on V, the dtype and the mode only, never on N (batch invariance).
  for (int64_t v : {257, 4099, 40000, 151936}) {
    const Tiling a = plan(request(1, v, 2), "N=1");
    const Tiling b = plan(request(7, v, 2), "N=7");
    const Tiling c = plan(request(16384, v, 2), "N=16384");
    CHECK(a.tile_len == b.tile_len && b.tile_len == c.tile_len && a.num_tiles == c.num_tiles,
          "V=%lld: tile depends on N", (long long)v);
  }

  // ---- V not a multiple of the alignment: tails of every size.
  for (int64_t v : {1, 2, 15, 16, 17, 63, 64, 65, 1000, 5003, 16385, 32000, 151937}) {
    for (int64_t elem : {2, 4}) {
      TilingRequest r = request(100, v, elem);
      plan(r, "tails");
      r.max_tile_len = 1000;  // capped tiles: many tiles, tail = V mod 960
      const Tiling t = plan(r, "tails capped");
      CHECK(t.tile_len == (v <= 960 ? align_up(v, 64) : 960), "V=%lld capped tile %lld", (long long)v,
            (long long)t.tile_len);
    }
  }

  // ---- N < core count, N = core count + 1, N = 0.
  {
    const Tiling t = plan(request(3, 151936, 2), "N=3");
    CHECK(t.used_cores == 3 && t.rows_per_core == 1 && t.front_cores == 0, "N=3 split");
    const Tiling u = plan(request(41, 5003, 2), "N=41");
    CHECK(u.used_cores == 40 && u.rows_per_core == 1 && u.front_cores == 1, "N=41 split");
    CHECK(core_row_begin(u, 0) == 0 && core_row_begin(u, 1) == 2 && core_row_begin(u, 39) == 40, "N=41 begins");
    const Tiling z = plan(request(0, 151936, 2), "N=0");
    CHECK(z.used_cores == 0 && z.rows_per_core == 0 && z.front_cores == 0, "N=0: no launch");
    const Tiling zz = plan(request(0, 0, 4), "N=0 V=0");
    CHECK(zz.used_cores == 0 && zz.num_tiles == 0, "N=0 V=0");
  }

  // ---- Row offsets of [N, V] and [B, S, V] views: row_index.h's RowIndexOf, as the NPU
  // instantiates it (i64), against the offsets of the rows enumerated as (b, s).
  {
    const int64_t cases[][3] = {{7, 0, 611}, {5, 3000, 600}, {1, 0, 1}, {8, 8 * 700, 700}, {3, 4096, 1200}};
    for (const auto& c : cases) {
      const RowIndexNpu mine{c[0], c[1], c[2]};
      int64_t row = 0;
      for (int64_t b = 0; row < 40; ++b) {
        for (int64_t s = 0; s < (c[1] == 0 ? 40 : c[0]) && row < 40; ++s, ++row) {
          const int64_t expected = c[1] == 0 ? row * c[2] : b * c[1] + s * c[2];
          CHECK(mine(row) == expected, "rows(%lld) of {%lld, %lld, %lld}", (long long)row, (long long)c[0],
                (long long)c[1], (long long)c[2]);
        }
      }
    }
    // logits[:, :-1] of [4, 9, 611]: rows (b, s) at b * 9 * 611 + s * 611; a separate gradient layout.
    TilingRequest r = request(4 * 8, 611, 2, kBackward);
    r.x_rows = RowIndexNpu{8, 9 * 611, 611};
    r.g_rows = RowIndexNpu{8, 8 * 640, 640};
    r.y_rows = RowIndexNpu{8, 9, 1};
    const Tiling t = plan(r, "[B, S, V] view");
    CHECK(logits_offset(t, 8 + 3, 5) == 9 * 611 + 3 * 611 + 5, "view logits offset");
    CHECK(grad_offset(t, 8 + 3, 5) == 8 * 640 + 3 * 640 + 5, "view grad offset");
    CHECK(label_offset(t, 8 + 3, 0) == 9 + 3, "view label offset");
    TilingRequest c2 = request(6, 100, 4, kBackward);
    const Tiling contiguous = plan(c2, "default gradient rows");
    CHECK(grad_offset(contiguous, 5, 7) == 5 * 100 + 7, "a contiguous gradient by default");
    TilingRequest k = request(6, 100, 4);
    k.label_k = 4;
    k.label_k_stride = 2;
    k.y_rows = RowIndexNpu{6, 0, 8};
    CHECK(label_offset(plan(k, "k labels"), 5, 3) == 5 * 8 + 3 * 2, "k-label offset");
  }

  // ---- Labels on a vocab shard [300, 700) of 1000, ignore_index -100.
  {
    TilingRequest r = request(8, 400, 2);
    r.vocab_start = 300;
    r.vocab_size = 1000;
    r.max_tile_len = 128;
    const Tiling t = plan(r, "shard");
    CHECK(label_column(t, -100) == -1 && label_ignored(t, -100) && !label_out_of_range(t, -100), "ignored label");
    CHECK(label_column(t, 299) == -1 && label_column(t, 700) == -1 && label_column(t, 999) == -1, "off shard");
    CHECK(!label_out_of_range(t, 0) && !label_out_of_range(t, 999), "in range");
    CHECK(label_out_of_range(t, 1000) && label_out_of_range(t, -1) && label_column(t, 1000) == -1, "out of range");
    CHECK(label_column(t, 300) == 0 && label_column(t, 699) == 399, "on shard");
    TilingRequest ign = r;
    ign.ignore_index = 450;  // an ignore_index inside the shard wins over the shard
    CHECK(label_column(plan(ign, "ignore in shard"), 450) == -1, "ignore_index inside the shard");
  }

  // ---- Argument validation: each refusal names the argument.
  {
    TilingRequest r = request(4, 10, 8);
    expect_refused(r, "elem_bytes", "fp64 logits");
    r = request(4, 10, 2);
    r.label_bytes = 2;
    expect_refused(r, "label_bytes", "int16 labels");
    r = request(-1, 10, 2);
    expect_refused(r, "n_rows", "negative N");
    r = request(4, 0, 2);
    expect_refused(r, "V must be >= 1", "V = 0 with rows");
    r = request(4, 10, 2);
    r.vocab_start = 1;
    expect_refused(r, "vocab_start", "shard past vocab_size");
    r.vocab_start = -1;
    expect_refused(r, "vocab_start", "negative vocab_start");
    r = request(4, 10, 2);
    r.core_count = 0;
    expect_refused(r, "core_count", "no cores");
    r = request(4, 10, 2);
    r.ub_bytes = 1024;
    expect_refused(r, "ub_bytes", "tiny UB");
    r = request(4, 10, 2);
    r.max_tile_len = 32;
    expect_refused(r, "max_tile_len", "tile cap below 64");
    r = request(4, 10, 2);
    r.x_rows.inner = 0;
    expect_refused(r, "row strides", "inner row count 0");
    r = request(int64_t(1) << 40, int64_t(1) << 30, 2);
    expect_refused(r, "overflows", "N x row_stride past int64");
  }

  // ---- The SoC's bf16 support: the 220 architecture (910B, 910_93) and 950, any case.
  {
    const char* yes[] = {"Ascend910B1", "Ascend910B2", "Ascend910B2C", "Ascend910B3", "Ascend910B4", "ascend910b4-1",
                         "Ascend910_9391", "Ascend910_9392", "Ascend910_9381", "ASCEND910_9362", "Ascend950PR_9599",
                         "Ascend950DT_95A1"};
    const char* no[] = {"Ascend910A", "Ascend910ProA", "Ascend910PremiumA", "Ascend910", "Ascend310P3",
                        "Ascend310B1", "Ascend310", "", "910B", "Ascend91", nullptr};
    for (const char* s : yes) CHECK(soc_supports_bf16(s), "%s should have bf16", s);
    for (const char* s : no) CHECK(!soc_supports_bf16(s), "%s should not have bf16", s ? s : "(null)");
  }

  // ---- The kernel's scalar helpers against the C library.
  {
    // 16-bit floats from their bits: every fp16 value, and bf16 around each power of 2.
    for (uint32_t h = 0; h < 65536; ++h) {
      const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
      double want = e == 0 ? std::ldexp(double(m), -24) : std::ldexp(1.0 + m / 1024.0, e - 15);
      if (h & 0x8000) want = -want;
      const float got = fp16_bits_to_float(static_cast<u16>(h));
      if (e == 31) {
        CHECK(m ? std::isnan(got) : std::isinf(got) && (got < 0) == bool(h & 0x8000), "fp16 %04x special", h);
      } else {
        CHECK(double(got) == want, "fp16 %04x -> %.9g, want %.9g", h, got, want);
      }
      const float b = bf16_bits_to_float(static_cast<u16>(h));
      uint32_t bits;
      std::memcpy(&bits, &b, 4);
      CHECK(bits == (h << 16), "bf16 %04x", h);
    }
    // expm1 near 0: the series, within 2 ulp of expm1 on |u| < 0.5.
    double worst = 0;
    std::mt19937 gen(2);
    std::uniform_real_distribution<float> uni(-0.5f, 0.5f);
    std::vector<float> us = {1e-30f, -1e-30f, 1e-8f, -1e-8f, 1e-4f, -3e-3f, 0.25f, -0.25f, 0.4999f, -0.4999f};
    for (int i = 0; i < 200000; ++i) us.push_back(uni(gen) * std::pow(10.0f, -float(i % 8)));
    for (float u : us) {
      if (!(std::fabs(u) < kExpm1SeriesBound)) continue;
      const double e = ulps(expm1_series(u), std::expm1(double(u)));
      worst = e > worst ? e : worst;
    }
    CHECK(worst <= 2.0, "expm1_series: %.3f ulp", worst);
    std::printf("npu scalar math: expm1_series within %.3f ulp of expm1 on |u| < 0.5\n", worst);
    // log1p of the row's rest: series below 2^-7, ln(w) + c / w above (ln from logf).
    worst = 0;
    std::vector<float> rs = {0.0f, 1e-38f, 1e-20f, 1e-10f, 1e-7f, 1.2e-7f, 3e-3f, 0.0078f, 0.0078125f, 0.01f,
                             0.5f, 1.0f, 3.0f, 151935.0f, 1e10f, 3e38f};
    std::uniform_real_distribution<float> lg(-40.0f, 38.0f);
    for (int i = 0; i < 200000; ++i) rs.push_back(std::pow(10.0f, lg(gen)));
    for (float r : rs) {
      if (!std::isfinite(r)) continue;
      const float got = log1p_from_ln(r, log1p_needs_ln(r) ? std::log(1.0f + r) : 0.0f);
      const double e = ulps(got, std::log1p(double(r)));
      worst = e > worst ? e : worst;
    }
    CHECK(worst <= 2.0, "log1p_from_ln: %.3f ulp", worst);
    std::printf("npu scalar math: log1p_from_ln within %.3f ulp of log1p (ln from logf)\n", worst);
    CHECK(std::isinf(log1p_from_ln(-1.0f, std::log(0.0f))), "log1p(-1) = -inf (a row of -inf)");
    CHECK(std::isnan(log1p_from_ln(quiet_nan(), std::log(quiet_nan()))), "log1p(NaN) = NaN");
    CHECK(bits_of_float(neg_inf()) == 0xff800000u && float_from_bits(0x3f800000u) == 1.0f, "bit casts");
  }

  // ---- The plan drives the shared online-softmax math to the row statistics.
  {
    std::mt19937 gen(0);
    std::normal_distribution<float> normal(0.f, 4.f);
    for (int64_t v : {1, 65, 5003, 151936}) {
      std::vector<float> x(v);
      for (auto& e : x) e = normal(gen);
      if (v > 100) {
        for (int64_t i = 0; i < v / 3; ++i) x[i] = -INFINITY;  // whole tiles of -inf before finite values
        for (int64_t i = v / 3; i < v / 2; ++i) x[i] = -3.40282347e+38f;  // finfo.min tiles
      }
      for (int64_t cap : {0, 64, 1000}) {
        TilingRequest r = request(1, v, 2);
        r.max_tile_len = cap;
        char what[64];
        std::snprintf(what, sizeof what, "stream V=%lld cap=%lld", (long long)v, (long long)cap);
        check_streamed_row(plan(r, what), x, 1.f / 0.7f, what);
      }
    }
  }

  CHECK(sizeof(Tiling) == kTilingWords * sizeof(int64_t), "Tiling is int64 words");

  if (g_failures) {
    std::printf("npu tiling: %d of %d checks failed\n", g_failures, g_checks);
    return 1;
  }
  std::printf("npu tiling: %d checks passed\n", g_checks);
  return 0;
}
