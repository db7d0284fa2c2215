// The CPU kernel's row loops, written once over a SIMD type Vec (VecTraits
// gives its lane type acc_t and width W). Two translation units include it,
// each inside its own namespace: selective_log_softmax.cpp (portable, Vec =
// float or double) and selective_log_softmax_avx2.cpp (Vec = Vec8f).
//
// The including namespace provides: VecTraits<Vec>, load_vec(const T*) -> Vec,
// store_vec(T*, Vec), store_pair(T*, Vec, Vec) (2 W elements), load_scalar(const T*)
// -> acc_t, store_scalar(T*, acc_t),
// hmax(Vec), hsum(Vec), and the exp_/max_ overloads that online_softmax.h's
// templates call.

constexpr int64_t kBlock = 2048;  // elements per L1-resident block of a row

// Online softmax state of z = x[0, n) * inv_T. Each block of the row is read
// from memory once: a first sweep converts it to acc_t into an L1 buffer and
// finds its max, a second accumulates exp(t) and the entropy term, with
// t = x inv_T - shift from one FMA.
template <typename Vec, typename scalar_t>
OnlineSoftmax<typename VecTraits<Vec>::acc_t> segment_state(
    const scalar_t* x, int64_t n, typename VecTraits<Vec>::acc_t inv_T, bool with_entropy) {
  using acc_t = typename VecTraits<Vec>::acc_t;
  constexpr int64_t W = VecTraits<Vec>::W;
  constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();
  alignas(64) acc_t x_buf[kBlock];
  const Vec v_inv_T(inv_T);
  OnlineSoftmax<acc_t> state = empty_state<acc_t>();
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
    // inv_T > 0: the max of z is inv_T times the max of x.
    const acc_t shift = finite_shift(max_(s_max, hmax(v_max)) * inv_T);

    const Vec v_neg_shift(-shift);
    Vec v_sum(acc_t(0)), v_zsum(acc_t(0));
    acc_t s_sum = 0, s_zsum = 0;
    i = 0;
    if (with_entropy) {
      for (; i + W <= len; i += W) {
        const Vec t = shifted(load_vec(x_buf + i), v_inv_T, v_neg_shift);
        const Vec e = exp_(t);
        v_sum = v_sum + e;
        v_zsum = add_entropy_term<Vec, acc_t>(v_zsum, t, e);
      }
      for (; i < len; ++i) {
        const acc_t t = shifted(x_buf[i], inv_T, -shift);
        const acc_t e = exp_(t);
        s_sum += e;
        s_zsum = add_entropy_term<acc_t, acc_t>(s_zsum, t, e);
      }
    } else {
      for (; i + W <= len; i += W) v_sum = v_sum + exp_(shifted(load_vec(x_buf + i), v_inv_T, v_neg_shift));
      for (; i < len; ++i) s_sum += exp_(shifted(x_buf[i], inv_T, -shift));
    }
    state = merge(state, OnlineSoftmax<acc_t>{shift, s_sum + hsum(v_sum), s_zsum + hsum(v_zsum)});
  }
  return state;
}

// d[0, n) = gradient of g_logp * logp + g_entropy * entropy for logits x[0, n),
// as if none of them were the label (the caller fixes the label's element).
// d may alias x (in-place backward): each vector is read before it is written.
template <typename Vec, typename scalar_t>
void segment_grad(const scalar_t* x, scalar_t* d, int64_t n, typename VecTraits<Vec>::acc_t lse,
                  typename VecTraits<Vec>::acc_t mean, typename VecTraits<Vec>::acc_t g_logp,
                  typename VecTraits<Vec>::acc_t g_entropy, typename VecTraits<Vec>::acc_t inv_T) {
  using acc_t = typename VecTraits<Vec>::acc_t;
  constexpr int64_t W = VecTraits<Vec>::W;
  const OffLabelGrad<acc_t> c = off_label_grad(lse, mean, g_logp, g_entropy, inv_T);
  const Vec v_inv_T(inv_T), v_neg_lse(c.neg_lse), v_a(c.a), v_b(c.b), v_x_floor(c.x_floor);
  int64_t i = 0;
  for (; i + 2 * W <= n; i += 2 * W) {  // two vectors per store: one full-width 16-bit store
    store_pair(d + i, grad_off_label(load_vec(x + i), v_inv_T, v_neg_lse, v_a, v_b, v_x_floor),
               grad_off_label(load_vec(x + i + W), v_inv_T, v_neg_lse, v_a, v_b, v_x_floor));
  }
  for (; i + W <= n; i += W) {
    store_vec(d + i, grad_off_label(load_vec(x + i), v_inv_T, v_neg_lse, v_a, v_b, v_x_floor));
  }
  for (; i < n; ++i) {
    store_scalar(d + i, grad_off_label(load_scalar(x + i), inv_T, c.neg_lse, c.a, c.b, c.x_floor));
  }
}
