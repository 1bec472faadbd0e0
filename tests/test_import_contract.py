"""The layering of acb, read off its folders and checked on the source of every module:
each folder of acb/ is a layer (:data:`LAYER_ORDER`, bottom first) and a module imports only
from its own layer or one below; the import graph has no cycle; the core (acb/core/) is plain
Python (no torch); the kernels import nothing of acb; integrations use only the public API;
nothing but tests and ``acb serve --tiny`` imports acb.testing; the top-level modules other than
``acb/__init__.py`` are public names only (re-exports, nothing defined), and no layer imports them;
no module reads another module's private attributes; the facades export what acb reads through
them; no module is over 450 lines, no class over 350. See docs/design.md, "The layout"."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ACB = ROOT / "acb"

# The layers, bottom first: each is a folder of acb/ (docs/design.md says what each holds).
LAYER_ORDER = ["kernels", "core", "attention", "model", "worker", "distributed", "engine", "integrations",
               "serving", "testing"]
# Imports that go up a layer on purpose, each with its reason:
# `acb serve --tiny` builds a test engine (imported inside the function that needs it)
UPWARD_ALLOWED = {("acb.serving.model_source", "acb.testing")}  # --tiny (acb serve, acb run-batch)
# beside the public API, integrations may use the throughput log of ``acb serve`` (plain Python)
SHARED_WITH_INTEGRATIONS = {"acb.core.progress"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in ACB.rglob("*.py")}


def _import_time_nodes(tree: ast.Module) -> list[ast.AST]:
    """The statements run when the module is imported: not function bodies, not ``if TYPE_CHECKING:``."""
    nodes, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        nodes.append(node)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo += node.orelse
        elif isinstance(node, (ast.If, ast.Try, ast.With, ast.ClassDef)):
            todo += [n for n in ast.iter_child_nodes(node) if isinstance(n, ast.stmt)]
    return nodes


def imported_modules(path: Path, at_import: bool = False) -> set[str]:
    """The names ``path`` imports, as written (relative ones keep their dots); with
    ``at_import``, only those imported when the module itself is."""
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in _import_time_nodes(tree) if at_import else ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            prefix = "." * node.level + (node.module or "")
            names.update(f"{prefix}.{alias.name}" if node.module else prefix + alias.name for alias in node.names)
    return names


def acb_imports(path: Path, at_import: bool = False) -> set[str]:
    """The acb modules ``path`` imports (absolute names; ``from .x import name`` counts as x)."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    modules = all_modules()
    found = set()
    for name in imported_modules(path, at_import):
        if name.startswith("."):
            level = len(name) - len(name.lstrip("."))
            rest = name[level:]
            name = ".".join(package[: len(package) - level + 1] + ([rest] if rest else []))
        if name != "acb" and not name.startswith("acb."):
            continue
        while name not in modules:  # an attribute of a module: the module
            name = name.rpartition(".")[0]
        found.add(name)
    return found


def imports_torch(path: Path) -> bool:
    """Whether importing ``path`` imports torch."""
    return any(n == "torch" or n.startswith("torch.") for n in imported_modules(path, at_import=True))


