"""twinkle_mem.heads.argmax.linear_argmax: the argmax over the vocab of an LM head's logits, one vocab block at a
time (twinkle's Accuracy on the fused path), against ``torch.argmax`` of the whole logits made as the layer makes
them (``F.linear`` in the inputs' dtype, divided by T in that dtype).

Real-training inputs: several vocab blocks and row tiles, exact ties across blocks and within one (the first index
wins, as torch.argmax's), all-equal rows, peaked rows, large logits, T = 0.05 and 1e4, bf16 (where rounding makes
ties common), rows of -inf logits (index 0, as torch), float64 maxima closer than float32 resolves, masked
rows (-1), a NaN row; under tensor parallelism (gloo worlds of 2 and 4) each rank its vocab
shard, every rank the whole-weight answer.
"""
import pytest
import torch
import torch.nn.functional as F

from head_helpers import vocab_shard
from helpers import Cases, blocks
from twinkle_mem.heads import plans
from twinkle_mem.heads.argmax import linear_argmax

cases = Cases(__name__, timeout_s=120)
case = cases.register


def head(n, h, v, dtype, seed=0):
    """Hidden states and a weight with real-training troubles: weight rows repeated across and within vocab
    blocks (exact ties), an all-zero hidden row (every logit equal), peaked and large rows."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen)
    weight = torch.randn(v, h, generator=gen) / h ** 0.5
    weight[v - 3] = weight[5]  # a tie across blocks: the first (5) must win
    weight[9] = weight[7]  # a tie within a block
    hidden[0] = 0  # all-equal row: index 0
    hidden[1] = weight[7] * 40  # peaked on the tied pair (7, 9): 7
    hidden[2] = weight[v - 3] * 1e3  # large logits on the cross-block tie: 5
    return hidden.to(dtype), weight.to(dtype)


def reference(hidden, weight, temperature=1.0):
    logits = F.linear(hidden, weight)
    if temperature != 1.0:
        logits.div_(temperature)
    return logits.argmax(-1)


@pytest.fixture
def small_blocks():
    """Vocab blocks of 64 columns, row tiles of 16: several of each in a small case."""
    with blocks(64, 16):
        yield


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.05, 1e4])
def test_equals_argmax_of_the_logits(small_blocks, dtype, temperature):
    hidden, weight = head(70, 32, 300, dtype)
    got = linear_argmax(hidden, weight, temperature=temperature)
    assert torch.equal(got, reference(hidden, weight, temperature))
    assert got[0] == 0 and got[1] == 7 and got[2] == 5


def test_temperature_divides_as_twinkle_does():
    """bf16 logits 1.9921875 < 2.0, divided by T = 0.99 in bf16 as twinkle's forward divides them, round to one value:
    the first index wins there, where the undivided logits' argmax is the second."""
    hidden = torch.ones(1, 1, dtype=torch.bfloat16)
    weight = torch.tensor([[1.9921875], [2.0]], dtype=torch.bfloat16)
    assert reference(hidden, weight).item() == 1 and reference(hidden, weight, 0.99).item() == 0
    assert linear_argmax(hidden, weight, temperature=0.99).item() == 0


def test_rows_batches_and_masks(small_blocks):
    hidden, weight = head(70, 32, 300, torch.float32)
    rows = torch.rand(70, generator=torch.Generator().manual_seed(1)) < 0.6
    got = linear_argmax(hidden.view(7, 10, 32), weight, rows.view(7, 10))
    want = torch.where(rows, reference(hidden, weight), -1).view(7, 10)
    assert torch.equal(got, want)
    alone = torch.cat([linear_argmax(hidden[i:i + 1], weight) for i in range(70)])  # a row, whatever the batch
    assert torch.equal(alone, reference(hidden, weight))


def test_nan_row_as_torch(small_blocks):
    hidden, weight = head(20, 32, 300, torch.float32)
    weight = weight.clone()
    weight[200, 0] = float("nan")  # every row with hidden[:, 0] != 0 has a NaN logit at 200
    assert torch.equal(linear_argmax(hidden, weight), reference(hidden, weight))


def minus_inf_rows(v, dtype=torch.float32):
    """Rows whose logits are all -inf (a -inf hidden value against a positive weight column), with a finite row and
    a row of logits near finfo.min between them: torch.argmax gives 0 at the first."""
    weight = torch.rand(v, 4, generator=torch.Generator().manual_seed(2), dtype=torch.float64) + 0.5
    hidden = torch.zeros(3, 4, dtype=torch.float64)
    hidden[0, 0] = float("-inf")
    hidden[1] = torch.arange(4)
    hidden[2, 1] = torch.finfo(dtype).min / 2
    return hidden.to(dtype), weight.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_of_minus_inf_as_torch(small_blocks, dtype):
    hidden, weight = minus_inf_rows(300, dtype)
    assert F.linear(hidden, weight)[0].isneginf().all()
    assert torch.equal(linear_argmax(hidden, weight), reference(hidden, weight))


def test_float64_maxima_kept_exactly(small_blocks):
    """float64 logits 1 and 1 + 1e-12 in different blocks (one value in float32): the larger, as torch.argmax."""
    hidden = torch.ones(1, 1, dtype=torch.float64)
    weight = torch.zeros(300, 1, dtype=torch.float64)
    weight[5], weight[200] = 1.0, 1.0 + 1e-12
    assert reference(hidden, weight).item() == 200
    assert linear_argmax(hidden, weight).item() == 200


def test_default_blocks_one_block():
    """The package's own blocks (at H = 16 one block of 4 x 8192 columns and a ragged one, one row tile here)."""
    hidden, weight = head(40, 16, plans.block_width(1 << 20, 16, plans.PLANS["cpu"]) + 100, torch.float32)
    assert torch.equal(linear_argmax(hidden, weight), reference(hidden, weight))


@case()
def tensor_parallel(rank, world):
    import torch.distributed as dist
    for dtype in (torch.float32, torch.bfloat16):
        hidden, weight = head(50, 16, 96 * world, dtype)
        weight[96 * world - 1] = weight[5]  # the tie across ranks: the first global column wins
        rows = torch.arange(50) % 3 != 0
        got = linear_argmax(hidden, vocab_shard(weight, rank, world), rows, process_group=dist.group.WORLD)
        assert torch.equal(got, torch.where(rows, reference(hidden, weight), -1)), dtype
        hidden, weight = minus_inf_rows(96 * world, dtype)  # every rank's logits -inf at row 0: global column 0
        got = linear_argmax(hidden, vocab_shard(weight, rank, world), process_group=dist.group.WORLD)
        assert torch.equal(got, reference(hidden, weight)), (dtype, got)


@pytest.mark.parametrize("world,name", cases.params(), ids=lambda v: f"tp{v}" if isinstance(v, int) else v)
def test_linear_argmax_tensor_parallel(world, name):
    failures = cases.failures(world, name)
    assert not failures, "\n".join(failures)
