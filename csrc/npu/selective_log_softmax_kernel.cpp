// AscendC kernels of the selective log-softmax op (forward, backward, in-place
// backward) for the Ascend NPU, and their host-side launchers.
//
// Compiled by the CANN toolchain on a CANN node (csrc/npu/CMakeLists.txt), by
// g++ in AscendC's CPU-debug mode (ASCENDC_CPU_DEBUG: no launchers), and by
// g++ against the project's stand-in of the AscendC API (emulation/), which
// runs this file's kernels in CI. See docs/npu.md for what each of them proves.
//
// The algorithm is the CPU / CUDA kernels' (csrc/common/online_softmax.h),
// restated with vector instructions because that header cannot compile on
// the AI core (it needs <cmath> and scalar exp / log the scalar unit lacks):
//   - rows (of [N, V] or [B, S, V] logits with any leading strides) are split
//     across the vector cores by the plan in tiling.h;
//   - each row streams through the Unified Buffer in tiles of tile_len
//     elements (a function of V and the dtype, never of N: batch invariance),
//     double buffered: the copy-in of the next tile, or of the next row's
//     first tile, is issued before the current tile is computed;
//   - per tile: x in fp32, its max m and the max's index (ReduceMax), that
//     element set to -inf (it is the state's implicit 1: rest sums every
//     other element), t = (x - m) / T, e = exp(t), rest = sum e,
//     zsum = sum max(lowest, t) e (sums halved pairwise, then ReduceSum);
//     tiles merged in order with merge() (far-below clamp included, one
//     scalar exp per merge);
//   - per row: shift = max (0 for a row of -inf), log_sum = log1p(rest),
//     entropy = log_sum - zsum / (1 + rest), logp_j = (x_j - shift) / T - log_sum;
//   - backward per tile: u = (x - shift) / T - log_sum, p = exp(u),
//     d = p (b (max(u_floor, u) + entropy) + a) off the labels and
//     d = p (b (max(u_floor, u) + entropy) + a_here) - g_here / T expm1(u) at
//     them (grad_off_label() and grad_at_label(): a = -G / T, b = -g_H / T; the
//     same grouping, with b w and + a as a multiply then an add, no fused
//     multiply-add; expm1 as a series for |u| < 0.5, else p - 1), written over
//     the logits for the in-place variant (each tile is read before it is
//     written; tiles and rows are disjoint).
#include "kernel_operator.h"
#include "scalar_math.h"
#include "tiling.h"

using namespace AscendC;
namespace tm_npu = twinkle_mem::npu;
using tm_npu::i64;

namespace {

constexpr float kLowest = -3.40282347e+38f;  // max(lowest, t) keeps t e = 0 at t = -inf
constexpr float kFarBelow = -1e30f;          // merge(): exp() of it is 0, times any sum finite
constexpr float kUFloor = -150.0f;           // exp_underflow<float>(): p = 0 below it
constexpr int32_t kSlotFloats = static_cast<int32_t>(tm_npu::kUbBlockBytes / sizeof(float));  // one block per slot

// One pipe waits for another (the AscendC flag pair); e.g. Sync<HardEvent::V_S>()
// before the scalar unit reads a vector result.
template <HardEvent E>
__aicore__ inline void Sync() {
  event_t ev = static_cast<event_t>(GetTPipePtr()->FetchEventID(E));
  SetFlag<E>(ev);
  WaitFlag<E>(ev);
}

// Online state of a row (online_softmax.h OnlineSoftmax<float>); rest = -1 is empty.
struct State {
  float max;
  float rest;
  float zsum;
};

// What the forward and the backward share: the plan, the core's rows, the
// labels, the logits' copy-in queue and fp32 work tiles.
template <typename T>
class RowStream {
 public:
  __aicore__ inline void InitCommon(TPipe* pipe, GM_ADDR logits, GM_ADDR labels, GM_ADDR tiling, float inv_t) {
    pipe_ = pipe;
    GlobalTensor<int64_t> tiling_gm;
    tiling_gm.SetGlobalBuffer(reinterpret_cast<__gm__ int64_t*>(tiling), tm_npu::kTilingWords);
    i64* words = reinterpret_cast<i64*>(&t_);
    for (i64 i = 0; i < tm_npu::kTilingWords; ++i) words[i] = tiling_gm.GetValue(i);
    inv_t_ = inv_t;
    const i64 core = GetBlockIdx();
    row_begin_ = tm_npu::core_row_begin(t_, core);
    row_end_ = row_begin_ + tm_npu::core_row_count(t_, core);
    x_gm_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(logits));
    x_bits_gm_.SetGlobalBuffer(reinterpret_cast<__gm__ uint16_t*>(logits));
    if (t_.label_bytes == 8) {
      y64_gm_.SetGlobalBuffer(reinterpret_cast<__gm__ int64_t*>(labels));
    } else {
      y32_gm_.SetGlobalBuffer(reinterpret_cast<__gm__ int32_t*>(labels));
    }
    pipe_->InitBuffer(in_q_, 2, static_cast<uint32_t>(t_.tile_len * sizeof(T)));
    pipe_->InitBuffer(a_buf_, static_cast<uint32_t>(t_.tile_len * sizeof(float)));
    pipe_->InitBuffer(b_buf_, static_cast<uint32_t>(t_.tile_len * sizeof(float)));
  }

