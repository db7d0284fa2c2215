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


# ------------------------------------------------------------------ examples (issue 27)
DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]


def _python_blocks():
    for path in DOCS:
        text = (ROOT / path).read_text()
        for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
            yield path, text.count("\n", 0, m.start()) + 1, m.group(1)


BLOCKS = list(_python_blocks())


def _shown_output(path, line):
    """The ```text block that follows the python block at `line` (prose between them allowed, no other
    block): what the docs say it prints; None where they show no output."""
    text = (ROOT / path).read_text()
    start = len("\n".join(text.split("\n")[:line - 1]))
    fences = list(re.finditer(r"^```(\w*)\n", text[start:], re.M))
    # fences[0] opens the python block, fences[1] closes it, fences[2] opens the next block
    if len(fences) < 3 or fences[2].group(1) != "text":
        return None
    body = text[start + fences[2].end():]
    return body[:body.index("\n```")]


# In printed output, a number in e-notation (4.0e-07) is a difference from a reference: it may vary with
# the CPU path and the thread count, within the op's accuracy at these sizes. Every other character is
# compared as it is: shapes, dtypes, values rounded to 4 decimals (far above the op's error) and words.
DIFFERENCE = re.compile(r"-?\d\.\de[+-]\d\d")
DIFFERENCE_BOUND = 1e-5


def output_mismatches(printed, shown):
    """Why `printed` is not what the docs show ([] when it is)."""
    printed, shown = printed.rstrip("\n").split("\n"), shown.rstrip("\n").split("\n")
    if len(printed) != len(shown):
        return [f"{len(printed)} lines printed, {len(shown)} shown:\n" + "\n".join(printed)]
    why = []
    for n, (got, want) in enumerate(zip(printed, shown), 1):
        if DIFFERENCE.sub("<d>", got) != DIFFERENCE.sub("<d>", want):
            why.append(f"line {n}: printed {got!r}, shown {want!r}")
        for value in DIFFERENCE.findall(got) + DIFFERENCE.findall(want):
            if abs(float(value)) > DIFFERENCE_BOUND:
                why.append(f"line {n}: difference {value} beyond {DIFFERENCE_BOUND}")
    return why


@pytest.mark.parametrize("path", DOCS)
def test_logits_never_exist_is_bounded_by_one_block(path):
    # The fused head computes logits that fit in (fused_)chunk_bytes as one block: "the logits never
    # exist" is only true with that bound stated in the same sentence.
    for sentence in (s for s in _sentences(path) if "never exist" in s):
        assert "chunk_bytes" in sentence and "one block" in sentence, f"{path}: {sentence!r}"


def test_the_never_exist_claims_are_where_they_were():
    for path in ("docs/twinkle_integration.md", "docs/linear.md"):
        assert any("never exist" in s for s in _sentences(path)), f"{path}: the claim moved; update this test"


def test_the_readme_has_examples_to_run():
    assert sum(path == "README.md" for path, _, _ in BLOCKS) >= 1, "the README's examples moved: update this test"


