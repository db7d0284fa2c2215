// Row indexing and ceil_div, written once for every backend: the CPU kernel,
// the CUDA kernels (host and device), and the AscendC kernel on the AI core.
//
// Plain C++ without any #include: the AI core's compiler has no <cstdint> or
// <algorithm> (csrc/npu/tiling.h says more), so RowIndexOf is a template over
// the index type (int64_t on the CPU and CUDA, tiling.h's i64 on the NPU).
// Which qualifiers a function needs is keyed on the compiler: nvcc defines
// __CUDACC__; the AscendC headers define __aicore__ before a kernel includes
// this (as nothing in CPU-debug mode and in the project's stand-in).
#pragma once

#if defined(__CUDACC__) || defined(__HIPCC__)
#define TM_INDEX_FN __host__ __device__ __forceinline__
#elif defined(__aicore__)
#define TM_INDEX_FN __aicore__ inline
#else
#define TM_INDEX_FN inline
#endif

namespace twinkle_mem {

// Element offset of a row of a [N, ...] or [B, S, ...] tensor (rows numbered
// row = b * S + s): (row / inner) * outer_stride + (row % inner) * inner_stride.
// A 2-D tensor [N, ...] is the case outer_stride = 0, inner = N.
template <typename index_t>
struct RowIndexOf {
  index_t inner;
  index_t outer_stride;
  index_t inner_stride;
  TM_INDEX_FN index_t operator()(index_t row) const {
    if (outer_stride == 0) return row * inner_stride;
    const index_t outer = row / inner;
    return outer * outer_stride + (row - outer * inner) * inner_stride;
  }
};

// a / b rounded up, for a >= 0 and b > 0, in the wider of the two types.
template <typename A, typename B>
TM_INDEX_FN auto ceil_div(A a, B b) -> decltype(a + b) {
  return (a + b - 1) / b;
}

}  // namespace twinkle_mem
