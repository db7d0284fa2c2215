// AscendC kernels of the selective log-softmax op (forward, backward, in-place
// backward) for the Ascend NPU, and their host-side launchers.
//
// WRITTEN FOR THE CLUSTER: this file needs the CANN toolkit (bisheng,
// kernel_operator.h) and has not been compiled or run on the machines this
// project is developed on. See docs/npu.md for what was verified where.
//
// The algorithm is the CPU/CUDA kernels' (csrc/common/online_softmax.h):
//   - rows are split across the vector cores by the plan in tiling.h
//     (front cores take one row more);
//   - each row is streamed through the Unified Buffer in tiles of
//     tile_len elements, double buffered (a depth-2 TQue: the copy-in of tile
//     k+1 is issued before tile k is computed), tails moved by DataCopyPad;
//   - bf16/fp16 tiles are cast to fp32 in UB; z = x / T is formed there;
//   - each tile yields (shift = finite max, sum exp(z - shift),
//     sum (max(lowest, z) - shift) exp(z - shift)), merged into the row's
//     online state with online_softmax.h's merge();
//   - the backward recomputes p = exp(z - lse) tile by tile:
//       d = [g_logp (onehot - p) - g_H p (max(lowest, z) - mean)] / T,
//     written to the gradient, or over the logits for the in-place variant
//     (each tile is read before it is written, tiles are disjoint).
// online_softmax.h cannot be included here (it needs <cmath>/<limits> and
// scalar exp, which the AI core's scalar unit lacks), so merge() and
// finalize() are restated below on scalars, with exp/ln done as 1-element
// vector instructions; tests/npu_tiling_test.cpp runs the header's merge over
// this kernel's tile plan on the CPU.
#include "kernel_operator.h"
#include "tiling.h"

using namespace AscendC;
namespace tm_npu = twinkle_mem::npu;

namespace {

constexpr float kLowest = -3.40282347e+38f;  // lowest finite fp32: max(lowest, -inf) keeps (z - m) * 0 at 0
constexpr int32_t kSlotFloats = 8;           // one 32-byte block per scalar slot

__aicore__ inline float NegInf() { return -__builtin_inff(); }

// Online state of one row (online_softmax.h OnlineSoftmax<float>).
struct State {
  float max;
  float sum;
  float zsum;
};

// Waits until the vector pipe's results are visible to the scalar unit, and back.
__aicore__ inline void VectorToScalar() {
  event_t ev = static_cast<event_t>(GetTPipePtr()->FetchEventID(HardEvent::V_S));
  SetFlag<HardEvent::V_S>(ev);
  WaitFlag<HardEvent::V_S>(ev);
}
__aicore__ inline void ScalarToVector() {
  event_t ev = static_cast<event_t>(GetTPipePtr()->FetchEventID(HardEvent::S_V));
  SetFlag<HardEvent::S_V>(ev);
  WaitFlag<HardEvent::S_V>(ev);
}
__aicore__ inline void ScalarToCopyOut() {
  event_t ev = static_cast<event_t>(GetTPipePtr()->FetchEventID(HardEvent::S_MTE3));
  SetFlag<HardEvent::S_MTE3>(ev);
  WaitFlag<HardEvent::S_MTE3>(ev);
}
__aicore__ inline void CopyOutToScalar() {
  event_t ev = static_cast<event_t>(GetTPipePtr()->FetchEventID(HardEvent::MTE3_S));
  SetFlag<HardEvent::MTE3_S>(ev);
  WaitFlag<HardEvent::MTE3_S>(ev);
}

__aicore__ inline void LoadTiling(GM_ADDR tiling_gm, tm_npu::Tiling& t) {
  const __gm__ int64_t* src = reinterpret_cast<const __gm__ int64_t*>(tiling_gm);
  int64_t* dst = reinterpret_cast<int64_t*>(&t);
  for (int64_t i = 0; i < tm_npu::kTilingWords; ++i) dst[i] = src[i];
}

// Shared by the forward and the backward: tiling, row range, labels, the
// logits' copy-in queue, fp32 work tiles and scalar slots.
template <typename T>
class RowStreamer {
 public:
  __aicore__ inline void InitCommon(TPipe* pipe, GM_ADDR logits, GM_ADDR labels, GM_ADDR tiling, float inv_t) {
    pipe_ = pipe;
    LoadTiling(tiling, t_);
    inv_t_ = inv_t;
    core_ = GetBlockIdx();
    row_begin_ = tm_npu::core_row_begin(t_, core_);
    row_count_ = core_ < t_.used_cores ? tm_npu::core_row_count(t_, core_) : 0;
    x_gm_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(logits));
    if (t_.label_bytes == 8) {
      labels64_gm_.SetGlobalBuffer(reinterpret_cast<__gm__ int64_t*>(labels));
    } else {
      labels32_gm_.SetGlobalBuffer(reinterpret_cast<__gm__ int32_t*>(labels));
    }
    pipe_->InitBuffer(in_q_, 2, t_.tile_len * sizeof(T));
    pipe_->InitBuffer(z_buf_, t_.tile_len * sizeof(float));
    pipe_->InitBuffer(w_buf_, t_.tile_len * sizeof(float));
    pipe_->InitBuffer(reduce_buf_, t_.reduce_work_elems * sizeof(float));
    pipe_->InitBuffer(slot_buf_, tm_npu::kScalarSlots * tm_npu::kUbBlockBytes);
  }

