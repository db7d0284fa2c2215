// The CPU kernel's row loops, written once over a SIMD type Vec (VecTraits
// gives its lane type acc_t and width W). Three translation units include it,
// each inside its own namespace: selective_log_softmax.cpp (portable, Vec =
// float or double), selective_log_softmax_avx2.cpp (Vec = Vec8f) and
// selective_log_softmax_avx512.cpp (Vec = Vec16f).
//
// The including namespace provides: RowVec (its fp32 Vec) and the tag types
// bf16_t, fp16_t of 16-bit logits (for kRowKernels, isa.h's table of entry
// points, defined at the end), VecTraits<Vec>, load_vec(const T*) -> Vec,
// load_pair(const T*, Vec&, Vec&) where it has its own (2 W elements, in any fixed lane order) and with it
// store_loaded_pair(T*, Vec, Vec) (the way back, the same order), the running max of the first sweep
// (max_start(const T*) -> m, max_add_pair(m, const T*) -> m with 2 W more elements, in order, and
// max_result(m, const T*) -> acc_t), store_vec(T*, Vec),
// store_pair(T*, Vec, Vec) (2 W elements, in order), load_scalar(const T*) -> acc_t,
// store_scalar(T*, acc_t), hsum(Vec), count_equal(Vec, Vec) (how many lanes are equal),
// add_below(sum, e, x, max) (sum + e in the lanes where x != max: below it, or
// NaN), the exp_/exp2_for_sums/exp2_for_grads/max_/fma_ overloads that the templates call, and
// kExp2TakesNegInf (whether exp2_for_sums gives 0 for -inf; else y is clamped first).
//
// Deliberately no include guard, and no #include: the file is a body of
// templates to be compiled once per instruction set, inside the namespace of
// that instruction set (a guard would silently drop the second copy, and a
// standard header included inside a namespace would break). So the includer
// includes what it uses first (<algorithm>, <limits>, <type_traits>,
// online_softmax.h), opens its namespace, defines TWINKLE_MEM_ROW_KERNELS_ISA
// (the namespace's name, for the check below) and includes this file, once;
// it is undefined again at the end, so a second include in the same namespace
// fails loudly instead of redefining everything.
#ifndef TWINKLE_MEM_ROW_KERNELS_ISA
#error "row_kernels.h: define TWINKLE_MEM_ROW_KERNELS_ISA and include it once inside a per-ISA namespace"
#endif

constexpr int64_t kBlock = 2048;  // elements per L1-resident block of a row
constexpr int64_t kSubVectors = 16;  // vectors summed in acc_t before their sum joins a double
constexpr int64_t kPrefetchAhead = 4 * kBlock;  // how far ahead of the pair in hand the sweeps ask for the row
constexpr double kLog2e = 1.4426950408889634;
constexpr double kLn2 = 0.6931471805599453;

// The base-2 scale log2(e) / T: the acc_t 1 / T times log2(e) in double, rounded
// to acc_t (within two roundings of the true scale: 1.2e-7 relative in fp32).
template <typename acc_t>
inline acc_t log2e_over_T(acc_t inv_T) { return static_cast<acc_t>(static_cast<double>(inv_T) * kLog2e); }

// The y below which 2^y is 0 in acc_t (rounded to nearest): the entropy term and the 16-bit gradients
// clamp y at it, and the sums do where exp2_for_sums needs y finite (kExp2TakesNegInf).
template <typename acc_t>
constexpr acc_t exp2_floor() { return sizeof(acc_t) == 4 ? acc_t(-160) : acc_t(-1100); }

// 2 W elements as two vectors, in order: what every logit type takes where its instruction set has no
// load_pair of its own (x86 bf16 has: the odd and even elements apart).
template <typename T, typename Vec>
inline void load_pair(const T* p, Vec& lo, Vec& hi) {
  lo = load_vec(p);
  hi = load_vec(p + VecTraits<Vec>::W);
}

