// Just enough of the CUDA device API to run the kernels of
// csrc/cuda/selective_log_softmax_kernels.cuh as host C++. Blocks run one after another; the
// threads of a block are fibers (ucontext) on one OS thread, switched at every
// barrier (__syncthreads, __syncthreads_or, warp shuffles), so the emulation is
// deterministic and cheap on a small machine. It tests the kernels' indexing,
// reductions and label handling where no GPU is present; it says nothing about
// speed or the memory model, and its exp/log are the host's libm.
#pragma once

#include <sys/mman.h>
#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static  // blocks run one at a time, so one copy serves each block in turn
#define __launch_bounds__(...)

struct uint4 {
  unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }

struct EmuDim {
  unsigned x = 1, y = 1, z = 1;
};
inline EmuDim threadIdx, blockIdx, blockDim, gridDim;

template <typename T>
inline T min(T a, T b) { return b < a ? b : a; }

// ---- bit casts and 16-bit floats (round to nearest even, like the cvt.rn instructions)
template <typename To, typename From>
inline To emu_bit_cast(const From& v) {
  static_assert(sizeof(To) == sizeof(From));
  To out;
  std::memcpy(&out, &v, sizeof(To));
  return out;
}
inline float __uint_as_float(unsigned u) { return emu_bit_cast<float>(u); }
inline unsigned __float_as_uint(float f) { return emu_bit_cast<unsigned>(f); }
inline double __hiloint2double(int hi, int lo) {
  return emu_bit_cast<double>((uint64_t(uint32_t(hi)) << 32) | uint32_t(lo));
}
inline int __double2loint(double d) { return int(uint32_t(emu_bit_cast<uint64_t>(d))); }
inline int __double2hiint(double d) { return int(uint32_t(emu_bit_cast<uint64_t>(d) >> 32)); }

struct __nv_bfloat16 {
  uint16_t bits;
};
struct __half {
  uint16_t bits;
};
struct __nv_bfloat162 {
  __nv_bfloat16 x, y;
};
struct __half2 {
  __half x, y;
};
inline float __bfloat162float(__nv_bfloat16 v) { return __uint_as_float(uint32_t(v.bits) << 16); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u = __float_as_uint(f);
  if (std::isnan(f)) return {uint16_t((u >> 16) | 0x40)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return {uint16_t(u >> 16)};
}
inline float __half2float(__half h) { return float(emu_bit_cast<_Float16>(h.bits)); }
inline __half __float2half_rn(float f) { return {emu_bit_cast<uint16_t>(static_cast<_Float16>(f))}; }
inline __half __ushort_as_half(unsigned short u) { return {u}; }
inline unsigned short __half_as_ushort(__half h) { return h.bits; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.bits; }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return {__float2bfloat16_rn(a), __float2bfloat16_rn(b)}; }
inline __half2 __floats2half2_rn(float a, float b) { return {__float2half_rn(a), __float2half_rn(b)}; }
// Lane-wise max that propagates NaN, like the hardware's max.NaN.
inline float emu_max_nan(float p, float q) { return (std::isnan(p) || std::isnan(q)) ? NAN : std::fmax(p, q); }
inline __nv_bfloat162 __hmax2_nan(__nv_bfloat162 a, __nv_bfloat162 b) {
  auto m = [](__nv_bfloat16 p, __nv_bfloat16 q) {
    return __float2bfloat16_rn(emu_max_nan(__bfloat162float(p), __bfloat162float(q)));
  };
  return {m(a.x, b.x), m(a.y, b.y)};
}
inline __half2 __hmax2_nan(__half2 a, __half2 b) {
  auto m = [](__half p, __half q) { return __float2half_rn(emu_max_nan(__half2float(p), __half2float(q))); };
  return {m(a.x, b.x), m(a.y, b.y)};
}

// ---- memory; global loads and stores counted by width (16-byte vectors or narrower),
// so that tests can see which path a kernel took
inline uint64_t emu_vector_loads, emu_narrow_loads, emu_vector_stores, emu_narrow_stores;
template <typename T>
inline T __ldcs(const T* p) {
  ++(sizeof(T) == 16 ? emu_vector_loads : emu_narrow_loads);
  return *p;
}
template <typename T>
inline void __stcs(T* p, T v) {
  ++(sizeof(T) == 16 ? emu_vector_stores : emu_narrow_stores);
  *p = v;
}

// ---- atomics: threads switch only at barriers, so a plain read-modify-write is atomic here
inline unsigned atomicCAS(unsigned* address, unsigned compare, unsigned val) {
  const unsigned old = *address;
  if (old == compare) *address = val;
  return old;
}