 protected:
  __aicore__ inline i64 Label(i64 row, i64 j) {
    const i64 at = tm_npu::label_offset(t_, row, j);
    return t_.label_bytes == 8 ? static_cast<i64>(y64_gm_.GetValue(at)) : static_cast<i64>(y32_gm_.GetValue(at));
  }
  // A row with labels, all of them ignore_index, is skipped: outputs 0, logits unread.
  __aicore__ inline bool Skipped(i64 row) {
    if (t_.label_k == 0) return false;
    for (i64 j = 0; j < t_.label_k; ++j) {
      if (!tm_npu::label_ignored(t_, Label(row, j))) return false;
    }
    return true;
  }
  __aicore__ inline i64 NextLiveRow(i64 row) {
    for (i64 r = row + 1; r < row_end_; ++r) {
      if (!Skipped(r)) return r;
    }
    return row_end_;
  }

  // One logit as fp32, read by the scalar unit (the forward's label logits).
  __aicore__ inline float Logit(i64 row, i64 col) {
    const i64 at = tm_npu::logits_offset(t_, row, col);
    if constexpr (IsSameType<T, float>::value) {
      return x_gm_.GetValue(at);
    } else {
      const uint16_t bits = x_bits_gm_.GetValue(at);
      return IsSameType<T, half>::value ? tm_npu::fp16_bits_to_float(bits) : tm_npu::bf16_bits_to_float(bits);
    }
  }

  // GM -> UB, any length and address (DataCopyPad pads the UB side to 32 bytes).
  __aicore__ inline void CopyIn(i64 row, i64 tile) {
    LocalTensor<T> x = in_q_.template AllocTensor<T>();
    const i64 len = tm_npu::tile_elems(t_, tile);
    DataCopyExtParams params{1, static_cast<uint32_t>(len * sizeof(T)), 0, 0, 0};
    DataCopyPadExtParams<T> no_pad;  // no padding values: the kernel never reads past len
    DataCopyPad(x, x_gm_[tm_npu::logits_offset(t_, row, tm_npu::tile_begin(t_, tile))], params, no_pad);
    in_q_.EnQue(x);
  }
  // Prefetch for the tile after (row, tile): the row's next tile, else the
  // next live row's first one (`next_row` == row_end_: none).
  __aicore__ inline void Prefetch(i64 row, i64 tile, i64 next_row) {
    if (tile + 1 < t_.num_tiles) {
      CopyIn(row, tile + 1);
    } else if (next_row < row_end_) {
      CopyIn(next_row, 0);
    }
  }

  // The tile at the head of the queue as fp32: cast into a_buf_ (bf16 / fp16;
  // the queue slot is freed at once), or the queue slot itself (fp32; freed by
  // ReleaseX() once a vector instruction has read it into a_buf_).
  __aicore__ inline LocalTensor<float> LoadX(int32_t len) {
    LocalTensor<T> x = in_q_.template DeQue<T>();
    PipeBarrier<PIPE_V>();  // the previous tile's vector instructions are done with the work tiles
    if constexpr (IsSameType<T, float>::value) {
      held_ = x;
      return x;
    } else {
      LocalTensor<float> a = a_buf_.Get<float>();
      Cast(a, x, RoundMode::CAST_NONE, len);
      PipeBarrier<PIPE_V>();
      in_q_.FreeTensor(x);
      return a;
    }
  }
  __aicore__ inline void ReleaseX() {
    if constexpr (IsSameType<T, float>::value) in_q_.FreeTensor(held_);
  }

