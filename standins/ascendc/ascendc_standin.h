// A stand-in for the subset of the AscendC API that
// csrc/npu/selective_log_softmax_kernel.cpp uses, written from the API's
// documented semantics (the AscendC basic-API reference: data movement,
// vector computation, reductions, queues and synchronisation), so that the
// real kernel source compiles with g++ and runs on the CPU in CI.
//
// What it models, and asserts (a violation throws standin::Violation):
//   - one vector core at a time: a Unified Buffer (UB) whose allocations
//     (TPipe::InitBuffer) are checked against the UB budget the plan was made
//     for; UB operands of vector instructions and data copies 32-byte aligned
//     (ReduceMax's destination 8-byte aligned); every access inside its buffer;
//   - global memory as the regions the driver registers (each row of the
//     logits and gradient on its own, read-only or writable): every GM access
//     lies inside one, writes only to writable ones;
//   - DataCopyPad's lengths and limits (blockLen a multiple of the element,
//     < 2 MiB; the UB side padded to 32 bytes with bytes that read as NaN),
//     DataCopy's whole 32-byte blocks; GM -> UB only into VECIN / VECOUT,
//     UB -> GM only from VECIN / VECOUT;
//   - the four pipes (scalar S, vector V, GM -> UB MTE2, UB -> GM MTE3) as
//     vector clocks: a pipe may read or overwrite UB that another pipe wrote
//     (or read) only after a SetFlag / WaitFlag pair (or a queue's EnQue /
//     DeQue, FreeTensor / AllocTensor, which carry the same flags) made that
//     pipe's work visible to it; dependent vector instructions need
//     PipeBarrier<PIPE_V>. Reading UB nothing wrote is an error too;
//   - queue depth: AllocTensor with every buffer in use, DeQue of an empty
//     queue, a flag set twice or waited without a set (a hang on the NPU);
//   - the documented numerics: ReduceSum's order on A2 / A3 (a binary tree
//     inside each 256-byte repeat, repeats added in order), ReduceMax's first
//     index among equal maxima and its index stored as the value's bits, the
//     work-buffer size ReduceMax documents, the Cast round modes of A2 / A3,
//     Exp flushing subnormal results to zero.
// What it cannot model: the hardware's exp / ln accuracy (the host's expf /
// logf stand in; set_transcendental_ulp() perturbs them by n ulp to probe the
// margin), real timing, and anything the documentation leaves open.
#pragma once

#ifndef ASCENDC_CPU_DEBUG
#error "the stand-in compiles the kernel as AscendC's CPU-debug mode does: define ASCENDC_CPU_DEBUG"
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#define __aicore__
#define __global__
#define __gm__
#define GM_ADDR uint8_t*

