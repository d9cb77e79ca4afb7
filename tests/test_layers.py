"""The house's import direction, read from the code (docs/design.md "Layers").

Every module of ``bakeoff/``, ``backends/``, ``adapters/`` and ``evaluations/`` may import only
modules of its own layer or a lower one; ``import`` statements at module level may not form a
cycle. Imports are read in every form: ``import`` and ``from`` (relative ones resolved), and
``importlib.import_module`` / ``__import__`` with a literal name (a computed name is the lazy
registries' business, ``backends/__init__.py``). Imports under ``if TYPE_CHECKING:`` are annotations, not dependencies, and are skipped.
The exceptions are listed in :data:`ALLOWED`, each with its reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("bakeoff", "backends", "adapters", "evaluations", "cli")

# lowest first; a module's layer is the first prefix it matches
LAYERS = [
    ("contracts", ("bakeoff.api", "bakeoff")),
    ("host", ("bakeoff.host", "backends._hosting")),
    ("analysis", ("bakeoff.analysis",)),
    ("models", ("bakeoff.models",)),
    ("loadgen", ("bakeoff.loadgen",)),
    ("reporting", ("bakeoff.reporting",)),
    ("adapters", ("adapters",)),
    ("backends", ("backends",)),
    ("evaluations", ("evaluations",)),
    ("application", ("cli",)),
]

# (importer, imported): why the upward import is right
ALLOWED = {
    ("bakeoff.loadgen.calibrate", "backends.openai.backend"):
        "calibration measures the client through the same openai backend the sweeps use, against "
        "the synthetic server; called from the application and the calibration check only",
    ("bakeoff.models.fixtures.variants", "adapters.awq_int4"):
        "the tiny-qwen3.5-moe-w4a16 fixture is made by bakeoff's own `bakeoff quantize awq` (issue 19), and "
        "fixtures are built on first use by bakeoff.models.resolve; imported inside the builder only",
    ("bakeoff.models.fixtures.variants", "adapters.checkpoint_patches"):
        "the -w4a16-patched fixture is the -w4a16 one with the checkpoint patch the pre-flight names; "
        "imported inside the builder only",
}


def layer(module: str) -> int:
    best, rank = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), i
    assert rank is not None, module
    return rank


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _package(module: str, is_package: bool) -> list[str]:
    """The package a relative import in ``module`` starts from (level 1)."""
    parts = module.split(".") if module else []
    return parts if is_package else parts[:-1]


def _relative(module: str, is_package: bool, level: int, name: str | None) -> str | None:
    """``from ..x import y`` in ``module`` as an absolute name (None when it climbs out of the repo)."""
    base = _package(module, is_package)
    if level - 1 > len(base):
        return None
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else [])) or None


def _dynamic(call: ast.Call) -> str | None:
    """The literal module name of ``importlib.import_module("x")`` / ``import_module("x")`` /
    ``__import__("x")`` (None for any other call or a name computed at run time)."""
    f = call.func
    fname = f.id if isinstance(f, ast.Name) else (f.attr if isinstance(f, ast.Attribute) else None)
    if fname not in ("import_module", "__import__") or not call.args:
        return None
    if isinstance(f, ast.Attribute) and not (isinstance(f.value, ast.Name) and f.value.id == "importlib"):
        return None
    arg = call.args[0]
    return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None


def imports(path: Path, module: str | None = None) -> list[tuple[str, bool]]:
    """``(imported module, at module level)`` for every import of ours in ``path``: ``import``
    and ``from`` statements (relative ones resolved against ``module``, by default the file's own
    name), and ``importlib.import_module`` / ``__import__`` called with a literal name."""
    tree = ast.parse(path.read_text())
    if module is None:
        module = module_name(path) if REPO in path.resolve().parents else ""
    is_package = path.name == "__init__.py"
    out: list[tuple[str, bool]] = []

    def ours(name: str | None) -> bool:
        return bool(name) and name.split(".")[0] in PACKAGES

    def from_import(target: str, names: list[ast.alias], top: bool) -> None:
        if target in PACKAGES or target in MODULES:
            # ``from pkg import sub`` names a module when ``pkg.sub`` is one
            for a in names:
                sub = f"{target}.{a.name}"
                out.append((sub if sub in MODULES else target, top))
        else:
            out.append((target, top))

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                continue
            if isinstance(child, ast.ImportFrom):
                target = child.module if child.level == 0 else _relative(module, is_package, child.level, child.module)
                if ours(target):
                    from_import(target, child.names, top)
            elif isinstance(child, ast.Import):
                out.extend((a.name, top) for a in child.names if ours(a.name))
            elif isinstance(child, ast.Call):
                name = _dynamic(child)
                if name and name.startswith("."):
                    level = len(name) - len(name.lstrip("."))
                    name = _relative(module, is_package, level, name.lstrip(".") or None)
                if ours(name):
                    out.append((name, top))
            nested = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, top and not nested)

    visit(tree, True)
    return out


FILES = sorted(p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py") if "__pycache__" not in p.parts)
MODULES = {module_name(p) for p in FILES}


def _resolve(name: str) -> str:
    """The module an import names (``pkg.mod.attr`` -> ``pkg.mod``)."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def test_no_module_imports_upward():
    bad = []
    for p in FILES:
        me = module_name(p)
        for target, _ in imports(p):
            target = _resolve(target)
            if layer(target) > layer(me) and (me, target) not in ALLOWED:
                bad.append(f"{me} ({LAYERS[layer(me)][0]}) imports {target} ({LAYERS[layer(target)][0]})")
    assert not bad, "imports running the wrong way:\n" + "\n".join(sorted(set(bad)))


