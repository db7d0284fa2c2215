"""install() on a twinkle-kit with this project's three fixes merged (standins/twinkle_copies.py builds it from
twinkle-kit 0.5.1's source, as twinkle PR #283 proposes them): its selective_log_softmax a chunked fp32 autograd
Function, the attention-mask type defaulting to causal with the skip decided at collate time, its Megatron
forward_backward reporting logits only when asked.

install() recognizes that twinkle-kit by its code (twinkle_names.py): it still gives twinkle-mem's kernels and
its fused head, adds no second logits guard (no patched reduce_loss, no guard entered, the same logits reported
to reduce_loss as the twinkle-kit's own), and every result (loss, log-probs, entropies, every parameter gradient,
on the Megatron and the transformers path) equals that twinkle-kit's own within fp32 bounds. Each run is a fresh
interpreter with the copy first on the path (tests/integrations/twinkle/fixed_twinkle_step.py).
"""
import os
import subprocess
import sys

import pytest
import torch

from helpers import TOL, assert_close
from standins import twinkle_copies

HERE = os.path.dirname(os.path.abspath(__file__))

TWINKLE_0_5_1 = twinkle_copies.twinkle_kit("0.5.1")  # (the test extras install it)
# Another twinkle-kit, built and run in fresh interpreters: the end-to-end tier (pyproject.toml), as the releases
# .ci/run runs against
pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(TWINKLE_0_5_1 is None, reason="the fixed twinkle-kit is built from twinkle-kit "
                                 "0.5.1's source, which is not installed here (pip install '.[test]')")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{mode: what fixed_twinkle_step.py saved} for the fixed twinkle-kit as it ships, under install() and under
    install(fused_lm_head=True)."""
    copy = twinkle_copies.twinkle_copy(str(tmp_path_factory.mktemp("fixed_twinkle")),
                                       twinkle_copies.FIXED_TWINKLE_EDITS, source=TWINKLE_0_5_1)
    env = {k: v for k, v in os.environ.items() if k != "TWINKLE_MEM_INSTALL"}
    env["PYTHONPATH"] = os.pathsep.join([copy, *filter(None, [env.get("PYTHONPATH")])])
    out = {}
    for mode in ("shipped", "install", "fused"):
        path = os.path.join(copy, f"{mode}.pt")
        proc = subprocess.run([sys.executable, "-W", "ignore", os.path.join(HERE, "fixed_twinkle_step.py"), path, mode],
                              env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        out[mode] = torch.load(path, weights_only=False)
    return out


def test_the_fixed_twinkle_is_recognized_and_nothing_is_refused(runs):
    for mode in ("install", "fused"):
        assert runs[mode]["refused"] == {}
    assert runs["shipped"]["counts"]["twinkle's own selective_log_softmax"] > 0  # control: the fixed function ran


@pytest.mark.parametrize("mode", ["install", "fused"])
def test_no_second_logits_guard(runs, mode):
    """twinkle's forward step reports logits only when asked: install() patches no reduce_loss and enters no
    guard of its own, and reduce_loss sees what it sees without twinkle-mem (no logits: none were asked for)."""
    got = runs[mode]
    assert not any(p.endswith("MegatronStrategy.reduce_loss") for p in got["patched"]), got["patched"]
    assert got["counts"].get("twinkle-mem's logits guard", 0) == 0
    assert got["reported"] == runs["shipped"]["reported"] == [None, None]


@pytest.mark.parametrize("mode", ["install", "fused"])
def test_kernels_and_fused_head_still_given(runs, mode):
    counts = runs[mode]["counts"]
    assert counts.get("twinkle's own selective_log_softmax", 0) == 0  # replaced by twinkle-mem's op ...
    if mode == "install":
        assert counts["twinkle-mem's op"] == 3 and "twinkle-mem's fused head" not in counts  # 2 micro-batches + 1
    else:  # ... or, on the fused path, by its fused head: no logits at all
        assert counts["twinkle-mem's fused head"] == 3 and "twinkle-mem's op" not in counts


@pytest.mark.parametrize("path", ["megatron", "transformers"])
@pytest.mark.parametrize("mode", ["install", "fused"])
def test_every_result_equals_the_fixed_twinkles_own(runs, mode, path):
    want, got = runs["shipped"]["steps"][path], runs[mode]["steps"][path]
    mask = want["labels"] != -100
    assert torch.equal(got["labels"], want["labels"])
    assert got["loss"] == pytest.approx(want["loss"], rel=TOL[torch.float32], abs=1e-6)
    assert got["logps"].dtype == want["logps"].dtype == torch.float32  # (the fixed function computes in fp32 too)
    assert_close(got["logps"][mask], want["logps"][mask], torch.float32, "logps")
    entropy, ref_entropy = torch.cat(got["entropies"]), torch.cat(want["entropies"])
    assert entropy.shape == ref_entropy.shape == mask.shape
    assert_close(entropy[mask], ref_entropy[mask], torch.float32, "entropy")  # (the loss reads it under the mask)
    assert got["grads"].keys() == want["grads"].keys() and want["grads"]
    for name, ref in want["grads"].items():
        assert_close(got["grads"][name], ref, torch.float32, f"grad of {name}")


def test_mask_skipped_at_collate_as_the_fixed_twinkle_does(runs):
    """On an NPU neither builds the dense mask; elsewhere both build the same one."""
    for mode in ("shipped", "install", "fused"):
        assert runs[mode]["masks"]["npu"] is None
        assert torch.equal(runs[mode]["masks"]["cpu"], runs["shipped"]["masks"]["cpu"])
    assert runs["shipped"]["masks"]["cpu"].dim() == 4