namespace standin {

struct Violation : std::logic_error {
  using std::logic_error::logic_error;
};
[[noreturn]] inline void fail(const std::string& what) { throw Violation("AscendC stand-in: " + what); }
// STANDIN_REQUIRE(cond, message): the message is built only when cond fails (the checks run per 32-byte block).
#define STANDIN_REQUIRE(cond, ...)        \
  do {                                     \
    if (!(cond)) ::standin::fail(__VA_ARGS__); \
  } while (0)

enum Pipe : int { kS = 0, kV = 1, kMTE2 = 2, kMTE3 = 3, kPipes = 4 };
inline const char* pipe_name(int p) {
  static const char* names[] = {"S", "V", "MTE2", "MTE3"};
  return names[p];
}

struct Clock {
  uint64_t c[kPipes] = {0, 0, 0, 0};
  void join(const Clock& o) {
    for (int i = 0; i < kPipes; ++i) c[i] = std::max(c[i], o.c[i]);
  }
};

// What happened last to one 32-byte block of UB.
struct BlockState {
  int writer = -1;
  uint64_t write_seq = 0;
  uint64_t read_seq[kPipes] = {0, 0, 0, 0};
};

struct GmRegion {
  uintptr_t begin, end;
  bool writable;
  std::string name;
};

constexpr int64_t kUbPhysical = 256 * 1024;

// The vector core that runs now (blocks run one after another).
struct Core {
  std::vector<uint8_t> ub = std::vector<uint8_t>(kUbPhysical);
  std::vector<BlockState> blocks = std::vector<BlockState>(kUbPhysical / 32);
  int64_t budget = 0, used = 0;
  uint64_t seq[kPipes] = {0, 0, 0, 0};
  uint64_t cur[kPipes] = {0, 0, 0, 0};  // the op each pipe is executing
  Clock known[kPipes];                  // known[P].c[Q]: Q's ops up to this are visible to P
  std::map<std::pair<int, int>, Clock> flags;
  int64_t block_idx = 0, block_num = 1;
  void* pipe = nullptr;
  int ulp_noise = 0;
  uint64_t noise_state = 1;
  struct Read {
    int pipe;
    uint64_t seq;
    int64_t off, bytes;
  };
  std::vector<Read> pending_reads;  // an instruction's reads, recorded once its writes are checked
};
inline Core& core() {
  static Core c;
  return c;
}
// Counted over a launch: copy-ins into VECIN queues, and those issued while an
// earlier one was still waiting to be consumed (the double buffer at work).
struct Stats {
  int64_t copy_ins = 0;
  int64_t overlapped_copy_ins = 0;
};
inline Stats& stats() {
  static Stats s;
  return s;
}
inline std::vector<GmRegion>& gm_regions() {
  static std::vector<GmRegion> r;
  return r;
}

inline void reset_core(int64_t budget, int64_t block_idx, int64_t block_num) {
  Core& c = core();
  std::fill(c.ub.begin(), c.ub.end(), uint8_t(0xff));  // stale UB reads as NaN
  std::fill(c.blocks.begin(), c.blocks.end(), BlockState{});
  c.budget = budget;
  c.used = 0;
  for (int p = 0; p < kPipes; ++p) {
    c.seq[p] = c.cur[p] = 0;
    c.known[p] = Clock{};
  }
  c.flags.clear();
  c.pending_reads.clear();
  c.block_idx = block_idx;
  c.block_num = block_num;
  c.pipe = nullptr;
}

// One instruction of pipe p begins: its accesses carry this sequence number.
// The previous instruction's reads are recorded now, after its own writes were
// checked against the reads before it (an in-place instruction reads and
// writes the same block; the instruction before it may have read it too).
inline uint64_t begin_op(int p) {
  Core& c = core();
  for (const Core::Read& r : c.pending_reads) {
    for (int64_t b = r.off / 32; b <= (r.off + r.bytes - 1) / 32; ++b) {
      c.blocks[b].read_seq[r.pipe] = std::max(c.blocks[b].read_seq[r.pipe], r.seq);
    }
  }
  c.pending_reads.clear();
  c.cur[p] = ++c.seq[p];
  if (p == kS) c.known[kS].c[kS] = c.seq[kS];  // the scalar unit is in order with itself
  return c.cur[p];
}

inline bool visible(int to, int from, uint64_t seq) {
  if (from == to && to != kV) return true;  // S, MTE2, MTE3 run their own work in order
  return core().known[to].c[from] >= seq;
}

inline std::string where(int64_t off) { return "UB offset " + std::to_string(off); }

// Pipe p reads / writes bytes [off, off + bytes) of the UB.
inline void ub_access(int p, int64_t off, int64_t bytes, bool write) {
  if (bytes <= 0) return;
  Core& c = core();
  const uint64_t now = c.cur[p];
  for (int64_t b = off / 32; b <= (off + bytes - 1) / 32; ++b) {
    BlockState& s = c.blocks[b];
    if (!write) {
      STANDIN_REQUIRE(s.writer >= 0, std::string("pipe ") + pipe_name(p) + " reads " + where(b * 32) +
                                 ", which nothing has written (uninitialised UB)");
      if (!(s.writer == p && s.write_seq == now)) {
        STANDIN_REQUIRE(visible(p, s.writer, s.write_seq),
                std::string("pipe ") + pipe_name(p) + " reads " + where(b * 32) + " written by pipe " +
                    pipe_name(s.writer) + " without a " + pipe_name(s.writer) + "->" + pipe_name(p) +
                    " synchronisation (SetFlag/WaitFlag, a queue, or PipeBarrier<PIPE_V>)");
      }
    } else {
      if (s.writer >= 0 && !(s.writer == p && s.write_seq == now)) {
        STANDIN_REQUIRE(visible(p, s.writer, s.write_seq),
                std::string("pipe ") + pipe_name(p) + " overwrites " + where(b * 32) + " written by pipe " +
                    pipe_name(s.writer) + " without a " + pipe_name(s.writer) + "->" + pipe_name(p) +
                    " synchronisation");
      }
      for (int q = 0; q < kPipes; ++q) {
        if (s.read_seq[q] == 0) continue;
        STANDIN_REQUIRE(visible(p, q, s.read_seq[q]),
                std::string("pipe ") + pipe_name(p) + " overwrites " + where(b * 32) + " that pipe " + pipe_name(q) +
                    " reads, without a " + pipe_name(q) + "->" + pipe_name(p) + " synchronisation");
      }
      s.writer = p;
      s.write_seq = now;
    }
  }
  if (!write) c.pending_reads.push_back({p, now, off, bytes});
}

// ---------------------------------------------------------------- GM regions
inline const GmRegion& gm_region(uintptr_t begin, uintptr_t end, bool write, const char* what) {
  for (const GmRegion& r : gm_regions()) {
    if (begin >= r.begin && end <= r.end) {
      STANDIN_REQUIRE(!write || r.writable, std::string(what) + " writes read-only global memory (" + r.name + ")");
      return r;
    }
  }
  fail(std::string(what) + " touches global memory outside every tensor (" + std::to_string(end - begin) +
       " bytes)");
}

// ---------------------------------------------------------------- 16-bit floats
inline uint32_t bits32(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float from_bits32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t float_to_bf16(float f) {  // round to nearest even
  const uint32_t x = bits32(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}
inline float bf16_to_float(uint16_t h) { return from_bits32(static_cast<uint32_t>(h) << 16); }
inline uint16_t float_to_fp16(float f) {  // round to nearest even
  const uint32_t x = bits32(f), sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return static_cast<uint16_t>(sign | (ax > 0x7f800000u ? 0x7e00u : 0x7c00u));
  if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds past 65504
  if (ax < 0x38800000u) {                                                // below 2^-14: subnormal
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(from_bits32(ax) * 16777216.0f)));
  }
  uint32_t h = (((ax >> 23) - 112u) << 10) | ((ax >> 13) & 0x3ffu);
  const uint32_t rem = ax & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}
inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0x1fu) return from_bits32(sign | 0x7f800000u | (m << 13));
  if (e == 0) return (sign ? -1.0f : 1.0f) * static_cast<float>(m) * 5.9604644775390625e-08f;
  return from_bits32(sign | ((e + 112u) << 23) | (m << 13));
}

