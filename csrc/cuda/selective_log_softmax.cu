// The CUDA backend of the selective log-softmax op: the stable-ABI glue that
// registers the kernels (selective_log_softmax_kernels.cuh, launched by the host
// plan in selective_log_softmax_plan.cuh) for the CUDA dispatch key of the
// schemas in csrc/ops.cpp. The entry points and argument checks are
// csrc/common/op_entry.h's, the outputs' allocation forward_outputs.h's; here:
// workspaces, the stream, the launch.
#include "../common/forward_outputs.h"
#include "../common/op_entry.h"
#include "selective_log_softmax_plan.cuh"

#include <cuda_runtime.h>

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/macros.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>

namespace twinkle_mem {
namespace cuda {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

cudaStream_t current_stream(int32_t device_index) {
  void* stream = nullptr;
  STD_TORCH_CHECK(aoti_torch_get_current_cuda_stream(device_index, &stream) == AOTI_TORCH_SUCCESS,
                  "twinkle_mem: could not get the current CUDA stream of device ", device_index);
  return static_cast<cudaStream_t>(stream);
}

// The plan's launcher: on the current stream, checked at once (no sync).
struct StreamLauncher {
  cudaStream_t stream;
  template <typename Kernel, typename Args>
  void operator()(Kernel kernel, unsigned grid, int threads, const Args& args) const {
    kernel<<<grid, threads, 0, stream>>>(args);
    STD_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

// Grid-stride loops: 2^31 - 1 blocks is the hardware's limit on grid.x.
constexpr Launch kHardwareLimits{std::numeric_limits<int32_t>::max(), kSegmentBytes};

Dtype dtype_of(const Tensor& t) {
  switch (t.scalar_type()) {
    case ScalarType::BFloat16: return Dtype::kBFloat16;
    case ScalarType::Half: return Dtype::kHalf;
    case ScalarType::Float: return Dtype::kFloat;
    default: return Dtype::kDouble;
  }
}

TensorRef ref(const Tensor& t) {
  TensorRef r{t.data_ptr(), static_cast<int>(t.dim()), {}, {}};
  for (int d = 0; d < r.dim; ++d) {
    r.sizes[d] = t.size(d);
    r.strides[d] = t.stride(d);
  }
  return r;
}

// A scratch tensor of `bytes` on the logits' device (the caching allocator: no sync).
Tensor scratch(const Tensor& logits, int64_t bytes) {
  return torch::stable::new_empty(logits, {std::max<int64_t>(bytes, 1)}, ScalarType::Byte);
}

// The CUDA kernels behind forward_outputs.h's StableBackend (the arguments were
// checked by op_entry.h, the outputs allocated there): workspaces, the stream, the launch.
struct Kernels {
  static void forward(const Tensor& logits, const Tensor& labels, const OpOptions& o, Tensor& logp, Tensor& entropy,
                      Tensor& shift, Tensor& log_sum) {
    if (shift.numel() == 0) return;
    torch::stable::accelerator::DeviceGuard guard(logits.get_device_index());
    const TensorRef x = ref(logits);
    const Tensor workspace = scratch(logits, forward_workspace_bytes(dtype_of(logits), x, kHardwareLimits));
    run_forward(dtype_of(logits), x, ref(labels), labels.scalar_type() == ScalarType::Long, o,
                {logp.data_ptr(), entropy.data_ptr(), shift.data_ptr(), log_sum.data_ptr()}, workspace.data_ptr(),
                kHardwareLimits, StreamLauncher{current_stream(logits.get_device_index())});
  }

  // Writes into `grad` (the logits themselves in place).
  static void backward(const BackwardInputs<Tensor>& args, const OpOptions& o, const Tensor& grad) {
    const Tensor& logits = args.logits;
    if (args.shift.numel() == 0) return;
    torch::stable::accelerator::DeviceGuard guard(logits.get_device_index());
    const BackwardRowInputs in = contiguous_row_inputs(args);
    const Dtype dtype = dtype_of(logits);
    const TensorRef y = ref(args.labels);
    // The workspace (the logits at the labels) is read only in place: no scratch out of place.
    std::optional<Tensor> workspace;
    if (o.inplace_backward) workspace = scratch(logits, backward_workspace_bytes(dtype, y, true));
    const BackwardRows rows{in.grad_logp.data_ptr(), in.grad_entropy.data_ptr(), in.entropy.data_ptr(),
                            in.shift.data_ptr(), in.log_sum.data_ptr()};
    run_backward(dtype, ref(logits), ref(grad), y, args.labels.scalar_type() == ScalarType::Long, rows, o,
                 workspace ? workspace->data_ptr() : nullptr, kHardwareLimits,
                 StreamLauncher{current_stream(logits.get_device_index())});
  }
};
using Ops = OpEntries<StableBackend<Kernels>>;

}  // namespace cuda
}  // namespace twinkle_mem

STABLE_TORCH_LIBRARY_IMPL(twinkle_mem, CUDA, m) {
  m.impl("selective_log_softmax_fwd", TORCH_BOX(&twinkle_mem::cuda::Ops::fwd));
  m.impl("selective_log_softmax_bwd", TORCH_BOX(&twinkle_mem::cuda::Ops::bwd));
  m.impl("selective_log_softmax_bwd_", TORCH_BOX(&twinkle_mem::cuda::Ops::bwd_));
}
