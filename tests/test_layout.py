"""Where code lives (issues 18, 33, 42): the package's folders and modules are the ones docs/architecture.md draws,
package modules stay small, the package's folders are layers that import only the layers below them, no module
imports another's private name, bench/ and standins/ import nothing from tests/, no test module imports another
(what they share is in tests/helpers.py, head_helpers.py, distill/distill_helpers.py and conftest.py), and tests/
mirrors the package. That the wheel holds only the package (nothing of standins/ or tests/):
tests/test_packaging.py."""
import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "python" / "twinkle_mem"
# The package's layers (docs/architecture.md), each importing only those of a lower or equal rank: the op's
# Python side; distillation math; the fused heads; the public API (__init__.py); the integrations; the
# command line. A module at the package's root other than these two is standalone (measure.py): rank 0, it
# imports no layer; or the public import path of a framework-agnostic fix that lives in integrations/twinkle/
# (DESIGN.md, docs/twinkle_integration.md), of the integrations' layer: it re-exports that module and defines nothing.
LAYER_RANK = {"op": 0, "distill": 1, "heads": 2, "__init__": 3, "integrations": 4, "__main__": 5}
PUBLIC_PATHS = {"processor": "integrations.twinkle.causal_mask", "megatron": "integrations.twinkle.logits_guard"}


# The package's modules, folder by folder (docs/architecture.md draws them; a new module is added here and there).
PACKAGE_LAYOUT = {
    "": "__init__ __main__ measure processor megatron",
    "op": "__init__ functional contract op_args rows ops row_stats vocab_parallel composite native reference",
    "distill": "__init__ divergence arguments topk_teacher local_teacher reference",
    "heads": "__init__ plans engine matmul gathered frozen logprobs gkd_topk gkd_full argmax reference",
    "integrations": "__init__",
    "integrations/core": "__init__ settings source recognition install_plan patching startup framework",
    "integrations/twinkle": "__init__ settings twinkle_names twinkle_source patches startup causal_mask mask_skip "
                            "logits_guard megatron_steps failed_micro_batches transformers_path fused_call_plan "
                            "fused_eligibility fused_call loss_heads distill_loss",
    "integrations/verl": "__init__ settings verl_names patches fsdp_head megatron_head entropy_grad logits_path startup "
                         "plugin",
    "integrations/swift": "__init__ settings swift_names patches output_layer grpo_head gkd_head megatron_head "
                          "logits_path startup plugin",
}
# Names that misled, and where they went (issue 42; CHANGELOG.md): none may come back.
MOVED = {"integrations/twinkle/fused_head.py": "integrations/twinkle/fused_call.py",
         "integrations/twinkle/fused_plan.py": "integrations/twinkle/fused_call_plan.py",
         "integrations/twinkle/_model.py": "integrations/twinkle/twinkle_names.py (tensor_parallel_group)",
         "integrations/twinkle_lm_head.py": "(removed: the fused head's former import path)",
         "integrations/core/plan.py": "integrations/core/install_plan.py",
         "integrations/core/integration.py": "integrations/core/framework.py"}


def _imported_modules(path):
    """The top-level names of every module ``path`` imports (absolute imports), and every string constant
    that names the tests folder (``"tests"``, ``"../tests"``: how a script would put it on ``sys.path``)."""
    tree = ast.parse(path.read_text())
    names, paths = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.Constant) and node.value in ("tests", "../tests"):
            paths.append(node.value)
    return names, paths


def _test_modules():
    return {p.stem for p in (ROOT / "tests").rglob("*.py")}