def layer_of(module: str) -> str:
    """The layer (folder) of ``module``: ``"api"`` for acb's own top-level modules."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (ACB / parts[1]).is_dir()) else "api"


def rank(module: str) -> int:
    layer = layer_of(module)
    return len(LAYER_ORDER) if layer == "api" else LAYER_ORDER.index(layer)


def test_the_folders_are_the_layers():
    folders = {p.name for p in ACB.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(LAYER_ORDER), "a new folder of acb/ is a new layer: place it in LAYER_ORDER"
    strays = [p.name for p in ACB.iterdir() if p.is_dir() and any(p.glob("*.py")) and p.name not in folders]
    assert strays == []


@functools.cache
def graph() -> dict[str, set[str]]:
    """Every acb module -> the acb modules it imports (at import time, in functions or for types)."""
    return {name: acb_imports(path) - {name} for name, path in all_modules().items()}


def test_no_module_imports_from_a_layer_above_its_own():
    upward = [f"{m} ({layer_of(m)}) imports {t} ({layer_of(t)})"
              for m, targets in graph().items() if m != "acb" for t in targets
              if t != "acb" and rank(t) > rank(m) and (m, t) not in UPWARD_ALLOWED]
    assert upward == []


def test_the_import_graph_has_no_cycle():
    # Tarjan's strongly connected components over all imports, lazy and type-only ones included
    g = {m: {t for t in ts if t != "acb"} for m, ts in graph().items()}
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(g):
        if v not in index:
            visit(v)
    assert cycles == []


def test_the_top_level_modules_are_public_names_only():
    """acb/serving/cli.py, loading.py, tools.py, reasoning.py: the paths users import, re-exporting a
    layer's module; nothing is defined there, and no layer imports them."""
    for path in ACB.glob("*.py"):
        if path.name == "__init__.py":
            continue
        for node in ast.parse(path.read_text()).body:
            assert isinstance(node, (ast.Import, ast.ImportFrom, ast.Expr, ast.If)) or (
                isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "__all__"), \
                f"{path.name}:{node.lineno} defines something: it belongs in a layer's folder"
    facades = {m for m in all_modules() if layer_of(m) == "api" and m != "acb"}
    users = [f"{m} imports {t}" for m, ts in graph().items() if layer_of(m) != "api" for t in ts & facades]
    assert users == []


@pytest.mark.parametrize("module", sorted(m for m in all_modules() if layer_of(m) == "core"))
def test_the_core_is_plain_python(module):
    assert not imports_torch(all_modules()[module])


@pytest.mark.parametrize("module", sorted(m for m in all_modules() if layer_of(m) == "kernels"))
def test_kernels_import_nothing_of_acb(module):
    assert {m for m in graph()[module] if layer_of(m) != "kernels"} == set()


@pytest.mark.parametrize("module", sorted(m for m in all_modules() if layer_of(m) == "integrations"))
def test_integrations_use_only_the_public_api(module):
    public = {f"acb.{n}" for n in _public_names()}
    for name in imported_modules(all_modules()[module]):
        if name.startswith("..") or name.startswith("acb."):
            full = "acb." + name.removeprefix("acb.").removeprefix("..") if name != ".." else "acb"
            module = full if full in all_modules() else full.rpartition(".")[0]
            assert module in {"acb"} | public | SHARED_WITH_INTEGRATIONS or module.startswith("acb.integrations"), name


def test_library_code_does_not_import_acb_testing():
    offenders = [f"{m} imports {t}" for m, ts in graph().items() if layer_of(m) != "testing" for t in ts
                 if layer_of(t) == "testing" and (m, "acb.testing") not in UPWARD_ALLOWED]
    assert offenders == []


def _public_names() -> set[str]:
    tree = ast.parse((ACB / "__init__.py").read_text())
    return set(next(ast.literal_eval(node.value) for node in tree.body
                    if isinstance(node, ast.Assign) and node.targets[0].id == "__all__"))


def _private_members(tree: ast.AST) -> set[str]:
    """The private attributes and methods a module's classes define (``self._x = ...``, ``def _x``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            names.update(item.name for item in node.body
                         if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name.startswith("_"))
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
              and isinstance(node.value, ast.Name) and node.value.id == "self"):
            names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.endswith("__")}


def test_no_module_reads_another_modules_private_attributes():
    trees = {p: ast.parse(p.read_text()) for p in ACB.rglob("*.py")}
    own = {p: _private_members(t) for p, t in trees.items()}
    everyone = set().union(*own.values())
    reach_ins = [f"{p.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}"
                 for p, tree in trees.items() for node in ast.walk(tree)
                 if isinstance(node, ast.Attribute) and node.attr in everyone - own[p]
                 and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))]
    assert reach_ins == []


def test_tests_reach_the_engine_internals_only_through_acb_testing():
    """``acb.testing.runner_of`` / ``step_counts`` are the seam (docs/testing.md)."""
    files = [*(ROOT / "tests").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")]
    offenders = [f"{p.name}:{i}" for p in files if p != Path(__file__).resolve()
                 for i, line in enumerate(p.read_text().splitlines(), 1) if "._runner" in line]
    assert offenders == []


@pytest.mark.parametrize("facade", ["tools", "reasoning"])
def test_the_facades_export_every_name_acb_reads_through_them(facade):
    """``acb.tools.find_tool`` in an integration reads the facade, which has only its layer
    module's ``__all__``: a name missing there is an AttributeError at request time."""
    import importlib

    module = importlib.import_module(f"acb.{facade}")
    exported = set(module.__all__)
    read = {node.attr for path in ACB.rglob("*.py") for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute) and ast.unparse(node.value) == f"acb.{facade}"}
    assert read - exported == set()
    # and it exports every public name of the layer modules it re-exports, each one there
    sources = {node.module for node in ast.parse((ACB / f"{facade}.py").read_text()).body
               if isinstance(node, ast.ImportFrom) and node.level == 1}
    public = set().union(*(importlib.import_module(f"acb.{m}").__all__ for m in sources))
    assert exported == public and all(hasattr(module, name) for name in exported)


