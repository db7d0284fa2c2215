// Tiling of the selective log-softmax op for the Ascend NPU, shared by the
// host glue (selective_log_softmax_npu.cpp), the AscendC kernel
// (selective_log_softmax_kernel.cpp) and the CPU unit test
// (tests/npu_tiling_test.cpp). Plain C++17, no CANN header: the struct and the
// inline index helpers compile for the AI core (bisheng defines
// __CCE_AICORE__), the planning and validation below them for the host only.
//
// The plan: rows are split across the vector cores (the first `front_cores`
// take one row more than the rest); each row is streamed through the Unified
// Buffer (UB) in tiles of `tile_len` elements, the last one `tail_len` long.
// A tile is moved with DataCopyPad (any length, any GM address); tile_len is
// a multiple of kAlignElems, so every UB buffer of a tile, in the logits'
// dtype or in fp32, stays a whole number of 32-byte blocks and each fp32
// vector instruction works on whole 256-byte repeats.
#pragma once

#include <stdint.h>

#if defined(__CCE_AICORE__)
#define TM_NPU_INLINE __aicore__ inline
#else
#define TM_NPU_INLINE inline
#endif

namespace twinkle_mem {
namespace npu {

constexpr int64_t kUbBlockBytes = 32;     // UB address / DataCopy granule
constexpr int64_t kRepeatBytes = 256;     // one vector instruction repeat
constexpr int64_t kAlignElems = kRepeatBytes / 4;  // 64: a whole fp32 repeat, a whole 32 B block in any dtype
constexpr int64_t kRowBatch = 64;         // rows whose statistics are staged in UB before one copy out
constexpr int64_t kScalarSlots = 4;       // 32 B UB slots for reduce results and 1-element exp / ln

enum Mode : int64_t { kForward = 0, kBackward = 1 };

// Everything the kernel needs, as int64 words so that the kernel can copy it
// from global memory word by word. Written by make_tiling(); read-only after.
struct Tiling {
  int64_t n_rows;            // N
  int64_t vocab;             // V: elements of a row that belong to this shard
  int64_t row_stride;        // elements between rows of the logits (>= V)
  int64_t out_row_stride;    // elements between rows of the gradient (backward)
  int64_t elem_bytes;        // 2 (bf16 / fp16) or 4 (fp32)
  int64_t label_bytes;       // 4 (int32) or 8 (int64)
  int64_t vocab_start;       // first vocab id of the shard
  int64_t ignore_index;
  int64_t with_entropy;      // 0 / 1
  int64_t mode;              // kForward / kBackward
  int64_t used_cores;        // cores launched (0 when N = 0: no launch)
  int64_t rows_per_core;     // rows of a tail core; front cores take one more
  int64_t front_cores;       // cores [0, front_cores) take rows_per_core + 1 rows
  int64_t tile_len;          // elements per full tile (multiple of kAlignElems)
  int64_t num_tiles;         // tiles per row, the last one a tail
  int64_t tail_len;          // elements of the last tile, in [1, tile_len]
  int64_t reduce_work_elems; // fp32 scratch of ReduceMax / ReduceSum over one tile
  int64_t ub_bytes_used;     // UB bytes the kernel's buffers take (<= UB size)
};

constexpr int64_t kTilingWords = sizeof(Tiling) / sizeof(int64_t);

TM_NPU_INLINE int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
TM_NPU_INLINE int64_t align_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }
TM_NPU_INLINE int64_t align_down(int64_t a, int64_t b) { return (a / b) * b; }

// First row of `core`, and how many rows it owns.
TM_NPU_INLINE int64_t core_row_begin(const Tiling& t, int64_t core) {
  return core < t.front_cores ? core * (t.rows_per_core + 1)
                              : t.front_cores * (t.rows_per_core + 1) + (core - t.front_cores) * t.rows_per_core;
}
TM_NPU_INLINE int64_t core_row_count(const Tiling& t, int64_t core) {
  return core < t.front_cores ? t.rows_per_core + 1 : t.rows_per_core;
}

// Elements of tile `tile` (the last one may be shorter), and its first column.
TM_NPU_INLINE int64_t tile_elems(const Tiling& t, int64_t tile) {
  return tile == t.num_tiles - 1 ? t.tail_len : t.tile_len;
}
TM_NPU_INLINE int64_t tile_begin(const Tiling& t, int64_t tile) { return tile * t.tile_len; }

// 64-bit element offsets into the logits / gradient (N x row_stride exceeds 2^31).
TM_NPU_INLINE int64_t logits_offset(const Tiling& t, int64_t row, int64_t col) { return row * t.row_stride + col; }
TM_NPU_INLINE int64_t grad_offset(const Tiling& t, int64_t row, int64_t col) { return row * t.out_row_stride + col; }

// The label's column on this shard, or -1 when the row is ignored or its
// label lies on another shard (the math of online_softmax.h's is_ignored and
// local_target, restated for the AI core where that header does not compile).
TM_NPU_INLINE int64_t label_column(const Tiling& t, int64_t label) {
  if (label == t.ignore_index) return -1;
  const int64_t local = label - t.vocab_start;
  return (local >= 0 && local < t.vocab) ? local : -1;
}
// Which tile holds column `col`, and where inside it.
TM_NPU_INLINE int64_t tile_of(const Tiling& t, int64_t col) { return col / t.tile_len; }
TM_NPU_INLINE int64_t col_in_tile(const Tiling& t, int64_t col) { return col % t.tile_len; }

// fp32 elements of ReduceMax / ReduceSum scratch for `count` inputs: one
// partial per 256-byte repeat, rounded up to a 32-byte block; doubled so the
// same buffer serves ReduceMax with its index pairs.
TM_NPU_INLINE int64_t reduce_work_elems(int64_t count) {
  return 2 * align_up(ceil_div(count, kAlignElems), kUbBlockBytes / 4);
}

// UB bytes taken by the kernel's buffers for a given tile length:
//   forward : input queue (2 x tile, logits dtype) + fp32 z and e (2 x tile)
//   backward: input and output queues (2 + 2 x tile, logits dtype) + fp32 z and p (2 x tile)
//   both    : reduce scratch, scalar slots, and staged per-row values.
TM_NPU_INLINE int64_t ub_bytes_for(int64_t tile_len, int64_t elem_bytes, int64_t mode) {
  const int64_t queues = (mode == kForward ? 2 : 4) * tile_len * elem_bytes;
  const int64_t fp32_work = 2 * tile_len * 4;
  const int64_t scratch = reduce_work_elems(tile_len) * 4 + kScalarSlots * kUbBlockBytes;
  const int64_t staged = 4 * kRowBatch * 4;  // logp, entropy, lse, mean of kRowBatch rows
  return queues + fp32_work + scratch + staged;
}

#if !defined(__CCE_AICORE__)
// ------------------------------------------------------------------ host only
// Inputs of the plan; the glue fills them from the tensors and the platform.
struct TilingRequest {
  int64_t n_rows = 0;
  int64_t vocab = 0;
  int64_t row_stride = 0;
  int64_t out_row_stride = 0;  // backward only; 0 = contiguous (V)
  int64_t elem_bytes = 0;
  int64_t label_bytes = 8;
  int64_t vocab_start = 0;
  int64_t vocab_size = 0;
  int64_t ignore_index = 0;
  bool with_entropy = false;
  int64_t mode = kForward;
  int64_t ub_bytes = 0;     // UB per vector core (192 KiB on Ascend 910B)
  int64_t core_count = 0;   // vector cores (AIV) available to the launch
  int64_t max_tile_len = 0; // 0 = as large as the UB allows; tests and tuning set it
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
  auto fail = [&](const char* msg) {
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
  if (r.n_rows > 1 && r.row_stride < r.vocab)
    return fail("twinkle_mem(npu): logits rows must not overlap (row_stride < V)");
  if (r.vocab_start < 0 || r.vocab_start > r.vocab_size - r.vocab)
    return fail("twinkle_mem(npu): the vocab shard [vocab_start, vocab_start + V) must lie within [0, vocab_size)");
  if (r.mode != kForward && r.mode != kBackward) return fail("twinkle_mem(npu): mode must be forward or backward");
  if (r.core_count < 1) return fail("twinkle_mem(npu): core_count must be >= 1");
  if (r.max_tile_len < 0) return fail("twinkle_mem(npu): max_tile_len must be >= 0");
  const int64_t out_stride = r.out_row_stride > 0 ? r.out_row_stride : r.vocab;
  if (r.mode == kBackward && r.n_rows > 1 && out_stride < r.vocab)
    return fail("twinkle_mem(npu): gradient rows must not overlap (out_row_stride < V)");
  // Offsets are int64: the last element of the last row must be addressable.
  const int64_t max_stride = r.row_stride > out_stride ? r.row_stride : out_stride;
  if (r.n_rows > 0 && max_stride > 0 && r.n_rows - 1 > (INT64_MAX - r.vocab) / max_stride)
    return fail("twinkle_mem(npu): N x row_stride overflows int64 offsets");

  if (ub_bytes_for(kAlignElems, r.elem_bytes, r.mode) > r.ub_bytes)
    return fail("twinkle_mem(npu): ub_bytes is too small for one 64-element tile");

  // The largest aligned tile that fits the UB, no longer than the row needs.
  int64_t lo = kAlignElems, hi = align_down(r.ub_bytes / (r.elem_bytes + 4), kAlignElems);
  if (hi < lo) hi = lo;
  while (lo < hi) {  // largest tile with ub_bytes_for(tile) <= ub_bytes
    const int64_t mid = align_down(lo + (hi - lo + kAlignElems) / 2, kAlignElems);
    if (ub_bytes_for(mid, r.elem_bytes, r.mode) <= r.ub_bytes) {
      lo = mid;
    } else {
      hi = mid - kAlignElems;
    }
  }
  int64_t tile = lo;
  if (r.max_tile_len > 0) {
    const int64_t cap = align_down(r.max_tile_len, kAlignElems);
    if (cap < kAlignElems) return fail("twinkle_mem(npu): max_tile_len must be >= 64");
    if (cap < tile) tile = cap;
  }
  const int64_t row_need = align_up(r.vocab > 0 ? r.vocab : 1, kAlignElems);
  if (row_need < tile) tile = row_need;

  t.n_rows = r.n_rows;
  t.vocab = r.vocab;
  t.row_stride = r.n_rows > 1 ? r.row_stride : (r.row_stride > r.vocab ? r.row_stride : r.vocab);
  t.out_row_stride = out_stride;
  t.elem_bytes = r.elem_bytes;
  t.label_bytes = r.label_bytes;
  t.vocab_start = r.vocab_start;
  t.ignore_index = r.ignore_index;
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
  res.error = nullptr;
  return res;
}
#endif  // !__CCE_AICORE__

}  // namespace npu
}  // namespace twinkle_mem
