// The out-of-range label message, written once for every native backend: the
// host checks (op_checks.h: the CPU loop, the NPU glue) throw it and the CUDA
// kernel asserts with it on the device, where there is no std::string and a
// local buffer would give the kernel a stack frame; hence a writer over any
// char buffer and no library call. python/twinkle_mem/op/contract.py mirrors the
// text for the composite and the fused head.
//
// Plain C++ (no torch header): the CUDA kernels' CPU emulation includes it too.
#pragma once

#include <cstdint>
#include <limits>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define TM_MESSAGE_HD __host__ __device__ __forceinline__
#else
#define TM_MESSAGE_HD inline
#endif

namespace twinkle_mem {

// The op's ignore_index when the caller ignores nothing (op/contract.NO_IGNORE_INDEX):
// no label can take it, and a message must not show it.
constexpr int64_t kNoIgnoreIndex = std::numeric_limits<int64_t>::min();

// Appends to text[0, capacity), always NUL-terminated, cut at the capacity.
struct MessageWriter {
  char* text;
  int capacity;
  int len = 0;

  TM_MESSAGE_HD void put(char c) {
    if (len < capacity - 1) text[len++] = c;
    text[len] = '\0';
  }
  TM_MESSAGE_HD void add(const char* s) {
    while (*s != '\0') put(*s++);
  }
  TM_MESSAGE_HD void add(int64_t v) {
    // Through unsigned (-INT64_MIN is no int64), digits from the top (no digit buffer).
    const uint64_t u = v < 0 ? uint64_t(0) - static_cast<uint64_t>(v) : static_cast<uint64_t>(v);
    if (v < 0) put('-');
    uint64_t scale = 1;
    while (u / scale >= 10) scale *= 10;
    for (; scale != 0; scale /= 10) put(static_cast<char>('0' + (u / scale) % 10));
  }

  // What a label must be, for messages that name one label or count several:
  // "neither a token id in [0, V) (vocab size V) nor the ignore_index (...)".
  TM_MESSAGE_HD void add_rule(int64_t vocab_size, int64_t ignore_index) {
    add("neither a token id in [0, ");
    add(vocab_size);
    add(") (vocab size ");
    add(vocab_size);
    add(") nor the ignore_index (");
    if (ignore_index == kNoIgnoreIndex) {
      add("none given");
    } else {
      add(ignore_index);
    }
    add(")");
  }

  // The padding convention of twinkle and transformers (-100), for messages that
  // cannot name the label.
  TM_MESSAGE_HD void add_ignore_hint() {
    add("to ignore padding labels such as -100 (logp 0, no gradient), pass ignore_index=-100");
  }

  // "twinkle_mem: label out of range: labels.flatten()[i] = y is neither ...; <what to do>".
  TM_MESSAGE_HD void add_label_out_of_range(int64_t index, int64_t label, int64_t vocab_size, int64_t ignore_index) {
    add("twinkle_mem: label out of range: labels.flatten()[");
    add(index);
    add("] = ");
    add(label);
    add(" is ");
    add_rule(vocab_size, ignore_index);
    if (label < 0) {  // padding, most likely: say how to ignore exactly this value
      add("; to ignore such positions (logp 0, no gradient), pass ignore_index=");
      add(label);
    } else {
      add("; check that the labels come from the logits' vocabulary");
    }
  }
};

// A message in its own buffer (host code).
struct Message : MessageWriter {
  static constexpr int kCapacity = 512;
  char buffer[kCapacity];
  Message() : MessageWriter{buffer, kCapacity} { buffer[0] = '\0'; }
  Message(const Message&) = delete;
};

}  // namespace twinkle_mem
