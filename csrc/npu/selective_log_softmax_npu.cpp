// torch_npu glue of the selective log-softmax op: registers the AscendC
// kernels (selective_log_softmax_kernel.cpp) for the PrivateUse1 ("npu")
// dispatch key of the schemas in csrc/ops.cpp (contract v2).
//
// Unlike _C_cpu / _C_cuda this library uses the regular torch C++ API (not the
// stable ABI): torch_npu's headers (OpCommand, NPUStream) are only offered
// that way, and torch_npu pins one torch version anyway. It is built by the
// top-level CMakeLists.txt on a CANN node only (see docs/npu.md).
//
// Per call, without a host synchronisation:
//   - the shared entry points and argument checks (csrc/common/op_entry.h,
//     op_checks.h) and the NPU's own
//     (plain ND format, a dtype the library and the SoC have);
//   - out-of-range labels: the kernel writes NaN for their log-probs and never
//     reads outside a row; a count of them is reduced on the device and copied
//     to pinned memory behind an event, and a later call raises once that event
//     has completed (TWINKLE_MEM_NPU_SYNC_CHECKS=1: check with a host sync at
//     the call, naming the label, as the CPU kernel does);
//   - the plan (tiling.h) from the tensors' strides (no copy of [B, S, V] views
//     or label views), the device's vector-core count (aclGetDeviceCapability)
//     and the documented UB budget; its device copy is cached per shape and
//     stream, and uploaded from pinned memory with a non-blocking copy on a miss;
//   - the launch inside at_npu::native::OpCommand, ordered with torch_npu's
//     task queue, on the current stream taken without flushing that queue.
// fp64 logits, which the NPU's vector units do not compute, run on the CPU
// kernel and come back.
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <acl/acl.h>

#include "torch_npu/csrc/core/npu/NPUEvent.h"
#include "torch_npu/csrc/core/npu/NPUFormat.h"
#include "torch_npu/csrc/core/npu/NPUGuard.h"
#include "torch_npu/csrc/core/npu/NPUStream.h"
#include "torch_npu/csrc/framework/OpCommand.h"

#include <array>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "../common/layout.h"
#include "../common/op_checks.h"
#include "../common/op_entry.h"
#include "launch.h"
#include "tiling.h"

namespace twinkle_mem {
namespace npu {
namespace {

using at::Tensor;

int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return (v && *v) ? std::strtoll(v, nullptr, 10) : fallback;
}

// ------------------------------------------------------------- argument checks
// The kernel reads rows by element offsets: the NPU tensor must hold its plain (ND) layout.
void check_base_format(const Tensor& logits) {
  const int64_t format = at_npu::native::get_npu_format(logits);
  TORCH_CHECK(format == ACL_FORMAT_ND || format == ACL_FORMAT_NCHW || format == ACL_FORMAT_NHWC ||
                  format == ACL_FORMAT_NCDHW,
              "twinkle_mem(npu): logits must be in a base (ND) format, not the internal NPU format ", format,
              " (convert with torch_npu.npu_format_cast(logits, 2))");
}

int kernel_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return TWINKLE_MEM_NPU_FP32;
    case at::kHalf: return TWINKLE_MEM_NPU_FP16;
    case at::kBFloat16: return TWINKLE_MEM_NPU_BF16;
    default: TORCH_CHECK(false, "twinkle_mem(npu): no kernel for logits dtype ", t);
  }
}

// A dtype must be built into the library and supported by the SoC, or the
// call raises here: before any output is allocated or any launch is queued.
void check_dtype_supported(at::ScalarType t) {
  const int dtype = kernel_dtype(t);
  TORCH_CHECK((twinkle_mem_npu_kernel_dtypes() >> dtype) & 1, "twinkle_mem(npu): this build of _C_npu has no ", t,
              " kernel (it was built for a SoC without bf16 vector instructions; rebuild with SOC_VERSION of this "
              "NPU, or use float16 / float32 logits)");
  if (t == at::kBFloat16) {
    static const bool soc_bf16 = soc_supports_bf16(aclrtGetSocName());
    TORCH_CHECK(soc_bf16, "twinkle_mem(npu): this NPU (", aclrtGetSocName() ? aclrtGetSocName() : "unknown SoC",
                ") has no bf16 vector instructions (Atlas A2 / A3 or later needed); use float16 or float32 logits");
  }
}