 protected:
  __aicore__ inline int64_t Label(int64_t row) {
    return t_.label_bytes == 8 ? labels64_gm_.GetValue(row) : static_cast<int64_t>(labels32_gm_.GetValue(row));
  }

  // GM -> UB, any length and address (DataCopyPad pads the UB side to 32 bytes).
  __aicore__ inline void CopyIn(int64_t row, int64_t tile) {
    LocalTensor<T> x = in_q_.template AllocTensor<T>();
    const int64_t len = tm_npu::tile_elems(t_, tile);
    DataCopyExtParams params{1, static_cast<uint32_t>(len * sizeof(T)), 0, 0, 0};
    DataCopyPadExtParams<T> no_pad;
    DataCopyPad(x, x_gm_[tm_npu::logits_offset(t_, row, tm_npu::tile_begin(t_, tile))], params, no_pad);
    in_q_.EnQue(x);
  }

  // z = x / T in fp32, from the tile at the head of the queue (which is freed).
  __aicore__ inline LocalTensor<float> ScaledTile(int32_t len) {
    LocalTensor<T> x = in_q_.template DeQue<T>();
    LocalTensor<float> z = z_buf_.Get<float>();
    if constexpr (IsSameType<T, float>::value) {
      Muls(z, x, inv_t_, len);
    } else {
      Cast(z, x, RoundMode::CAST_NONE, len);
      PipeBarrier<PIPE_V>();
      Muls(z, z, inv_t_, len);
    }
    PipeBarrier<PIPE_V>();
    in_q_.FreeTensor(x);
    return z;
  }

  __aicore__ inline LocalTensor<float> Slot(int32_t i) { return slot_buf_.Get<float>()[i * kSlotFloats]; }

  // exp / ln of one scalar, as a 1-element vector instruction.
  __aicore__ inline float ScalarExp(float v) {
    LocalTensor<float> s = Slot(3);
    s.SetValue(0, v);
    ScalarToVector();
    Exp(s, s, 1);
    VectorToScalar();
    return s.GetValue(0);
  }
  __aicore__ inline float ScalarLn(float v) {
    LocalTensor<float> s = Slot(3);
    s.SetValue(0, v);
    ScalarToVector();
    Ln(s, s, 1);
    VectorToScalar();
    return s.GetValue(0);
  }

  // online_softmax.h merge(): exact for any split of a row. One exponent of the
  // two is exp(0) = 1, so one scalar exp suffices.
  __aicore__ inline State Merge(const State& a, const State& b) {
    if (b.sum == 0.0f) return a;
    if (a.sum == 0.0f) return b;
    if (a.max > b.max) {
      const float db = b.max - a.max, eb = ScalarExp(db);
      return {a.max, a.sum + b.sum * eb, a.zsum + (b.zsum + db * b.sum) * eb};
    }
    const float da = a.max - b.max, ea = ScalarExp(da);
    return {b.max, a.sum * ea + b.sum, (a.zsum + da * a.sum) * ea + b.zsum};
  }

