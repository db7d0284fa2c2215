"""Where code lives (issue 18): package modules stay small, bench/ imports nothing from tests/, no test
module imports another (what they share is in tests/helpers.py and conftest.py). That the wheel holds
only the package (no stand-in, no cpu_harness/): tests/test_packaging.py."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


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
    return {p.stem for p in (ROOT / "tests").glob("*.py")}


def test_package_modules_stay_small():
    """Issue 18: no Python module of the package above 400 lines (split by concern instead)."""
    import twinkle_mem
    root = pathlib.Path(twinkle_mem.__file__).parent
    sizes = {str(p.relative_to(root)): len(p.read_text().splitlines()) for p in root.rglob("*.py")}
    assert sizes and max(sizes.values()) <= 400, {k: v for k, v in sizes.items() if v > 400}


def test_bench_imports_nothing_from_tests():
    tests = _test_modules()
    for script in sorted((ROOT / "bench").glob("*.py")):
        names, paths = _imported_modules(script)
        assert not names & tests, f"{script.name} imports {sorted(names & tests)} from tests/"
        assert not paths, f"{script.name} puts tests/ on sys.path"


def test_no_test_module_imports_another():
    tests = {name for name in _test_modules() if name.startswith("test_")}
    for module in sorted((ROOT / "tests").glob("*.py")):
        names, _ = _imported_modules(module)
        assert not names & tests, f"{module.name} imports {sorted(names & tests)}: shared code goes to helpers.py"
