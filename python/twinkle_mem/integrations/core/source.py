"""A framework's source as found on disk, read without importing it.

An integration judges the framework it meets by what its code is (twinkle's twinkle_names.py, verl's
verl_names.py), before the process has imported more of the framework than its package does: the modules it
patches import torch, megatron-core and transformers, which a process that never builds a model never pays
for. So the functions are read from source: each one's lines are cut out of its file and parsed alone (parsing
twinkle's large model modules whole would cost about a tenth of ``import twinkle``).
"""
import ast
import functools
import os
import re
import textwrap
from typing import Dict, List, Optional, Tuple

_DEF = r"(?:async\s+)?def\s+{}\s*\("
_ASSIGNED = r"\s*(?::|=(?!=))"  # `name: ...` or `name = ...`, not `name == ...`
_CLASS_BODY_NAME = re.compile(rf"^    (\w+){_ASSIGNED}", re.MULTILINE)
_SELF_ATTRIBUTE = re.compile(rf"\bself\.(\w+){_ASSIGNED}")


class PackageSource:
    """The package at ``folder`` (the folder holding its ``__init__.py``): ``twinkle``, ``verl``."""

    def __init__(self, folder: str):
        self.folder = folder
        self._texts: Dict[str, Optional[List[str]]] = {}
        self._classes: Dict[Tuple[str, str], Optional[List[str]]] = {}
        self._bodies: Dict[str, Optional[ast.Module]] = {}
        self._declared: Dict[Tuple[str, str], set] = {}
        self._functions: Dict[Tuple[str, str, bool], Optional[ast.FunctionDef]] = {}

    def version(self) -> Optional[str]:
        """What the package says its version is (a name, not what install() goes by): its ``version.py``'s
        ``__version__`` (twinkle), or its ``version/version`` text file (verl)."""
        lines = self._lines(os.path.basename(self.folder) + ".version") or []
        match = re.search(r"__version__\s*=\s*['\"]([^'\"]+)['\"]", "\n".join(lines))
        if match:
            return match.group(1)
        text_file = os.path.join(self.folder, "version", "version")
        if os.path.isfile(text_file):
            with open(text_file, encoding="utf-8") as f:
                return f.read().strip() or None
        return None

    def has_module(self, module: str) -> bool:
        return self._lines(module) is not None

    def function(self, module: str, qualname: str, body: bool = True) -> Optional[ast.FunctionDef]:
        """The definition of ``qualname`` (``f`` or ``Class.f``) in ``module``, decorators included, or None;
        ``body=False``: its decorators and parameters only (a body of ``...``: cheaper to read)."""
        if body is False and (module, qualname, True) in self._functions:
            return self._functions[(module, qualname, True)]
        key = (module, qualname, body)
        if key not in self._functions:
            self._functions[key] = self._find_function(module, qualname, body)
        return self._functions[key]

    def module_node(self, module: str) -> Optional[ast.Module]:
        """``module`` parsed whole (for a small module: its top level is what a feature reads), or None."""
        if module not in self._bodies:
            lines = self._lines(module)
            self._bodies[module] = None if lines is None else ast.parse("\n".join(lines))
        return self._bodies[module]

    def binds(self, module: str, name: str) -> bool:
        """Whether ``module``'s top level binds ``name`` (a def, a class, an assignment or an import)."""
        tree = self.module_node(module)
        for node in tree.body if tree is not None else ():
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
                return True
            if isinstance(node, (ast.Import, ast.ImportFrom)) and \
                    any((alias.asname or alias.name.split(".")[0]) == name for alias in node.names):
                return True
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                return True
        return False

    def declares(self, module: str, cls: str, attribute: str) -> bool:
        """Whether ``cls`` in ``module`` declares ``attribute``: in its body (a dataclass field, a class attribute)
        or as ``self.<attribute> = ...`` in a method (read from the class's text)."""
        if (module, cls) not in self._declared:
            text = "\n".join(self._class_lines(module, cls) or ())
            self._declared[(module, cls)] = set(_CLASS_BODY_NAME.findall(text)) | set(_SELF_ATTRIBUTE.findall(text))
        return attribute in self._declared[(module, cls)]

    # --- reading ---------------------------------------------------------------------------------

    def _lines(self, module: str) -> Optional[List[str]]:
        if module not in self._texts:
            parts = module.split(".")[1:]  # (below the package's folder)
            base = os.path.join(self.folder, *parts)
            text = None
            for path in (base + ".py", os.path.join(base, "__init__.py")):
                if os.path.isfile(path):
                    with open(path, encoding="utf-8") as f:
                        text = f.read().splitlines()
                    break
            self._texts[module] = text
        return self._texts[module]

    def _class_lines(self, module: str, cls: str) -> Optional[List[str]]:
        if (module, cls) not in self._classes:
            lines, found = self._lines(module), None
            pattern = re.compile(rf"class\s+{cls}\b")
            start = next((i for i, line in enumerate(lines or ()) if pattern.match(line)), None)
            if start is not None:
                end = next((j for j in range(start + 1, len(lines)) if _top_level(lines[j])), len(lines))
                found = lines[start:end]
            self._classes[(module, cls)] = found
        return self._classes[(module, cls)]

    def _find_function(self, module: str, qualname: str, body: bool) -> Optional[ast.FunctionDef]:
        *owner, name = qualname.split(".")
        lines = self._class_lines(module, owner[0]) if owner else self._lines(module)
        if lines is None:
            return None
        indent = " " * 4 if owner else ""
        pattern = re.compile(indent + _DEF.format(re.escape(name)))
        start = next((i for i, line in enumerate(lines) if pattern.match(line)), None)
        if start is None:
            return None
        # (the parameters' closing line may sit at the definition's own indent: the block starts after the header)
        header_end = next((j for j in range(start, min(start + 60, len(lines)))
                           if lines[j].rstrip().endswith(":") and _header("\n".join(lines[start:j + 1]))), start)
        end = next((j for j in range(header_end + 1, len(lines)) if _ends_block(lines[j], len(indent))), len(lines))
        first = _first_decorator(lines, start, len(indent))
        text = textwrap.dedent("\n".join(lines[first:end]))
        if not body:  # the lines up to the colon that ends the parameters, then a body of `...`
            header = _header(text)
            text = header + " ..." if header is not None else text
        try:
            tree = ast.parse(text)
        except SyntaxError:  # a line at a smaller indent inside the function (a string): read the whole file
            tree = ast.parse("\n".join(self._lines(module)))
            for part in owner:
                tree = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == part), None)
                if tree is None:
                    return None
        return next((n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                     and n.name == name), None)