  TPipe* pipe_;
  tm_npu::Tiling t_;
  float inv_t_;
  int64_t core_, row_begin_, row_count_;
  GlobalTensor<T> x_gm_;
  GlobalTensor<int64_t> labels64_gm_;
  GlobalTensor<int32_t> labels32_gm_;
  TQue<QuePosition::VECIN, 2> in_q_;
  TBuf<QuePosition::VECCALC> z_buf_, w_buf_, reduce_buf_, slot_buf_;
};

// ------------------------------------------------------------------ forward
template <typename T>
class ForwardKernel : public RowStreamer<T> {
  using Base = RowStreamer<T>;

 public:
  __aicore__ inline void Init(TPipe* pipe, GM_ADDR logits, GM_ADDR labels, GM_ADDR logp, GM_ADDR entropy,
                              GM_ADDR lse, GM_ADDR mean, GM_ADDR tiling, float inv_t) {
    this->InitCommon(pipe, logits, labels, tiling, inv_t);
    logp_gm_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(logp));
    lse_gm_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(lse));
    if (this->t_.with_entropy) {
      entropy_gm_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(entropy));
      mean_gm_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(mean));
    }
    this->pipe_->InitBuffer(stage_buf_, 4 * tm_npu::kRowBatch * sizeof(float));
  }

  __aicore__ inline void Process() {
    LocalTensor<float> stage = stage_buf_.Get<float>();
    constexpr int64_t B = tm_npu::kRowBatch;
    for (int64_t first = 0; first < this->row_count_; first += B) {
      const int64_t rows = this->row_count_ - first < B ? this->row_count_ - first : B;
      for (int64_t i = 0; i < rows; ++i) {
        float out[4];
        Row(this->row_begin_ + first + i, out);
        for (int32_t k = 0; k < 4; ++k) stage.SetValue(k * B + i, out[k]);
      }
      ScalarToCopyOut();
      DataCopyExtParams params{1, static_cast<uint32_t>(rows * sizeof(float)), 0, 0, 0};
      const int64_t row0 = this->row_begin_ + first;
      DataCopyPad(logp_gm_[row0], stage[0], params);
      DataCopyPad(lse_gm_[row0], stage[B], params);
      if (this->t_.with_entropy) {
        DataCopyPad(entropy_gm_[row0], stage[2 * B], params);
        DataCopyPad(mean_gm_[row0], stage[3 * B], params);
      }
      CopyOutToScalar();  // the next batch overwrites the stage
    }
  }

 private:
  // out = {logp, lse, entropy, mean} of one row; zeros for an ignored row.
  __aicore__ inline void Row(int64_t row, float out[4]) {
    const tm_npu::Tiling& t = this->t_;
    const int64_t label = this->Label(row);
    if (label == t.ignore_index) {
      out[0] = out[1] = out[2] = out[3] = 0.0f;
      return;
    }
    const int64_t col = tm_npu::label_column(t, label);
    const int64_t target_tile = col >= 0 ? tm_npu::tile_of(t, col) : -1;
    float z_target = 0.0f;
    State state{NegInf(), 0.0f, 0.0f};
    this->CopyIn(row, 0);
    for (int64_t k = 0; k < t.num_tiles; ++k) {
      if (k + 1 < t.num_tiles) this->CopyIn(row, k + 1);  // double buffer: next tile in flight
      state = this->Merge(state, Tile(k, k == target_tile ? tm_npu::col_in_tile(t, col) : -1, z_target));
    }
    // online_softmax.h finalize()
    const float log_sum = this->ScalarLn(state.sum);
    const float rel_mean = state.zsum / state.sum;
    out[1] = state.max + log_sum;
    out[0] = col >= 0 ? z_target - out[1] : 0.0f;
    out[2] = log_sum - rel_mean;
    out[3] = state.max + rel_mean;
  }

  // The state of one tile: {shift, sum exp(z - shift), sum (max(lowest, z) - shift) exp(z - shift)}.
  __aicore__ inline State Tile(int64_t k, int64_t target_in_tile, float& z_target) {
    const int32_t len = static_cast<int32_t>(tm_npu::tile_elems(this->t_, k));
    LocalTensor<float> z = this->ScaledTile(len);
    LocalTensor<float> e = this->w_buf_.template Get<float>();
    LocalTensor<float> work = this->reduce_buf_.template Get<float>();
    LocalTensor<float> s_max = this->Slot(0), s_sum = this->Slot(1), s_zsum = this->Slot(2);

    ReduceMax(s_max, z, work, len, false);
    VectorToScalar();
    const float m = s_max.GetValue(0);
    if (target_in_tile >= 0) z_target = z.GetValue(target_in_tile);
    const float shift = m == NegInf() ? 0.0f : m;  // finite_shift(): a tile of only -inf has shift 0

    if (this->t_.with_entropy) {
      Maxs(z, z, kLowest, len);  // -inf -> lowest: its term (lowest - shift) * 0 is 0, not NaN
      PipeBarrier<PIPE_V>();
    }
    Adds(z, z, -shift, len);
    PipeBarrier<PIPE_V>();
    Exp(e, z, len);
    PipeBarrier<PIPE_V>();
    ReduceSum(s_sum, e, work, len);
    if (this->t_.with_entropy) {
      PipeBarrier<PIPE_V>();
      Mul(z, z, e, len);
      PipeBarrier<PIPE_V>();
      ReduceSum(s_zsum, z, work, len);
    }
    VectorToScalar();
    return {shift, s_sum.GetValue(0), this->t_.with_entropy ? s_zsum.GetValue(0) : 0.0f};
  }

  TBuf<QuePosition::VECCALC> stage_buf_;
  GlobalTensor<float> logp_gm_, entropy_gm_, lse_gm_, mean_gm_;
};

