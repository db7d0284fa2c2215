// Just enough of the CUDA device API to run the kernels of
// ../selective_log_softmax.cu as host C++: one OS thread per CUDA thread,
// blocks one after another, __syncthreads and warp shuffles on barriers.
// It tests the kernels' indexing (edges, chunks, segments, grid-stride loops,
// reductions, label handling) where no GPU is present. It says nothing about
// speed or memory-model subtleties, and its exp/log are the host's, not __expf.
#pragma once

#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
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
inline thread_local EmuDim threadIdx, blockIdx, blockDim, gridDim;

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
// Lane-wise max; like the hardware, a NaN lane yields the other operand.
inline __nv_bfloat162 __hmax2(__nv_bfloat162 a, __nv_bfloat162 b) {
  auto m = [](__nv_bfloat16 p, __nv_bfloat16 q) {
    return __float2bfloat16_rn(std::fmax(__bfloat162float(p), __bfloat162float(q)));
  };
  return {m(a.x, b.x), m(a.y, b.y)};
}
inline __half2 __hmax2(__half2 a, __half2 b) {
  auto m = [](__half p, __half q) { return __float2half_rn(std::fmax(__half2float(p), __half2float(q))); };
  return {m(a.x, b.x), m(a.y, b.y)};
}

// ---- memory
template <typename T>
inline T __ldcs(const T* p) { return *p; }
template <typename T>
inline void __stcs(T* p, T v) { *p = v; }
inline std::mutex emu_atomic_mutex;
inline unsigned long long atomicMax(unsigned long long* p, unsigned long long v) {
  std::lock_guard<std::mutex> lock(emu_atomic_mutex);
  const unsigned long long old = *p;
  if (v > old) *p = v;
  return old;
}

// ---- block execution
struct EmuBlock {
  explicit EmuBlock(unsigned threads) : block(threads), slots(threads) {
    for (unsigned w = 0; w < (threads + 31) / 32; ++w) warps.emplace_back(std::make_unique<std::barrier<>>(32));
  }
  std::barrier<> block;
  std::vector<std::unique_ptr<std::barrier<>>> warps;
  std::vector<uint64_t> slots;
};
inline thread_local EmuBlock* emu_block = nullptr;

inline void __syncthreads() { emu_block->block.arrive_and_wait(); }

template <typename T>
inline T __shfl_down_sync(unsigned /*mask: whole warps only*/, T v, int offset) {
  static_assert(sizeof(T) <= sizeof(uint64_t));
  EmuBlock& b = *emu_block;
  const unsigned t = threadIdx.x, lane = t % 32;
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  b.slots[t] = bits;
  b.warps[t / 32]->arrive_and_wait();
  T out = v;
  if (lane + offset < 32) std::memcpy(&out, &b.slots[t + offset], sizeof(T));
  b.warps[t / 32]->arrive_and_wait();
  return out;
}

// kernel<<<grid, threads>>>(), run on the CPU. threads must be a multiple of 32.
template <typename F>
void emulate_launch(unsigned grid, unsigned threads, F kernel) {
  for (unsigned b = 0; b < grid; ++b) {
    EmuBlock block(threads);
    std::vector<std::thread> pool;
    pool.reserve(threads);
    for (unsigned t = 0; t < threads; ++t) {
      pool.emplace_back([&, b, t] {
        threadIdx.x = t;
        blockIdx.x = b;
        blockDim.x = threads;
        gridDim.x = grid;
        emu_block = &block;
        kernel();
      });
    }
    for (auto& th : pool) th.join();
  }
}