def _header(text: str) -> Optional[str]:
    """``text`` (a definition) up to the colon after its parameters, or None where that is not plain to see (then
    the whole definition is read). Strings (one-line ones, as annotations and defaults are) and comments are
    stepped over."""
    depth, i = 0, text.find("def ")
    while 0 <= i < len(text):
        char = text[i]
        if char in "\"'":
            if text.startswith(char * 3, i):
                return None
            end = text.find(char, i + 1)
            if end < 0 or "\\" in text[i:end] or "\n" in text[i:end]:
                return None
            i = end
        elif char == "#":
            i = text.find("\n", i)
            continue
        depth += (char in "([{") - (char in ")]}")
        if char == ":" and depth == 0:
            return text[:i + 1]
        i += 1
    return None


def _top_level(line: str) -> bool:
    return bool(line) and not line[0].isspace() and not line.startswith("#")


def _ends_block(line: str, indent: int) -> bool:
    """A line after a definition at ``indent`` that is no longer inside it."""
    stripped = line.strip()
    return bool(stripped) and not stripped.startswith("#") and len(line) - len(line.lstrip()) <= indent


def _first_decorator(lines: List[str], start: int, indent: int) -> int:
    """The first line of the decorators above the definition at ``start`` (``start`` itself without any)."""
    first, j = start, start - 1
    while j >= 0 and lines[j].strip():
        depth = len(lines[j]) - len(lines[j].lstrip())
        if depth == indent and lines[j].lstrip().startswith("@"):
            first = j
        elif depth <= indent:
            break
        j -= 1
    return first