// The way back: two vectors in load_pair's lane order stored to their 2 W elements. In order, store_pair; x86
// bf16 has its own (the odd and even elements apart).
template <typename T, typename Vec>
inline void store_loaded_pair(T* p, Vec lo, Vec hi) {
  store_pair(p, lo, hi);
}

// Asks for the vector pair x[from, from + kPair) to be brought into L2: no fault, no wait. The sweeps ask for
// the row kPrefetchAhead ahead of the pair in hand, one hint per pair as they go, so that memory and arithmetic
// overlap. (One block ahead into L1 kept a 6 GB/s stream waiting at each block's first sweep; a sub-block's
// hints in a burst (8 for 16-bit logits on AVX-512), then its arithmetic, left the forward 13 % slower on a Xeon:
// docs/cpu.md.)
// Past the segment's end too: a thread's next task is the row's next segment (parallel_for hands each thread a
// contiguous range of tasks); bounding the hint by the segment left half of each segment's blocks to the
// hardware prefetcher. One hint per 64-byte line: a pair of 16-bit AVX-512 lanes is a line and of fp32 ones
// two; where a pair is less than a line (AVX2 16-bit, the portable path) only a pair that starts one asks.
template <int64_t kPair, typename scalar_t>
inline void prefetch_pair(const scalar_t* x, int64_t from) {
  constexpr int64_t kBytes = kPair * int64_t(sizeof(scalar_t));
  const uintptr_t at = reinterpret_cast<uintptr_t>(x) + from * sizeof(scalar_t);  // past the row: only a hint
  if constexpr (kBytes >= 64) {
    for (int64_t line = 0; line < kBytes / 64; ++line) __builtin_prefetch(reinterpret_cast<const void*>(at + 64 * line), 0, 2);
  } else {
    if (from * int64_t(sizeof(scalar_t)) % 64 == 0) __builtin_prefetch(reinterpret_cast<const void*>(at), 0, 2);
  }
}

// The max of p[0, n), n a whole number of vector pairs: the first sweep's running max over them, in order.
template <typename Vec, typename scalar_t>
auto max_of(const scalar_t* p, int64_t n) {
  auto m = max_start(p);
  for (int64_t i = 0; i < n; i += 2 * VecTraits<Vec>::W) m = max_add_pair(m, p + i);
  return max_result(m, p);
}