  TPipe* pipe_;
  tm_npu::Tiling t_;
  float inv_t_;
  i64 row_begin_, row_end_;
  GlobalTensor<T> x_gm_;
  GlobalTensor<uint16_t> x_bits_gm_;
  GlobalTensor<int64_t> y64_gm_;
  GlobalTensor<int32_t> y32_gm_;
  TQue<TPosition::VECIN, 2> in_q_;
  TBuf<TPosition::VECCALC> a_buf_, b_buf_;
  LocalTensor<T> held_;
};

// ------------------------------------------------------------------ forward
template <typename T>
class ForwardKernel : public RowStream<T> {
 public:
  __aicore__ inline void Init(TPipe* pipe, GM_ADDR logits, GM_ADDR labels, GM_ADDR logp, GM_ADDR entropy,
                              GM_ADDR shift, GM_ADDR log_sum, GM_ADDR tiling, float inv_t) {
    this->InitCommon(pipe, logits, labels, tiling, inv_t);
    pipe->InitBuffer(slot_buf_, static_cast<uint32_t>(tm_npu::kScalarSlots * tm_npu::kUbBlockBytes));
    logp_gm_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(logp));
    shift_gm_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(shift));
    log_sum_gm_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(log_sum));
    if (this->t_.with_entropy) entropy_gm_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(entropy));
    pipe->InitBuffer(work_buf_, static_cast<uint32_t>(tm_npu::align_up(this->t_.reduce_work_elems * 4,
                                                                        tm_npu::kUbBlockBytes)));
    pipe->InitBuffer(stage_buf_, static_cast<uint32_t>(4 * tm_npu::kRowBatch * sizeof(float)));
    stage_ = stage_buf_.Get<float>();
    rows_first_ = this->row_begin_;
    logp_first_ = this->row_begin_ * this->t_.label_k;
  }

  __aicore__ inline void Process() {
    i64 live = this->NextLiveRow(this->row_begin_ - 1);
    if (live < this->row_end_) this->CopyIn(live, 0);
    for (i64 row = this->row_begin_; row < this->row_end_; ++row) {
      if (row != live) {  // skipped: every output 0
        StageRow(0.0f, 0.0f, 0.0f);
        for (i64 j = 0; j < this->t_.label_k; ++j) StageLogp(0.0f);
        continue;
      }
      const i64 next = this->NextLiveRow(row);
      Row(row, next);
      live = next;
    }
    FlushRows();
    FlushLogp();
  }

 private:
  __aicore__ inline void Row(i64 row, i64 next_row) {
    const tm_npu::Tiling& t = this->t_;
    State state{tm_npu::neg_inf(), -1.0f, 0.0f};
    for (i64 k = 0; k < t.num_tiles; ++k) {
      this->Prefetch(row, k, next_row);
      state = Merge(state, TileState(static_cast<int32_t>(tm_npu::tile_elems(t, k))));
    }
    // finalize(): shift, log_sum = log1p(rest), entropy = log_sum - E_p[t]
    // (a row of only -inf, rest = -1: log_sum = -inf without a vector Ln(0))
    const float shift = state.max == tm_npu::neg_inf() ? 0.0f : state.max;
    const float log_sum = tm_npu::log1p_from_ln(
        state.rest, tm_npu::log1p_needs_ln(state.rest) ? ScalarLn(1.0f + state.rest) : 0.0f);
    const float entropy = log_sum - state.zsum / (1.0f + state.rest);
    StageRow(shift, log_sum, t.with_entropy ? entropy : 0.0f);
    for (i64 j = 0; j < t.label_k; ++j) {
      const i64 y = this->Label(row, j);
      const i64 col = tm_npu::label_column(t, y);
      float logp = 0.0f;
      if (tm_npu::label_out_of_range(t, y)) {
        logp = tm_npu::quiet_nan();  // an invalid label shows in the output; the glue raises later
      } else if (col >= 0) {
        logp = (this->Logit(row, col) - shift) * this->inv_t_ - log_sum;  // log_prob()
      }
      StageLogp(logp);
    }
  }

  // The state of the tile at the head of the queue: {max, sum of exp(t) over
  // all elements but the (first) max, sum max(lowest, t) exp(t)}, t = (x - max) / T.
  __aicore__ inline State TileState(int32_t len) {
    LocalTensor<float> x = this->LoadX(len);
    LocalTensor<float> a = this->a_buf_.template Get<float>(), e = this->b_buf_.template Get<float>();
    LocalTensor<float> work = work_buf_.Get<float>();
    LocalTensor<float> s_max = Slot(0), s_sum = Slot(1), s_zsum = Slot(2);

    ReduceMax(s_max, x, work, len, true);
    Sync<HardEvent::V_S>();
    const float m = s_max.GetValue(0);
    const uint32_t at_max = tm_npu::bits_of_float(s_max.GetValue(1));  // the index, stored as the value's bits
    // A max of -inf: no max element, the exponentials taken against 0 (finite_shift), and the sums decide
    // (block_state): 0 for a tile of only -inf, NaN where ReduceMax passed over a NaN.
    const bool no_max = m == tm_npu::neg_inf();
    if (!no_max && at_max < static_cast<uint32_t>(len)) x.SetValue(at_max, tm_npu::neg_inf());  // the max leaves the sum
    Sync<HardEvent::S_V>();  // (also: the slot's reads are done before a vector instruction rewrites it)
    Adds(a, x, no_max ? 0.0f : -m, len);  // (in place for bf16 / fp16)
    PipeBarrier<PIPE_V>();
    this->ReleaseX();
    if (this->inv_t_ != 1.0f) {  // x * 1 = x: nothing to do at T = 1
      Muls(a, a, this->inv_t_, len);
      PipeBarrier<PIPE_V>();
    }
    Exp(e, a, len);
    PipeBarrier<PIPE_V>();
    if (this->t_.with_entropy) {
      Maxs(a, a, kLowest, len);  // t = -inf -> lowest: its term lowest * 0 is 0, not NaN
      PipeBarrier<PIPE_V>();
      Mul(a, a, e, len);
      PipeBarrier<PIPE_V>();
      Sum(s_zsum, a, work, len);
    }
    Sum(s_sum, e, work, len);
    Sync<HardEvent::V_S>();
    const float sum = s_sum.GetValue(0), zsum = this->t_.with_entropy ? s_zsum.GetValue(0) : 0.0f;
    if (!no_max) return {m, sum, zsum};
    return sum == sum ? State{m, -1.0f, 0.0f} : State{sum, sum, sum};  // block_state(): empty, or NaN
  }

  // dst[0] = the sum of v[0, len), v destroyed. ReduceSum adds its 256-byte
  // repeats one after another (on A2 / A3), an error growing with the tile;
  // halving the tile with vector adds first (pairwise, log2 levels) keeps a
  // 16K-element sum as accurate as a 64-element one. The order depends on len only.
  __aicore__ inline void Sum(const LocalTensor<float>& dst, const LocalTensor<float>& v,
                             const LocalTensor<float>& work, int32_t len) {
    while (len > static_cast<int32_t>(tm_npu::kAlignElems)) {
      const int32_t half = static_cast<int32_t>(tm_npu::align_up(tm_npu::ceil_div(len, 2), tm_npu::kAlignElems));
      Add(v, v, v[half], len - half);  // v[i] += v[half + i]; v[half] is 256-byte aligned
      PipeBarrier<PIPE_V>();
      len = half;
    }
    ReduceSum(dst, v, work, len);
    PipeBarrier<PIPE_V>();
  }

  // online_softmax.h merge(): exact for any split of a row; the state with the
  // larger max keeps its max element (a on ties), the other's whole sum
  // (1 + rest) joins the rest scaled by exp(gap), gap clamped at kFarBelow.
  __aicore__ inline State Merge(const State& a, const State& b) {
    if (b.rest == -1.0f) return a;
    if (a.rest == -1.0f) return b;
    const bool a_top = !(b.max > a.max);
    const State& top = a_top ? a : b;
    const State& low = a_top ? b : a;
    const float g = (low.max - top.max) * this->inv_t_;
    const float gap = kFarBelow > g ? kFarBelow : g;  // max_(kFarBelow, g): NaN stays NaN
    const float scale = ScalarExp(gap);
    const float weight = low.rest * scale + scale;
    return {top.max, top.rest + weight, top.zsum + (gap * weight + low.zsum * scale)};
  }

  // exp / ln of one scalar, as 1-element vector instructions.
  __aicore__ inline float ScalarExp(float v) { return OnScalar<true>(v); }
  __aicore__ inline float ScalarLn(float v) { return OnScalar<false>(v); }
  template <bool kExp>
  __aicore__ inline float OnScalar(float v) {
    LocalTensor<float> s = Slot(3);
    s.SetValue(0, v);
    Sync<HardEvent::S_V>();
    if constexpr (kExp) {
      Exp(s, s, 1);
    } else {
      Ln(s, s, 1);
    }
    Sync<HardEvent::V_S>();
    return s.GetValue(0);
  }

  // Per-row results and log-probs are staged in UB and copied out in runs
  // (a core's rows, and their row * k log-probs, are contiguous in the outputs).
  __aicore__ inline void StageRow(float shift, float log_sum, float entropy) {
    const i64 i = rows_staged_;
    stage_.SetValue(static_cast<uint32_t>(i), shift);
    stage_.SetValue(static_cast<uint32_t>(tm_npu::kRowBatch + i), log_sum);
    stage_.SetValue(static_cast<uint32_t>(2 * tm_npu::kRowBatch + i), entropy);
    if (++rows_staged_ == tm_npu::kRowBatch) FlushRows();
  }
  __aicore__ inline void StageLogp(float logp) {
    stage_.SetValue(static_cast<uint32_t>(3 * tm_npu::kRowBatch + logp_staged_), logp);
    if (++logp_staged_ == tm_npu::kRowBatch) FlushLogp();
  }
  __aicore__ inline void FlushRows() {
    if (rows_staged_ == 0) return;
    Sync<HardEvent::S_MTE3>();
    DataCopyExtParams params{1, static_cast<uint32_t>(rows_staged_ * sizeof(float)), 0, 0, 0};
    DataCopyPad(shift_gm_[rows_first_], stage_[0], params);
    DataCopyPad(log_sum_gm_[rows_first_], stage_[tm_npu::kRowBatch], params);
    if (this->t_.with_entropy) DataCopyPad(entropy_gm_[rows_first_], stage_[2 * tm_npu::kRowBatch], params);
    Sync<HardEvent::MTE3_S>();  // the stage is rewritten by the scalar unit next
    rows_first_ += rows_staged_;
    rows_staged_ = 0;
  }
  __aicore__ inline void FlushLogp() {
    if (logp_staged_ == 0) return;
    Sync<HardEvent::S_MTE3>();
    DataCopyExtParams params{1, static_cast<uint32_t>(logp_staged_ * sizeof(float)), 0, 0, 0};
    DataCopyPad(logp_gm_[logp_first_], stage_[3 * tm_npu::kRowBatch], params);
    Sync<HardEvent::MTE3_S>();
    logp_first_ += logp_staged_;
    logp_staged_ = 0;
  }

  // Scalar slots (forward only): reduce results and the 1-element exp / ln.
  __aicore__ inline LocalTensor<float> Slot(int32_t i) { return slot_buf_.Get<float>()[i * kSlotFloats]; }

  TBuf<TPosition::VECCALC> work_buf_, slot_buf_;
  TBuf<TPosition::VECOUT> stage_buf_;  // UB -> GM copies read VECIN / VECOUT buffers
  LocalTensor<float> stage_;
  i64 rows_first_ = 0, rows_staged_ = 0, logp_first_ = 0, logp_staged_ = 0;
  GlobalTensor<float> logp_gm_, entropy_gm_, shift_gm_, log_sum_gm_;
};