// ----------------------------------------------------------------- backward
template <typename T>
class BackwardKernel : public RowStreamer<T> {
 public:
  // grad may equal logits (in-place backward): out_row_stride then equals row_stride.
  __aicore__ inline void Init(TPipe* pipe, GM_ADDR grad_logp, GM_ADDR grad_entropy, GM_ADDR logits, GM_ADDR labels,
                              GM_ADDR lse, GM_ADDR mean, GM_ADDR grad, GM_ADDR tiling, float inv_t) {
    this->InitCommon(pipe, logits, labels, tiling, inv_t);
    g_logp_gm_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(grad_logp));
    lse_gm_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(lse));
    if (this->t_.with_entropy) {
      g_entropy_gm_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(grad_entropy));
      mean_gm_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(mean));
    }
    grad_gm_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(grad));
    this->pipe_->InitBuffer(out_q_, 2, this->t_.tile_len * sizeof(T));
  }

  __aicore__ inline void Process() {
    for (int64_t i = 0; i < this->row_count_; ++i) Row(this->row_begin_ + i);
  }

 private:
  __aicore__ inline void Row(int64_t row) {
    const tm_npu::Tiling& t = this->t_;
    const int64_t label = this->Label(row);
    if (label == t.ignore_index) {  // zero gradient; the logits are not read
      for (int64_t k = 0; k < t.num_tiles; ++k) {
        const int32_t len = static_cast<int32_t>(tm_npu::tile_elems(t, k));
        LocalTensor<float> p = this->w_buf_.template Get<float>();
        Duplicate(p, 0.0f, len);
        PipeBarrier<PIPE_V>();
        CopyOut(row, k, p, len);
      }
      return;
    }
    const int64_t col = tm_npu::label_column(t, label);
    const int64_t target_tile = col >= 0 ? tm_npu::tile_of(t, col) : -1;
    const float g_logp = g_logp_gm_.GetValue(row), lse = lse_gm_.GetValue(row);
    const float g_entropy = t.with_entropy ? g_entropy_gm_.GetValue(row) : 0.0f;
    const float mean = t.with_entropy ? mean_gm_.GetValue(row) : 0.0f;
    this->CopyIn(row, 0);
    for (int64_t k = 0; k < t.num_tiles; ++k) {
      if (k + 1 < t.num_tiles) this->CopyIn(row, k + 1);  // disjoint from tile k: safe in place
      const int32_t len = static_cast<int32_t>(tm_npu::tile_elems(t, k));
      LocalTensor<float> z = this->ScaledTile(len);
      LocalTensor<float> p = this->w_buf_.template Get<float>();
      // p = exp(z - lse)
      Adds(p, z, -lse, len);
      PipeBarrier<PIPE_V>();
      Exp(p, p, len);
      PipeBarrier<PIPE_V>();
      if (t.with_entropy) {  // z = g_H p (max(lowest, z) - mean): p first, so p = 0 at -inf gives 0
        Maxs(z, z, kLowest, len);
        PipeBarrier<PIPE_V>();
        Adds(z, z, -mean, len);
        PipeBarrier<PIPE_V>();
        Mul(z, z, p, len);
        PipeBarrier<PIPE_V>();
        Muls(z, z, g_entropy, len);
        PipeBarrier<PIPE_V>();
      }
      // p = -(g_logp p + z) / T: the gradient with onehot = 0
      Muls(p, p, g_logp, len);
      PipeBarrier<PIPE_V>();
      if (t.with_entropy) {
        Add(p, p, z, len);
        PipeBarrier<PIPE_V>();
      }
      Muls(p, p, -this->inv_t_, len);
      if (k == target_tile) {  // + g_logp / T at the label
        const int64_t j = tm_npu::col_in_tile(t, col);
        VectorToScalar();
        p.SetValue(j, p.GetValue(j) + g_logp * this->inv_t_);
        ScalarToVector();
      } else {
        PipeBarrier<PIPE_V>();
      }
      CopyOut(row, k, p, len);
    }
  }

  // p (fp32) -> the logits' dtype -> global memory at (row, tile k).
  __aicore__ inline void CopyOut(int64_t row, int64_t k, const LocalTensor<float>& p, int32_t len) {
    LocalTensor<T> out = out_q_.template AllocTensor<T>();
    if constexpr (IsSameType<T, float>::value) {
      DataCopy(out, p, static_cast<uint32_t>(tm_npu::align_up(len, tm_npu::kUbBlockBytes / 4)));
    } else {
      Cast(out, p, RoundMode::CAST_RINT, len);
    }
    out_q_.EnQue(out);
    out = out_q_.template DeQue<T>();
    DataCopyExtParams params{1, static_cast<uint32_t>(len * sizeof(T)), 0, 0, 0};
    DataCopyPad(grad_gm_[tm_npu::grad_offset(this->t_, row, tm_npu::tile_begin(this->t_, k))], out, params);
    out_q_.FreeTensor(out);
  }

  TQue<QuePosition::VECOUT, 2> out_q_;
  GlobalTensor<float> g_logp_gm_, g_entropy_gm_, lse_gm_, mean_gm_;
  GlobalTensor<T> grad_gm_;
};

}  // namespace