// Online softmax state of x[0, n) (see online_softmax.h), in double. Each block
// of the row is read from memory once: a first sweep finds its max (and each
// sub-block's: max_of, which for 16-bit logits on x86 works on integer keys
// without converting), a second reads the block again from L1 and accumulates
// exp(t) and the entropy term with t = (x - max) / T. (It used to convert 16-bit
// logits into an fp32 L1 buffer in the first sweep: a conversion and a store per
// vector that cost more than converting again in the second.) The second sweep
// takes the block by vector pairs (load_pair), in an order of the instruction
// set's own: sums do not depend on the order within a path. The state leaves out one
// element holding the max (its exp is the state's implicit 1): the second sweep
// sums exp over the elements below the max only, and the k elements equal to it
// (counted in the sub-blocks whose max it is) add k - 1 exactly, in double. (The
// first max element's copy was once set to -inf instead: that store, at an
// address known only after a search, held up the second sweep's loads, 15% of
// the AVX-512 forward; and ties added their 1s in fp32 among small terms.) The
// entropy term of an element at the max is 0 whichever way. Sums run in acc_t
// over a sub-block of 16 vectors and then in double: a row's rest and zsum carry
// ~1e-8 relative error, not the ~1e-6 of 150k fp32 adds.
template <typename Vec, typename scalar_t>
OnlineSoftmax<double> segment_state(const scalar_t* x, int64_t n, typename VecTraits<Vec>::acc_t inv_T,
                                    bool with_entropy) {
  using acc_t = typename VecTraits<Vec>::acc_t;
  constexpr int64_t W = VecTraits<Vec>::W;
  constexpr int64_t kSub = kSubVectors * W;  // elements per sub-block, a whole number of vector pairs
  constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();
  // Sweep 1 of a block runs inside sweep 2 of the block before, pair by pair beside its pairs: its loads go out
  // while the arithmetic of sweep 2 runs (on Zen 4 the forward took 4 % less run a sub-block ahead, on a Xeon 5 %
  // less again pair by pair: docs/cpu.md). So the sub-block maxima of two blocks are kept, this one's and the
  // next one's.
  acc_t sub_max_of[2][kBlock / kSub + 1];
  auto body_of = [&](int64_t start) {
    const int64_t len = std::min(kBlock, n - start);
    return len - len % (2 * W);  // whole vector pairs
  };
  const acc_t a = log2e_over_T(inv_T);  // sweep 2's scale
  OnlineSoftmax<double> state = empty_state<double>();
  {  // the first block's sweep 1, on its own
    const int64_t body = body_of(0);
    for (int64_t i = 0, b = 0; i < body; i += kSub, ++b) sub_max_of[0][b] = max_of<Vec>(x + i, std::min(kSub, body - i));
  }
  for (int64_t start = 0, k = 0; start < n; start += kBlock, ++k) {
    const int64_t len = std::min(kBlock, n - start);
    const int64_t body = body_of(start);
    const scalar_t* x_block = x + start;
    acc_t* sub_max = sub_max_of[k & 1];
    acc_t* next_sub_max = sub_max_of[(k + 1) & 1];
    const int64_t next_body = start + kBlock < n ? body_of(start + kBlock) : 0;
    const scalar_t* x_next = next_body > 0 ? x_block + kBlock : x_block;

    // sweep 1 (done: the sub-block maxima): the block max
    const int64_t subs = (body + kSub - 1) / kSub;
    acc_t tail_max = kNegInf;
    for (int64_t i = body; i < len; ++i) tail_max = max_(tail_max, acc_t(load_scalar(x_block + i)));
    acc_t block_max = tail_max;
    for (int64_t b = 0; b < subs; ++b) block_max = max_(block_max, sub_max[b]);
    const acc_t shift = finite_shift(block_max);
    // The elements equal to the max (none for a NaN max; a block of -inf gets the empty state below): the tail's
    // here, the body's in sweep 2, where the sub-blocks that may hold the max compare each element with it
    // (counting them here, in a pass of their own behind a branch on which sub-block holds the max, cost 5 % of
    // the AVX-512 forward on Zen 4: docs/cpu.md).
    int64_t at_max = 0;
    for (int64_t i = body; i < len; ++i) at_max += acc_t(load_scalar(x_block + i)) == block_max;

    // sweep 2: the sums in base 2. y = (x - shift) a with a = log2e_over_T(inv_T), so that exp(t) = 2^y:
    // the exponential needs no reduction by ln2, and the entropy term sums y 2^y (in units of ln2). For
    // the entropy, y is clamped from below where 2^y is 0 in acc_t (a -inf logit: y 2^y stays 0, not NaN;
    // NaN passes through); the sum alone needs no clamp where exp2_for_sums takes -inf to 0 (kExp2TakesNegInf).
    double sum = 0, zsum_log2 = 0;
    auto sweep = [&](auto entropy) {
      constexpr bool kEntropy = decltype(entropy)::value;
      const Vec v_neg_shift(-shift), v_a(a), v_y_floor(exp2_floor<acc_t>()), v_block_max(block_max);
      for (int64_t i = 0, b = 0; i < body; i += kSub, ++b) {
        const int64_t end = std::min(body, i + kSub);
        // The next block's sweep 1, this sub-block's share: a pair at a time beside this sub-block's pairs where it
        // is whole, on its own where it is the last, partial one. (A block is whole but at the segment's end, so the
        // next one has no more sub-blocks than this one, and this one's are whole where a next one exists.) Where
        // it is not whole the running max reads this sub-block's own pairs instead and is dropped: no branch in the
        // loop. (Pair by pair and not in a burst of loads of its own: 5 % of the forward on a Xeon, docs/cpu.md.)
        const bool next_whole = i + kSub <= next_body;
        if (!next_whole && i < next_body) next_sub_max[b] = max_of<Vec>(x_next + i, next_body - i);
        const scalar_t* x_max = next_whole ? x_next : x_block;
        auto next_max = max_start(x_max);
        Vec v_sum[2] = {acc_t(0), acc_t(0)}, v_zsum[2] = {acc_t(0), acc_t(0)};  // a pair's halves apart
        auto run = [&](auto may_hold_max) {  // only a sub-block whose max is the block's pays for the test
          auto add = [&](Vec xv, int half) {
            const Vec y_raw = (xv + v_neg_shift) * v_a;
            // The entropy term needs y finite (y 2^y: -inf times 0 is NaN); the sum alone only where the
            // instruction set's exp2_for_sums does not take -inf to 0.
            const Vec y = kEntropy || !kExp2TakesNegInf ? max_(v_y_floor, y_raw) : y_raw;
            const Vec e = exp2_for_sums(y);
            if constexpr (decltype(may_hold_max)::value) {
              v_sum[half] = add_below(v_sum[half], e, xv, v_block_max);
              at_max += count_equal(xv, v_block_max);
            } else {
              v_sum[half] = v_sum[half] + e;
            }
            if constexpr (kEntropy) v_zsum[half] = fma_(y, e, v_zsum[half]);
          };
          for (int64_t j = i; j < end; j += 2 * W) {
            prefetch_pair<2 * W>(x_block, kPrefetchAhead + j);
            next_max = max_add_pair(next_max, x_max + j);
            Vec lo, hi;
            load_pair(x_block + j, lo, hi);
            add(lo, 0);
            add(hi, 1);
          }
        };
        if (sub_max[b] == block_max) {
          run(std::true_type{});
        } else {
          run(std::false_type{});
        }
        if (next_whole) next_sub_max[b] = max_result(next_max, x_max);
        if constexpr (kEntropy) zsum_log2 += hsum(v_zsum[0] + v_zsum[1]);
        sum += hsum(v_sum[0] + v_sum[1]);
      }
    };
    with_entropy ? sweep(std::true_type{}) : sweep(std::false_type{});
    double zsum = zsum_log2 * kLn2;
    for (int64_t i = body; i < len; ++i) {
      const acc_t xi = load_scalar(x_block + i);
      if (xi == block_max) continue;  // counted in at_max
      const acc_t t = scaled_gap(xi, -shift, inv_T);
      const acc_t e = exp_(t);
      sum += e;
      if (with_entropy) zsum += add_entropy_term<acc_t, acc_t>(acc_t(0), t, e);
    }
    if (at_max > 1) sum += double(at_max - 1);
    state = merge(state, block_state<double>(block_max, sum, zsum), static_cast<double>(inv_T));
  }
  return state;
}