@pytest.mark.parametrize("path,line,code", BLOCKS, ids=[f"{p}:{n}" for p, n, _ in BLOCKS])
def test_python_block_runs_as_written(path, line, code, tmp_path):
    # Each in a fresh interpreter, outside the repository: what a reader gets from a copy and paste
    # (install() patches and process groups stay there). The package is this test run's.
    package_root = str(Path(twinkle_mem.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"{path}:{line} failed:\n{proc.stderr[-3000:]}"
    shown = _shown_output(path, line)
    if shown is not None:  # the output the docs show under it
        assert output_mismatches(proc.stdout, shown) == [], f"{path}:{line} printed otherwise"


def test_the_readme_quick_start_shows_its_output():
    # Issue 42: the quick start shows what it prints, and the test above compares it with what it does print.
    text = (ROOT / "README.md").read_text()
    heading = text.index("\n## Quick start\n")
    line = text.count("\n", 0, text.index("\n```python\n", heading) + 1) + 1
    assert ("README.md", line) in {(path, n) for path, n, _ in BLOCKS}
    shown = _shown_output("README.md", line)
    assert shown is not None and shown.count("\n") >= 4, "the quick start shows what it prints"


def test_the_output_check_can_fail():
    shown = "logp torch.float32 (2, 8) [0.0, -8.3722]\nmax |logp - float64| = 4.0e-07\ngkd loss 0.0613"
    assert output_mismatches(shown, shown) == []
    assert output_mismatches(shown.replace("4.0e-07", "9.1e-07"), shown) == []   # a difference may vary
    for printed in (shown.replace("-8.3722", "-8.3723"),        # a value
                    shown.replace("(2, 8)", "(2, 9)"),          # a shape
                    shown.replace("float32", "bfloat16"),       # a dtype
                    shown.replace("4.0e-07", "2.0e-04"),        # a difference beyond the bound
                    shown.rsplit("\n", 1)[0],                   # a line missing
                    shown + "\nwarning: something"):            # a line more
        assert output_mismatches(printed, shown), printed


def test_integrations_reachable_from_the_package():
    # `import twinkle_mem` then `twinkle_mem.integrations.twinkle.install()`, as the README writes it.
    proc = subprocess.run([sys.executable, "-c", "import twinkle_mem; f = twinkle_mem.integrations.twinkle.install; "
                           "import twinkle_mem.processor, twinkle_mem.megatron; print(callable(f))"],
                          capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(
                              Path(twinkle_mem.__file__).resolve().parents[1])))
    assert proc.stdout.strip() == "True", proc.stderr[-2000:]


# ------------------------------------------------------------------ the README on one screen (issue 42)
README = (ROOT / "README.md").read_text()


def _bash_commands(block):
    """The commands of a bash block, each without its comment, a line ending in a backslash joined to the next."""
    lines = [line.split("  #")[0].strip() for line in block.strip().split("\n") if line.strip()]
    return "\n".join(lines).replace("\\\n", " ").split("\n")


def _bash_blocks(text):
    return [m.group(1) for m in re.finditer(r"^ *```bash\n(.*?)^ *```", text, re.S | re.M)]


def test_readme_is_one_screen_of_basics():
    lines = README.split("\n")
    assert len(lines) <= 200, f"README.md has {len(lines)} lines"
    first_screen = "\n".join(lines[:50])
    # the two commands, then the GPU-less variant written out as commands of its own, each with its time
    with_gpu, gpu_less = _bash_blocks(first_screen)[:2]
    assert _bash_commands(with_gpu) == ['pip install ".[bench]"', "python bench/bench_selective_log_softmax.py",
                                        'pip install ".[test]"', "python -m pytest tests -q"]
    assert _bash_commands(gpu_less) == [
        "pip install torch --index-url https://download.pytorch.org/whl/cpu", 'pip install "setuptools>=77" wheel',
        'pip install --no-build-isolation ".[bench]"', "python bench/bench_selective_log_softmax.py",
        'pip install --no-build-isolation ".[test]"', "python -m pytest tests -q"]
    timed = {line.split("  #")[0].strip(): line.split("  #", 1)[1] for line in gpu_less.split("\n") if "  #" in line}
    for command in ("python bench/bench_selective_log_softmax.py", "python -m pytest tests -q"):
        assert "minutes" in timed[command], f"{command}: its time"
    for command in ('pip install --no-build-isolation ".[bench]"', 'pip install --no-build-isolation ".[test]"'):
        assert "GB" in timed[command], f"{command}: its disk"
    assert "mcore-bridge" in with_gpu, "the test extras install mcore-bridge too"
    assert "python -m pytest tests -q -m e2e" in first_screen, "the end-to-end tier CI runs, with its time"
    # the headline result: the whole step of twinkle's recipes, the table as the benchmark recorded it
    recorded = (ROOT / "bench/results/recipe.md").read_text().split("\n")
    table = [line for line in lines if line.startswith(("| GRPO |", "| GKD |"))]
    assert len(table) == 6 and all(row in recorded for row in table), "the recipe table is bench_recipe's"
    assert lines.index(table[-1]) < 50, "the result on the first screen"
    # the README's commands run the installed package, never the source tree
    assert "PYTHONPATH=" not in README and "replace both commands" not in README


def test_readme_says_what_ran_on_its_hardware():
    rows = {line.split("|")[1].strip().split(" (")[0]: line for line in README.split("\n")
            if line.startswith(("| CUDA", "| Ascend NPU", "| CPU"))}
    assert "**not run**" in rows["Ascend NPU"] and "bench/npu_check.sh" in rows["Ascend NPU"], rows["Ascend NPU"]
    assert "the AscendC kernel has never run on an NPU" in README
    # The CUDA row names the hardware it ran on, the script, and what was fixed after and not re-run.
    assert "H200" in rows["CUDA"] and "bench/gpu_check.sh" in rows["CUDA"], rows["CUDA"]
    assert "not re-run on a GPU" in rows["CUDA"], rows["CUDA"]


def test_readme_switches_for_twinkle_and_verl_users():
    commands = [c for block in _bash_blocks(README) for c in _bash_commands(block)]
    assert any(c.startswith("TWINKLE_MEM_INSTALL=") for c in commands)
    assert any(c.startswith("python -m verl.trainer.main_ppo") and "impl_backend=twinkle" in c for c in commands)
    assert "twinkle_mem.integrations.twinkle.install()" in README
    # twinkle-mem is not on PyPI: a verl user installs it from its source, against the torch verl runs on
    verl_docs = (ROOT / "docs/verl_integration.md").read_text()
    for text in (README, verl_docs):
        assert "twinkle-mem[verl]" not in text.replace('`pip install "twinkle-mem[verl]"` finds no package', "")
        assert any('pip install --no-build-isolation ".[verl]"' in c for block in _bash_blocks(text)
                   for c in _bash_commands(block))


def test_readme_verl_table_is_bench_verls():
    # the verl users' result, row for row as bench_verl recorded it (a figure edited by hand fails here)
    recorded = (ROOT / "bench/results/verl.md").read_text().split("\n")
    rows = [line.strip() for line in README.split("\n")
            if line.strip().startswith(("| verl's", "| impl_backend=twinkle", "| FSDP2"))]
    assert len(rows) == 4 and all(row in recorded for row in rows), rows
    assert "bench/bench_verl.py --out bench/results/verl" in README


def test_readme_lists_every_doc_in_one_line():
    listed = re.findall(r"^- \[([\w.]+)\]\(docs/([\w.]+)\): \S.*$", README, re.M)
    assert all(name == target for name, target in listed)
    assert sorted(target for _, target in listed) == sorted(p.name for p in (ROOT / "docs").glob("*.md"))


# ------------------------------------------------------------------ paths the docs quote (issue 42)
TOP = ("csrc/", "python/", "tests/", "bench/", "docs/", "standins/", "cmake/", ".ci/")
TOP_FILES = ("README.md", "CHANGELOG.md", "LICENSE", "setup.py", "pyproject.toml", "CMakeLists.txt", "MANIFEST.in")
# Folders a run writes (never committed), and the file that says so.
WRITTEN_BY_A_RUN = {"bench/results/local/": ".gitignore", "bench/results/gpu_check_<gpu>_<date>/": "bench/gpu_check.sh",
                    "bench/results/npu_check_<soc>_<date>/": "bench/npu_check.sh"}


def _expand(pattern):
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [p for alt in m.group(1).split(",") for p in _expand(pattern[:m.start()] + alt + pattern[m.end():])]


def _quoted_paths(path):
    """Each repository path `path` quotes, relative to the repository root: in backquotes (written from the
    root) or as a link (from the file's folder)."""
    text = (ROOT / path).read_text()
    quoted = {q: q for q in re.findall(r"`([^`\s]+)`", text)}
    for block in re.findall(r"^ *```bash\n(.*?)^ *```", text, re.S | re.M):   # the commands' own paths
        quoted.update((word, word) for word in re.findall(r"[^\s\"'=]+", block) if word.startswith(TOP))
    for link in re.findall(r"\]\(([^)#\s:]+)(?:#[^)]*)?\)", text):
        rel = os.path.relpath(ROOT / Path(path).parent / link, ROOT).replace(os.sep, "/")
        quoted[link] = rel + "/" if link.endswith("/") else rel
    for q, rel in quoted.items():
        rel = rel.rstrip(".,:;")
        if rel.startswith(TOP) or rel in TOP_FILES:
            yield q, rel


def _missing(rel):
    file, _, name = rel.partition("::")
    if any(file.startswith(folder) for folder in WRITTEN_BY_A_RUN):
        return False
    patterns = _expand(file)
    found = [match for pattern in patterns for match in ROOT.glob(pattern)]
    if not found or ("*" not in file and len(found) < len(patterns)):
        return True
    return bool(name) and not re.search(rf"def {re.escape(name)}\b", found[0].read_text())


@pytest.mark.parametrize("path", DOCS)
def test_quoted_paths_exist(path):
    missing = sorted({quoted for quoted, rel in _quoted_paths(path) if _missing(rel)})
    assert missing == [], f"{path} quotes paths that do not exist: {missing}"


def _anchors(path):
    """The anchors of a Markdown file's headings, as GitHub makes them (fenced blocks left out)."""
    text = re.sub(r"^ *```.*?^ *```", "", (ROOT / path).read_text(), flags=re.S | re.M)
    seen, anchors = {}, set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


@pytest.mark.parametrize("path", DOCS)
def test_links_to_headings_exist(path):
    text = (ROOT / path).read_text()
    broken = []
    for target, anchor in re.findall(r"\]\(([^)#\s:]*)#([^)\s]+)\)", text):
        file = os.path.relpath(ROOT / Path(path).parent / target, ROOT) if target else path
        if anchor not in _anchors(file):
            broken.append(f"{target}#{anchor}")
    assert broken == [], f"{path} links to headings that do not exist: {broken}"


def test_folders_a_run_writes_are_named_there():
    for folder, named_in in WRITTEN_BY_A_RUN.items():
        assert folder in (ROOT / named_in).read_text(), f"{named_in} no longer writes {folder}"


# ------------------------------------------------------------------ the index of bench/results/ (issue 51)
def _indexed_results():
    """The entries docs/measurements.md's index names (first cells; ``..._tail`` keeps the prefix of a name
    before it in the same cell), and its text."""
    text = (ROOT / "docs" / "measurements.md").read_text()
    section = text.split("## Index of bench/results/", 1)[1].split("\n## ", 1)[0]
    cells = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    return [[t.rstrip("/") for t in re.findall(r"`([^`]+)`", cell)] for cell in cells]


def _named(stem, cells):
    for tokens in cells:
        full = [t for t in tokens if not t.startswith("...")]
        for token in tokens:
            name = re.sub(r"\.(json|md|png|txt|log)$", "", token)
            if name == stem:
                return True
            if token.startswith("...") and stem.endswith(name[3:]):
                head = stem[:-len(name[3:])]
                if any(f.startswith(head) for f in full):
                    return True
    return False


def test_measurements_indexes_every_result():
    results = ROOT / "bench" / "results"
    stems = {p.name if p.is_dir() else p.name.split(".")[0] for p in results.iterdir() if p.name != "local"}
    cells = _indexed_results()
    assert len(stems) > 30 and not [s for s in sorted(stems) if not _named(s, cells)]
    assert not _named("linear_issue41_frozen_fp32_logp", cells)  # (a name of the work, not of the run: gone)