// ------------------------------------------------------------ entry points
#define TM_NPU_KERNELS(NAME, TYPE)                                                                               \
  extern "C" __global__ __aicore__ void twinkle_mem_sls_fwd_##NAME(GM_ADDR logits, GM_ADDR labels, GM_ADDR logp, \
                                                                   GM_ADDR entropy, GM_ADDR lse, GM_ADDR mean,  \
                                                                   GM_ADDR tiling, float inv_t) {               \
    TPipe pipe;                                                                                                  \
    ForwardKernel<TYPE> op;                                                                                      \
    op.Init(&pipe, logits, labels, logp, entropy, lse, mean, tiling, inv_t);                                     \
    op.Process();                                                                                                \
  }                                                                                                              \
  extern "C" __global__ __aicore__ void twinkle_mem_sls_bwd_##NAME(GM_ADDR grad_logp, GM_ADDR grad_entropy,      \
                                                                   GM_ADDR logits, GM_ADDR labels, GM_ADDR lse, \
                                                                   GM_ADDR mean, GM_ADDR grad, GM_ADDR tiling,  \
                                                                   float inv_t) {                               \
    TPipe pipe;                                                                                                  \
    BackwardKernel<TYPE> op;                                                                                     \
    op.Init(&pipe, grad_logp, grad_entropy, logits, labels, lse, mean, grad, tiling, inv_t);                     \
    op.Process();                                                                                                \
  }