// d[0, n) = the off-label gradient p (a + b (u + entropy)) of logits x[0, n) (the caller
// rewrites the elements that hold labels). d may alias x (in-place backward):
// each vector pair is read before it is written. A 16-bit gradient takes p in base 2,
// p = 2^y with y = (x - shift) log2(e) / T - log_sum log2(e) and u = y ln2, like the
// forward's sums: fewer instructions, and its rounding (p within ~1e-6 relative,
// from log_sum log2(e) in fp32) is far below a bf16 or fp16 ulp. fp32 gradients keep
// u and exp(u) as the contract writes them: 2 fp32 ulp would not hold the base-2 form.
// One pass, by vector pairs in load_pair's order (x86 bf16: the odd and even elements
// apart, put back in place by one blend per pair), asking for the row kPrefetchAhead
// ahead as the forward's sweeps do (prefetch_pair): with the arithmetic between its loads
// the pass issues too few of them to keep memory streaming on its own (issue 41).
template <typename Vec, typename scalar_t>
void segment_grad(const scalar_t* x, scalar_t* d, int64_t n, const RowGrad<typename VecTraits<Vec>::acc_t>& g) {
  using acc_t = typename VecTraits<Vec>::acc_t;
  constexpr int64_t W = VecTraits<Vec>::W;
  const Vec v_neg_shift(g.neg_shift), v_inv_T(g.inv_temperature), v_neg_log_sum(g.neg_log_sum),
      v_entropy(g.entropy), v_a(g.a), v_b(g.b), v_u_floor(g.u_floor);
  const Vec v_a2(log2e_over_T(g.inv_temperature)),
      v_c2(static_cast<acc_t>(static_cast<double>(g.neg_log_sum) * kLog2e)), v_y_floor(exp2_floor<acc_t>()),
      v_ln2(static_cast<acc_t>(kLn2));
  auto grad = [&](Vec xv) {
    if constexpr (sizeof(scalar_t) == 2 && !std::is_same_v<Vec, acc_t>) {
      const Vec y = max_(v_y_floor, fma_(xv + v_neg_shift, v_a2, v_c2));
      return exp2_for_grads(y) * fma_(v_b, fma_(y, v_ln2, v_entropy), v_a);
    } else {
      return grad_off_label(xv, v_neg_shift, v_inv_T, v_neg_log_sum, v_entropy, v_a, v_b, v_u_floor);
    }
  };
  const int64_t body = n - n % (2 * W);  // whole vector pairs
  for (int64_t j = 0; j < body; j += 2 * W) {
    prefetch_pair<2 * W>(x, kPrefetchAhead + j);
    Vec lo, hi;
    load_pair(x + j, lo, hi);
    store_loaded_pair(d + j, grad(lo), grad(hi));
  }
  int64_t i = body;
  for (; i + W <= n; i += W) store_vec(d + i, grad(load_vec(x + i)));
  for (; i < n; ++i) store_scalar(d + i, grad_off_label(load_scalar(x + i), g));
}

