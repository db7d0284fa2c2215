"""Ops' arguments by name: one options value per op family, as csrc/common/op_options.h packs the native op's.

A schema lists an op's scalar arguments one by one (schemas.def for the native op; the signature of each
Python custom op: the fused heads', the GKD ops'). Past the schema a family's scalars travel as one value, a
NamedTuple whose fields are named like the schema's arguments (``contract.OpOptions``,
``heads.logprobs.LogprobOptions``, ``distill.arguments.GkdOptions``, ``vocab_parallel.VocabShard``,
``heads.engine.Needs``):
``call`` fills an op's arguments from such values by name, ``pick`` reads one back from an op's inputs (in
setup_context), and ``register_autograd`` takes a backward that returns its gradients by input name and gives
autograd the tuple it wants, one entry per input of the schema (None for every other), so that no backward
counts Nones by hand.
"""
from __future__ import annotations

from typing import Callable

import torch


_ARG_NAMES: dict = {}  # an op's qualified name -> its arguments' names (filled outside any torch.compile trace)


def arg_names(op) -> tuple[str, ...]:
    """The names of ``op``'s arguments, in its schema's order (a Python custom op, or an OpOverload). Read from
    the schema once per op (register_autograd reads them at import), then from a dict torch.compile traces."""
    key = op.name() if isinstance(op, torch._ops.OpOverload) else op._qualname
    if key not in _ARG_NAMES:
        schema = op._schema if isinstance(op, torch._ops.OpOverload) else op._opoverload._schema
        _ARG_NAMES[key] = tuple(a.name for a in schema.arguments)
    return _ARG_NAMES[key]


def _is_options(value) -> bool:
    return isinstance(value, dict) or (isinstance(value, tuple) and hasattr(value, "_asdict"))


def call(op, *args):
    """``op(...)``: ``args`` are its leading arguments in order (tensors), then option values (NamedTuples or
    dicts) that give each of its other arguments by name."""
    leading = 0
    while leading < len(args) and not _is_options(args[leading]):
        leading += 1
    named = {}
    for value in args[leading:]:
        named.update(value if isinstance(value, dict) else value._asdict())
    return op(*args[:leading], *(named[name] for name in arg_names(op)[leading:]))


def named_inputs(op, inputs) -> dict:
    """An op's inputs (setup_context's ``inputs``) by argument name."""
    return dict(zip(arg_names(op), inputs))


def pick(cls, op, inputs):
    """A ``cls`` (NamedTuple) from an op's inputs, each field from the argument of its name (a field the schema
    lacks keeps its default)."""
    args = named_inputs(op, inputs)
    return cls(**{field: args[field] for field in cls._fields if field in args})


def register_autograd(op, backward: Callable, setup_context: Callable) -> None:
    """``op``'s autograd with ``backward(ctx, *grad_outputs) -> {input name: gradient}``; every input it does not
    name gets None. ``op``: a Python custom op, or the qualified name of a native one."""
    schema_of = getattr(torch.ops.twinkle_mem, op.split("::")[1]).default if isinstance(op, str) else op
    names = arg_names(schema_of)

    def by_position(ctx, *grads):
        named = backward(ctx, *grads)
        unknown = set(named) - set(names)
        assert not unknown, f"not inputs of {names}: {unknown}"
        return tuple(named.get(name) for name in names)

    if isinstance(op, str):
        torch.library.register_autograd(op, by_position, setup_context=setup_context)
    else:
        op.register_autograd(by_position, setup_context=setup_context)
