"""The loss heads a fused call serves: registered kinds, one class each.

A loss head says which twinkle calls are its own (:meth:`LossHead.claims`), why a call of its own cannot take
the fused path (its layout, before the model is read; its own inputs, once the output layer's vocab is known),
what the deferred output layer returns in place of the logits (:meth:`LossHead.output`), and what the loss runs
under for the call (:meth:`LossHead.loss_context`). fused_call_plan.py plans every fused call through them, in the
same order on both twinkle paths.

The heads are tried from the last registered to the first: :class:`LogProbs` (twinkle's
``selective_log_softmax`` takes the log-probs computed from the layer's input), registered first, claims every
call; ``distill_loss.GKD`` (the GKD loss reads the layer's input and weight off a placeholder) claims GKD calls.
A new loss head is one class, decorated with :func:`register`.
"""
import contextlib
from typing import List, Optional, Type


class LossHead:
    """One kind of loss the deferred output layer serves. Class methods decide on a call; an instance holds
    the per-call state (made by :meth:`for_call`)."""
    name = ""
    # Whether twinkle's forward step hands the loss log-probs (the step hooks count a micro-batch without them
    # as failed); False where the loss computes from the placeholder itself.
    hands_log_probs = True
    # Whether the loss reads the placeholder where it reads the logits: a loss that needs logits (require_logits)
    # is served.
    replaces_logits = False
    # Where the deferred output layer cannot serve a call of this head (no labels for the micro-batch, a
    # gathered output, a model called with labels): None runs the layer unchanged, else the refusal's message.
    cannot_defer: Optional[str] = None

    @classmethod
    def claims(cls, kwargs, loss) -> bool:
        """Whether a call (twinkle's kwargs, its loss; one the call checks let through) is this head's."""
        raise NotImplementedError

    @classmethod
    def layout_ineligible(cls, plan, path: str, model, kwargs) -> Optional[str]:
        """Why the call cannot take the fused path on ``path`` ("megatron" / "transformers") before its model's
        output layers are read (install()'s plan, the sequence layout), or None."""
        return None

    @classmethod
    def head_ineligible(cls, kwargs, vocab: int, tensor_parallel: bool) -> Optional[str]:
        """Why the call cannot take the fused path given the output layer's whole ``vocab`` (its inputs: a
        teacher), or None."""
        return None

    @classmethod
    def for_call(cls, path) -> "LossHead":
        """The head's state for one call on ``path`` (fused_call_plan.FusedPath)."""
        return cls()

    def output(self, call, hidden, weight, labels, process_group, seq_first: bool):
        """What the deferred output layer returns for a micro-batch in place of its logits: ``hidden`` [s, b, H]
        when ``seq_first`` (Megatron) else [b, s, H], ``labels`` [b, s], ``weight`` this rank's vocab shard
        under ``process_group``; ``call`` the fused_call.FusedCall."""
        raise NotImplementedError

    def loss_context(self, loss):
        """What the call's loss runs under."""
        return contextlib.nullcontext()


_HEADS: List[Type[LossHead]] = []


def register(head: Type[LossHead]) -> Type[LossHead]:
    """Register a loss head class (a decorator): it is tried before every head registered earlier."""
    _HEADS.append(head)
    return head


def claiming(kwargs, loss) -> Type[LossHead]:
    """The loss head of a call: the last registered that claims it."""
    return next(head for head in reversed(_HEADS) if head.claims(kwargs, loss))


def registered() -> List[Type[LossHead]]:
    """The registered heads, in the order they are tried."""
    return list(reversed(_HEADS))


@register
class LogProbs(LossHead):
    """The log-probs (and entropy) of the micro-batch's labels, computed through the fused head and handed to
    twinkle's ``selective_log_softmax`` (fused_call.take) by a zero-width placeholder."""
    name = "log-probs"

    @classmethod
    def claims(cls, kwargs, loss) -> bool:
        return True

    def output(self, call, hidden, weight, labels, process_group, seq_first: bool):
        logp, entropy = call.compute(hidden, weight, labels.t() if seq_first else labels, process_group)
        if seq_first:  # (the op's rows in the hidden states' [s, b] order; twinkle's in [b, s])
            logp = logp.t().contiguous()
            entropy = entropy.t().contiguous() if entropy is not None else None
        return call.defer(logp, entropy, hidden)
