// Tiling of the selective log-softmax op for the Ascend NPU, shared by the
// host glue (selective_log_softmax_npu.cpp), the AscendC kernel
// (selective_log_softmax_kernel.cpp), its CPU emulation against the stand-in of
// the AscendC API (standins/ascendc/) and the CPU unit test
// (tests/backends/npu/npu_tiling_test.cpp).
//
// Plain C++ without any standard header: the struct and the index helpers
// compile for the AI core (where <cstdint>, <cmath> and most of csrc/common/
// do not; csrc/common/row_index.h is written to), the
// planning below them for the host, for the AscendC CPU-debug mode and for the
// stand-in. Which of the two a compilation is, is keyed on `__aicore__`: the
// AscendC headers define it (as an attribute for the device, as nothing in
// CPU-debug mode) before this file is included; host code never has it.
//
// The plan: rows are split across the vector cores (the first `front_cores`
// take one row more than the rest); each row is streamed through the Unified
// Buffer (UB) in tiles of `tile_len` elements, the last one `tail_len` long.
// tile_len depends on V, the dtype, the mode and the UB budget, never on N:
// a row is reduced in the same order whatever the batch (batch invariance).
// Every UB buffer is a whole number of 32-byte blocks; tiles are moved with
// DataCopyPad (any length, any GM address).
#pragma once

#include "../common/row_index.h"  // RowIndexOf, ceil_div: one copy for every backend

#if defined(__aicore__)
#define TM_NPU_INLINE __aicore__ inline
#else
#define TM_NPU_INLINE inline
#endif

