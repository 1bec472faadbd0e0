"""The dependency rules of docs/design.md, checked on the source of every module of acb/:
each module belongs to one layer (a new module must be placed in :data:`LAYERS`), and each
layer imports only what its rules allow. The scheduler and the cache manager are plain
Python (no torch, no runner); the runner and attention code never reach up into the engine
or the integrations; integrations use only the public API; nothing but tests imports
acb.testing; no module reads another module's private attributes."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ACB = ROOT / "acb"

# Every module of acb/, by layer:
# - plain: the request-side core, pure Python over ids and counts (no torch);
# - kernels: leaves, importing nothing of acb's;
# - device: the model runner's side (attention, sampling, kernels' callers, tensor parallel);
# - engine: the loop and what it composes (may import the two above, never the apps);
# - integrations: the serving adapters, on the public API only;
# - app: the `acb` command and its server; testing: acb.testing.
LAYERS = {
    "plain": ["detokenizer.py", "errors.py", "eventloop.py", "handle.py", "kv_cache.py", "kv_events.py",
              "progress.py", "prompt_logprobs.py", "request.py", "scheduler.py", "step.py", "tools.py",
              "reasoning.py", "lifecycle.py", "config.py", "defaults.py", "speculative.py", "sequence.py",
              "run_queues.py", "page_tables.py", "preemption.py", "admission.py", "intake.py"],
    "kernels": ["kernels/__init__.py", "kernels/cpu.py", "kernels/cpu_linear.py", "kernels/triton_attention.py"],
    "device": ["attention.py", "attention_routing.py", "compiling.py", "cuda_graphs.py", "distributed/__init__.py",
               "distributed/group.py", "distributed/protocol.py", "distributed/sharding.py", "distributed/worker.py",
               "block_tables.py", "draft.py", "fast_paths.py", "fused.py", "gguf_int8.py", "kv_quant.py", "kv_store.py",
               "loading.py",
               "model_shape.py", "offload.py", "packing.py", "quantization.py", "runner.py", "sampling.py", "sizing.py",
               "watch.py", "lora.py", "lora_source.py", "fused_lora.py"],
    "engine": ["__init__.py", "adapters.py", "engine.py", "inputs.py", "live.py", "outputs.py", "assembly.py",
               "request_table.py", "step_loop.py", "structured.py", "sync.py"],
    "integrations": ["integrations/__init__.py", "integrations/aiohttp.py", "integrations/common.py",
                     "integrations/metrics.py", "integrations/openai_protocol.py", "integrations/openai_service.py",
                     "integrations/prefix_index.py", "integrations/ray.py", "integrations/ray_http.py",
                     "integrations/ray_prefix.py", "integrations/starlette.py"],
    "app": ["cli.py", "server.py"],
    "testing": ["testing/__init__.py", "testing/attention_cases.py", "testing/inspection.py",
                "testing/pytest_plugin.py"],
}
LAYER_OF = {module: layer for layer, modules in LAYERS.items() for module in modules}
ENGINE_SIDE = {"engine", "outputs", "scheduler", "inputs", "handle", "sync", "progress", "structured", "live",
               "lifecycle", "assembly", "request_table", "step_loop", "speculative", "sequence", "run_queues",
               "page_tables", "preemption", "admission", "intake"}
APPS = {"integrations", "server", "cli", "testing"}
# beside the public API, integrations may use the throughput log of ``acb serve`` (plain Python)
SHARED_WITH_INTEGRATIONS = {"progress"}


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
            names.add(prefix)
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


def test_every_module_belongs_to_a_layer():
    modules = {str(p.relative_to(ACB)) for p in ACB.rglob("*.py")}
    assert modules - LAYER_OF.keys() == set(), "place the new module in a layer of LAYERS"
    assert LAYER_OF.keys() - modules == set(), "LAYERS names a module that is gone"


def _layer(module: str) -> str:
    return LAYER_OF[str(all_modules()[module].relative_to(ACB))]


def _short(module: str) -> str:
    return module.removeprefix("acb.").split(".")[0]


@pytest.mark.parametrize("module", LAYERS["plain"])
def test_the_request_side_core_is_plain_python(module):
    path = ACB / module
    assert not imports_torch(path)
    assert {m for m in acb_imports(path, at_import=True) if _layer(m) != "plain"} == set()


@pytest.mark.parametrize("module", LAYERS["kernels"])
def test_kernels_import_nothing_of_acb(module):
    assert {m for m in acb_imports(ACB / module) if _layer(m) != "kernels"} == set()


@pytest.mark.parametrize("module", LAYERS["device"])
def test_device_side_never_imports_the_engine_side_or_the_apps(module):
    bad = {m for m in acb_imports(ACB / module) if _short(m) in ENGINE_SIDE | APPS}
    assert bad == set()


@pytest.mark.parametrize("module", LAYERS["engine"])
def test_the_engine_never_imports_the_apps(module):
    assert {m for m in acb_imports(ACB / module) if _short(m) in APPS} == set()


@pytest.mark.parametrize("module", LAYERS["integrations"])
def test_integrations_use_only_the_public_api(module):
    public = _public_names()
    for name in imported_modules(ACB / module):
        if name.startswith("..") or name.startswith("acb."):
            top = name.removeprefix("acb.").removeprefix("..")
            assert not top or top in public or top.split(".")[0] in SHARED_WITH_INTEGRATIONS, name


# The apps beside the public API: the server uses the integrations; the CLI starts the
# server, loads models (acb.loading), builds the Ray app, runs torchrun's other ranks
# (acb.distributed) and, for --tiny, a test engine (acb.testing).
APP_ALLOWED = {
    "server.py": {"integrations", "progress"},
    "cli.py": {"server", "loading", "testing", "integrations", "distributed"},
}


@pytest.mark.parametrize("module", LAYERS["app"])
def test_the_apps_use_the_public_api_and_their_named_modules_only(module):
    public = _public_names()
    for name in acb_imports(ACB / module):
        top = _short(name)
        assert name == "acb" or top in public or top in APP_ALLOWED[module], f"{module} imports {name}"


def _public_names() -> set[str]:
    tree = ast.parse((ACB / "__init__.py").read_text())
    return set(next(ast.literal_eval(node.value) for node in tree.body
                    if isinstance(node, ast.Assign) and node.targets[0].id == "__all__"))


def test_library_code_does_not_import_acb_testing():
    offenders = []
    for layer in ("plain", "kernels", "device", "engine", "integrations"):
        offenders += [m for m in LAYERS[layer] if any(_short(n) == "testing" for n in acb_imports(ACB / m))]
    assert offenders == []  # (acb serve --tiny, an app, imports acb.testing lazily)


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