// ----------------------------------------------------------------- backward
template <typename T>
class BackwardKernel : public RowStream<T> {
 public:
  // grad may equal logits (in-place backward): the plan's g_rows are then the logits' rows.
  __aicore__ inline void Init(TPipe* pipe, GM_ADDR grad_logp, GM_ADDR grad_entropy, GM_ADDR logits, GM_ADDR labels,
                              GM_ADDR shift, GM_ADDR log_sum, GM_ADDR entropy, GM_ADDR grad, GM_ADDR tiling,
                              float inv_t) {
    this->InitCommon(pipe, logits, labels, tiling, inv_t);
    g_logp_gm_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(grad_logp));
    shift_gm_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(shift));
    log_sum_gm_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(log_sum));
    if (this->t_.with_entropy) {
      g_entropy_gm_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(grad_entropy));
      entropy_gm_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(entropy));
    }
    grad_gm_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(grad));
    pipe->InitBuffer(out_q_, 2, static_cast<uint32_t>(this->t_.tile_len * sizeof(T)));
    pipe->InitBuffer(c_buf_, static_cast<uint32_t>(this->t_.tile_len * sizeof(float)));
  }

  __aicore__ inline void Process() {
    i64 live = this->NextLiveRow(this->row_begin_ - 1);
    if (live < this->row_end_) this->CopyIn(live, 0);
    for (i64 row = this->row_begin_; row < this->row_end_; ++row) {
      if (row != live) {  // skipped: a zero gradient, the logits unread
        for (i64 k = 0; k < this->t_.num_tiles; ++k) ZeroTile(row, k);
        continue;
      }
      const i64 next = this->NextLiveRow(row);
      Row(row, next);
      live = next;
    }
  }

 private:
  // row_grad()'s constants for grad_off_label()'s p (b (max(u_floor, u) + entropy) + a):
  // a = -G / T (neg_g_total_t), b = -g_H / T, G = the sum of the row's
  // non-ignored upstream logp gradients (other shards' labels included). The
  // tile keeps online_softmax.h's grouping (w = u + entropy = z - E_p[z], small
  // where p is large) and forms b w + a as Muls then Adds: no fused multiply-add.
  struct RowConsts {
    float neg_shift, neg_log_sum, entropy, b, g_total, neg_g_total_t;
  };

  __aicore__ inline void Row(i64 row, i64 next_row) {
    const tm_npu::Tiling& t = this->t_;
    RowConsts c;
    c.g_total = 0.0f;
    for (i64 j = 0; j < t.label_k; ++j) {
      if (!tm_npu::label_ignored(t, this->Label(row, j))) c.g_total += g_logp_gm_.GetValue(row * t.label_k + j);
    }
    const float g_entropy = t.with_entropy ? g_entropy_gm_.GetValue(row) : 0.0f;
    c.entropy = t.with_entropy ? entropy_gm_.GetValue(row) : 0.0f;
    c.neg_shift = -shift_gm_.GetValue(row);
    c.neg_log_sum = -log_sum_gm_.GetValue(row);
    c.neg_g_total_t = -c.g_total * this->inv_t_;
    c.b = -g_entropy * this->inv_t_;
    for (i64 k = 0; k < t.num_tiles; ++k) {
      this->Prefetch(row, k, next_row);
      Tile(row, k, c);
    }
  }

  __aicore__ inline void Tile(i64 row, i64 k, const RowConsts& c) {
    const tm_npu::Tiling& t = this->t_;
    const int32_t len = static_cast<int32_t>(tm_npu::tile_elems(t, k));
    // u = log p = (x - shift) / T - log_sum (log_p()), p = exp(u)
    LocalTensor<float> x = this->LoadX(len);
    LocalTensor<float> u = this->a_buf_.template Get<float>(), p = this->b_buf_.template Get<float>();
    LocalTensor<float> w = c_buf_.Get<float>();
    Adds(u, x, c.neg_shift, len);
    PipeBarrier<PIPE_V>();
    this->ReleaseX();
    if (this->inv_t_ != 1.0f) {  // x * 1 = x: nothing to do at T = 1
      Muls(u, u, this->inv_t_, len);
      PipeBarrier<PIPE_V>();
    }
    Adds(u, u, c.neg_log_sum, len);
    PipeBarrier<PIPE_V>();
    Exp(p, u, len);
    PipeBarrier<PIPE_V>();
    // d = p (b (max(u_floor, u) + entropy) - G / T) into the fp32 gradient
    // tile (for fp32 logits the output slot itself, otherwise w, cast below)
    LocalTensor<T> out = out_q_.template AllocTensor<T>();
    LocalTensor<float> d = w;
    if constexpr (IsSameType<T, float>::value) d = out;
    if (t.with_entropy) {
      Adds(w, u, c.entropy, len);
      PipeBarrier<PIPE_V>();
      Maxs(w, w, kUFloor + c.entropy, len);  // the floor where p = 0: b u stays finite at x = -inf
      PipeBarrier<PIPE_V>();
      Muls(w, w, c.b, len);
      PipeBarrier<PIPE_V>();
      Adds(w, w, c.neg_g_total_t, len);
      PipeBarrier<PIPE_V>();
      Mul(d, w, p, len);
    } else {
      Muls(d, p, c.neg_g_total_t, len);
    }
    // grad_at_label() at the positions of this tile that hold labels
    const i64 begin = tm_npu::tile_begin(t, k);
    bool synced = false;
    for (i64 j = 0; j < t.label_k; ++j) {
      const i64 col = tm_npu::label_column(t, this->Label(row, j)) - begin;
      if (col < 0 || col >= len) continue;
      if (!synced) {
        Sync<HardEvent::V_S>();
        synced = true;
      }
      // The upstream gradient of every label at this position (repeated labels
      // summed; each of them writes the same value).
      float g_here = 0.0f;
      for (i64 i = 0; i < t.label_k; ++i) {
        if (tm_npu::label_column(t, this->Label(row, i)) - begin == col) g_here += g_logp_gm_.GetValue(row * t.label_k + i);
      }
      const float uc = u.GetValue(static_cast<uint32_t>(col)), pc = p.GetValue(static_cast<uint32_t>(col));
      const float expm1_u = (uc > -tm_npu::kExpm1SeriesBound && uc < tm_npu::kExpm1SeriesBound)
                                ? tm_npu::expm1_series(uc)
                                : pc - 1.0f;
      // p (a_here + b u) - g_here / T expm1(u), a_here = -(g_other + g_H entropy) / T
      const float lin = c.b * ((kUFloor > uc ? kUFloor : uc) + c.entropy) - (c.g_total - g_here) * this->inv_t_;
      d.SetValue(static_cast<uint32_t>(col), pc * lin - (g_here * this->inv_t_) * expm1_u);
    }
    if (synced) {
      Sync<HardEvent::S_V>();
    } else {
      PipeBarrier<PIPE_V>();
    }
    if constexpr (!IsSameType<T, float>::value) Cast(out, w, RoundMode::CAST_RINT, len);
    CopyOut(row, k, out, len);
  }

  // A zero tile of a skipped row, written without reading the logits.
  __aicore__ inline void ZeroTile(i64 row, i64 k) {
    const int32_t len = static_cast<int32_t>(tm_npu::tile_elems(this->t_, k));
    LocalTensor<T> out = out_q_.template AllocTensor<T>();
    if constexpr (IsSameType<T, float>::value) {
      Duplicate(out, 0.0f, len);
    } else {
      LocalTensor<float> w = c_buf_.Get<float>();
      Duplicate(w, 0.0f, len);
      PipeBarrier<PIPE_V>();
      Cast(out, w, RoundMode::CAST_RINT, len);
    }
    CopyOut(row, k, out, len);
  }

  // UB -> GM at (row, tile k) of the gradient.
  __aicore__ inline void CopyOut(i64 row, i64 k, LocalTensor<T>& out, int32_t len) {
    out_q_.EnQue(out);
    out = out_q_.template DeQue<T>();
    DataCopyExtParams params{1, static_cast<uint32_t>(len * sizeof(T)), 0, 0, 0};
    DataCopyPad(grad_gm_[tm_npu::grad_offset(this->t_, row, tm_npu::tile_begin(this->t_, k))], out, params);
    out_q_.FreeTensor(out);
  }

  TQue<TPosition::VECOUT, 2> out_q_;
  TBuf<TPosition::VECCALC> c_buf_;
  GlobalTensor<float> g_logp_gm_, g_entropy_gm_, shift_gm_, log_sum_gm_, entropy_gm_;
  GlobalTensor<T> grad_gm_;
};

}  // namespace