def signature(node: ast.FunctionDef) -> str:
    """A definition's parameters as text: names, ``*`` / ``**`` and ``=`` where a default is given:
    ``(self, *, inputs, micro_batch_size=, **kwargs)``."""
    args = node.args
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    parts = [a.arg + ("=" if d is not None else "") for a, d in zip(positional, defaults)]
    if args.vararg is not None:
        parts.append("*" + args.vararg.arg)
    elif args.kwonlyargs:
        parts.append("*")
    parts += [a.arg + ("=" if d is not None else "") for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg is not None:
        parts.append("**" + args.kwarg.arg)
    return "(" + ", ".join(parts) + ")"


def accepts(node: ast.FunctionDef, expected: str) -> Optional[str]:
    """Why a definition's parameters are not what ``expected`` (as :func:`signature` writes it) calls it with,
    or None: the expected parameters, in their order and kinds, and any more only with defaults."""
    found = signature(node)
    want, have = _params(expected), _params(found)
    extra = [p for p in have if p not in want]
    if [p for p in have if p in want] != want or any(not p.endswith("=") and not p.startswith("*")
                                                    and p != "*" for p in extra):
        return f"unexpected signature {found}, expected {expected}"
    return None


def _params(text: str) -> List[str]:
    return [p.strip() for p in text.strip("()").split(",") if p.strip()]


def decorated(node: ast.FunctionDef, name: str) -> bool:
    return any(isinstance(d, ast.Name) and d.id == name for d in node.decorator_list)


@functools.lru_cache(maxsize=None)
def _index(node: ast.AST):
    """One walk of ``node``: its calls by the name called, its string constants, the definitions inside it."""
    by_name: Dict[str, List[ast.Call]] = {}
    found_strings, definitions = set(), []
    for n in ast.walk(node):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            definitions.append(n)
        elif isinstance(n, ast.Call):
            func = n.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            by_name.setdefault(name, []).append(n)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            found_strings.add(n.value)
    return by_name, found_strings, definitions


def calls(node: ast.AST, name: str) -> List[ast.Call]:
    """The calls in ``node`` of ``name``: a plain name (``f(...)``) or an attribute (``x.f(...)``)."""
    return _index(node)[0].get(name, [])


def strings(node: ast.AST) -> set:
    return _index(node)[1]


def enclosing_function(tree: ast.AST, target: ast.AST) -> Optional[ast.FunctionDef]:
    """The innermost function definition in ``tree`` that contains the call ``target`` (the walk meets outer
    definitions before inner ones)."""
    name = target.func.id if isinstance(target.func, ast.Name) else target.func.attr
    return next((d for d in reversed(_index(tree)[2]) if any(c is target for c in calls(d, name))), None)


# --- features: what a function does, for the names modules' FEATURES ---------------------------------------------

def feature(check, module: str, *qualnames: str, **options):
    """A feature of a framework: ``check(node, **options)`` holds for each function ``qualnames`` of ``module``
    (False where one is absent)."""
    def holds(source: PackageSource) -> bool:
        nodes = [source.function(module, q) for q in qualnames]
        return all(node is not None and check(node, **options) for node in nodes)
    return holds


def divides_then_computes(node) -> bool:
    """The function divides the model's logits by the temperature in place (``x.div_(temperature)``) and hands that
    very tensor to ``selective_log_softmax``: where the fused head's placeholder arrives."""
    divided = {c.func.value.id for c in calls(node, "div_") if isinstance(c.func.value, ast.Name)}
    found = calls(node, "selective_log_softmax")
    return bool(found) and all(c.args and isinstance(c.args[0], ast.Name) and c.args[0].id in divided for c in found)


def reads(node, word: str) -> bool:
    """The function names ``word`` in a string (as ``getattr(loss, 'require_logps', True)`` does)."""
    return word in strings(node)


def calls_function(node, function: str) -> bool:
    return bool(calls(node, function))


def has_param(node, param: str) -> bool:
    return param in {a.arg for a in node.args.args + node.args.kwonlyargs}