// ---- device-side asserts: recorded, reported by the caller after the launch
inline std::string emu_assert_message;
#define CUDA_KERNEL_ASSERT_MSG(cond, msg)                                 \
  do {                                                                    \
    if (!(cond) && emu_assert_message.empty()) emu_assert_message = (msg); \
  } while (0)

// ---- fibers: the threads of one block
struct EmuBarrier {
  unsigned expected = 0, arrived = 0, generation = 0;
  int or_pending = 0, or_result = 0;
};

struct EmuBlock {
  unsigned threads = 0;
  std::vector<ucontext_t> contexts;
  ucontext_t scheduler;
  std::vector<bool> done;
  unsigned current = 0;
  EmuBarrier block;
  std::vector<EmuBarrier> warps;
  std::vector<uint64_t> slots[2];  // shuffle exchange, double-buffered (one barrier per shuffle)
  std::vector<unsigned> shuffle_phase;
};
inline EmuBlock* emu_block = nullptr;

inline void emu_yield() {
  EmuBlock& b = *emu_block;
  swapcontext(&b.contexts[b.current], &b.scheduler);
}

// Waits until all `expected` participants arrived; returns the OR of their flags.
inline int emu_barrier(EmuBarrier& bar, int flag) {
  if (bar.arrived == 0) bar.or_pending = 0;
  bar.or_pending |= flag;
  const unsigned gen = bar.generation;
  if (++bar.arrived == bar.expected) {
    bar.arrived = 0;
    bar.or_result = bar.or_pending;
    ++bar.generation;
    return bar.or_result;
  }
  while (bar.generation == gen) emu_yield();
  return bar.or_result;
}

inline void __syncthreads() { emu_barrier(emu_block->block, 0); }
inline int __syncthreads_or(int pred) { return emu_barrier(emu_block->block, pred != 0); }

template <typename T>
inline T __shfl_down_sync(unsigned /*mask: whole warps only*/, T v, int offset) {
  static_assert(sizeof(T) <= sizeof(uint64_t));
  EmuBlock& b = *emu_block;
  const unsigned t = threadIdx.x, lane = t % 32;
  std::vector<uint64_t>& slot = b.slots[b.shuffle_phase[t]];
  b.shuffle_phase[t] ^= 1u;
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  slot[t] = bits;
  emu_barrier(b.warps[t / 32], 0);
  T out = v;
  if (lane + offset < 32) std::memcpy(&out, &slot[t + offset], sizeof(T));
  return out;
}

// kernel<<<grid, threads>>>(), run on the CPU. threads must be a multiple of 32.
template <typename F>
void emulate_launch(unsigned grid, unsigned threads, F kernel) {
  constexpr size_t kStack = 256 << 10;
  EmuBlock block;
  block.threads = threads;
  block.contexts.resize(threads);
  block.block.expected = threads;
  block.warps.resize((threads + 31) / 32);
  for (EmuBarrier& w : block.warps) w.expected = 32;
  block.slots[0].assign(threads, 0);
  block.slots[1].assign(threads, 0);
  // One mapping for all stacks, a guard page below each.
  const size_t page = 4096, per = kStack + page;
  char* stacks = static_cast<char*>(mmap(nullptr, per * threads, PROT_READ | PROT_WRITE,
                                         MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  if (stacks == MAP_FAILED) std::abort();
  for (unsigned t = 0; t < threads; ++t) mprotect(stacks + t * per, page, PROT_NONE);
  static F* body;
  body = &kernel;
  auto entry = [] {
    (*body)();
    emu_block->done[emu_block->current] = true;
  };
  EmuBlock* saved = emu_block;
  emu_block = &block;
  blockDim.x = threads;
  gridDim.x = grid;
  for (unsigned b = 0; b < grid; ++b) {
    blockIdx.x = b;
    block.done.assign(threads, false);
    block.shuffle_phase.assign(threads, 0);
    for (unsigned t = 0; t < threads; ++t) {
      getcontext(&block.contexts[t]);
      block.contexts[t].uc_stack.ss_sp = stacks + t * per + page;
      block.contexts[t].uc_stack.ss_size = kStack;
      block.contexts[t].uc_link = &block.scheduler;
      makecontext(&block.contexts[t], +entry, 0);
    }
    // Round-robin until every thread has returned.
    for (unsigned left = threads; left > 0;) {
      left = 0;
      for (unsigned t = 0; t < threads; ++t) {
        if (block.done[t]) continue;
        block.current = t;
        threadIdx.x = t;
        swapcontext(&block.scheduler, &block.contexts[t]);
        if (!block.done[t]) ++left;
      }
    }
  }
  emu_block = saved;
  munmap(stacks, per * threads);
}