// ------------------------------------------------------------- label range
// Out-of-range labels counted on the device, read back when the copy is done.
struct PendingLabelCheck {
  Tensor host_count;  // pinned int64 [1]
  std::shared_ptr<c10_npu::NPUEvent> done;
  int64_t vocab_size, ignore_index;
};
std::mutex g_label_mu;
std::deque<PendingLabelCheck> g_label_checks;
constexpr size_t kMaxPendingLabelChecks = 256;

void raise_if_bad(const PendingLabelCheck& c) {
  const int64_t bad = c.host_count.data_ptr<int64_t>()[0];
  if (bad == 0) return;
  // label_message.h's rule and hint: the same words as the message that names the label.
  Message m;
  m.add("twinkle_mem: label out of range in an earlier call on the NPU: ");
  m.add(bad);
  m.add(" labels were ");
  m.add_rule(c.vocab_size, c.ignore_index);
  m.add(" (their log-probs are NaN); ");
  m.add_ignore_hint();
  m.add("; set TWINKLE_MEM_NPU_SYNC_CHECKS=1 to raise at the call, naming the label");
  TORCH_CHECK(false, m.text);
}

// Raises for the first completed check that found bad labels; never waits
// (unless more than kMaxPendingLabelChecks are in flight).
void poll_label_checks() {
  std::lock_guard<std::mutex> lock(g_label_mu);
  while (!g_label_checks.empty()) {
    PendingLabelCheck& c = g_label_checks.front();
    if (g_label_checks.size() > kMaxPendingLabelChecks) {
      c.done->synchronize();
    } else if (!c.done->query()) {
      break;
    }
    PendingLabelCheck ready = std::move(c);
    g_label_checks.pop_front();
    raise_if_bad(ready);
  }
}

