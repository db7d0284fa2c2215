// The AscendC kernels of csrc/npu/selective_log_softmax_kernel.cpp, compiled
// against the stand-in (ascendc_standin.h) and run on the CPU: a C entry point
// per direction, called from Python (standins/npu_emulation.py) with plain pointers.
// The plan comes from csrc/npu/tiling.h as the torch_npu glue makes it; every tensor
// is registered as global memory (each logits / gradient row on its own), so
// that any access outside them, or a write to an input, is a violation.
//
// Built at test time only (the kernel's directory, csrc/npu or a copy, on the path):
//   g++ -std=c++17 -O2 -shared -fPIC -DASCENDC_CPU_DEBUG=1 -I standins/ascendc -I csrc/npu
//       standins/ascendc/emulate_kernels.cpp
#include "kernel_operator.h"

#include "selective_log_softmax_kernel.cpp"

#include <cstdio>
#include <string>

namespace {

namespace tn = twinkle_mem::npu;

void add_region(const void* begin, int64_t bytes, bool writable, const char* name) {
  if (bytes <= 0) return;
  const uintptr_t b = reinterpret_cast<uintptr_t>(begin);
  standin::gm_regions().push_back({b, b + static_cast<uintptr_t>(bytes), writable, name});
}

// Each row [off, off + V) of a [N, V] / [B, S, V] tensor as its own region.
void add_rows(const void* base, int64_t elem, const tn::RowIndexNpu& rows, int64_t n, int64_t v, bool writable,
              const char* name) {
  for (int64_t r = 0; r < n; ++r) {
    add_region(static_cast<const uint8_t*>(base) + rows(r) * elem, v * elem, writable, name);
  }
}

int report(const std::exception& e, char* err, int64_t err_len) {
  std::snprintf(err, static_cast<size_t>(err_len), "%s", e.what());
  return 1;
}

tn::RowIndexNpu rows_of(const int64_t* r) { return tn::RowIndexNpu{r[0], r[1], r[2]}; }

// The host's TilingRequest from the flat words Python passes (req: see the layout below).
tn::TilingRequest request_of(const int64_t* req, tn::Mode mode, const int64_t* x_rows, const int64_t* y_rows,
                             const int64_t* g_rows) {
  tn::TilingRequest r;
  r.n_rows = req[0];
  r.vocab = req[1];
  r.vocab_start = req[2];
  r.vocab_size = req[3];
  r.ignore_index = req[4];
  r.label_k = req[5];
  r.label_k_stride = req[6];
  r.elem_bytes = req[7];
  r.label_bytes = req[8];
  r.with_entropy = req[9] != 0;
  r.core_count = req[10];
  r.ub_bytes = req[11];
  r.max_tile_len = req[12];
  r.mode = mode;
  r.x_rows = rows_of(x_rows);
  r.y_rows = rows_of(y_rows);
  if (g_rows != nullptr) r.g_rows = rows_of(g_rows);
  return r;
}

// make_tiling's plan, copied to plan_out for the tests; throws its error.
tn::Tiling plan_of(const tn::TilingRequest& r, int64_t* plan_out) {
  const tn::TilingResult plan = tn::make_tiling(r);
  if (plan.error) throw std::runtime_error(plan.error);
  std::memcpy(plan_out, &plan.tiling, sizeof(tn::Tiling));
  return plan.tiling;
}

uint8_t* gm(void* p) { return static_cast<uint8_t*>(p); }

// The launch, after the tensors' regions are registered: the plan's words as the
// kernel reads them (one more read-only region), the stats reset, kernel(tiling)
// on the plan's cores with the stand-in's UB budget; every region cleared after.
template <typename F>
void launch_on_plan(const tn::Tiling& t, int64_t ub_bytes, F&& kernel) {
  std::vector<int64_t> words(tn::kTilingWords);
  std::memcpy(words.data(), &t, sizeof(tn::Tiling));
  add_region(words.data(), sizeof(tn::Tiling), false, "tiling");
  standin::stats() = standin::Stats{};
  standin::launch(t.used_cores, ub_bytes, [&] { kernel(reinterpret_cast<uint8_t*>(words.data())); });
  standin::gm_regions().clear();
}

}  // namespace