// The host's expf / logf, optionally moved by up to n ulp (deterministic noise; normal results only).
inline float noisy(float v) {
  Core& c = core();
  if (c.ulp_noise == 0 || !std::isnormal(v) || std::fabs(v) < 1e-37f) return v;  // (bits would cross 0)
  c.noise_state = c.noise_state * 6364136223846793005ull + 1442695040888963407ull;
  const int shift = static_cast<int>((c.noise_state >> 33) % (2 * c.ulp_noise + 1)) - c.ulp_noise;
  return from_bits32(static_cast<uint32_t>(static_cast<int64_t>(bits32(v)) + shift));
}
inline void set_transcendental_ulp(int n) { core().ulp_noise = n; }

}  // namespace standin

struct half {
  uint16_t bits;
  half() = default;
  half(float f) : bits(standin::float_to_fp16(f)) {}
  operator float() const { return standin::fp16_to_float(bits); }
};
struct bfloat16_t {
  uint16_t bits;
  bfloat16_t() = default;
  bfloat16_t(float f) : bits(standin::float_to_bf16(f)) {}
  operator float() const { return standin::bf16_to_float(bits); }
};

namespace AscendC {

template <typename A, typename B>
struct IsSameType {
  static constexpr bool value = std::is_same<A, B>::value;
};

enum class TPosition { GM, VECIN, VECOUT, VECCALC };
using QuePosition = TPosition;
enum class RoundMode { CAST_NONE = 0, CAST_RINT, CAST_FLOOR, CAST_CEIL, CAST_ROUND, CAST_TRUNC, CAST_ODD };
enum pipe_t { PIPE_S, PIPE_V, PIPE_MTE2, PIPE_MTE3, PIPE_ALL };
using event_t = int;

// HardEvent A_B: pipe B waits for pipe A. Its value is A * kPipes + B (STANDIN_EVENT writes it from the name), from
// which event_pipes reads {A, B} back.
#define STANDIN_EVENT(A, B) A##_##B = standin::k##A * standin::kPipes + standin::k##B
enum class HardEvent {
  STANDIN_EVENT(MTE2, V), STANDIN_EVENT(V, MTE2), STANDIN_EVENT(MTE3, V), STANDIN_EVENT(V, MTE3),
  STANDIN_EVENT(S, V), STANDIN_EVENT(V, S), STANDIN_EVENT(S, MTE3), STANDIN_EVENT(MTE3, S),
  STANDIN_EVENT(MTE2, S), STANDIN_EVENT(S, MTE2), STANDIN_EVENT(MTE2, MTE3), STANDIN_EVENT(MTE3, MTE2)
};
#undef STANDIN_EVENT
inline std::pair<int, int> event_pipes(HardEvent e) {
  return {static_cast<int>(e) / standin::kPipes, static_cast<int>(e) % standin::kPipes};
}

// A snapshot of what pipe `from` has done (all its issued work, and what it had synchronised with).
inline standin::Clock snapshot(int from) {
  standin::Core& c = standin::core();
  standin::Clock s = c.known[from];
  s.c[from] = c.seq[from];
  return s;
}

template <HardEvent E>
inline void SetFlag(event_t ev) {
  const auto pipes = event_pipes(E);
  auto key = std::make_pair(static_cast<int>(E), static_cast<int>(ev));
  STANDIN_REQUIRE(!standin::core().flags.count(key), "SetFlag twice on one event without a WaitFlag");
  standin::core().flags[key] = snapshot(pipes.first);
}
template <HardEvent E>
inline void WaitFlag(event_t ev) {
  const auto pipes = event_pipes(E);
  auto& flags = standin::core().flags;
  auto it = flags.find(std::make_pair(static_cast<int>(E), static_cast<int>(ev)));
  STANDIN_REQUIRE(it != flags.end(), "WaitFlag on an event nobody set (the core would hang)");
  standin::core().known[pipes.second].join(it->second);
  flags.erase(it);
}
template <pipe_t P>
inline void PipeBarrier() {
  standin::Core& c = standin::core();
  if (P == PIPE_ALL) {
    for (int p = 0; p < standin::kPipes; ++p) {
      for (int q = 0; q < standin::kPipes; ++q) c.known[p].c[q] = c.seq[q];
    }
  } else {
    const int p = P == PIPE_S ? standin::kS : P == PIPE_V ? standin::kV : P == PIPE_MTE2 ? standin::kMTE2 : standin::kMTE3;
    c.known[p].c[p] = c.seq[p];
  }
}

inline int64_t GetBlockIdx() { return standin::core().block_idx; }
inline int64_t GetBlockNum() { return standin::core().block_num; }

// ------------------------------------------------------------------ tensors
template <typename T>
class LocalTensor {
 public:
  LocalTensor() = default;
  LocalTensor(int64_t off, int64_t cap, TPosition pos) : off_(off), cap_(cap), pos_(pos) {}
  LocalTensor operator[](int64_t i) const {
    STANDIN_REQUIRE(i >= 0 && i <= cap_, "LocalTensor[] past its buffer");
    return LocalTensor(off_ + i * static_cast<int64_t>(sizeof(T)), cap_ - i, pos_);
  }
  T GetValue(int64_t i) const {
    check_scalar(i);
    standin::begin_op(standin::kS);
    standin::ub_access(standin::kS, off_ + i * sizeof(T), sizeof(T), false);
    T v;
    std::memcpy(&v, &standin::core().ub[off_ + i * sizeof(T)], sizeof(T));
    return v;
  }
  void SetValue(int64_t i, T v) const {
    check_scalar(i);
    standin::begin_op(standin::kS);
    standin::ub_access(standin::kS, off_ + i * sizeof(T), sizeof(T), true);
    std::memcpy(&standin::core().ub[off_ + i * sizeof(T)], &v, sizeof(T));
  }
  // For an instruction: `count` elements from here, the start 32-byte aligned.
  T* operand(int64_t count, const char* what, int64_t align = 32) const {
    STANDIN_REQUIRE(valid(), std::string(what) + ": an unallocated LocalTensor");
    STANDIN_REQUIRE(count >= 0 && count <= cap_, std::string(what) + ": " + std::to_string(count) +
                                                      " elements past the buffer (" + std::to_string(cap_) + ")");
    STANDIN_REQUIRE(off_ % align == 0, std::string(what) + ": UB address " + std::to_string(off_) +
                                            " is not " + std::to_string(align) + "-byte aligned");
    return reinterpret_cast<T*>(&standin::core().ub[off_]);
  }
  bool valid() const { return cap_ > 0 || off_ > 0; }
  int64_t offset() const { return off_; }
  int64_t capacity() const { return cap_; }
  TPosition position() const { return pos_; }

