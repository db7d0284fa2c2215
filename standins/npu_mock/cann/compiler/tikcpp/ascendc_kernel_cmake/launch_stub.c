/* The kernel library's C entry points (csrc/npu/launch.h) without kernels:
 * what the mock ascendc_library() builds in place of the AscendC sources. */
#include <stdint.h>

int twinkle_mem_npu_kernel_dtypes(void) { return 7; }

int twinkle_mem_npu_launch_fwd(int dtype, uint32_t block_dim, void* stream, uint8_t* logits, uint8_t* labels,
                               uint8_t* logp, uint8_t* entropy, uint8_t* shift, uint8_t* log_sum, uint8_t* tiling,
                               float inv_t) {
  (void)block_dim, (void)stream, (void)logits, (void)labels, (void)logp, (void)entropy, (void)shift, (void)log_sum;
  (void)tiling, (void)inv_t;
  return dtype > 2;
}

int twinkle_mem_npu_launch_bwd(int dtype, uint32_t block_dim, void* stream, uint8_t* grad_logp,
                               uint8_t* grad_entropy, uint8_t* logits, uint8_t* labels, uint8_t* shift,
                               uint8_t* log_sum, uint8_t* entropy, uint8_t* grad, uint8_t* tiling, float inv_t) {
  (void)block_dim, (void)stream, (void)grad_logp, (void)grad_entropy, (void)logits, (void)labels, (void)shift;
  (void)log_sum, (void)entropy, (void)grad, (void)tiling, (void)inv_t;
  return dtype > 2;
}
