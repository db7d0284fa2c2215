"""Claims the documentation makes that a reader acts on, checked against what they must say, and the
examples it gives, run as written."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import twinkle_mem

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


# ------------------------------------------------------------------ examples (issue 27)
DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]


def _python_blocks():
    for path in DOCS:
        text = (ROOT / path).read_text()
        for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
            yield path, text.count("\n", 0, m.start()) + 1, m.group(1)


BLOCKS = list(_python_blocks())


def test_the_readme_has_examples_to_run():
    assert sum(path == "README.md" for path, _, _ in BLOCKS) >= 2, "the README's examples moved: update this test"


@pytest.mark.parametrize("path,line,code", BLOCKS, ids=[f"{p}:{n}" for p, n, _ in BLOCKS])
def test_python_block_runs_as_written(path, line, code, tmp_path):
    # Each in a fresh interpreter, outside the repository: what a reader gets from a copy and paste
    # (install() patches and process groups stay there). The package is this test run's.
    package_root = str(Path(twinkle_mem.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"{path}:{line} failed:\n{proc.stderr[-3000:]}"


def test_integrations_reachable_from_the_package():
    # `import twinkle_mem` then `twinkle_mem.integrations.twinkle.install()`, as the README writes it.
    proc = subprocess.run([sys.executable, "-c", "import twinkle_mem; f = twinkle_mem.integrations.twinkle.install; "
                           "import twinkle_mem.processor, twinkle_mem.megatron; print(callable(f))"],
                          capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(
                              Path(twinkle_mem.__file__).resolve().parents[1])))
    assert proc.stdout.strip() == "True", proc.stderr[-2000:]


def test_readme_leads_with_the_basics():
    # Issue 27: what it is, the two commands, then a runnable example of each public function and of
    # install(), before the long prose; the facts a newcomer needs before installing stated up front.
    text = (ROOT / "README.md").read_text()
    fences = [m.start() for m in re.finditer(r"^```", text, re.M)]
    # Issue 31: a reader without a GPU meets the CPU-torch install first, the commands that replace both
    gpu_less, commands = text[fences[0]:fences[1]], text[fences[2]:fences[3]]
    assert "download.pytorch.org/whl/cpu" in gpu_less and "--no-build-isolation" in gpu_less
    assert "replace both commands" in text[:fences[0]]
    assert 'pip install ".[bench]" && python bench/bench_selective_log_softmax.py' in commands
    assert 'pip install ".[test]" && python -m pytest tests -q' in commands
    assert "mcore-bridge" in commands, "the test extras install mcore-bridge too"
    first_prose = text.index("\n## ", text.index("## Install and run") + 1)
    assert "download.pytorch.org/whl/cpu" in text[:first_prose], "how to get the CPU build of torch"
    examples = "".join(code for path, line, code in BLOCKS[:2] if path == "README.md")
    for call in ("selective_log_softmax(", "entropy_from_logits(", "linear_selective_log_softmax(",
                 "twinkle_mem.integrations.twinkle.install("):
        assert call in examples, f"the README's first examples lack {call}"
    readme_lines = [line for path, line, _ in BLOCKS if path == "README.md"]
    assert readme_lines[1] < text[:text.index("## What it fixes")].count("\n"), "examples before the long prose"