 private:
  void check_scalar(int64_t i) const {
    STANDIN_REQUIRE(valid() && i >= 0 && i < cap_, "GetValue/SetValue index " + std::to_string(i) +
                                                        " outside the LocalTensor (" + std::to_string(cap_) + ")");
  }
  int64_t off_ = 0, cap_ = 0;
  TPosition pos_ = TPosition::VECCALC;
};

template <typename T>
class GlobalTensor {
 public:
  void SetGlobalBuffer(T* ptr, int64_t size = 0) {
    ptr_ = ptr;
    (void)size;
  }
  GlobalTensor operator[](int64_t i) const {
    GlobalTensor g;
    g.ptr_ = ptr_ + i;
    return g;
  }
  T GetValue(int64_t i) const {
    const uintptr_t a = reinterpret_cast<uintptr_t>(ptr_ + i);
    standin::gm_region(a, a + sizeof(T), false, "GlobalTensor::GetValue");
    standin::begin_op(standin::kS);
    T v;
    std::memcpy(&v, ptr_ + i, sizeof(T));
    return v;
  }
  void SetValue(int64_t i, T v) const {
    const uintptr_t a = reinterpret_cast<uintptr_t>(ptr_ + i);
    standin::gm_region(a, a + sizeof(T), true, "GlobalTensor::SetValue");
    standin::begin_op(standin::kS);
    std::memcpy(ptr_ + i, &v, sizeof(T));
  }
  T* address() const { return ptr_; }