// ------------------------------------------------------------ entry points
#define TM_NPU_KERNELS(NAME, TYPE)                                                                                 \
  extern "C" __global__ __aicore__ void twinkle_mem_sls_fwd_##NAME(GM_ADDR logits, GM_ADDR labels, GM_ADDR logp,   \
                                                                   GM_ADDR entropy, GM_ADDR shift,                \
                                                                   GM_ADDR log_sum, GM_ADDR tiling, float inv_t) { \
    TPipe pipe;                                                                                                    \
    ForwardKernel<TYPE> op;                                                                                        \
    op.Init(&pipe, logits, labels, logp, entropy, shift, log_sum, tiling, inv_t);                                  \
    op.Process();                                                                                                  \
  }                                                                                                                \
  extern "C" __global__ __aicore__ void twinkle_mem_sls_bwd_##NAME(                                                \
      GM_ADDR grad_logp, GM_ADDR grad_entropy, GM_ADDR logits, GM_ADDR labels, GM_ADDR shift, GM_ADDR log_sum,     \
      GM_ADDR entropy, GM_ADDR grad, GM_ADDR tiling, float inv_t) {                                                \
    TPipe pipe;                                                                                                    \
    BackwardKernel<TYPE> op;                                                                                       \
    op.Init(&pipe, grad_logp, grad_entropy, logits, labels, shift, log_sum, entropy, grad, tiling, inv_t);         \
    op.Process();                                                                                                  \
  }

