// The CPU kernel's row loops, written once over a SIMD type Vec (VecTraits
// gives its lane type acc_t and width W). Two translation units include it,
// each inside its own namespace: selective_log_softmax.cpp (portable, Vec =
// float or double) and selective_log_softmax_avx2.cpp (Vec = Vec8f).
//
// The including namespace provides: VecTraits<Vec>, load_vec(const T*) -> Vec,
// store_vec(T*, Vec), store_pair(T*, Vec, Vec) (2 W elements), load_scalar(const T*)
// -> acc_t, store_scalar(T*, acc_t), hmax(Vec), hsum(Vec), index_of(const acc_t*,
// n, acc_t) (the first index holding a value, or n), and the exp_/max_/fma_
// overloads that online_softmax.h's templates call.

constexpr int64_t kBlock = 2048;  // elements per L1-resident block of a row
constexpr int64_t kSubVectors = 16;  // vectors summed in acc_t before their sum joins a double

// Online softmax state of x[0, n) (see online_softmax.h), in double. Each block
// of the row is read from memory once: a first sweep converts it to acc_t into
// an L1 buffer and finds its max, a second accumulates exp(t) and the entropy
// term with t = (x - max) / T over every element but the first max, whose
// buffer copy is set to -inf in between (its exp is the state's implicit 1).
// Sums run in acc_t over 16 vectors at a time and then in double: a row's
// rest and zsum carry ~1e-8 relative error, not the ~1e-6 of 150k fp32 adds.
template <typename Vec, typename scalar_t>
OnlineSoftmax<double> segment_state(const scalar_t* x, int64_t n, typename VecTraits<Vec>::acc_t inv_T,
                                    bool with_entropy) {
  using acc_t = typename VecTraits<Vec>::acc_t;
  constexpr int64_t W = VecTraits<Vec>::W;
  constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();
  alignas(64) acc_t x_buf[kBlock];
  const Vec v_inv_T(inv_T);
  OnlineSoftmax<double> state = empty_state<double>();
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t len = std::min(kBlock, n - start);
    const scalar_t* x_block = x + start;

    Vec v_max(kNegInf);
    acc_t s_max = kNegInf;
    int64_t i = 0;
    for (; i + W <= len; i += W) {
      const Vec xv = load_vec(x_block + i);
      store_vec(x_buf + i, xv);
      v_max = max_(v_max, xv);
    }
    for (; i < len; ++i) {
      const acc_t xs = load_scalar(x_block + i);
      x_buf[i] = xs;
      s_max = max_(s_max, xs);
    }
    const acc_t block_max = max_(s_max, hmax(v_max));
    const acc_t shift = finite_shift(block_max);
    const int64_t at_max = index_of(x_buf, len, block_max);  // len for a NaN or -inf max: nothing left out
    if (block_max != kNegInf && at_max < len) x_buf[at_max] = kNegInf;

    const Vec v_neg_shift(-shift);
    double sum = 0, zsum = 0;
    i = 0;
    while (i + W <= len) {
      const int64_t sub_end = std::min(len - len % W, i + kSubVectors * W);
      Vec v_sum(acc_t(0)), v_zsum(acc_t(0));
      if (with_entropy) {
        for (; i < sub_end; i += W) {
          const Vec t = scaled_gap(load_vec(x_buf + i), v_neg_shift, v_inv_T);
          const Vec e = exp_(t);
          v_sum = v_sum + e;
          v_zsum = add_entropy_term<Vec, acc_t>(v_zsum, t, e);
        }
      } else {
        for (; i < sub_end; i += W) v_sum = v_sum + exp_(scaled_gap(load_vec(x_buf + i), v_neg_shift, v_inv_T));
      }
      sum += hsum(v_sum);
      zsum += hsum(v_zsum);
    }
    for (; i < len; ++i) {
      const acc_t t = scaled_gap(x_buf[i], -shift, inv_T);
      const acc_t e = exp_(t);
      sum += e;
      if (with_entropy) zsum += add_entropy_term<acc_t, acc_t>(acc_t(0), t, e);
    }
    state = merge(state, block_state<double>(block_max, sum, zsum), static_cast<double>(inv_T));
  }
  return state;
}

// d[0, n) = the off-label gradient p (a + b (u + entropy)) of logits x[0, n) (the caller
// rewrites the elements that hold labels). d may alias x (in-place backward):
// each vector is read before it is written.
template <typename Vec, typename scalar_t>
void segment_grad(const scalar_t* x, scalar_t* d, int64_t n, const RowGrad<typename VecTraits<Vec>::acc_t>& g) {
  constexpr int64_t W = VecTraits<Vec>::W;
  const Vec v_neg_shift(g.neg_shift), v_inv_T(g.inv_temperature), v_neg_log_sum(g.neg_log_sum),
      v_entropy(g.entropy), v_a(g.a), v_b(g.b), v_u_floor(g.u_floor);
  auto grad = [&](Vec xv) {
    return grad_off_label(xv, v_neg_shift, v_inv_T, v_neg_log_sum, v_entropy, v_a, v_b, v_u_floor);
  };
  int64_t i = 0;
  for (; i + 2 * W <= n; i += 2 * W) {  // two vectors per store: one full-width 16-bit store
    store_pair(d + i, grad(load_vec(x + i)), grad(load_vec(x + i + W)));
  }
  for (; i + W <= n; i += W) store_vec(d + i, grad(load_vec(x + i)));
  for (; i < n; ++i) store_scalar(d + i, grad_off_label(load_scalar(x + i), g));
}