void check_label_range(const Tensor& labels, int64_t ignore_index, int64_t vocab_size) {
  if (labels.numel() == 0) return;
  const Tensor bad = labels.ne(ignore_index).logical_and(labels.lt(0).logical_or(labels.ge(vocab_size)));
  if (env_int("TWINKLE_MEM_NPU_SYNC_CHECKS", 0) != 0) {  // exact, with a host sync
    if (!bad.any().item<bool>()) return;
    const Tensor flat = bad.flatten();
    const int64_t i = flat.nonzero().select(1, 0)[0].item<int64_t>();
    fail_label_out_of_range(i, labels.flatten()[i].item<int64_t>(), vocab_size, ignore_index);
  }
  PendingLabelCheck c;
  c.host_count = at::empty({1}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  c.host_count.copy_(bad.sum(at::kLong).reshape({1}), /*non_blocking=*/true);
  c.done = std::make_shared<c10_npu::NPUEvent>();
  c.done->record(c10_npu::getCurrentNPUStream());
  c.vocab_size = vocab_size;
  c.ignore_index = ignore_index;
  std::lock_guard<std::mutex> lock(g_label_mu);
  g_label_checks.push_back(std::move(c));
}

// ------------------------------------------------------------- device facts
struct DeviceFacts {
  int64_t ub_bytes;
  int64_t vector_cores;
};

// Vector cores (AIV) from aclGetDeviceCapability (CANN 8.0+; aclrtGetDeviceInfo
// does not exist there), asked once per device; the UB budget is the
// documented one of the 220 architecture (A2 / A3), which later SoCs exceed.
// TWINKLE_MEM_NPU_CORES / TWINKLE_MEM_NPU_UB_BYTES override them.
DeviceFacts device_facts(int device) {
  static std::mutex mu;
  static std::unordered_map<int, DeviceFacts> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(device);
  if (it != cache.end()) return it->second;
  int64_t cores = 0;
  if (aclGetDeviceCapability(static_cast<uint32_t>(device), ACL_DEVICE_INFO_VECTOR_CORE_NUM, &cores) != ACL_SUCCESS ||
      cores <= 0) {
    int64_t ai_cores = 0;
    cores = aclGetDeviceCapability(static_cast<uint32_t>(device), ACL_DEVICE_INFO_AI_CORE_NUM, &ai_cores) ==
                        ACL_SUCCESS &&
                    ai_cores > 0
                ? 2 * ai_cores  // A2 / A3: two vector cores per AI core
                : 40;
  }
  DeviceFacts facts{env_int("TWINKLE_MEM_NPU_UB_BYTES", kUbBudget220), env_int("TWINKLE_MEM_NPU_CORES", cores)};
  cache.emplace(device, facts);
  return facts;
}

// ------------------------------------------------------------- the plan
TilingRequest make_request(const Tensor& logits, const Tensor& labels, int64_t mode, const OpOptions& o) {
  const int64_t lead = logits.dim() - 1;
  const DeviceFacts facts = device_facts(logits.device().index());
  TilingRequest r;
  r.n_rows = 1;
  for (int64_t d = 0; d < lead; ++d) r.n_rows *= logits.size(d);
  r.vocab = logits.size(lead);
  // layout.h's row_index, as the CPU kernel forms it, in the plan's i64 words.
  r.x_rows = row_index<i64>(lead, logits.sizes().data(), logits.strides().data());
  r.y_rows = row_index<i64>(lead, labels.sizes().data(), labels.strides().data());
  const bool has_k = labels.dim() > lead;
  r.label_k = has_k ? labels.size(lead) : 1;
  r.label_k_stride = has_k ? labels.stride(lead) : 1;
  r.elem_bytes = static_cast<int64_t>(logits.element_size());
  r.label_bytes = static_cast<int64_t>(labels.element_size());
  r.vocab_start = o.vocab_start;
  r.vocab_size = o.vocab_size;
  r.ignore_index = o.ignore_index;
  r.with_entropy = o.with_entropy;
  r.mode = mode;
  r.ub_bytes = facts.ub_bytes;
  r.core_count = facts.vector_cores;
  r.max_tile_len = env_int("TWINKLE_MEM_NPU_MAX_TILE", 0);
  return r;
}

// The device copy of a plan: cached per (device, stream, plan), so that a
// training loop's repeated shapes upload nothing; a new shape is copied from
// pinned memory without blocking. A cached tensor is only freed into the
// caching allocator of its own stream, after the kernels that read it.
Tensor device_tiling(const Tiling& t, const Tensor& like) {
  using Key = std::array<int64_t, kTilingWords + 2>;
  static std::mutex mu;
  static std::list<std::pair<Key, Tensor>> lru;  // most recent first
  constexpr size_t kCapacity = 64;
  Key key;
  key[0] = like.device().index();
  key[1] = static_cast<int64_t>(c10_npu::getCurrentNPUStream().id());
  std::memcpy(key.data() + 2, &t, sizeof(Tiling));
  std::lock_guard<std::mutex> lock(mu);
  for (auto it = lru.begin(); it != lru.end(); ++it) {
    if (it->first == key) {
      lru.splice(lru.begin(), lru, it);
      return it->second;
    }
  }
  Tensor host = at::empty({kTilingWords}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  std::memcpy(host.data_ptr(), &t, sizeof(Tiling));
  Tensor dev = at::empty({kTilingWords}, like.options().dtype(at::kLong));
  dev.copy_(host, /*non_blocking=*/true);  // the host block stays reserved until the copy is done
  lru.emplace_front(key, dev);
  if (lru.size() > kCapacity) lru.pop_back();
  return dev;
}

std::pair<Tiling, Tensor> plan(const TilingRequest& r, const Tensor& like) {
  const TilingResult res = make_tiling(r);
  TORCH_CHECK(res.error == nullptr, res.error ? res.error : "");
  return {res.tiling, device_tiling(res.tiling, like)};
}

// The current stream without flushing torch_npu's task queue: the launch runs
// inside an OpCommand handler, which that queue orders after earlier work.
aclrtStream current_stream() { return c10_npu::getCurrentNPUStream().stream(false); }

uint8_t* bytes_of(const Tensor& t) { return t.defined() ? static_cast<uint8_t*>(t.data_ptr()) : nullptr; }

std::vector<int64_t> lead_sizes(const Tensor& t) {
  return std::vector<int64_t>(t.sizes().begin(), t.sizes().end() - 1);
}

// Launches the backward writing into `grad` (which may be the logits).
void launch_backward(const BackwardInputs<Tensor>& in, const OpOptions& o, const Tensor& grad) {
  const bool with_entropy = o.with_entropy;
  // Per-label and per-row vectors are O(N k): contiguous copies cost nothing next to the rows.
  const Tensor gl = in.grad_logp.contiguous(), sh = in.shift.contiguous(), ls = in.log_sum.contiguous();
  const Tensor ge = with_entropy ? in.grad_entropy->contiguous() : Tensor();
  const Tensor en = with_entropy ? in.entropy->contiguous() : Tensor();
  const Tensor logits = in.logits, labels = in.labels;  // held by the handler below
  TilingRequest r = make_request(logits, labels, kBackward, o);
  r.g_rows = row_index<i64>(logits.dim() - 1, grad.sizes().data(), grad.strides().data());
  const std::pair<Tiling, Tensor> planned = plan(r, logits);
  const Tiling& tiling = planned.first;
  const Tensor tiling_dev = planned.second;
  const int dtype = kernel_dtype(logits.scalar_type());
  const uint32_t block_dim = static_cast<uint32_t>(tiling.used_cores);
  const float inv_t = static_cast<float>(o.inv_temperature);
  aclrtStream stream = current_stream();
  at_npu::native::OpCommand cmd;
  cmd.Name("twinkle_mem_selective_log_softmax_bwd");
  cmd.SetCustomHandler([=]() -> int {
    return twinkle_mem_npu_launch_bwd(dtype, block_dim, stream, bytes_of(gl), with_entropy ? bytes_of(ge) : nullptr,
                                      bytes_of(logits), bytes_of(labels), bytes_of(sh), bytes_of(ls),
                                      with_entropy ? bytes_of(en) : nullptr, bytes_of(grad), bytes_of(tiling_dev),
                                      inv_t);
  });
  cmd.Run();
}

// fp64: the CPU kernel, through the dispatcher, on CPU copies.
c10::OperatorHandle op_handle(const char* name) { return c10::Dispatcher::singleton().findSchemaOrThrow(name, ""); }
std::optional<Tensor> cpu_copy(const std::optional<Tensor>& t) {
  return t ? std::optional<Tensor>(t->cpu()) : std::nullopt;
}

// The NPU backend of op_entry.h's OpEntries (the shared argument checks ran there).
struct Backend {
  using Tensor = at::Tensor;
  using Ops = OpEntries<Backend>;

  static void check(const Tensor& logits) { check_base_format(logits); }

  static std::tuple<Tensor, Tensor, Tensor, Tensor> forward(const Tensor& logits, const Tensor& labels,
                                                            const OpOptions& o) {
    c10_npu::NPUGuard guard(logits.device());
    poll_label_checks();
    if (logits.scalar_type() == at::kDouble) {
      auto cpu_op = op_handle("twinkle_mem::selective_log_softmax_fwd")
                        .typed<std::remove_pointer_t<decltype(&Ops::fwd)>>();
      auto out = call_forward([&](auto&&... args) { return cpu_op.call(args...); }, logits.cpu(), labels.cpu(), o);
      const auto dev = logits.device();
      return {std::get<0>(out).to(dev), std::get<1>(out).to(dev), std::get<2>(out).to(dev),
              std::get<3>(out).to(dev)};
    }
    check_dtype_supported(logits.scalar_type());
    const auto opts = logits.options().dtype(at::kFloat);
    const std::vector<int64_t> lead = lead_sizes(logits);
    Tensor logp = at::empty(labels.sizes(), opts), shift = at::empty(lead, opts), log_sum = at::empty(lead, opts);
    Tensor entropy = o.with_entropy ? at::empty(lead, opts) : at::empty({0}, opts);
    if (shift.numel() == 0) return {logp, entropy, shift, log_sum};
    check_label_range(labels, o.ignore_index, o.vocab_size);

    const std::pair<Tiling, Tensor> planned = plan(make_request(logits, labels, kForward, o), logits);
    const Tiling& tiling = planned.first;
    const Tensor tiling_dev = planned.second;  // (C++17 lambdas cannot capture structured bindings)
    const int dtype = kernel_dtype(logits.scalar_type());
    const uint32_t block_dim = static_cast<uint32_t>(tiling.used_cores);
    const float inv_t = static_cast<float>(o.inv_temperature);
    const bool with_entropy = o.with_entropy;
    aclrtStream stream = current_stream();
    // The handler may run later, from torch_npu's task queue: it holds the tensors.
    at_npu::native::OpCommand cmd;
    cmd.Name("twinkle_mem_selective_log_softmax_fwd");
    cmd.SetCustomHandler([=]() -> int {
      return twinkle_mem_npu_launch_fwd(dtype, block_dim, stream, bytes_of(logits), bytes_of(labels), bytes_of(logp),
                                        with_entropy ? bytes_of(entropy) : nullptr, bytes_of(shift),
                                        bytes_of(log_sum), bytes_of(tiling_dev), inv_t);
    });
    cmd.Run();
    return {logp, entropy, shift, log_sum};
  }

  static Tensor backward(const BackwardInputs<Tensor>& in, const OpOptions& o) {
    c10_npu::NPUGuard guard(in.logits.device());
    poll_label_checks();
    if (in.logits.scalar_type() == at::kDouble) {
      auto cpu_op = op_handle("twinkle_mem::selective_log_softmax_bwd")
                        .typed<std::remove_pointer_t<decltype(&Ops::bwd)>>();
      const Tensor g_logp = in.grad_logp.cpu(), logits = in.logits.cpu(), labels = in.labels.cpu(),
                   shift = in.shift.cpu(), log_sum = in.log_sum.cpu();
      const std::optional<Tensor> g_entropy = cpu_copy(in.grad_entropy), entropy = cpu_copy(in.entropy);
      const BackwardInputs<Tensor> on_cpu{g_logp, g_entropy, logits, labels, shift, log_sum, entropy};
      return call_backward([&](auto&&... args) { return cpu_op.call(args...); }, on_cpu, o).to(in.logits.device());
    }
    check_dtype_supported(in.logits.scalar_type());
    Tensor grad = new_grad_like(
        in.logits, [](const Tensor& like, const std::vector<int64_t>& sizes) { return at::empty(sizes, like.options()); },
        [](const Tensor& t, int dim, int64_t len) { return t.narrow(dim, 0, len); });
    if (in.shift.numel() == 0) return grad;
    launch_backward(in, o, grad);
    return grad;
  }

  static void backward_inplace(const BackwardInputs<Tensor>& in, Tensor& logits, const OpOptions& o) {
    c10_npu::NPUGuard guard(logits.device());
    poll_label_checks();
    if (logits.scalar_type() == at::kDouble) {
      logits.copy_(backward(in, o));
      return;
    }
    check_dtype_supported(logits.scalar_type());
    if (in.shift.numel() == 0) return;
    launch_backward(in, o, logits);
  }
};
using Ops = OpEntries<Backend>;

}  // namespace
}  // namespace npu
}  // namespace twinkle_mem

TORCH_LIBRARY_IMPL(twinkle_mem, PrivateUse1, m) {
  m.impl("selective_log_softmax_fwd", &twinkle_mem::npu::Ops::fwd);
  m.impl("selective_log_softmax_bwd", &twinkle_mem::npu::Ops::bwd);
  m.impl("selective_log_softmax_bwd_", &twinkle_mem::npu::Ops::bwd_);
}