TM_NPU_KERNELS(fp32, float)
TM_NPU_KERNELS(fp16, half)
#if !defined(TWINKLE_MEM_NPU_NO_BF16)  // bf16 vector ops need the 220 architecture (A2 / A3) or later; CMake decides
TM_NPU_KERNELS(bf16, bfloat16_t)
#define TM_NPU_HAS_BF16 1
#endif

// --------------------------------------------------------- host launchers
// Called by the torch_npu glue from inside an OpCommand custom handler, on
// the current NPU stream. g++ cannot parse <<<>>>: AscendC's CPU-debug mode
// (and the project's stand-in, which defines ASCENDC_CPU_DEBUG too) runs the
// kernels through its own entry instead.
#ifndef ASCENDC_CPU_DEBUG
#include "launch.h"

extern "C" int twinkle_mem_npu_kernel_dtypes(void) {
  int mask = (1 << TWINKLE_MEM_NPU_FP32) | (1 << TWINKLE_MEM_NPU_FP16);
#ifdef TM_NPU_HAS_BF16
  mask |= 1 << TWINKLE_MEM_NPU_BF16;
#endif
  return mask;
}

extern "C" int twinkle_mem_npu_launch_fwd(int dtype, uint32_t block_dim, void* stream, uint8_t* logits,
                                          uint8_t* labels, uint8_t* logp, uint8_t* entropy, uint8_t* shift,
                                          uint8_t* log_sum, uint8_t* tiling, float inv_t) {
  switch (dtype) {
    case TWINKLE_MEM_NPU_FP32:
      twinkle_mem_sls_fwd_fp32<<<block_dim, nullptr, stream>>>(logits, labels, logp, entropy, shift, log_sum, tiling,
                                                                inv_t);
      return 0;
    case TWINKLE_MEM_NPU_FP16:
      twinkle_mem_sls_fwd_fp16<<<block_dim, nullptr, stream>>>(logits, labels, logp, entropy, shift, log_sum, tiling,
                                                                inv_t);
      return 0;
#ifdef TM_NPU_HAS_BF16
    case TWINKLE_MEM_NPU_BF16:
      twinkle_mem_sls_fwd_bf16<<<block_dim, nullptr, stream>>>(logits, labels, logp, entropy, shift, log_sum, tiling,
                                                                inv_t);
      return 0;
#endif
    default:
      return 1;
  }
}

