"""Float64 references of the fused heads, used by the tests: each named after the function it checks, in the op's
style (``op/reference.py``), computed from the whole logits of the same inputs, so the only differences from a
head are its own rounding."""
from __future__ import annotations

from ..op.reference import selective_log_softmax_grad_ref, selective_log_softmax_ref


def linear_selective_log_softmax_ref(hidden, weight, bias, labels, grad_logp, grad_entropy, temperature,
                                     ignore_index):
    """float64 values and gradient of ``linear_selective_log_softmax``: {logp, entropy (shaped as the call's),
    d (dL/dx of sum(grad_logp * logp + grad_entropy * entropy)), x, lse, mean ([N, ...], rows flattened)}.

    x, the logits, are rounded as any matmul in the inputs' dtype rounds them (exact fp32 sums of exact
    products, rounded once to the dtype), so that exact inputs (dyadic values) leave the head nothing but
    its own rounding."""
    h2 = hidden.reshape(-1, hidden.shape[-1])
    x = h2.double() @ weight.double().t() + (0 if bias is None else bias.double())
    x = x.to(hidden.dtype).double()
    y = labels.reshape(h2.shape[0], *labels.shape[hidden.dim() - 1:])
    logp, entropy, lse, mean = selective_log_softmax_ref(x, y, temperature, ignore_index)
    g_logp = grad_logp.reshape(y.shape).double()
    g_entropy = None if grad_entropy is None else grad_entropy.reshape(-1).double()
    d = selective_log_softmax_grad_ref(x, y, g_logp, g_entropy, temperature, ignore_index)
    return dict(logp=logp.view(labels.shape), entropy=entropy.view(labels.shape[:hidden.dim() - 1]), d=d, x=x,
                lse=lse, mean=mean)