extern "C" {

// req: n, V, vocab_start, vocab_size, ignore_index, label_k, label_k_stride,
//      elem_bytes, label_bytes, with_entropy, core_count, ub_bytes, max_tile_len,
//      dtype (launch.h: 0 fp32, 1 fp16, 2 bf16), the stand-in's UB budget (0: ub_bytes)
// x_rows / y_rows / g_rows: RowIndex {inner, outer_stride, inner_stride}.
// Returns 0, or 1 with a message in err. plan_out (kTilingWords int64) gets the plan.
int tm_npu_emu_forward(const int64_t* req, const int64_t* x_rows, const int64_t* y_rows, void* logits,
                       void* labels, int64_t labels_span, void* logp, void* entropy, void* shift, void* log_sum,
                       float inv_t, int64_t* plan_out, char* err, int64_t err_len) {
  try {
    const tn::TilingRequest r = request_of(req, tn::kForward, x_rows, y_rows, nullptr);
    const tn::Tiling t = plan_of(r, plan_out);

    standin::gm_regions().clear();
    add_rows(logits, r.elem_bytes, t.x_rows, t.n_rows, t.vocab, false, "logits");
    add_region(labels, labels_span * r.label_bytes, false, "labels");
    add_region(logp, t.n_rows * t.label_k * 4, true, "logp");
    add_region(shift, t.n_rows * 4, true, "shift");
    add_region(log_sum, t.n_rows * 4, true, "log_sum");
    if (r.with_entropy) add_region(entropy, t.n_rows * 4, true, "entropy");
    launch_on_plan(t, req[14] > 0 ? req[14] : r.ub_bytes, [&](uint8_t* tp) {
      if (r.elem_bytes == 4) {
        twinkle_mem_sls_fwd_fp32(gm(logits), gm(labels), gm(logp), gm(entropy), gm(shift), gm(log_sum), tp, inv_t);
      } else if (req[13] == 1) {
        twinkle_mem_sls_fwd_fp16(gm(logits), gm(labels), gm(logp), gm(entropy), gm(shift), gm(log_sum), tp, inv_t);
      } else {
        twinkle_mem_sls_fwd_bf16(gm(logits), gm(labels), gm(logp), gm(entropy), gm(shift), gm(log_sum), tp, inv_t);
      }
    });
    return 0;
  } catch (const std::exception& e) {
    standin::gm_regions().clear();
    return report(e, err, err_len);
  }
}

// grad may be logits (in place: then g_rows are the logits' rows).
int tm_npu_emu_backward(const int64_t* req, const int64_t* x_rows, const int64_t* y_rows, const int64_t* g_rows,
                        void* grad_logp, void* grad_entropy, void* logits, void* labels, int64_t labels_span,
                        void* shift, void* log_sum, void* entropy, void* grad, float inv_t, int64_t* plan_out,
                        char* err, int64_t err_len) {
  try {
    const tn::TilingRequest r = request_of(req, tn::kBackward, x_rows, y_rows, g_rows);
    const tn::Tiling t = plan_of(r, plan_out);

    const bool inplace = grad == logits;
    standin::gm_regions().clear();
    add_rows(logits, r.elem_bytes, t.x_rows, t.n_rows, t.vocab, inplace, "logits");
    if (!inplace) add_rows(grad, r.elem_bytes, t.g_rows, t.n_rows, t.vocab, true, "grad");
    add_region(labels, labels_span * r.label_bytes, false, "labels");
    add_region(grad_logp, t.n_rows * t.label_k * 4, false, "grad_logp");
    add_region(shift, t.n_rows * 4, false, "shift");
    add_region(log_sum, t.n_rows * 4, false, "log_sum");
    if (r.with_entropy) {
      add_region(grad_entropy, t.n_rows * 4, false, "grad_entropy");
      add_region(entropy, t.n_rows * 4, false, "entropy");
    }
    launch_on_plan(t, req[14] > 0 ? req[14] : r.ub_bytes, [&](uint8_t* tp) {
      if (r.elem_bytes == 4) {
        twinkle_mem_sls_bwd_fp32(gm(grad_logp), gm(grad_entropy), gm(logits), gm(labels), gm(shift), gm(log_sum),
                                 gm(entropy), gm(grad), tp, inv_t);
      } else if (req[13] == 1) {
        twinkle_mem_sls_bwd_fp16(gm(grad_logp), gm(grad_entropy), gm(logits), gm(labels), gm(shift), gm(log_sum),
                                 gm(entropy), gm(grad), tp, inv_t);
      } else {
        twinkle_mem_sls_bwd_bf16(gm(grad_logp), gm(grad_entropy), gm(logits), gm(labels), gm(shift), gm(log_sum),
                                 gm(entropy), gm(grad), tp, inv_t);
      }
    });
    return 0;
  } catch (const std::exception& e) {
    standin::gm_regions().clear();
    return report(e, err, err_len);
  }
}

// Moves the stand-in's exp / ln results by up to n ulp (0: the host's own).
void tm_npu_emu_set_transcendental_ulp(int n) { standin::set_transcendental_ulp(n); }

int64_t tm_npu_emu_tiling_words(void) { return tn::kTilingWords; }

// The latest launch's copy-in counts: {copy-ins, copy-ins issued while another waited}.
void tm_npu_emu_stats(int64_t* out) {
  out[0] = standin::stats().copy_ins;
  out[1] = standin::stats().overlapped_copy_ins;
}

}  // extern "C"