 private:
  T* ptr_ = nullptr;
};

// ------------------------------------------------------------------ pipe, queues, buffers
class TPipe;
inline TPipe* GetTPipePtr();

struct BufferSlot {
  int64_t off = 0, bytes = 0;
  int state = 0;  // 0 free, 1 allocated, 2 enqueued, 3 dequeued
  bool has_free_sync = false;
  standin::Clock free_sync, enq_sync;
};

template <TPosition Pos, int Depth>
class TQue {
 public:
  template <typename T>
  LocalTensor<T> AllocTensor() {
    for (BufferSlot& s : slots_) {
      if (s.state != 0) continue;
      // FreeTensor's flag: the producer waits for the consumer's last use.
      if (s.has_free_sync) standin::core().known[producer()].join(s.free_sync);
      s.state = 1;
      return LocalTensor<T>(s.off, s.bytes / static_cast<int64_t>(sizeof(T)), Pos);
    }
    standin::fail("TQue::AllocTensor with all " + std::to_string(slots_.size()) +
                  " buffers in use (the core would hang)");
  }
  template <typename T>
  void EnQue(const LocalTensor<T>& t) {
    BufferSlot& s = slot_of(t.offset(), "EnQue");
    STANDIN_REQUIRE(s.state == 1, "TQue::EnQue of a tensor that is not freshly allocated");
    s.state = 2;
    s.enq_sync = snapshot(producer());
    if (Pos == TPosition::VECIN) {
      ++standin::stats().copy_ins;
      if (!fifo_.empty()) ++standin::stats().overlapped_copy_ins;
    }
    fifo_.push_back(&s);
  }
  template <typename T>
  LocalTensor<T> DeQue() {
    STANDIN_REQUIRE(!fifo_.empty(), "TQue::DeQue of an empty queue (the core would hang)");
    BufferSlot* s = fifo_.front();
    fifo_.erase(fifo_.begin());
    standin::core().known[consumer()].join(s->enq_sync);
    s->state = 3;
    return LocalTensor<T>(s->off, s->bytes / static_cast<int64_t>(sizeof(T)), Pos);
  }
  template <typename T>
  void FreeTensor(const LocalTensor<T>& t) {
    BufferSlot& s = slot_of(t.offset(), "FreeTensor");
    STANDIN_REQUIRE(s.state == 3 || s.state == 1, "TQue::FreeTensor of a tensor that is not in use");
    s.state = 0;
    s.has_free_sync = true;
    s.free_sync = snapshot(consumer());
  }
  void init(int64_t off, int64_t bytes, int num) {
    STANDIN_REQUIRE(num >= 1 && num <= Depth, "InitBuffer: more buffers than the queue's depth");
    slots_.clear();
    for (int i = 0; i < num; ++i) {
      BufferSlot s;
      s.off = off + i * bytes;
      s.bytes = bytes;
      slots_.push_back(s);
    }
  }
  bool idle() const {
    for (const BufferSlot& s : slots_) {
      if (s.state != 0) return false;
    }
    return true;
  }

 private:
  static int producer() { return Pos == TPosition::VECIN ? standin::kMTE2 : standin::kV; }
  static int consumer() { return Pos == TPosition::VECIN ? standin::kV : standin::kMTE3; }
  BufferSlot& slot_of(int64_t off, const char* what) {
    for (BufferSlot& s : slots_) {
      if (s.off == off) return s;
    }
    standin::fail(std::string("TQue::") + what + " of a tensor from another buffer");
  }
  std::vector<BufferSlot> slots_;
  std::vector<BufferSlot*> fifo_;
};

template <TPosition Pos>
class TBuf {
 public:
  template <typename T>
  LocalTensor<T> Get() const {
    STANDIN_REQUIRE(bytes_ > 0, "TBuf::Get before InitBuffer");
    return LocalTensor<T>(off_, bytes_ / static_cast<int64_t>(sizeof(T)), Pos);
  }
  void init(int64_t off, int64_t bytes) {
    off_ = off;
    bytes_ = bytes;
  }

 private:
  int64_t off_ = 0, bytes_ = 0;
};

class TPipe {
 public:
  TPipe() {
    STANDIN_REQUIRE(standin::core().pipe == nullptr, "a second TPipe on one core");
    standin::core().pipe = this;
  }
  ~TPipe() { standin::core().pipe = nullptr; }
  TPipe(const TPipe&) = delete;
  TPipe& operator=(const TPipe&) = delete;

  template <TPosition Pos, int Depth>
  void InitBuffer(TQue<Pos, Depth>& que, uint8_t num, uint32_t len) {
    const int64_t bytes = align32(len);
    que.init(allocate(int64_t(num) * bytes), bytes, num);
  }
  template <TPosition Pos>
  void InitBuffer(TBuf<Pos>& buf, uint32_t len) {
    const int64_t bytes = align32(len);
    buf.init(allocate(bytes), bytes);
  }
  event_t FetchEventID(HardEvent) { return next_event_++ % 8; }

