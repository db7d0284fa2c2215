"""A frozen LM head (LoRA: weight and bias need no gradient) differentiated in its forward.

An output with one value per row (a log-prob, an entropy) receives one upstream number per row, g[n], so its
gradient to the hidden states is

    grad_hidden[n] = g[n] * sum_v (d out[n] / d x[n, v]) * weight[v]

an [H] vector per row that the forward can sum block by block while each block's logits are at hand; the backward
is then g[n] times the vector, O(N H), with no logit recomputed. (A trainable head's grad_weight mixes g[n] with
p[n, v] over the rows, so it still needs the logits in the backward: engine.backward_sweep.)

For the log-prob of label y and the entropy H of the softmax over z = x / T (log-normalizer L), per row:

    S = d logp / d hidden = (W[y] - sum_v p_v W_v) / T
    E = d H / d hidden    = -sum_v p_v (z_v - L + H) W_v / T

The vocab comes in blocks b (log-normalizer L_b, entropy H_b), folded in order into the rows' running statistics
(L is the running union's after each block). With w_b = exp(L_b - L) the block's share of the union's mass, the
forward keeps

    A = sum_b w_b (onehot_b - p_b) W_b / T          (p_b the block's own softmax; onehot_b: the label, if in b)
    R = sum_b w_b (-p_b (z - L)) W_b / T            (no one-hot: the label is given as no shard's id)

each block's terms made by the op's in-place backward on its logits with the upstream gradients w_b (and, for R,
w_b (L_b - L - H_b) and g_H = w_b: its formula then gives exactly the term), and summed by one product per row
tile with the block's weight rows (engine.BlockProducts) straight into A and R. When the next block raises L by
delta = L_old - L_new < 0, every w_b so far scales by alpha = exp(delta) and R's (z - L) shifts by -delta:

    A <- alpha A,    R <- alpha (R + delta Q),    Q = sum_b w_b p_b W_b / T = w_y W[y] / T - A

(w_y: the label block's w). Q's W[y] part is a scalar per row (rho), so a block costs two products and a rescale;
W[y] is added once at the end:

    S = A + (1 - w_y) W[y] / T
    E = R + rho W[y] - H Q = R + H A + (rho - H w_y / T) W[y]

The label's one-hot is summed with p inside the op's kernel, before any rounding, so a peaked row (p_y near 1, a
gradient near 0) keeps the unfused backward's precision; (1 - w_y) is -expm1 of a float64. Under tensor
parallelism each rank ends with its shard's share of the whole vocab's vectors, its partial sum, as grad_hidden is
(Megatron's ColumnParallelLinear convention): with gamma = exp(L_shard - L) and lg = log gamma,

    S = gamma A + (1 - gamma w_y) W[y] / T,    E = gamma (R + (lg + H) A + (rho - (lg + H) w_y / T) W[y])

(W[y] only on the rank that holds y). Coefficients are per row, in float64, rounded once; every product is one row
tile and every other step elementwise per row: a row's vectors depend on nothing but the row. The backward is one
custom op (``frozen_grad``), not differentiable again.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..op import ops
from ..op.contract import acc_dtype
from .engine import BlockProducts, Rows
from .plans import BlockPlan, device_plan
from .matmul import native_reduced_products, reduced


def recompute_is_cheaper(dtype: torch.dtype, device: torch.device, entropy_vector: bool) -> bool:
    """Whether a frozen head does better to recompute its logits in the backward, as a trainable one does, than to
    sum its vectors in the forward: with the entropy's vector in bf16 on a CPU that multiplies bf16 natively
    (matmul.native_reduced_products), or in bf16/fp16 on a device whose plan batches its steps (a GPU). Both vectors
    then come from fp32 copies (E's terms cancel against H S: a bf16 product's rounding would not hold its
    precision), fp32 products at half the bf16 rate on that CPU (N = 2048, H = 1024, V = 32768 on Zen 4: 2.02 s
    against 1.62 s for the recompute, docs/cpu.md) and far below it on a GPU's tensor cores, with a GPU step's fp32
    copies (gigabytes) besides. With the log-probs' vector alone, in fp32, fp16 on a CPU, or elsewhere, the
    forward's sums cost no more and save the recompute."""
    if not entropy_vector or not reduced(dtype):
        return False
    return bool(device_plan(device).step_rows) or (dtype == torch.bfloat16 and native_reduced_products(dtype, device))