def _drawn_layout():
    """docs/architecture.md's tree of the package ("The package in layers"): {folder: the words of its entries}."""
    block = (ROOT / "docs" / "architecture.md").read_text().split("## The package in layers", 1)[1].split("```")[1]
    drawn, stack, folder = {"": set()}, [], ""
    for line in block.splitlines()[2:]:  # the lines under python/twinkle_mem/
        indent = len(line) - len(line.lstrip())
        if not indent:
            break
        if indent < 20:  # an entry: a folder ("op/") or a module ("measure.py"), two spaces a level
            name, stack = line.split()[0], stack[:indent // 2 - 1]
            if name.endswith("/"):
                stack.append(name.rstrip("/"))
            else:
                drawn[""].add(name.removesuffix(".py"))
            folder = "/".join(stack)
        drawn.setdefault(folder, set()).update(re.findall(r"\w+", line))
    return drawn


def test_package_layout_is_the_documented_one():
    """Issue 42: the package's folders and modules are PACKAGE_LAYOUT's, and docs/architecture.md's tree draws
    each module in its folder."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        found.setdefault(path.parent.relative_to(PACKAGE).as_posix().replace(".", ""), set()).add(path.stem)
    assert found == {folder: set(names.split()) for folder, names in PACKAGE_LAYOUT.items()}
    drawn = _drawn_layout()
    missing = [f"{folder}/{name}.py".lstrip("/") for folder, names in PACKAGE_LAYOUT.items() for name in names.split()
               if name != "__init__" and name not in drawn.get(folder, ())]
    assert not missing, f"docs/architecture.md's tree does not draw {missing}"


def test_moved_names_stay_gone():
    """Issue 42: the misleading names are gone: the moved modules, and the three classes called ``Plan`` (a head's
    BlockPlan, install()'s InstallPlan and its TwinkleInstallPlan / VerlInstallPlan)."""
    assert not [old for old in MOVED if (PACKAGE / old).exists()]
    plans = [f"{path.relative_to(PACKAGE)}" for path in PACKAGE.rglob("*.py")
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.ClassDef) and node.name == "Plan"]
    assert not plans, plans


def test_package_modules_stay_small():
    """Issue 18: no Python module of the package above 400 lines (split by concern instead)."""
    import twinkle_mem
    root = pathlib.Path(twinkle_mem.__file__).parent
    sizes = {str(p.relative_to(root)): len(p.read_text().splitlines()) for p in root.rglob("*.py")}
    assert sizes and max(sizes.values()) <= 400, {k: v for k, v in sizes.items() if v > 400}


def _layer(parts) -> str:
    """The layer of a module given by its path under the package (("heads", "engine"), ("processor",), ())."""
    if len(parts) > 1 or (parts and parts[0] in LAYER_RANK):
        return parts[0]
    if parts and parts[0] in PUBLIC_PATHS:
        return "integrations"
    return "__init__" if not parts or parts == ("__init__",) else "standalone"


def _package_imports(path):
    """(imported module's path under the package, imported name) for every import of the package in ``path``."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    here = parts[:-1]  # the package a relative import starts from
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - (node.level - 1)] + (tuple(node.module.split(".")) if node.module else ())
            elif node.module and node.module.split(".")[0] == "twinkle_mem":
                base = tuple(node.module.split(".")[1:])
            else:
                continue
            for alias in node.names:
                yield base, alias.name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "twinkle_mem":
                    yield tuple(alias.name.split(".")[1:]), None


def test_layers_import_only_layers_below():
    """Issue 33: op/ imports no other layer, distill/ only op/, heads/ op/ and distill/, the public API those;
    the integrations anything; standalone root modules nothing of the package's layers."""
    rank = dict(LAYER_RANK, standalone=0)
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = _layer(path.relative_to(PACKAGE).with_suffix("").parts)
        for module, name in _package_imports(path):
            target = module + ((name,) if not module and name else ())  # `from .. import x`: x is the module
            layer = _layer(target)
            if layer != source and rank[layer] > rank[source]:
                bad.append(f"{path.relative_to(PACKAGE)} ({source}) imports {'.'.join(module) or name} ({layer})")
    assert not bad, bad


def test_public_paths_only_re_export_their_module():
    """twinkle_mem.processor and twinkle_mem.megatron: a docstring, the names of their module in
    integrations/twinkle/, and __all__ naming exactly those; no code of their own, and nothing imports them."""
    for name, target in PUBLIC_PATHS.items():
        body = ast.parse((PACKAGE / f"{name}.py").read_text()).body
        docstring, imported, exported = body[0], body[1], body[2:]
        assert isinstance(docstring, ast.Expr) and isinstance(docstring.value, ast.Constant), name
        assert isinstance(imported, ast.ImportFrom) and (imported.level, imported.module) == (1, target), name
        names = [alias.name for alias in imported.names if alias.asname is None]
        assert len(exported) == 1 and isinstance(exported[0], ast.Assign), name
        assert sorted(ast.literal_eval(exported[0].value)) == sorted(names), name
        defined = {node.name for node in ast.parse((PACKAGE / f"{target.replace('.', '/')}.py").read_text()).body
                   if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_")}
        assert defined <= set(names), (name, defined - set(names))  # every public function of its module
    users = [f"{path.relative_to(PACKAGE)} imports {'.'.join(module) or name}"
             for path in sorted(PACKAGE.rglob("*.py")) for module, name in _package_imports(path)
             if module in {(n,) for n in PUBLIC_PATHS} or (not module and name in PUBLIC_PATHS)]
    assert not users, users


def test_no_module_imports_a_private_name_of_another():
    """Issue 33: what a module shares is public; a leading underscore means "this module's own"."""
    bad = [f"{path.relative_to(PACKAGE)}: {'.'.join(module)} {name}" for path in sorted(PACKAGE.rglob("*.py"))
           for module, name in _package_imports(path) if name and name.startswith("_") and not name.startswith("__")]
    assert not bad, bad


def test_bench_imports_nothing_from_tests():
    """Nor does standins/: the benchmarks use it too."""
    tests = _test_modules()
    for script in sorted([*(ROOT / "bench").glob("*.py"), *(ROOT / "standins").glob("*.py")]):
        names, paths = _imported_modules(script)
        assert not names & tests, f"{script.name} imports {sorted(names & tests)} from tests/"
        assert not paths, f"{script.name} puts tests/ on sys.path"


def test_no_test_module_imports_another():
    tests = {name for name in _test_modules() if name.startswith("test_")}
    for module in sorted((ROOT / "tests").rglob("*.py")):
        names, _ = _imported_modules(module)
        assert not names & tests, f"{module.name} imports {sorted(names & tests)}: shared code goes to a *helpers.py"


# The checks of the whole project, at the top of tests/; every other test module in the folder of what it tests.
TOP_LEVEL_TESTS = {"test_docs.py", "test_layout.py", "test_packaging.py", "test_measure.py", "test_bench_common.py",
                   "test_bench_selective_log_softmax.py", "test_bench_head_peers.py", "test_bench_verl_forward.py",
                   "test_bench_head_sizes.py", "test_bench_swift.py",
                   "test_device_checks.py"}


def test_tests_mirror_the_package():
    """Issue 42: tests/op, tests/distill, tests/heads for the package's layers, tests/integrations/<framework> for
    each integration, tests/backends/<device> for each backend's kernels and their emulation."""
    tests = ROOT / "tests"
    loose = {p.name for p in tests.glob("test_*.py")} - TOP_LEVEL_TESTS
    assert not loose, f"{sorted(loose)}: into the folder of what they test"
    for layer in ("op", "distill", "heads"):
        assert (PACKAGE / layer).is_dir() and any((tests / layer).glob("test_*.py")), layer
    frameworks = {p.parent.name for p in (PACKAGE / "integrations").glob("*/__init__.py")} - {"core"}
    assert frameworks and all(any((tests / "integrations" / f).glob("test_*.py")) for f in frameworks), frameworks
    for device in ("cpu", "cuda", "npu"):
        assert (ROOT / "csrc" / device).is_dir() and any((tests / "backends" / device).glob("test_*.py")), device
