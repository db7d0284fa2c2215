// torch_npu glue of the selective log-softmax op: registers the AscendC
// kernels (selective_log_softmax_kernel.cpp) for the PrivateUse1 ("npu")
// dispatch key of the schemas in csrc/ops.cpp.
//
// Unlike _C_cpu / _C_cuda this library uses the regular torch C++ API (not the
// stable ABI): torch_npu's headers (OpCommand, NPUStream) are only offered
// that way, and torch_npu pins one torch version anyway. It is built by the
// top-level CMakeLists.txt on a CANN node only (see docs/npu.md).
//
// Per call: check the arguments (the messages of csrc/common/op_checks.h),
// check the label range (one device reduction and a host sync, as the CPU
// kernel's host-side check), plan the tiles (tiling.h) from the UB size and
// vector-core count of the device, copy the plan to the device, and launch
// through at_npu::native::OpCommand so the launch is ordered with torch_npu's
// own task queue (a raw launch on the stream could run before queued ops).
// fp64 logits, which the NPU's vector units do not compute, run on the CPU
// kernel and come back.
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <acl/acl.h>

#include "torch_npu/csrc/core/npu/NPUFormat.h"
#include "torch_npu/csrc/core/npu/NPUGuard.h"
#include "torch_npu/csrc/core/npu/NPUStream.h"
#include "torch_npu/csrc/framework/OpCommand.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <tuple>
#include <unordered_map>

#include "../common/op_checks.h"
#include "launch.h"
#include "tiling.h"

namespace twinkle_mem {
namespace npu {
namespace {

using at::Tensor;

// ------------------------------------------------------------- argument checks
// The shared checks of csrc/common/op_checks.h, plus what only the NPU needs.

// The kernel reads rows by (row, column) offsets: the NPU tensor must hold its plain (ND) layout.
void check_base_format(const Tensor& logits) {
  const int64_t format = at_npu::native::get_npu_format(logits);
  TORCH_CHECK(format == ACL_FORMAT_ND || format == ACL_FORMAT_NCHW || format == ACL_FORMAT_NHWC ||
                  format == ACL_FORMAT_NCDHW,
              "twinkle_mem(npu): logits must be in a base (ND) format, not the internal NPU format ", format,
              " (convert with torch_npu.npu_format_cast(logits, 2))");
}

void check_label_range(const Tensor& labels, int64_t ignore_index, int64_t vocab_size) {
  if (labels.numel() == 0) return;
  const Tensor y = labels.to(at::kLong);
  const Tensor bad = y.ne(ignore_index).logical_and(y.lt(0).logical_or(y.ge(vocab_size)));
  if (!bad.any().item<bool>()) return;  // the one host sync of the op
  const int64_t i = bad.nonzero().select(1, 0)[0].item<int64_t>();
  fail_label_out_of_range(i, y[i].item<int64_t>(), vocab_size, ignore_index);
}

// ------------------------------------------------------------- device facts
struct DeviceFacts {
  int64_t ub_bytes;
  int64_t vector_cores;
};

int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return (v && *v) ? std::strtoll(v, nullptr, 10) : fallback;
}

// UB bytes per vector core and the vector-core count, asked of ACL once per
// device. TWINKLE_MEM_NPU_UB_BYTES / TWINKLE_MEM_NPU_CORES override them.
DeviceFacts device_facts(int device) {
  static std::mutex mu;
  static std::unordered_map<int, DeviceFacts> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(device);
  if (it != cache.end()) return it->second;
  int64_t cores = 0, ub = 0;
  // ACL_DEV_ATTR_VECTOR_CORE_NUM (201) and ACL_DEV_ATTR_UBUF_PER_VECTOR_CORE (204), by value: older
  // CANN headers lack the second name, and an older runtime answers an error we fall back from.
  if (aclrtGetDeviceInfo(static_cast<uint32_t>(device), static_cast<aclrtDevAttr>(201), &cores) != ACL_SUCCESS ||
      cores <= 0) {
    int64_t ai_cores = 0;
    cores = aclrtGetDeviceInfo(static_cast<uint32_t>(device), static_cast<aclrtDevAttr>(101), &ai_cores) == ACL_SUCCESS &&
                    ai_cores > 0
                ? 2 * ai_cores  // A2/A3: two vector cores per AI core
                : 40;
  }
  if (aclrtGetDeviceInfo(static_cast<uint32_t>(device), static_cast<aclrtDevAttr>(204), &ub) != ACL_SUCCESS || ub <= 0) {
    ub = 192 * 1024;  // Ascend 910B / 910C
  }
  DeviceFacts facts{env_int("TWINKLE_MEM_NPU_UB_BYTES", ub), env_int("TWINKLE_MEM_NPU_CORES", cores)};
  cache.emplace(device, facts);
  return facts;
}

int kernel_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return TWINKLE_MEM_NPU_FP32;
    case at::kHalf: return TWINKLE_MEM_NPU_FP16;
    case at::kBFloat16: return TWINKLE_MEM_NPU_BF16;
    default: TORCH_CHECK(false, "twinkle_mem(npu): no kernel for logits dtype ", t);
  }
}

