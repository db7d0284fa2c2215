// CPU unit test of the NPU tiling (csrc/npu/tiling.h): the host logic of the
// AscendC kernels that runs without CANN. Built and run by test_npu_tiling.py:
//   g++ -std=c++17 -I csrc tests/npu_tiling_test.cpp && ./a.out
// Prints one line per failed check and "npu tiling: N checks passed" at the end.
#include "common/online_softmax.h"
#include "npu/tiling.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

using namespace twinkle_mem::npu;

static int g_checks = 0, g_failures = 0;
#define CHECK(cond, ...)                                          \
  do {                                                            \
    ++g_checks;                                                   \
    if (!(cond)) {                                                \
      ++g_failures;                                               \
      std::printf("FAIL %s:%d: %s | ", __FILE__, __LINE__, #cond); \
      std::printf(__VA_ARGS__);                                   \
      std::printf("\n");                                          \
    }                                                             \
  } while (0)

constexpr int64_t kUb910B = 192 * 1024;  // UB per vector core, Ascend 910B
constexpr int64_t kCores910B = 40;       // vector cores of a 910B2 (20 AI cores x 2 AIV)

static TilingRequest request(int64_t n, int64_t v, int64_t elem_bytes, int64_t mode = kForward) {
  TilingRequest r;
  r.n_rows = n;
  r.vocab = v;
  r.row_stride = v;
  r.elem_bytes = elem_bytes;
  r.vocab_size = v;
  r.ignore_index = -100;
  r.with_entropy = true;
  r.mode = mode;
  r.ub_bytes = kUb910B;
  r.core_count = kCores910B;
  return r;
}

// Every invariant the kernel relies on, for one accepted plan.
static void check_plan(const TilingRequest& r, const Tiling& t, const char* what) {
  CHECK(t.tile_len % kAlignElems == 0, "%s: tile_len %lld not a multiple of 64", what, (long long)t.tile_len);
  CHECK(t.tile_len * t.elem_bytes % kUbBlockBytes == 0, "%s: tile bytes not 32-byte aligned", what);
  CHECK(t.tile_len * 4 % kRepeatBytes == 0, "%s: fp32 tile not whole repeats", what);
  CHECK(t.ub_bytes_used <= r.ub_bytes, "%s: UB %lld > %lld", what, (long long)t.ub_bytes_used, (long long)r.ub_bytes);
  CHECK(t.ub_bytes_used == ub_bytes_for(t.tile_len, t.elem_bytes, t.mode), "%s: ub_bytes_used", what);
  // The next larger tile would not fit, unless the tile is capped by the row or max_tile_len.
  const bool capped = t.tile_len >= align_up(r.vocab, kAlignElems) ||
                      (r.max_tile_len > 0 && t.tile_len == align_down(r.max_tile_len, kAlignElems));
  CHECK(capped || ub_bytes_for(t.tile_len + kAlignElems, t.elem_bytes, t.mode) > r.ub_bytes,
        "%s: tile %lld is not the largest that fits", what, (long long)t.tile_len);
  CHECK(t.tile_len <= align_up(r.vocab > 0 ? r.vocab : 1, kAlignElems), "%s: tile longer than the row", what);
  if (r.vocab > 0) {
    CHECK(t.num_tiles == ceil_div(r.vocab, t.tile_len), "%s: num_tiles", what);
    CHECK(t.tail_len >= 1 && t.tail_len <= t.tile_len, "%s: tail_len %lld", what, (long long)t.tail_len);
    int64_t covered = 0;
    for (int64_t k = 0; k < t.num_tiles; ++k) {
      CHECK(tile_begin(t, k) == covered, "%s: tile %lld begins at %lld", what, (long long)k, (long long)covered);
      covered += tile_elems(t, k);
    }
    CHECK(covered == r.vocab, "%s: tiles cover %lld of V = %lld", what, (long long)covered, (long long)r.vocab);
    // DataCopyPad moves tail bytes; the UB tile buffer holds them rounded up to 32 B.
    CHECK(align_up(t.tail_len * t.elem_bytes, kUbBlockBytes) <= t.tile_len * t.elem_bytes, "%s: tail fits", what);
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
  CHECK(t.front_cores < (t.used_cores > 0 ? t.used_cores : 1), "%s: front_cores", what);
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

// The kernel's per-row algorithm on the CPU: tile by tile as the plan says,
// each tile's (max, sum exp, sum (z - max) exp) merged with online_softmax.h.
// Checks that the plan's tiles and tails give the row's lse and entropy.
static void check_streamed_row(const Tiling& t, const std::vector<float>& x, float inv_t, const char* what) {
  using namespace twinkle_mem;
  OnlineSoftmax<float> state = empty_state<float>();
  for (int64_t k = 0; k < t.num_tiles; ++k) {
    const int64_t b = tile_begin(t, k), n = tile_elems(t, k);
    float m = -INFINITY;
    for (int64_t i = 0; i < n; ++i) m = max_(m, x[b + i] * inv_t);
    const float shift = finite_shift(m);
    float s = 0, zs = 0;
    for (int64_t i = 0; i < n; ++i) {
      const float t = shifted(x[b + i], inv_t, -shift), e = exp_(t);
      s += e;
      zs = add_entropy_term<float, float>(zs, t, e);
    }
    state = merge(state, OnlineSoftmax<float>{shift, s, zs});
  }
  const RowStats<float> stats = finalize(state);
  double mx = -INFINITY;
  for (float v : x) mx = std::fmax(mx, double(v) * inv_t);
  double sum = 0, zsum = 0;
  for (float v : x) {
    const double z = double(v) * inv_t, e = std::exp(z - mx);
    sum += e;
    if (e > 0) zsum += z * e;  // -inf logits: e = 0 adds nothing
  }
  const double lse = mx + std::log(sum), entropy = lse - zsum / sum;
  CHECK(std::fabs(stats.lse - lse) <= 1e-5 * (1 + std::fabs(lse)), "%s: lse %.8g vs %.8g", what, stats.lse, lse);
  CHECK(std::fabs(stats.entropy - entropy) <= 1e-4 * (1 + std::fabs(lse)), "%s: entropy %.8g vs %.8g", what,
        stats.entropy, entropy);
}

int main() {
  // ---- V = 151936 (Qwen3), the shape the kernel is for: bf16 and fp32, forward and backward.
  for (int64_t elem : {2, 4}) {
    for (int64_t mode : {int64_t(kForward), int64_t(kBackward)}) {
      TilingRequest r = request(16384, 151936, elem, mode);
      const Tiling t = plan(r, "qwen");
      CHECK(t.used_cores == 40 && t.rows_per_core == 409 && t.front_cores == 24, "qwen rows: %lld %lld %lld",
            (long long)t.used_cores, (long long)t.rows_per_core, (long long)t.front_cores);
      CHECK(t.num_tiles > 1, "qwen: a 151936 row does not fit one tile of UB");
      // 64-bit offsets: the last element lies past 2^31.
      CHECK(logits_offset(t, 16383, 151935) == int64_t(16383) * 151936 + 151935, "qwen offset");
      CHECK(logits_offset(t, 16383, 151935) > (int64_t(1) << 31), "qwen offset is 64-bit");
      // A label in the tail tile.
      const int64_t col = label_column(t, 151935);
      CHECK(col == 151935 && tile_of(t, col) == t.num_tiles - 1 && col_in_tile(t, col) == t.tail_len - 1,
            "qwen tail label: tile %lld col %lld", (long long)tile_of(t, col), (long long)col_in_tile(t, col));
    }
  }
  {
    // The forward (one queue) affords longer tiles than the backward (two queues).
    const Tiling f = plan(request(8, 151936, 2, kForward), "fwd bf16");
    const Tiling b = plan(request(8, 151936, 2, kBackward), "bwd bf16");
    const Tiling f32 = plan(request(8, 151936, 4, kForward), "fwd fp32");
    CHECK(f.tile_len > b.tile_len && f.tile_len > f32.tile_len, "tile lengths %lld %lld %lld", (long long)f.tile_len,
          (long long)b.tile_len, (long long)f32.tile_len);
    // 192 KiB bf16 forward: 2 x 2 B + 2 x 4 B = 12 B per element, minus scratch: ~16K elements.
    CHECK(f.tile_len >= 15 * 1024 && f.tile_len <= 16 * 1024, "fwd bf16 tile %lld", (long long)f.tile_len);
  }

  // ---- V not a multiple of the alignment: tails of every size.
  for (int64_t v : {1, 2, 15, 16, 17, 63, 64, 65, 1000, 5003, 16385, 32000, 151937}) {
    char what[64];
    std::snprintf(what, sizeof what, "V=%lld", (long long)v);
    for (int64_t elem : {2, 4}) {
      TilingRequest r = request(100, v, elem);
      plan(r, what);
      r.max_tile_len = 1000;  // capped tiles: many tiles, tail = V mod 960
      const Tiling t = plan(r, what);
      CHECK(t.tile_len == (v <= 960 ? align_up(v, 64) : 960), "%s capped tile %lld", what, (long long)t.tile_len);
    }
  }
  {
    const Tiling t = plan(request(4, 1, 2), "V=1");
    CHECK(t.tile_len == 64 && t.num_tiles == 1 && t.tail_len == 1, "V=1 plan");
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
    TilingRequest r = request(0, 0, 4);
    const Tiling zz = plan(r, "N=0 V=0");
    CHECK(zz.used_cores == 0 && zz.num_tiles == 0, "N=0 V=0");
    TilingRequest one = request(1, 7, 4);
    one.core_count = 1;
    CHECK(plan(one, "one core").used_cores == 1, "one core");
  }

  // ---- Row strides: a view with row stride > V; the backward's own output stride.
  {
    TilingRequest r = request(64, 611, 2, kBackward);
    r.row_stride = 700;
    const Tiling t = plan(r, "strided");
    CHECK(t.row_stride == 700 && t.out_row_stride == 611, "strides %lld %lld", (long long)t.row_stride,
          (long long)t.out_row_stride);
    CHECK(logits_offset(t, 3, 5) == 3 * 700 + 5 && grad_offset(t, 3, 5) == 3 * 611 + 5, "strided offsets");
  }

  // ---- Label columns on a vocab shard [300, 700) of 1000, ignore_index -100.
  {
    TilingRequest r = request(8, 400, 2);
    r.vocab_start = 300;
    r.vocab_size = 1000;
    r.max_tile_len = 128;
    const Tiling t = plan(r, "shard");
    CHECK(label_column(t, -100) == -1, "ignored label");
    CHECK(label_column(t, 299) == -1 && label_column(t, 700) == -1 && label_column(t, 999) == -1, "off shard");
    CHECK(label_column(t, 300) == 0 && label_column(t, 699) == 399, "on shard");
    CHECK(tile_of(t, 399) == 3 && col_in_tile(t, 399) == 15 && t.tail_len == 16, "shard tail");
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
    r.row_stride = 9;
    expect_refused(r, "row_stride", "overlapping rows");
    r = request(4, 10, 2, kBackward);
    r.out_row_stride = 5;
    expect_refused(r, "out_row_stride", "overlapping gradient rows");
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
    r = request(int64_t(1) << 40, int64_t(1) << 30, 2);
    expect_refused(r, "overflows", "N x row_stride past int64");
  }

  // ---- The plan drives the shared online-softmax math to the right row statistics.
  {
    std::mt19937 gen(0);
    std::normal_distribution<float> normal(0.f, 4.f);
    for (int64_t v : {1, 65, 5003, 151936}) {
      std::vector<float> x(v);
      for (auto& e : x) e = normal(gen);
      if (v > 100) {
        for (int64_t i = 0; i < v / 3; ++i) x[i] = -INFINITY;  // whole tiles of -inf before finite values
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

  // ---- The Tiling is plain words (the kernel copies it from global memory word by word).
  CHECK(sizeof(Tiling) == kTilingWords * sizeof(int64_t), "Tiling is int64 words");

  if (g_failures) {
    std::printf("npu tiling: %d of %d checks failed\n", g_failures, g_checks);
    return 1;
  }
  std::printf("npu tiling: %d checks passed\n", g_checks);
  return 0;
}
