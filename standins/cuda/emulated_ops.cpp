// The CUDA kernels (csrc/cuda/selective_log_softmax_kernels.cuh) and their host
// plan (selective_log_softmax_plan.cuh), run on the CPU through fake_cuda.h,
// behind a C interface: standins/cuda_emulation.py builds this file into a shared
// library with the host C++ compiler and calls it with ctypes, so that the test
// suite runs the CUDA kernels (and their host plan: row and label indexing,
// segments, alignment, workspaces) on CPU tensors.
//
//   g++ -std=c++20 -O2 -shared -fPIC -I csrc -I standins/cuda standins/cuda/emulated_ops.cpp
#define TWINKLE_MEM_CUDA_EMULATION 1
#include "fake_cuda.h"
// Keep the include after fake_cuda.h: the kernels use its stand-ins (their one emulation hook).
#include "cuda/selective_log_softmax_plan.cuh"

#include <cstddef>
#include <cstring>
#include <vector>

using namespace twinkle_mem::cuda;

namespace {

// 0, or 1 with the device-side assert's message copied out.
int finish(char* message, int64_t message_len) {
  if (emu_assert_message.empty()) return 0;
  std::snprintf(message, static_cast<size_t>(message_len), "%s", emu_assert_message.c_str());
  emu_assert_message.clear();
  g_label_message_taken = 0;  // on a GPU the assert ends the context; here the next call starts afresh
  return 1;
}

// The plan's launcher here: the blocks one after another, threads as fibers.
struct EmulatedLauncher {
  template <typename Kernel, typename Args>
  void operator()(Kernel kernel, unsigned grid, int threads, const Args& args) const {
    emulate_launch(grid, static_cast<unsigned>(threads), [&] { kernel(args); });
  }
};

}  // namespace

extern "C" {

// dtype: 0 bf16, 1 fp16, 2 fp32, 3 fp64 (Dtype). Tensors as TensorRef (data
// pointer at the first element, dim, sizes, strides in elements); the op's
// options as csrc/common/op_options.h's OpOptions (standins/cuda_emulation.py mirrors it).
int tm_emu_forward(int dtype, const TensorRef* logits, const TensorRef* labels, int int64_labels,
                   const twinkle_mem::OpOptions* options, void* logp, void* entropy, void* shift, void* log_sum,
                   int64_t segment_bytes, int64_t max_grid, char* message, int64_t message_len) {
  const Launch how{max_grid, segment_bytes};
  std::vector<uint64_t> workspace(forward_workspace_bytes(Dtype(dtype), *logits, how) / 8 + 1);
  run_forward(Dtype(dtype), *logits, *labels, int64_labels != 0, *options, {logp, entropy, shift, log_sum},
              workspace.data(), how, EmulatedLauncher{});
  return finish(message, message_len);
}

// Per-row inputs contiguous; grad may be logits (options->inplace_backward).
int tm_emu_backward(int dtype, const TensorRef* logits, const TensorRef* grad, const TensorRef* labels,
                    int int64_labels, const twinkle_mem::OpOptions* options, const void* grad_logp,
                    const void* grad_entropy, const void* entropy, const void* shift, const void* log_sum,
                    int64_t segment_bytes, int64_t max_grid, char* message, int64_t message_len) {
  const Launch how{max_grid, segment_bytes};
  std::vector<uint64_t> workspace(backward_workspace_bytes(Dtype(dtype), *labels, options->inplace_backward) / 8 + 1);
  run_backward(Dtype(dtype), *logits, *grad, *labels, int64_labels != 0,
               {grad_logp, grad_entropy, entropy, shift, log_sum}, *options, workspace.data(), how,
               EmulatedLauncher{});
  return finish(message, message_len);
}

// Global loads and stores since the last call: {16-byte loads, narrower loads,
// 16-byte stores, narrower stores} (slot moves; the scalar tails are not counted).
void tm_emu_take_counters(uint64_t* out) {
  out[0] = emu_vector_loads;
  out[1] = emu_narrow_loads;
  out[2] = emu_vector_stores;
  out[3] = emu_narrow_stores;
  emu_vector_loads = emu_narrow_loads = emu_vector_stores = emu_narrow_stores = 0;
}

// OpOptions' layout, {sizeof, then each field's offset in order}: standins/cuda_emulation.py
// checks its ctypes mirror against it.
void tm_emu_options_layout(int64_t* out) {
  using twinkle_mem::OpOptions;
  const int64_t layout[] = {sizeof(OpOptions),
                            offsetof(OpOptions, inv_temperature),
                            offsetof(OpOptions, ignore_index),
                            offsetof(OpOptions, vocab_start),
                            offsetof(OpOptions, vocab_size),
                            offsetof(OpOptions, with_entropy),
                            offsetof(OpOptions, inplace_backward)};
  std::memcpy(out, layout, sizeof(layout));
}

// The CUDA build's segment size (kSegmentBytes): the tests' default.
int64_t tm_emu_segment_bytes() { return kSegmentBytes; }

// The split of a row of V elements: {segments, segment_len, threads}.
void tm_emu_split(int64_t V, int64_t elem_bytes, int64_t segment_bytes, int64_t* out) {
  const RowSplit s = split_rows(V, elem_bytes, segment_bytes);
  out[0] = s.segments;
  out[1] = s.segment_len;
  out[2] = s.threads;
}

}  // extern "C"
