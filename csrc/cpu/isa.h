// The CPU kernel's row loops per instruction set, as the host code sees them:
// one table of entry points per path (portable, AVX2, AVX-512, AVX-512 with
// BF16 conversions), each filled by the translation unit compiled for that
// instruction set (row_kernels.h's kRowKernels). Raw uint16_t pointers carry bf16/fp16 bits across, so that no
// c10 inline function is compiled twice with different instruction sets.
#pragma once

#include "../common/online_softmax.h"

#include <cstdint>

namespace twinkle_mem {
namespace cpu {

// fp32-accumulating entry points of one path (bf16, fp16 and fp32 logits):
// segment_state is row_kernels.h's online softmax state of x[0, n), in double;
// segment_grad its off-label gradient of a row segment.
struct RowKernels {
  const char* name;  // the path, as python -m twinkle_mem and TWINKLE_MEM_CPU_ISA name it
  OnlineSoftmax<double> (*state_bf16)(const uint16_t* x, int64_t n, float inv_T, bool with_entropy);
  OnlineSoftmax<double> (*state_fp16)(const uint16_t* x, int64_t n, float inv_T, bool with_entropy);
  OnlineSoftmax<double> (*state_fp32)(const float* x, int64_t n, float inv_T, bool with_entropy);
  void (*grad_bf16)(const uint16_t* x, uint16_t* d, int64_t n, const RowGrad<float>& g);
  void (*grad_fp16)(const uint16_t* x, uint16_t* d, int64_t n, const RowGrad<float>& g);
  void (*grad_fp32)(const float* x, float* d, int64_t n, const RowGrad<float>& g);
};

// Each defined by the translation unit of its instruction set: data only (no
// code of that instruction set runs until one of its entry points is called).
// selective_log_softmax.cpp picks one per op call (cpu_row_kernels).
extern const RowKernels portable_row_kernels;
#if defined(__x86_64__) && defined(__GNUC__)
#define TWINKLE_MEM_CPU_X86 1
extern const RowKernels avx2_row_kernels;    // AVX2 + FMA + F16C, 8 lanes
extern const RowKernels avx512_row_kernels;  // AVX-512 F/BW/VL/DQ, 16 lanes
extern const RowKernels avx512_bf16_row_kernels;  // the same, bf16 gradients stored by AVX-512 BF16
#endif

}  // namespace cpu
}  // namespace twinkle_mem