def vectors_at_most(dtype: torch.dtype, device: torch.device) -> int:
    """The most vectors a frozen head's forward sums on ``device`` (the blocks' budget counts them): 1 where the
    entropy's is recomputed instead (recompute_is_cheaper), else 2."""
    return 1 if recompute_is_cheaper(dtype, device, True) else 2


def reference_labels(labels: Tensor, ignore_index: int, outside: int) -> Tensor:
    """Each row's first label other than ignore_index, [rows, 1]: the one-hot the vector S carries (S of another
    label j is S + (W[y_j] - W[y_ref]) / T); ``outside`` (an id of no shard) for rows of k = 0 labels, whose S is
    -sum_v p_v W_v / T; ignore_index where every label is (the padding: the op skips the row)."""
    if labels.shape[1] == 0:
        return labels.new_full((labels.shape[0], 1), outside)
    valid = labels != ignore_index
    first = valid.int().argmax(dim=1, keepdim=True)
    return torch.where(valid.any(dim=1, keepdim=True), labels.gather(1, first), ignore_index)


def outside_id(vocab_size: int, ignore_index: int) -> int:
    """A label id no shard holds and not ignore_index: the op gives its row no one-hot (a label of another shard)."""
    return vocab_size if ignore_index != vocab_size else vocab_size + 1


def log_share(part, union, inv_t: float) -> Tensor:
    """L_part - L_union per row, in float64, from each side's (shift, log_sum) (L = shift / T + log_sum,
    op/row_stats.py): the shifts' difference first, so that logits near a dtype's limits (shifts of 1e38 / T) keep
    the log-sums' precision; -inf for a part of -inf logits only (no mass), NaN where the part holds a NaN."""
    (shift_p, log_sum_p), (shift_u, log_sum_u) = part[:2], union[:2]
    return torch.where(log_sum_p == float("-inf"), float("-inf"),
                       (shift_p - shift_u) * inv_t + (log_sum_p - log_sum_u))