// The plan for these tensors, and a device copy of it for the kernel.
std::pair<Tiling, Tensor> plan(const Tensor& logits, const Tensor& labels, int64_t mode, bool with_entropy,
                               int64_t ignore_index, int64_t vocab_start, int64_t vocab_size, int64_t out_row_stride) {
  const DeviceFacts facts = device_facts(logits.device().index());
  TilingRequest r;
  r.n_rows = logits.size(0);
  r.vocab = logits.size(1);
  r.row_stride = logits.size(0) > 1 ? logits.stride(0) : logits.size(1);
  r.out_row_stride = out_row_stride;
  r.elem_bytes = static_cast<int64_t>(logits.element_size());
  r.label_bytes = static_cast<int64_t>(labels.element_size());
  r.vocab_start = vocab_start;
  r.vocab_size = vocab_size;
  r.ignore_index = ignore_index;
  r.with_entropy = with_entropy;
  r.mode = mode;
  r.ub_bytes = facts.ub_bytes;
  r.core_count = facts.vector_cores;
  r.max_tile_len = env_int("TWINKLE_MEM_NPU_MAX_TILE", 0);
  const TilingResult res = make_tiling(r);
  TORCH_CHECK(res.error == nullptr, res.error ? res.error : "");
  Tensor host = at::empty({kTilingWords}, at::TensorOptions().dtype(at::kLong));
  std::memcpy(host.data_ptr(), &res.tiling, sizeof(Tiling));
  return {res.tiling, host.to(logits.device())};
}

// fp64: the CPU kernel, through the dispatcher, on CPU copies.
c10::OperatorHandle op_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

// ------------------------------------------------------------------- forward
std::tuple<Tensor, Tensor, Tensor, Tensor> selective_log_softmax_fwd(const Tensor& logits, const Tensor& labels,
                                                                     double inv_temperature, int64_t ignore_index,
                                                                     int64_t vocab_start, int64_t vocab_size,
                                                                     bool with_entropy, bool inplace_backward) {
  check_forward_args(logits, labels, inv_temperature, vocab_start, vocab_size);
  check_base_format(logits);
  c10_npu::NPUGuard guard(logits.device());
  if (logits.scalar_type() == at::kDouble) {
    auto out = op_handle("twinkle_mem::selective_log_softmax_fwd")
                   .typed<std::tuple<Tensor, Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, double, int64_t,
                                                                      int64_t, int64_t, bool, bool)>()
                   .call(logits.cpu(), labels.cpu(), inv_temperature, ignore_index, vocab_start, vocab_size,
                         with_entropy, inplace_backward);
    const auto dev = logits.device();
    return {std::get<0>(out).to(dev), std::get<1>(out).to(dev), std::get<2>(out).to(dev), std::get<3>(out).to(dev)};
  }
  check_label_range(labels, ignore_index, vocab_size);
  const int64_t n = logits.size(0);
  const auto opts = logits.options().dtype(at::kFloat);
  Tensor logp = at::empty({n}, opts), lse = at::empty({n}, opts);
  Tensor entropy = at::empty({with_entropy ? n : 0}, opts), mean = at::empty({with_entropy ? n : 0}, opts);
  if (n == 0) return {logp, entropy, lse, mean};

  const Tensor y = labels.contiguous();
  auto [tiling, tiling_dev] = plan(logits, y, kForward, with_entropy, ignore_index, vocab_start, vocab_size, 0);
  const int dtype = kernel_dtype(logits.scalar_type());
  const uint32_t block_dim = static_cast<uint32_t>(tiling.used_cores);
  const float inv_t = static_cast<float>(inv_temperature);
  aclrtStream stream = c10_npu::getCurrentNPUStream().stream();
  // The handler may run later, from torch_npu's task queue: it holds the tensors.
  at_npu::native::OpCommand cmd;
  cmd.Name("twinkle_mem_selective_log_softmax_fwd");
  cmd.SetCustomHandler([=]() -> int {
    return twinkle_mem_npu_launch_fwd(dtype, block_dim, stream, logits.data_ptr(), y.data_ptr(), logp.data_ptr(),
                                      with_entropy ? entropy.data_ptr() : nullptr, lse.data_ptr(),
                                      with_entropy ? mean.data_ptr() : nullptr, tiling_dev.data_ptr(), inv_t);
  });
  cmd.Run();
  return {logp, entropy, lse, mean};
}

// ------------------------------------------------------------------ backward
void check_backward(const Tensor& grad_logp, const std::optional<Tensor>& grad_entropy, const Tensor& logits,
                    const Tensor& labels, const Tensor& lse, const std::optional<Tensor>& mean,
                    double inv_temperature) {
  check_backward_args(grad_logp, grad_entropy, logits, labels, lse, mean, inv_temperature);
  check_base_format(logits);
}