namespace twinkle_mem {
namespace npu {

typedef long long i64;  // int64_t without <cstdint> (which the AI core lacks); LP64 and the AI core agree

constexpr i64 kUbBlockBytes = 32;               // UB address / DataCopy granule
constexpr i64 kRepeatBytes = 256;               // one vector instruction repeat
constexpr i64 kAlignElems = kRepeatBytes / 4;   // 64: a whole fp32 repeat, whole 32 B blocks in any dtype
constexpr i64 kRowBatch = 64;                   // per-row results staged in UB before one copy out
constexpr i64 kScalarSlots = 4;                 // 32 B UB slots (forward): reduce results, 1-element exp / ln
// UB per vector core on the 220 architecture (Atlas A2 / A3: 910B, 910_93) is
// 192 KiB, of which the AscendC library keeps the top 8 KiB as its own
// temporary space (CANN kernel_utils_constants.h, TMP_UB_OFFSET): the kernel's
// buffers must fit in the remaining 184 KiB.
constexpr i64 kUbBytes220 = 192 * 1024;
constexpr i64 kUbLibraryReserve = 8 * 1024;
constexpr i64 kUbBudget220 = kUbBytes220 - kUbLibraryReserve;

enum Mode : i64 { kForward = 0, kBackward = 1 };

// Element offset of a row of a [N, ...] or [B, S, ...] tensor: row_index.h's
// RowIndexOf over i64 (three words of the Tiling), rows(row) its offset.
using RowIndexNpu = twinkle_mem::RowIndexOf<i64>;
using twinkle_mem::ceil_div;

// Everything the kernel needs, as int64 words so that the kernel can copy it
// from global memory word by word. Written by make_tiling(); read-only after.
struct Tiling {
  i64 n_rows;             // N (rows = B * S for [B, S, V] logits)
  i64 vocab;              // V: elements of a row that belong to this shard
  i64 vocab_start;        // first vocab id of the shard
  i64 vocab_size;         // labels outside [0, vocab_size) (and not ignore_index) are errors
  i64 ignore_index;
  RowIndexNpu x_rows;     // logits rows
  RowIndexNpu g_rows;     // gradient rows (backward; the logits' own for in place)
  RowIndexNpu y_rows;     // labels rows
  i64 label_k;            // labels per row (1 for labels of the logits' leading shape; 0 allowed)
  i64 label_k_stride;     // elements between a row's labels
  i64 elem_bytes;         // 2 (bf16 / fp16) or 4 (fp32)
  i64 label_bytes;        // 4 (int32) or 8 (int64)
  i64 with_entropy;       // 0 / 1
  i64 mode;               // kForward / kBackward
  i64 used_cores;         // cores launched (0 when N = 0: no launch)
  i64 rows_per_core;      // rows of a tail core; front cores take one more
  i64 front_cores;        // cores [0, front_cores) take rows_per_core + 1 rows
  i64 tile_len;           // elements per full tile (multiple of kAlignElems)
  i64 num_tiles;          // tiles per row, the last one a tail
  i64 tail_len;           // elements of the last tile, in [1, tile_len]
  i64 reduce_work_elems;  // fp32 scratch of ReduceMax (with index) / ReduceSum over one tile
  i64 ub_bytes_used;      // UB bytes the kernel's buffers take (<= the budget)
};

constexpr i64 kTilingWords = sizeof(Tiling) / sizeof(i64);

TM_NPU_INLINE i64 align_up(i64 a, i64 b) { return ceil_div(a, b) * b; }
TM_NPU_INLINE i64 align_down(i64 a, i64 b) { return (a / b) * b; }

// First row of `core`, and how many rows it owns.
TM_NPU_INLINE i64 core_row_begin(const Tiling& t, i64 core) {
  return core < t.front_cores ? core * (t.rows_per_core + 1)
                              : t.front_cores * (t.rows_per_core + 1) + (core - t.front_cores) * t.rows_per_core;
}
TM_NPU_INLINE i64 core_row_count(const Tiling& t, i64 core) {
  if (core >= t.used_cores) return 0;
  return core < t.front_cores ? t.rows_per_core + 1 : t.rows_per_core;
}

// Elements of tile `tile` (the last one may be shorter), and its first column.
TM_NPU_INLINE i64 tile_elems(const Tiling& t, i64 tile) { return tile == t.num_tiles - 1 ? t.tail_len : t.tile_len; }
TM_NPU_INLINE i64 tile_begin(const Tiling& t, i64 tile) { return tile * t.tile_len; }

// 64-bit element offsets (B x S x V exceeds 2^31).
TM_NPU_INLINE i64 logits_offset(const Tiling& t, i64 row, i64 col) { return t.x_rows(row) + col; }
TM_NPU_INLINE i64 grad_offset(const Tiling& t, i64 row, i64 col) { return t.g_rows(row) + col; }
TM_NPU_INLINE i64 label_offset(const Tiling& t, i64 row, i64 j) { return t.y_rows(row) + j * t.label_k_stride; }

// online_softmax.h's is_ignored / local_target / label_in_range, restated for
// the AI core: the label's column on this shard, or -1 when it is ignored, lies
// on another shard, or is out of range (the kernel never reads outside the row
// for any label value).
TM_NPU_INLINE bool label_ignored(const Tiling& t, i64 label) { return label == t.ignore_index; }
TM_NPU_INLINE bool label_out_of_range(const Tiling& t, i64 label) {
  return label != t.ignore_index && (label < 0 || label >= t.vocab_size);
}
TM_NPU_INLINE i64 label_column(const Tiling& t, i64 label) {
  if (label == t.ignore_index) return -1;
  const i64 local = label - t.vocab_start;
  return (local >= 0 && local < t.vocab) ? local : -1;
}

// fp32 elements of the ReduceMax scratch for `count` inputs with the index
// returned, as the AscendC documentation of ReduceMax gives it (every round's
// output kept, each rounded up to a 32-byte block). ReduceSum over the same
// count needs less (on A2 / A3 its first-n form uses none), so one buffer serves both.
TM_NPU_INLINE i64 reduce_work_elems(i64 count) {
  const i64 per_block = kUbBlockBytes / 4, per_repeat = kRepeatBytes / 4;
  const i64 out1 = ceil_div(count, per_repeat) * 2;
  const i64 start2 = align_up(out1, per_block);
  const i64 out2 = ceil_div(out1, per_repeat) * 2;
  const i64 end2 = align_up(out2, per_block);
  if (out2 <= 2) return start2 + end2;
  const i64 out3 = ceil_div(out2, per_repeat) * 2;
  return start2 + end2 + align_up(out3, per_block);
}

// UB bytes taken by the kernel's buffers for a tile length (the kernel's
// InitBuffer calls, one for one; the stand-in asserts every call against the budget):
//   forward : input queue (2 x tile, logits dtype) + 2 fp32 tiles (x or t; exp(t))
//             + reduce scratch + scalar slots + staged per-row results (shift,
//             log_sum, entropy of kRowBatch rows, and kRowBatch log-probs)
//   backward: input and output queues (2 + 2 x tile, logits dtype) + 3 fp32
//             tiles (u; p; the gradient); no scalar slots (only the forward has them)
TM_NPU_INLINE i64 ub_bytes_for(i64 tile_len, i64 elem_bytes, i64 mode) {
  const i64 tile_bytes = align_up(tile_len * elem_bytes, kUbBlockBytes), fp32_tile = tile_len * 4;
  if (mode == kForward) {
    const i64 slots = kScalarSlots * kUbBlockBytes;
    return 2 * tile_bytes + 2 * fp32_tile + align_up(reduce_work_elems(tile_len) * 4, kUbBlockBytes) + slots +
           4 * kRowBatch * 4;
  }
  return 4 * tile_bytes + 3 * fp32_tile;
}

#if !defined(__aicore__) || defined(ASCENDC_CPU_DEBUG)
// ------------------------------------------- host, CPU-debug and stand-in only
// Inputs of the plan; the glue fills them from the tensors and the platform.
struct TilingRequest {
  i64 n_rows = 0;
  i64 vocab = 0;
  RowIndexNpu x_rows{1, 0, 0};
  RowIndexNpu g_rows{1, 0, 0};  // backward only; inner_stride 0 = contiguous (V)
  RowIndexNpu y_rows{1, 0, 1};
  i64 label_k = 1;
  i64 label_k_stride = 1;
  i64 elem_bytes = 0;
  i64 label_bytes = 8;
  i64 vocab_start = 0;
  i64 vocab_size = 0;
  i64 ignore_index = 0;
  bool with_entropy = false;
  i64 mode = kForward;
  i64 ub_bytes = 0;     // UB bytes the kernel may use per vector core (kUbBudget220 on A2 / A3)
  i64 core_count = 0;   // vector cores (AIV) available to the launch
  i64 max_tile_len = 0; // 0 = as large as the UB allows; tests and tuning set it
};

// Why a request was refused: nullptr when it was accepted. The messages name
// the argument, as op_checks.h does; the glue raises them as RuntimeError.
struct TilingResult {
  Tiling tiling;
  const char* error;
};

inline TilingResult make_tiling(const TilingRequest& r) {
  TilingResult res{};
  Tiling& t = res.tiling;
  res.error = nullptr;
  auto fail = [&res](const char* msg) {
    res.error = msg;
    return res;
  };
  if (r.n_rows < 0) return fail("twinkle_mem(npu): n_rows must be >= 0");
  if (r.elem_bytes != 2 && r.elem_bytes != 4)
    return fail("twinkle_mem(npu): logits must be bfloat16, float16 or float32 (elem_bytes 2 or 4)");
  if (r.label_bytes != 4 && r.label_bytes != 8)
    return fail("twinkle_mem(npu): labels must be int32 or int64 (label_bytes 4 or 8)");
  if (r.n_rows > 0 && r.vocab < 1) return fail("twinkle_mem(npu): the vocab dim V must be >= 1");
  if (r.vocab < 0) return fail("twinkle_mem(npu): the vocab dim V must be >= 0");
  if (r.label_k < 0) return fail("twinkle_mem(npu): label_k must be >= 0");
  if (r.vocab_start < 0 || r.vocab_start > r.vocab_size - r.vocab)
    return fail("twinkle_mem(npu): the vocab shard [vocab_start, vocab_start + V) must lie within [0, vocab_size)");
  if (r.mode != kForward && r.mode != kBackward) return fail("twinkle_mem(npu): mode must be forward or backward");
  if (r.core_count < 1) return fail("twinkle_mem(npu): core_count must be >= 1");
  if (r.max_tile_len < 0) return fail("twinkle_mem(npu): max_tile_len must be >= 0");
  const RowIndexNpu* rows[3] = {&r.x_rows, &r.g_rows, &r.y_rows};
  for (const RowIndexNpu* ri : rows) {
    if (ri->inner < 1 || ri->outer_stride < 0 || ri->inner_stride < 0)
      return fail("twinkle_mem(npu): row strides must be >= 0 and the inner row count >= 1");
  }
  // Offsets are int64: the last element of every tensor must be addressable.
  const i64 kMax = 0x7fffffffffffffffLL;
  if (r.n_rows > 0) {
    for (const RowIndexNpu* ri : rows) {
      const i64 outer = (r.n_rows - 1) / ri->inner, inner = ri->inner < r.n_rows ? ri->inner : r.n_rows;
      const i64 span = r.vocab + r.label_k * (r.label_k_stride > 0 ? r.label_k_stride : 1);
      if ((ri->outer_stride > 0 && outer > (kMax / 4) / ri->outer_stride) ||
          (ri->inner_stride > 0 && inner > (kMax / 4) / ri->inner_stride) || span > kMax / 4)
        return fail("twinkle_mem(npu): N x row_stride overflows int64 offsets");
    }
  }

  const i64 min_tile = kAlignElems;
  if (ub_bytes_for(min_tile, r.elem_bytes, r.mode) > r.ub_bytes)
    return fail("twinkle_mem(npu): ub_bytes is too small for one 64-element tile");
  // The largest aligned tile that fits the UB budget (ub_bytes_for grows with the tile).
  i64 lo = min_tile, hi = align_down(r.ub_bytes / (r.elem_bytes + 4), kAlignElems);
  if (hi < lo) hi = lo;
  while (lo < hi) {
    const i64 mid = align_down(lo + (hi - lo + kAlignElems) / 2, kAlignElems);
    if (ub_bytes_for(mid, r.elem_bytes, r.mode) <= r.ub_bytes) {
      lo = mid;
    } else {
      hi = mid - kAlignElems;
    }
  }
  i64 tile = lo;
  if (r.max_tile_len > 0) {
    const i64 cap = align_down(r.max_tile_len, kAlignElems);
    if (cap < kAlignElems) return fail("twinkle_mem(npu): max_tile_len must be >= 64");
    if (cap < tile) tile = cap;
  }
  const i64 row_need = align_up(r.vocab > 0 ? r.vocab : 1, kAlignElems);
  if (row_need < tile) tile = row_need;

  t.n_rows = r.n_rows;
  t.vocab = r.vocab;
  t.vocab_start = r.vocab_start;
  t.vocab_size = r.vocab_size;
  t.ignore_index = r.ignore_index;
  t.x_rows = r.x_rows;
  t.g_rows = r.g_rows;
  if (t.g_rows.inner_stride == 0 && t.g_rows.outer_stride == 0) t.g_rows = RowIndexNpu{1, 0, r.vocab};
  t.y_rows = r.y_rows;
  t.label_k = r.label_k;
  t.label_k_stride = r.label_k_stride;
  t.elem_bytes = r.elem_bytes;
  t.label_bytes = r.label_bytes;
  t.with_entropy = r.with_entropy ? 1 : 0;
  t.mode = r.mode;
  t.used_cores = r.n_rows < r.core_count ? r.n_rows : r.core_count;
  t.rows_per_core = t.used_cores > 0 ? r.n_rows / t.used_cores : 0;
  t.front_cores = t.used_cores > 0 ? r.n_rows % t.used_cores : 0;
  t.tile_len = tile;
  t.num_tiles = r.vocab > 0 ? ceil_div(r.vocab, tile) : 0;
  t.tail_len = r.vocab > 0 ? r.vocab - (t.num_tiles - 1) * tile : 0;
  t.reduce_work_elems = reduce_work_elems(tile);
  t.ub_bytes_used = ub_bytes_for(tile, r.elem_bytes, r.mode);
  return res;
}

// Whether the SoC named `soc` (as CANN and torch_npu spell it, any case:
// "Ascend910B2", "Ascend910_9392", "Ascend950PR_...") has the bf16 vector
// instructions the bf16 kernels need: the 220 architecture (Atlas A2 = 910B,
// A3 = 910_93) and later (950). Not: 310P, 310B, the first-generation 910.
inline bool soc_supports_bf16(const char* soc) {
  if (soc == nullptr) return false;
  char low[64];
  int n = 0;
  for (; soc[n] != '\0' && n < 63; ++n) {
    const char c = soc[n];
    low[n] = (c >= 'A' && c <= 'Z') ? static_cast<char>(c - 'A' + 'a') : c;
  }
  low[n] = '\0';
  const char* families[] = {"ascend910b", "ascend910_93", "ascend950"};
  for (const char* f : families) {
    int i = 0;
    while (f[i] != '\0' && low[i] == f[i]) ++i;
    if (f[i] == '\0') return true;
  }
  return false;
}
#endif  // host, CPU-debug and stand-in

}  // namespace npu
}  // namespace twinkle_mem