class FrozenGrads:
    """A frozen head's forward: the rows' vectors S (log-prob) and, with ``entropy``, E, summed over the vocab
    blocks of a forward_sweep (``block`` in each step, after the statistics' fold), finished by ``vectors``."""

    def __init__(self, rows: Rows, weight: Tensor, labels: Tensor, ignore_index: int, vocab_start: int,
                 vocab_size: int, inv_temperature: float, entropy: bool, plan: BlockPlan):
        tiles = rows.tiles
        self.weight, self.ignore_index, self.vocab_start, self.inv_t = weight, ignore_index, vocab_start, inv_temperature
        self.width = plan.width
        acc = acc_dtype(weight.dtype)
        self.a = weight.new_zeros((tiles.padded, weight.shape[1]), dtype=acc)
        self.r = torch.zeros_like(self.a) if entropy else None
        self.rho = weight.new_zeros(tiles.padded, dtype=torch.float64)
        self.w_y = torch.zeros_like(self.rho)  # the label's block's w (0 until that block, or no label here)
        self.running = (torch.zeros_like(self.rho), torch.zeros_like(self.rho))  # (shift, log_sum) of the blocks so far
        self.y = reference_labels(labels, ignore_index, outside_id(vocab_size, ignore_index))
        self.outside = torch.full_like(self.y, outside_id(vocab_size, ignore_index))
        self.local = self.y[:, 0] - vocab_start  # in [0, V shard) where this shard holds it
        self.label_block = torch.where((self.local >= 0) & (self.local < weight.shape[0]),
                                       self.local.div(plan.width, rounding_mode="floor"), -1)
        # The blocks' terms from their logits in the input dtype: A's are a share of one entry each (the dtype's
        # rounding stays within the op's bound); with R (whose terms cancel against H A in the end) and in fp16
        # (w_b p underflows its range), from fp32 copies of a row tile at a time instead.
        self.exact = reduced(weight.dtype) and (entropy or weight.dtype == torch.float16)
        grad_dtype = acc if self.exact else plan.logits_dtype
        self.products = BlockProducts(weight, grad_dtype, tiles, rounded=not self.exact)
        # the rows each product takes the blocks' terms of: a row tile where they are copies (a batched plan: its
        # step, whose one product is batched over its tiles), else the whole step in place
        self.piece = tiles.tile * (plan.group if tiles.batched else 1)
        self.in_pieces = self.exact or entropy
        size = min(self.piece, tiles.padded) * plan.width
        self.copies = [weight.new_empty(size, dtype=grad_dtype) for _ in range(entropy + self.exact)]

    def _fold(self, rs: slice, shift: Tensor, log_sum: Tensor, first: bool):
        """The rows' running normalizer with one more block of (shift, log_sum) (float64), in place: (delta, log_w),
        the logs of the blocks so far's and this block's shares of the union (delta None at the first block; -inf
        where a side has no mass, NaN where it holds a NaN). A side without mass is (-inf, -inf) as the op gives it
        (csrc/common/online_softmax.h), or (0, -inf) once folded: its share is -inf without a mask."""
        neg_inf = float("-inf")
        run_shift, run_log = self.running[0][rs], self.running[1][rs]
        if first:
            run_shift.copy_(shift), run_log.copy_(log_sum)
            return None, torch.where(log_sum == neg_inf, neg_inf, log_sum - log_sum)  # 0, or NaN for a NaN
        big = torch.maximum(run_shift, shift)
        big = torch.where(big == neg_inf, 0.0, big)  # (no mass on either side)
        side_a = torch.add(run_log, run_shift - big, alpha=self.inv_t)  # (shift - big) / T + log_sum
        side_b = torch.add(log_sum, shift - big, alpha=self.inv_t)
        union = torch.logaddexp(side_a, side_b)
        run_shift.copy_(big), run_log.copy_(union)
        union = torch.where(union == neg_inf, 0.0, union)  # (no mass at all: both shares -inf)
        return side_a - union, side_b - union

    def block(self, v0: int, v1: int, rs: slice, x: Tensor, shift: Tensor, log_sum: Tensor,
              h_block: Optional[Tensor]) -> None:
        """Fold the block [v0, v1) of the rows ``rs`` (x: its logits, overwritten) into their vectors: ``shift``,
        ``log_sum``, ``h_block`` (None without the entropy's vector) the op's statistics of the block as it
        returned them."""
        a, r = self.a[rs], None if self.r is None else self.r[rs]
        delta, log_w = self._fold(rs, shift.double(), log_sum.double(), v0 == 0)
        if delta is not None:  # the blocks so far: their w scale by alpha = exp(delta)
            alpha = delta.exp()
            if r is not None:
                delta = torch.where(alpha == 0, 0.0, delta)  # (nothing so far: R = 0)
                self.rho[rs] = alpha * (self.rho[rs] - delta * self.w_y[rs] * self.inv_t)
                r.add_(a * _column(delta, a.dtype)).mul_(_column(alpha, a.dtype))
                self.w_y[rs].mul_(alpha)
            a.mul_(_column(alpha, a.dtype))
        w = log_w.exp()
        if r is not None:  # (rho needs the label's share as it goes; S alone takes it at the end: label_share)
            self.w_y[rs] = torch.where(self.label_block[rs] == v0 // self.width, w, self.w_y[rs])
        g_a = _column(w, a.dtype)
        y_a = torch.where(w.unsqueeze(1) == 0, self.ignore_index, self.y[rs])  # -inf logits only: the op skips the
        if r is not None:  # row (its p would be NaN), adds 0
            g_r = _column(torch.where(w == 0, 0.0, w * (log_w - h_block.double())), a.dtype)
            y_r = torch.where(w.unsqueeze(1) == 0, self.ignore_index, self.outside[rs])
        piece = self.piece if self.in_pieces else x.shape[0]
        for r0 in range(0, x.shape[0], piece):
            t = slice(r0, r0 + piece)
            x_a, x_r = self._copies(x[t])
            if x_r is not None:
                ops.bwd_inplace(g_r[t], g_a[t, 0], x_r, y_r[t], shift[t], log_sum[t], h_block[t], self.inv_t,
                                self.ignore_index, self.vocab_start + v0)  # -w p (z - L) / T
                self.products(r[t], v0, v1, x_r, accumulate=True)
            ops.bwd_inplace(g_a[t], None, x_a, y_a[t], shift[t], log_sum[t], None, self.inv_t, self.ignore_index,
                            self.vocab_start + v0)  # w (onehot - p) / T
            self.products(a[t], v0, v1, x_a, accumulate=True)

    def _copies(self, x: Tensor):
        """(where A's terms are made, where R's are, or None): x itself, or copies (fp32 where exact)."""
        x_a = self.copies[-1][: x.numel()].view_as(x).copy_(x) if self.exact else x
        x_r = self.copies[0][: x.numel()].view_as(x).copy_(x_a) if self.r is not None else None
        return x_a, x_r

    def label_share(self, shift_b: Tensor, log_sum_b: Tensor) -> None:
        """w_y, each row's label block's share of the running normalizer after the last block, from the blocks'
        statistics [blocks, rows] (float64; S's rescaling block by block made the same shares): 0 where this
        shard holds no label. (With the entropy's vector, rho needed it as it went: block.)"""
        if self.r is not None:
            return
        at = self.label_block.clamp(min=0).unsqueeze(0)
        log_w = torch.add(log_sum_b.gather(0, at)[0] - self.running[1], shift_b.gather(0, at)[0] - self.running[0],
                          alpha=self.inv_t)
        self.w_y = torch.where(self.label_block >= 0, log_w.exp(), 0.0)

    def vectors(self, rows: Rows, shard, whole):
        """(S [N, H], E [N, H] or an empty [0]) of every row, 0 on the rows not kept, from the rows' statistics
        (shift, log_sum, H) of this weight's vocab (``shard``) and of the whole vocab (the same without tensor
        parallelism; with it, the vectors become this rank's share of the whole vocab's); after label_share."""
        lg = torch.zeros_like(self.rho) if shard is whole else log_share(shard, whole, self.inv_t)
        gamma = lg.exp()
        here = (self.local >= 0) & (self.local < self.weight.shape[0])
        wy = self.weight.index_select(0, self.local.clamp(0, self.weight.shape[0] - 1)).to(self.a.dtype)
        e = None
        if self.r is not None:
            h = torch.where(gamma == 0, 0.0, lg + whole[2])  # (lg + H), 0 for a shard of no mass
            e = self.r.mul_(_column(gamma, self.r.dtype))
            e.add_(self.a * _column(gamma * h, e.dtype))
            e.add_(wy * _column(torch.where(here, gamma * (self.rho - h * self.w_y * self.inv_t), 0.0), e.dtype))
        s = self.a.mul_(_column(gamma, self.a.dtype))
        s.add_(wy.mul_(_column(torch.where(here, -torch.expm1(lg + self.w_y.log()) * self.inv_t, 0.0), s.dtype)))
        empty = s.new_empty(0)
        return tuple(empty if v is None else rows.spread(v[: rows.m]) for v in (s, e))


def _column(t: Tensor, dtype: torch.dtype) -> Tensor:
    """A per-row float64 coefficient as a [rows, 1] column of the vectors' dtype (rounded once)."""
    return t.to(dtype).unsqueeze(1)


# ------------------------------------------------------------------ the backward: g times the vectors
@torch.library.custom_op("twinkle_mem::frozen_head_grad", mutates_args=())
def frozen_grad(grad_logp: Optional[Tensor], grad_entropy: Optional[Tensor], vec_logp: Tensor, vec_entropy: Tensor,
                hidden: Tensor, weight: Tensor, labels: Tensor, inv_temperature: Tensor, ignore_index: int,
                vocab_start: int, vocab_size: int) -> Tensor:
    """grad_hidden [N, H] in hidden's dtype = sum_j g_j dlogp_j/dhidden + g_H dH/dhidden from the forward's vectors
    (vec_entropy: [0] where not summed; grad_entropy must then be None). hidden: only its shape and dtype."""
    inv_t = inv_temperature.item()
    grad = torch.zeros_like(vec_logp)
    if grad_logp is not None:
        valid = labels != ignore_index
        g = torch.where(valid, grad_logp.to(grad.dtype), 0.0)
        total = g.sum(dim=1)
        grad += vec_logp * total.unsqueeze(1)
        if labels.shape[1] > 1:  # S_j = S + (W[y_j] - W[y_ref]) / T, each W[.] of this shard's ids
            ref = reference_labels(labels, ignore_index, outside_id(vocab_size, ignore_index))
            for j, coef in [(None, -total)] + [(j, g[:, j]) for j in range(labels.shape[1])]:
                local = (ref[:, 0] if j is None else labels[:, j]) - vocab_start
                here = (local >= 0) & (local < weight.shape[0])
                rows = weight.index_select(0, local.clamp(0, weight.shape[0] - 1)).to(grad.dtype)
                grad += rows * torch.where(here, coef * inv_t, 0.0).unsqueeze(1)
    if grad_entropy is not None:
        grad += vec_entropy * grad_entropy.to(grad.dtype).unsqueeze(1)
    return grad.to(hidden.dtype)


@frozen_grad.register_fake
def _frozen_grad_fake(grad_logp, grad_entropy, vec_logp, vec_entropy, hidden, weight, labels, inv_temperature,
                      ignore_index, vocab_start, vocab_size):
    return hidden.new_empty(hidden.shape)


def save_one_output(ctx, in_forward: bool, args: dict, output, saved: tuple) -> None:
    """setup_context of a head of one output per row (loss, then its backward's state and the vectors): (hidden, the
    vectors) where the forward summed them (``in_forward``), else hidden, weight, bias, the inputs named in ``saved``
    and the backward's state; the outputs but the first not differentiable."""
    if in_forward:  # the vectors, not the teacher: the backward recomputes nothing
        ctx.save_for_backward(args["hidden"], output[2])
    else:
        ctx.save_for_backward(args["hidden"], args["weight"], args["bias"], *(args[name] for name in saved), output[1])
    ctx.mark_non_differentiable(output[1], output[2])


def grad_from_vectors(ctx, grad: Tensor) -> dict:
    """The backward of a frozen head's output of one value per row whose forward saved (hidden, vectors):
    autograd's gradients by input name, grad_hidden = grad[n] vectors[n] (heads/gkd_full.py, gkd_topk.py)."""
    hidden, vectors = ctx.saved_tensors
    return {"hidden": row_scaled(grad, vectors, hidden) if ctx.needs_input_grad[0] else None}


@torch.library.custom_op("twinkle_mem::frozen_row_grad", mutates_args=())
def row_scaled(grad: Tensor, vectors: Tensor, hidden: Tensor) -> Tensor:
    """grad_hidden [N, H] in hidden's dtype = grad[n] vectors[n]: the backward of a frozen head's output of one value
    per row whose vectors the forward summed (heads/gkd_full.py, gkd_topk.py)."""
    return (vectors * grad.to(vectors.dtype).unsqueeze(1)).to(hidden.dtype)


@row_scaled.register_fake
def _row_scaled_fake(grad, vectors, hidden):
    return hidden.new_empty(hidden.shape)