// This instruction set's entry points (isa.h), from the 16-bit patterns the host passes.
#define TWINKLE_MEM_STRINGIFY(a) #a
#define TWINKLE_MEM_NAME(a) TWINKLE_MEM_STRINGIFY(a)
constexpr RowKernels kRowKernels{
    TWINKLE_MEM_NAME(TWINKLE_MEM_ROW_KERNELS_ISA),
    [](const uint16_t* x, int64_t n, float inv_T, bool with_entropy) {
      return segment_state<RowVec>(reinterpret_cast<const bf16_t*>(x), n, inv_T, with_entropy);
    },
    [](const uint16_t* x, int64_t n, float inv_T, bool with_entropy) {
      return segment_state<RowVec>(reinterpret_cast<const fp16_t*>(x), n, inv_T, with_entropy);
    },
    [](const float* x, int64_t n, float inv_T, bool with_entropy) {
      return segment_state<RowVec>(x, n, inv_T, with_entropy);
    },
    [](const uint16_t* x, uint16_t* d, int64_t n, const RowGrad<float>& g) {
      segment_grad<RowVec>(reinterpret_cast<const bf16_t*>(x), reinterpret_cast<bf16_t*>(d), n, g);
    },
    [](const uint16_t* x, uint16_t* d, int64_t n, const RowGrad<float>& g) {
      segment_grad<RowVec>(reinterpret_cast<const fp16_t*>(x), reinterpret_cast<fp16_t*>(d), n, g);
    },
    [](const float* x, float* d, int64_t n, const RowGrad<float>& g) { segment_grad<RowVec>(x, d, n, g); },
};
#undef TWINKLE_MEM_NAME
#undef TWINKLE_MEM_STRINGIFY

#undef TWINKLE_MEM_ROW_KERNELS_ISA