def test_no_import_cycle_at_module_level():
    graph = {module_name(p): {_resolve(t) for t, top in imports(p) if top} - {module_name(p)} for p in FILES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def strong(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    assert not cycles, f"module-level import cycles: {cycles}"


def test_the_checker_sees_an_upward_import(tmp_path):
    """The rule is not vacuous: a contract importing the application is caught."""
    src = tmp_path / "x.py"
    src.write_text("from cli.main import main\n\ndef f():\n    from backends.vllm.backend import VllmBackend\n")
    found = [_resolve(t) for t, _ in imports(src)]
    assert found == ["cli.main", "backends.vllm.backend"]
    assert layer("bakeoff.api.specs") < layer("cli.main") and layer("backends.vllm.backend") > layer("bakeoff.host.envs")


PLANTED = {
    "relative": "from ..loadgen.client import OpenAIClient\n",
    "relative, module named": "from .. import loadgen\n",
    "relative, deeper": "def f():\n    from ...backends.vllm import backend\n",
    "importlib.import_module": "import importlib\nimportlib.import_module('cli.main')\n",
    "import_module, relative": "from importlib import import_module\nimport_module('..loadgen.client', __package__)\n",
    "__import__": "def f():\n    return __import__('cli.main')\n",
}


@pytest.mark.parametrize("form", PLANTED)
def test_the_checker_sees_every_form_of_an_upward_import(tmp_path, form):
    """A contract module (``bakeoff.api.planted``) importing the application, the load generator or a
    backend in each form Python has is reported by the same rule as a plain ``import`` (the
    application is a top-level package now: relative forms reach a higher layer of ``bakeoff/``)."""
    src = tmp_path / "planted.py"
    src.write_text(PLANTED[form])
    me = "bakeoff.api.planted"
    found = [_resolve(t) for t, _ in imports(src, module=me)]
    assert found, f"{form}: no import seen in {PLANTED[form]!r}"
    assert all(layer(t) > layer(me) for t in found), (form, found)
    assert found[0] in ("cli.main", "bakeoff.loadgen.client", "bakeoff.loadgen", "backends.vllm.backend"), (form, found)


def test_computed_names_and_other_calls_are_not_imports(tmp_path):
    src = tmp_path / "computed.py"
    src.write_text("import importlib\nname = 'cli.main'\nimportlib.import_module(name)\n"
                   "importlib.import_module(f'cli.{name}')\nobj.import_module('cli.main')\n"
                   "__import__('json')\n")
    assert imports(src, module="bakeoff.api.planted") == []


def test_bakeoff_top_level_holds_folders_only():
    loose = sorted(p.name for p in (REPO / "bakeoff").iterdir() if p.suffix == ".py" and p.name != "__init__.py")
    assert not loose, f"modules at bakeoff/ top level (put them in their layer's folder): {loose}"
