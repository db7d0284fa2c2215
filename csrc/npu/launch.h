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

// One launch of block_dim vector cores on `stream` (an aclrtStream). Pointers are
// device addresses; entropy / mean (forward) and grad_entropy / mean (backward)
// are unused unless the tiling says with_entropy. `tiling` points to a device
// copy of twinkle_mem::npu::Tiling. Returns 0, or 1 for an unsupported dtype.
int twinkle_mem_npu_launch_fwd(int dtype, uint32_t block_dim, void* stream, void* logits, void* labels, void* logp,
                               void* entropy, void* lse, void* mean, void* tiling, float inv_t);

// grad may equal logits (in-place backward; the tiling's out_row_stride is then
// the logits' row stride).
int twinkle_mem_npu_launch_bwd(int dtype, uint32_t block_dim, void* stream, void* grad_logp, void* grad_entropy,
                               void* logits, void* labels, void* lse, void* mean, void* grad, void* tiling,
                               float inv_t);

#ifdef __cplusplus
}
#endif
