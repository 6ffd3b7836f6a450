"""The shape of the code, read from its imports (every import statement, at module level or inside a function):
the user's project sits on the engine, the engine never reaches back into it, nothing imports in a circle, and
inside the engine no module imports one of a higher layer."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# The engine's layers, lowest first: a module imports modules of its own layer or of lower ones only.
LAYERS = [
    ["engine.errors", "engine.console", "engine.launch.environment"],  # leaves: what every module may say
    ["engine.config", "engine.runs", "engine.data", "engine.contract"],  # run dirs, checkpoints, data machinery
    ["engine.strategies", "engine.launch", "engine.loggers", "engine.callbacks", "engine.sweeps", "hydra_plugins"],
    ["engine.build"],  # every component from its config
    ["engine.tasks"],  # what an entry point needs around the user's task
    ["engine.entry", "engine.help", "engine"],  # the command line, and the public API
]


def _modules() -> dict[str, Path]:
    found = {}
    for path in SRC.rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
        found[name] = path
    return found


MODULES = _modules()


def _ours(name: str) -> str | None:
    """The module of this repository that an import of `name` loads (a package's __init__ for a package)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                target = full if full in MODULES else _ours(node.module)
                if target and target != module:
                    found.add(target)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                target = _ours(alias.name)
                if target and target != module:
                    found.add(target)
    return found


GRAPH = {module: _imports(module) for module in MODULES}


def _layer(module: str) -> int:
    best = None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (index, len(prefix))
    assert best is not None, f"{module} belongs to no layer: add it to LAYERS"
    return best[0]


def test_the_engine_never_imports_the_users_project() -> None:
    upward = [
        (m, d) for m, deps in GRAPH.items() if not m.startswith("project") for d in deps if d.startswith("project")
    ]
    assert not upward


def test_no_module_imports_in_a_circle() -> None:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in GRAPH:
        if module not in index:
            visit(module)
    assert not circles


@pytest.mark.parametrize("module", sorted(m for m in MODULES if not m.startswith("project")))
def test_no_engine_module_imports_one_of_a_higher_layer(module: str) -> None:
    higher = [d for d in GRAPH[module] if not d.startswith("project") and _layer(d) > _layer(module)]
    assert not higher, f"{module} (layer {_layer(module)}) imports {higher}"


def _engine_imports_of(module: str) -> list[str]:
    """What a module imports from the engine, as written: `engine` (its public API) or a module path inside it."""
    found = []
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "engine":
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.split(".")[0] == "engine"]
    return found


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.split(".")[0] == "project"))
def test_the_project_uses_the_engine_through_its_public_api_only(module: str) -> None:
    import engine

    inside = [name for name in _engine_imports_of(module) if name != "engine"]
    assert not inside, f"{module} imports {inside}: import what it needs from `engine` (engine.__all__)"
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "engine":
            assert {a.name for a in node.names} <= set(engine.__all__)


def test_every_public_name_of_the_engine_loads_and_importing_it_loads_no_torch() -> None:
    import subprocess
    import sys

    import engine

    for name in engine.__all__:
        assert getattr(engine, name) is not None
    probe = "import sys, engine; assert 'torch' not in sys.modules and 'lightning' not in sys.modules"
    subprocess.run([sys.executable, "-c", probe], check=True)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.split(".")[0] == "project"))
def test_the_project_uses_no_private_api_of_a_library(module: str) -> None:
    """What a user copies is plain: no `x._name` of another object (a private of Lightning, torch, ...), no import of
    a private name or module, and no assignment to another module's attribute (a monkeypatch). Its own
    `self._name` is its business."""
    tree = ast.parse(MODULES[module].read_text())
    imported = {
        (alias.asname or alias.name).split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(f"line {node.lineno}: .{node.attr}")
        if isinstance(node, ast.ImportFrom) and node.module:
            parts = [*node.module.split("."), *(a.name for a in node.names)]
            found += [
                f"line {node.lineno}: import of {p}" for p in parts if p.startswith("_") and not p.startswith("__")
            ]
        if isinstance(node, ast.Assign):
            for target in node.targets:
                root = target
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(target, ast.Attribute) and isinstance(root, ast.Name) and root.id in imported:
                    found.append(f"line {node.lineno}: assigns {ast.unparse(target)}")
    assert not found, f"{module}: {found}"