// Launches the backward writing into `grad` (which may be `logits`).
void launch_backward(const Tensor& grad_logp, const std::optional<Tensor>& grad_entropy, const Tensor& logits,
                     const Tensor& labels, const Tensor& lse, const std::optional<Tensor>& mean,
                     double inv_temperature, int64_t ignore_index, int64_t vocab_start, const Tensor& grad) {
  const bool with_entropy = grad_entropy.has_value();
  const Tensor y = labels.contiguous(), gl = grad_logp.contiguous(), l = lse.contiguous();
  const Tensor ge = with_entropy ? grad_entropy->contiguous() : Tensor();
  const Tensor m = with_entropy ? mean->contiguous() : Tensor();
  // vocab_size only bounds the shard in the plan; the backward's labels were checked by the forward.
  const int64_t out_stride = grad.size(0) > 1 ? grad.stride(0) : grad.size(1);
  auto [tiling, tiling_dev] = plan(logits, y, kBackward, with_entropy, ignore_index, vocab_start,
                                   vocab_start + logits.size(1), out_stride);
  const int dtype = kernel_dtype(logits.scalar_type());
  const uint32_t block_dim = static_cast<uint32_t>(tiling.used_cores);
  const float inv_t = static_cast<float>(inv_temperature);
  aclrtStream stream = c10_npu::getCurrentNPUStream().stream();
  at_npu::native::OpCommand cmd;
  cmd.Name("twinkle_mem_selective_log_softmax_bwd");
  cmd.SetCustomHandler([=]() -> int {
    return twinkle_mem_npu_launch_bwd(dtype, block_dim, stream, gl.data_ptr(), with_entropy ? ge.data_ptr() : nullptr,
                                      logits.data_ptr(), y.data_ptr(), l.data_ptr(),
                                      with_entropy ? m.data_ptr() : nullptr, grad.data_ptr(), tiling_dev.data_ptr(),
                                      inv_t);
  });
  cmd.Run();
}

Tensor selective_log_softmax_bwd(const Tensor& grad_logp, const std::optional<Tensor>& grad_entropy,
                                 const Tensor& logits, const Tensor& labels, const Tensor& lse,
                                 const std::optional<Tensor>& mean, double inv_temperature, int64_t ignore_index,
                                 int64_t vocab_start) {
  check_backward(grad_logp, grad_entropy, logits, labels, lse, mean, inv_temperature);
  c10_npu::NPUGuard guard(logits.device());
  if (logits.scalar_type() == at::kDouble) {
    auto cpu = [](const std::optional<Tensor>& t) { return t ? std::optional<Tensor>(t->cpu()) : std::nullopt; };
    return op_handle("twinkle_mem::selective_log_softmax_bwd")
        .typed<Tensor(const Tensor&, const std::optional<Tensor>&, const Tensor&, const Tensor&, const Tensor&,
                      const std::optional<Tensor>&, double, int64_t, int64_t)>()
        .call(grad_logp.cpu(), cpu(grad_entropy), logits.cpu(), labels.cpu(), lse.cpu(), cpu(mean), inv_temperature,
              ignore_index, vocab_start)
        .to(logits.device());
  }
  Tensor grad = at::empty(logits.sizes(), logits.options().memory_format(at::MemoryFormat::Contiguous));
  if (logits.size(0) == 0) return grad;
  launch_backward(grad_logp, grad_entropy, logits, labels, lse, mean, inv_temperature, ignore_index, vocab_start,
                  grad);
  return grad;
}

void selective_log_softmax_bwd_(const Tensor& grad_logp, const std::optional<Tensor>& grad_entropy, Tensor& logits,
                                const Tensor& labels, const Tensor& lse, const std::optional<Tensor>& mean,
                                double inv_temperature, int64_t ignore_index, int64_t vocab_start) {
  check_backward(grad_logp, grad_entropy, logits, labels, lse, mean, inv_temperature);
  c10_npu::NPUGuard guard(logits.device());
  if (logits.scalar_type() == at::kDouble) {
    logits.copy_(selective_log_softmax_bwd(grad_logp, grad_entropy, logits, labels, lse, mean, inv_temperature,
                                           ignore_index, vocab_start));
    return;
  }
  if (logits.size(0) == 0) return;
  launch_backward(grad_logp, grad_entropy, logits, labels, lse, mean, inv_temperature, ignore_index, vocab_start,
                  logits);
}

}  // namespace
}  // namespace npu
}  // namespace twinkle_mem

TORCH_LIBRARY_IMPL(twinkle_mem, PrivateUse1, m) {
  m.impl("selective_log_softmax_fwd", &twinkle_mem::npu::selective_log_softmax_fwd);
  m.impl("selective_log_softmax_bwd", &twinkle_mem::npu::selective_log_softmax_bwd);
  m.impl("selective_log_softmax_bwd_", &twinkle_mem::npu::selective_log_softmax_bwd_);
}
