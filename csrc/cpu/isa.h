// What the host code of the CPU kernel calls in the AVX2 translation unit.
// Raw uint16_t pointers carry bf16/fp16 bits across, so that no c10 inline
// function is compiled twice with different instruction sets.
#pragma once

#include "../common/online_softmax.h"

#include <cstdint>

namespace twinkle_mem {
namespace cpu {

// True when the CPU has AVX2, FMA and F16C (checked once).
bool cpu_has_avx2();

// Online softmax state of x[0, n), in double (see row_kernels.h segment_state).
OnlineSoftmax<double> avx2_segment_state_bf16(const uint16_t* x, int64_t n, float inv_T, bool with_entropy);
OnlineSoftmax<double> avx2_segment_state_fp16(const uint16_t* x, int64_t n, float inv_T, bool with_entropy);
OnlineSoftmax<double> avx2_segment_state_fp32(const float* x, int64_t n, float inv_T, bool with_entropy);

// Off-label gradient of a row segment (see row_kernels.h segment_grad).
void avx2_segment_grad_bf16(const uint16_t* x, uint16_t* d, int64_t n, const RowGrad<float>& g);
void avx2_segment_grad_fp16(const uint16_t* x, uint16_t* d, int64_t n, const RowGrad<float>& g);
void avx2_segment_grad_fp32(const float* x, float* d, int64_t n, const RowGrad<float>& g);

}  // namespace cpu
}  // namespace twinkle_mem
