"""Claims the documentation makes that a reader acts on, checked against what they must say."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _sentences(path):
    text = " ".join((ROOT / path).read_text().split())
    return re.split(r"(?<=[.:;])\s+(?=[A-Z`(])", text)


@pytest.mark.parametrize("path", ["README.md", "docs/twinkle_integration.md", "docs/linear.md"])
def test_logits_never_exist_is_bounded_by_one_block(path):
    # The fused head computes logits that fit in (fused_)chunk_bytes as one block: "the logits never
    # exist" is only true with that bound stated in the same sentence.
    claims = [s for s in _sentences(path) if "never exist" in s]
    assert claims, f"{path}: the claim moved; update this test"
    for sentence in claims:
        assert "chunk_bytes" in sentence and "one block" in sentence, f"{path}: {sentence!r}"