 private:
  static int64_t align32(int64_t n) { return (n + 31) / 32 * 32; }
  int64_t allocate(int64_t bytes) {
    standin::Core& c = standin::core();
    STANDIN_REQUIRE(bytes > 0, "InitBuffer of 0 bytes");
    STANDIN_REQUIRE(c.used + bytes <= c.budget, "InitBuffer: " + std::to_string(c.used + bytes) +
                                                    " bytes of UB exceed the budget of " + std::to_string(c.budget));
    const int64_t off = c.used;
    c.used += bytes;
    return off;
  }
  int next_event_ = 0;
};
inline TPipe* GetTPipePtr() { return static_cast<TPipe*>(standin::core().pipe); }

// ------------------------------------------------------------------ data movement
struct DataCopyExtParams {
  DataCopyExtParams() {}
  DataCopyExtParams(uint16_t count, uint32_t len, uint32_t src_stride, uint32_t dst_stride, uint32_t rsv_in)
      : blockCount(count), blockLen(len), srcStride(src_stride), dstStride(dst_stride), rsv(rsv_in) {}
  uint16_t blockCount = 1;
  uint32_t blockLen = 0;
  uint32_t srcStride = 0;  // GM side: bytes; UB side: 32-byte blocks
  uint32_t dstStride = 0;
  uint32_t rsv = 0;
};
template <typename T>
struct DataCopyPadExtParams {
  DataCopyPadExtParams() {}
  DataCopyPadExtParams(bool pad, uint8_t left, uint8_t right, T value)
      : isPad(pad), leftPadding(left), rightPadding(right), paddingValue(value) {}
  bool isPad = false;
  uint8_t leftPadding = 0;
  uint8_t rightPadding = 0;
  T paddingValue{};
};

inline void check_copy_params(const DataCopyExtParams& p, int64_t elem, const char* what) {
  STANDIN_REQUIRE(p.blockCount <= 4095, std::string(what) + ": blockCount > 4095");
  STANDIN_REQUIRE(p.blockLen <= 2097151, std::string(what) + ": blockLen > 2097151 bytes");
  STANDIN_REQUIRE(p.blockLen % elem == 0, std::string(what) + ": blockLen is not a whole number of elements");
}

// GM -> UB, each block padded on the UB side to 32 bytes (the padding reads as NaN).
template <typename T>
void DataCopyPad(const LocalTensor<T>& dst, const GlobalTensor<T>& src, const DataCopyExtParams& p,
                 const DataCopyPadExtParams<T>& pad) {
  check_copy_params(p, sizeof(T), "DataCopyPad GM->UB");
  STANDIN_REQUIRE(dst.position() == TPosition::VECIN || dst.position() == TPosition::VECOUT,
                   "DataCopyPad GM->UB into a buffer that is not VECIN / VECOUT");
  STANDIN_REQUIRE(!pad.isPad && pad.leftPadding == 0 && pad.rightPadding == 0,
                   "DataCopyPad padding values are not modelled");
  const int64_t ub_block = (int64_t(p.blockLen) + 31) / 32 * 32 + int64_t(p.dstStride) * 32;
  uint8_t* ub = reinterpret_cast<uint8_t*>(dst.operand(0, "DataCopyPad GM->UB"));
  STANDIN_REQUIRE((p.blockCount * ub_block) / int64_t(sizeof(T)) <= dst.capacity(),
                   "DataCopyPad GM->UB: the padded blocks overrun the UB buffer");
  standin::begin_op(standin::kMTE2);
  const uint8_t* gm = reinterpret_cast<const uint8_t*>(src.address());
  for (int64_t b = 0; b < p.blockCount; ++b) {
    const uint8_t* from = gm + b * (int64_t(p.blockLen) + p.srcStride);
    standin::gm_region(reinterpret_cast<uintptr_t>(from), reinterpret_cast<uintptr_t>(from) + p.blockLen, false,
                       "DataCopyPad GM->UB");
    const int64_t at = dst.offset() + b * ub_block;
    const int64_t padded = (int64_t(p.blockLen) + 31) / 32 * 32;
    standin::ub_access(standin::kMTE2, at, padded, true);
    std::memcpy(ub + b * ub_block, from, p.blockLen);
    std::memset(ub + b * ub_block + p.blockLen, 0xff, padded - p.blockLen);
  }
}

// UB -> GM: exactly blockLen bytes per block reach GM.
template <typename T>
void DataCopyPad(const GlobalTensor<T>& dst, const LocalTensor<T>& src, const DataCopyExtParams& p) {
  check_copy_params(p, sizeof(T), "DataCopyPad UB->GM");
  STANDIN_REQUIRE(src.position() == TPosition::VECIN || src.position() == TPosition::VECOUT,
                   "DataCopyPad UB->GM from a buffer that is not VECIN / VECOUT");
  const int64_t ub_block = (int64_t(p.blockLen) + 31) / 32 * 32 + int64_t(p.srcStride) * 32;
  const uint8_t* ub = reinterpret_cast<const uint8_t*>(src.operand(0, "DataCopyPad UB->GM"));
  STANDIN_REQUIRE(((p.blockCount - 1) * ub_block + p.blockLen) / int64_t(sizeof(T)) <= src.capacity() ||
                       p.blockCount == 0,
                   "DataCopyPad UB->GM: the blocks overrun the UB buffer");
  standin::begin_op(standin::kMTE3);
  uint8_t* gm = reinterpret_cast<uint8_t*>(dst.address());
  for (int64_t b = 0; b < p.blockCount; ++b) {
    uint8_t* to = gm + b * (int64_t(p.blockLen) + p.dstStride);
    standin::gm_region(reinterpret_cast<uintptr_t>(to), reinterpret_cast<uintptr_t>(to) + p.blockLen, true,
                       "DataCopyPad UB->GM");
    standin::ub_access(standin::kMTE3, src.offset() + b * ub_block, p.blockLen, false);
    std::memcpy(to, ub + b * ub_block, p.blockLen);
  }
}

// Whole 32-byte blocks only: DataCopy of other lengths is rounded down on the NPU.
template <typename T>
void DataCopy(const LocalTensor<T>& dst, const GlobalTensor<T>& src, uint32_t count) {
  STANDIN_REQUIRE(count * sizeof(T) % 32 == 0, "DataCopy of a length that is not a multiple of 32 bytes");
  DataCopyPad(dst, src, DataCopyExtParams(1, static_cast<uint32_t>(count * sizeof(T)), 0, 0, 0),
              DataCopyPadExtParams<T>());
}
template <typename T>
void DataCopy(const GlobalTensor<T>& dst, const LocalTensor<T>& src, uint32_t count) {
  STANDIN_REQUIRE(count * sizeof(T) % 32 == 0, "DataCopy of a length that is not a multiple of 32 bytes");
  DataCopyPad(dst, src, DataCopyExtParams(1, static_cast<uint32_t>(count * sizeof(T)), 0, 0, 0));
}

// ------------------------------------------------------------------ vector instructions
// Each reads its sources, then writes its destination, as one V-pipe instruction.
namespace detail {
template <typename D, typename S, typename F>
void unary(const LocalTensor<D>& dst, const LocalTensor<S>& src, int32_t count, const char* what, F f) {
  if (count <= 0) return;  // a NOP on A2 / A3
  const S* s = src.operand(count, what);
  D* d = dst.operand(count, what);
  standin::begin_op(standin::kV);
  standin::ub_access(standin::kV, src.offset(), int64_t(count) * sizeof(S), false);
  std::vector<D> out(count);
  for (int32_t i = 0; i < count; ++i) out[i] = f(s[i]);
  standin::ub_access(standin::kV, dst.offset(), int64_t(count) * sizeof(D), true);
  std::memcpy(d, out.data(), count * sizeof(D));
}
template <typename T, typename F>
void binary(const LocalTensor<T>& dst, const LocalTensor<T>& a, const LocalTensor<T>& b, int32_t count,
            const char* what, F f) {
  if (count <= 0) return;
  const T* pa = a.operand(count, what);
  const T* pb = b.operand(count, what);
  T* d = dst.operand(count, what);
  standin::begin_op(standin::kV);
  standin::ub_access(standin::kV, a.offset(), int64_t(count) * sizeof(T), false);
  standin::ub_access(standin::kV, b.offset(), int64_t(count) * sizeof(T), false);
  std::vector<T> out(count);
  for (int32_t i = 0; i < count; ++i) out[i] = f(pa[i], pb[i]);
  standin::ub_access(standin::kV, dst.offset(), int64_t(count) * sizeof(T), true);
  std::memcpy(d, out.data(), count * sizeof(T));
}
inline float flush_subnormal(float v) { return std::fabs(v) < 1.17549435e-38f ? std::copysign(0.0f, v) : v; }
}  // namespace detail

template <typename T>
void Adds(const LocalTensor<T>& dst, const LocalTensor<T>& src, const T& s, const int32_t& count) {
  detail::unary(dst, src, count, "Adds", [s](T x) { return x + s; });
}
template <typename T>
void Muls(const LocalTensor<T>& dst, const LocalTensor<T>& src, const T& s, const int32_t& count) {
  detail::unary(dst, src, count, "Muls", [s](T x) { return x * s; });
}
template <typename T>
void Maxs(const LocalTensor<T>& dst, const LocalTensor<T>& src, const T& s, const int32_t& count) {
  detail::unary(dst, src, count, "Maxs", [s](T x) { return x > s ? x : s; });
}
template <typename T>
void Exp(const LocalTensor<T>& dst, const LocalTensor<T>& src, const int32_t& count) {
  static_assert(std::is_same<T, float>::value, "the stand-in's Exp is fp32");
  detail::unary(dst, src, count, "Exp", [](T x) { return detail::flush_subnormal(standin::noisy(std::exp(x))); });
}
template <typename T>
void Ln(const LocalTensor<T>& dst, const LocalTensor<T>& src, const int32_t& count) {
  static_assert(std::is_same<T, float>::value, "the stand-in's Ln is fp32");
  detail::unary(dst, src, count, "Ln", [](T x) { return standin::noisy(std::log(x)); });
}
template <typename T>
void Mul(const LocalTensor<T>& dst, const LocalTensor<T>& a, const LocalTensor<T>& b, const int32_t& count) {
  detail::binary(dst, a, b, count, "Mul", [](T x, T y) { return x * y; });
}
template <typename T>
void Add(const LocalTensor<T>& dst, const LocalTensor<T>& a, const LocalTensor<T>& b, const int32_t& count) {
  detail::binary(dst, a, b, count, "Add", [](T x, T y) { return x + y; });
}
template <typename T>
void Duplicate(const LocalTensor<T>& dst, const T& v, const int32_t& count) {
  if (count <= 0) return;
  T* d = dst.operand(count, "Duplicate");
  standin::begin_op(standin::kV);
  standin::ub_access(standin::kV, dst.offset(), int64_t(count) * sizeof(T), true);
  for (int32_t i = 0; i < count; ++i) d[i] = v;
}

// Cast between fp32 and the 16-bit floats, with the round modes A2 / A3 accept.
template <typename D, typename S>
void Cast(const LocalTensor<D>& dst, const LocalTensor<S>& src, const RoundMode& mode, const uint32_t& count) {
  constexpr bool widen = std::is_same<D, float>::value && !std::is_same<S, float>::value;
  constexpr bool narrow = std::is_same<S, float>::value && !std::is_same<D, float>::value;
  static_assert(widen || narrow, "the stand-in casts between fp32 and half / bfloat16_t");
  if (widen) STANDIN_REQUIRE(mode == RoundMode::CAST_NONE, "Cast to fp32 takes CAST_NONE (exact)");
  if (narrow && std::is_same<D, bfloat16_t>::value)
    STANDIN_REQUIRE(mode == RoundMode::CAST_RINT, "Cast fp32 -> bfloat16_t on A2 / A3 takes a rounding mode");
  STANDIN_REQUIRE(!narrow || mode == RoundMode::CAST_RINT || mode == RoundMode::CAST_NONE,
                   "the stand-in casts to 16 bits with round-to-nearest-even only");
  detail::unary(dst, src, static_cast<int32_t>(count), "Cast", [](S x) { return static_cast<D>(static_cast<float>(x)); });
}

// ReduceMax (first n elements): dst = [max, index as the value's bits]; the
// smallest index among equal maxima. NaN compares false (whether the vector
// unit propagates NaN through the max is not documented; the kernel does not
// rely on it). The scratch must hold what the documentation says, per round.
inline int64_t reduce_max_work_floats(int64_t count, bool index) {
  const int64_t per_block = 8, per_repeat = 64;
  const int64_t first = (count + per_repeat - 1) / per_repeat;
  const int64_t out1 = first * 2;
  const int64_t start2 = (out1 + per_block - 1) / per_block * per_block;
  if (!index) return start2;
  const int64_t out2 = (out1 + per_repeat - 1) / per_repeat * 2;
  const int64_t end2 = (out2 + per_block - 1) / per_block * per_block;
  if (out2 <= 2) return start2 + end2;
  const int64_t out3 = (out2 + per_repeat - 1) / per_repeat * 2;
  return start2 + end2 + (out3 + per_block - 1) / per_block * per_block;
}
inline void ReduceMax(const LocalTensor<float>& dst, const LocalTensor<float>& src, const LocalTensor<float>& work,
                      const int32_t count, bool cal_index = false) {
  if (count <= 0) return;
  const float* s = src.operand(count, "ReduceMax src");
  const int64_t need = reduce_max_work_floats(count, cal_index);
  work.operand(need, "ReduceMax sharedTmpBuffer (the size its documentation gives)");
  float* d = dst.operand(2, "ReduceMax dst", 8);
  standin::begin_op(standin::kV);
  standin::ub_access(standin::kV, src.offset(), int64_t(count) * 4, false);
  standin::ub_access(standin::kV, work.offset(), need * 4, true);
  float best = s[0];
  uint32_t at = 0;
  for (int32_t i = 1; i < count; ++i) {
    if (s[i] > best || (std::isnan(best) && !std::isnan(s[i]))) {
      best = s[i];
      at = static_cast<uint32_t>(i);
    }
  }
  standin::ub_access(standin::kV, dst.offset(), cal_index ? 8 : 4, true);
  d[0] = best;
  if (cal_index) d[1] = standin::from_bits32(at);
}
// ReduceSum (first n elements, A2 / A3): a binary tree inside each 64-float
// repeat, the repeats' sums added in order; the scratch is not used there.
inline void ReduceSum(const LocalTensor<float>& dst, const LocalTensor<float>& src, const LocalTensor<float>& work,
                      const int32_t count) {
  if (count <= 0) return;
  const float* s = src.operand(count, "ReduceSum src");
  work.operand(0, "ReduceSum sharedTmpBuffer");
  float* d = dst.operand(1, "ReduceSum dst", 4);
  standin::begin_op(standin::kV);
  standin::ub_access(standin::kV, src.offset(), int64_t(count) * 4, false);
  float total = 0.0f;
  for (int32_t r = 0; r < count; r += 64) {
    float lane[64];
    const int32_t n = std::min(64, count - r);
    for (int32_t i = 0; i < 64; ++i) lane[i] = i < n ? s[r + i] : 0.0f;
    for (int32_t width = 32; width >= 1; width /= 2) {
      for (int32_t i = 0; i < width; ++i) lane[i] = lane[2 * i] + lane[2 * i + 1];
    }
    total = r == 0 ? lane[0] : total + lane[0];
  }
  standin::ub_access(standin::kV, dst.offset(), 4, true);
  d[0] = total;
}

}  // namespace AscendC

namespace standin {
// Runs a kernel on `block_dim` vector cores, one after another (in reverse
// order: no core may depend on another having run first), each with a fresh
// UB of `ub_budget` bytes. Returns normally or throws Violation.
template <typename F>
void launch(int64_t block_dim, int64_t ub_budget, F&& kernel) {
  STANDIN_REQUIRE(ub_budget > 0 && ub_budget <= kUbPhysical, "launch: bad UB budget");
  for (int64_t b = block_dim - 1; b >= 0; --b) {
    reset_core(ub_budget, b, block_dim);
    kernel();
    STANDIN_REQUIRE(core().flags.empty(), "a flag was set and never waited on at the end of the kernel");
  }
}
}  // namespace standin
