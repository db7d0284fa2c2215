// Host launchers of the AscendC kernels (defined in selective_log_softmax_kernel.cpp,
// compiled by the CANN toolchain), declared for the torch_npu glue (compiled by the
// host C++ compiler). Plain C types only: the two sides share no other header.
#pragma once

#include <stdint.h>

#define TWINKLE_MEM_NPU_FP32 0
#define TWINKLE_MEM_NPU_FP16 1
#define TWINKLE_MEM_NPU_BF16 2

#ifdef __cplusplus
extern "C" {
#endif

// Bit (1 << TWINKLE_MEM_NPU_*) set for each logits dtype the library was built
// for (bf16 only for SoCs of the 220 architecture or later).
int twinkle_mem_npu_kernel_dtypes(void);

// One launch of block_dim vector cores on `stream` (an aclrtStream). Pointers are
// device addresses, passed as plain uint8_t* as AscendC launchers take them;
// entropy (forward) and grad_entropy / entropy (backward) are unused unless the
// plan says with_entropy. `tiling` points to a device copy of
// twinkle_mem::npu::Tiling. Returns 0, or 1 for a dtype the library lacks.
int twinkle_mem_npu_launch_fwd(int dtype, uint32_t block_dim, void* stream, uint8_t* logits, uint8_t* labels,
                               uint8_t* logp, uint8_t* entropy, uint8_t* shift, uint8_t* log_sum, uint8_t* tiling,
                               float inv_t);

// grad may equal logits (in-place backward; the plan's gradient rows are then
// the logits' own).
int twinkle_mem_npu_launch_bwd(int dtype, uint32_t block_dim, void* stream, uint8_t* grad_logp,
                               uint8_t* grad_entropy, uint8_t* logits, uint8_t* labels, uint8_t* shift,
                               uint8_t* log_sum, uint8_t* entropy, uint8_t* grad, uint8_t* tiling, float inv_t);

#ifdef __cplusplus
}
#endif