TM_NPU_KERNELS(fp32, float)
TM_NPU_KERNELS(fp16, half)
#if !defined(TWINKLE_MEM_NPU_NO_BF16)  // bf16 vector ops need A2/A3 (dav-c220) or later; CMake sets it for others
TM_NPU_KERNELS(bf16, bfloat16_t)
#define TM_NPU_HAS_BF16 1
#endif

// --------------------------------------------------------- host launchers
// Called by the torch_npu glue from inside an OpCommand custom handler, on
// the current NPU stream. Return 0, or a nonzero code for an unknown dtype.
#include "launch.h"

extern "C" int twinkle_mem_npu_launch_fwd(int dtype, uint32_t block_dim, void* stream, void* logits, void* labels,
                                          void* logp, void* entropy, void* lse, void* mean, void* tiling,
                                          float inv_t) {
  auto gm = [](void* p) { return reinterpret_cast<GM_ADDR>(p); };
  switch (dtype) {
    case TWINKLE_MEM_NPU_FP32:
      twinkle_mem_sls_fwd_fp32<<<block_dim, nullptr, stream>>>(gm(logits), gm(labels), gm(logp), gm(entropy),
                                                                gm(lse), gm(mean), gm(tiling), inv_t);
      return 0;
    case TWINKLE_MEM_NPU_FP16:
      twinkle_mem_sls_fwd_fp16<<<block_dim, nullptr, stream>>>(gm(logits), gm(labels), gm(logp), gm(entropy),
                                                                gm(lse), gm(mean), gm(tiling), inv_t);
      return 0;
#ifdef TM_NPU_HAS_BF16
    case TWINKLE_MEM_NPU_BF16:
      twinkle_mem_sls_fwd_bf16<<<block_dim, nullptr, stream>>>(gm(logits), gm(labels), gm(logp), gm(entropy),
                                                                gm(lse), gm(mean), gm(tiling), inv_t);
      return 0;
#endif
    default:
      return 1;
  }
}

extern "C" int twinkle_mem_npu_launch_bwd(int dtype, uint32_t block_dim, void* stream, void* grad_logp,
                                          void* grad_entropy, void* logits, void* labels, void* lse, void* mean,
                                          void* grad, void* tiling, float inv_t) {
  auto gm = [](void* p) { return reinterpret_cast<GM_ADDR>(p); };
  switch (dtype) {
    case TWINKLE_MEM_NPU_FP32:
      twinkle_mem_sls_bwd_fp32<<<block_dim, nullptr, stream>>>(gm(grad_logp), gm(grad_entropy), gm(logits),
                                                                gm(labels), gm(lse), gm(mean), gm(grad),
                                                                gm(tiling), inv_t);
      return 0;
    case TWINKLE_MEM_NPU_FP16:
      twinkle_mem_sls_bwd_fp16<<<block_dim, nullptr, stream>>>(gm(grad_logp), gm(grad_entropy), gm(logits),
                                                                gm(labels), gm(lse), gm(mean), gm(grad),
                                                                gm(tiling), inv_t);
      return 0;
#ifdef TM_NPU_HAS_BF16
    case TWINKLE_MEM_NPU_BF16:
      twinkle_mem_sls_bwd_bf16<<<block_dim, nullptr, stream>>>(gm(grad_logp), gm(grad_entropy), gm(logits),
                                                                gm(labels), gm(lse), gm(mean), gm(grad),
                                                                gm(tiling), inv_t);
      return 0;
#endif
    default:
      return 1;
  }
}