extern "C" int twinkle_mem_npu_launch_bwd(int dtype, uint32_t block_dim, void* stream, uint8_t* grad_logp,
                                          uint8_t* grad_entropy, uint8_t* logits, uint8_t* labels, uint8_t* shift,
                                          uint8_t* log_sum, uint8_t* entropy, uint8_t* grad, uint8_t* tiling,
                                          float inv_t) {
  switch (dtype) {
    case TWINKLE_MEM_NPU_FP32:
      twinkle_mem_sls_bwd_fp32<<<block_dim, nullptr, stream>>>(grad_logp, grad_entropy, logits, labels, shift,
                                                                log_sum, entropy, grad, tiling, inv_t);
      return 0;
    case TWINKLE_MEM_NPU_FP16:
      twinkle_mem_sls_bwd_fp16<<<block_dim, nullptr, stream>>>(grad_logp, grad_entropy, logits, labels, shift,
                                                                log_sum, entropy, grad, tiling, inv_t);
      return 0;
#ifdef TM_NPU_HAS_BF16
    case TWINKLE_MEM_NPU_BF16:
      twinkle_mem_sls_bwd_bf16<<<block_dim, nullptr, stream>>>(grad_logp, grad_entropy, logits, labels, shift,
                                                                log_sum, entropy, grad, tiling, inv_t);
      return 0;
#endif
    default:
      return 1;
  }
}
#endif  // ASCENDC_CPU_DEBUG