# A module over this many lines, or a class over CLASS_LINES, is split along its seams (issue 59):
# a reader holds one module in mind at a time. The native kernels (.cpp, .h) are not Python modules.
MODULE_LINES = 450
CLASS_LINES = 350


def test_no_module_is_over_the_size_limit():
    sizes = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines()) for p in ACB.rglob("*.py")}
    over = {path: n for path, n in sizes.items() if n > MODULE_LINES}
    assert over == {}, f"modules over {MODULE_LINES} lines: split them along their seams"


def test_no_class_is_over_the_size_limit():
    over = [f"{p.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for p in ACB.rglob("*.py") for node in ast.walk(ast.parse(p.read_text()))
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > CLASS_LINES]
    assert over == [], f"classes over {CLASS_LINES} lines: split them along their seams"


def _imports_of(path: Path):
    """(line, module, name or None) of each ``from X import name`` / ``import X`` in ``path``, at any depth."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield from ((node.lineno, node.module, a.name) for a in node.names)
        elif isinstance(node, ast.Import):
            yield from ((node.lineno, a.name, None) for a in node.names)


def _top_level_names(path: Path) -> set[str]:
    """The names a module defines or imports at its top level (what ``from it import name`` finds)."""
    names = set()
    for n in ast.parse(path.read_text()).body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, ast.Assign):
            names |= {t.id for t in n.targets if isinstance(t, ast.Name)}
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            names |= {a.asname or a.name.split(".")[0] for a in n.names}
    return names


def test_the_benchmarks_and_examples_import_only_names_that_exist():
    """A module moved or a helper renamed (``acb.quantization`` -> ``acb.model.quantization``,
    ``systems.load_smollm2`` -> ``load_model``) breaks the scripts that import it inside a function
    only when someone runs them: each acb import of benchmarks/, examples/ and scripts/ (at any depth)
    and each ``from systems import`` / ``from workloads import`` of benchmarks/ must resolve."""
    import importlib

    scripts = [p for d in ("benchmarks", "examples", "scripts") for p in (ROOT / d).rglob("*.py")]
    local = {p.stem: p for p in (ROOT / "benchmarks").glob("*.py")}
    missing = []
    for path in scripts:
        for line, module, name in _imports_of(path):
            where = f"{path.relative_to(ROOT)}:{line}: {module}" + (f".{name}" if name else "")
            if module.split(".")[0] == "acb":
                try:
                    found = importlib.import_module(module)
                except ModuleNotFoundError as e:  # an optional package this environment lacks (ray): unchecked
                    if (e.name or "acb").split(".")[0] == "acb":
                        missing.append(where)
                    continue
                except ImportError:
                    missing.append(where)
                    continue
                if name and not hasattr(found, name):
                    try:
                        importlib.import_module(f"{module}.{name}")
                    except ImportError:
                        missing.append(where)
            elif module in local and name and path.parent == local[module].parent:
                if name not in _top_level_names(local[module]):
                    missing.append(where)
    assert missing == []
