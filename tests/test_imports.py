"""The import rule of shared/DESIGN.md, checked over every import statement of the package
(function-level ones included: a lazy import is still a dependency).

Layers, lowest first: *core* (the IR, plan, cluster, capture, pass runner, dumps) imports only
core; *runtime* imports core and runtime; *passes* import core, runtime (the ops they insert)
and passes, never cost; *cost* imports core, cost and runtime (the launcher that profiles),
never passes; the *front* (compile, the planner and its op-level placement, the CLI, the testing
helpers) may import anything, and nothing below it imports the front. Subpackages belong to the
layer of their package. No two modules import each other, directly or through others.
"""

from __future__ import annotations

import ast
import pathlib

import networkx as nx

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = {"graphpass": "graphpass", "passes": "graphpass.passes", "cost": "graphpass.cost", "runtime": "graphpass.runtime"}
FRONT = {"graphpass", "graphpass.api", "graphpass.planner", "graphpass.cli", "graphpass.testing"}
ALLOWED = {
    "core": {"core"},
    "runtime": {"core", "runtime"},
    "passes": {"core", "runtime", "passes"},
    "cost": {"core", "cost", "runtime"},
    "front": {"core", "runtime", "passes", "cost", "front"},
}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if folder == "graphpass" and parts[0] in PACKAGES:  # graphpass/passes etc. are not there
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((package, *parts))] = path
    return out


def _layer(module: str) -> str:
    if any(module == front or module.startswith(front + ".") for front in FRONT - {"graphpass"}) or module == "graphpass":
        return "front"
    for layer in ("passes", "cost", "runtime"):
        if module == f"graphpass.{layer}" or module.startswith(f"graphpass.{layer}."):
            return layer
    return "core"


def _imports(path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The package modules ``path`` imports (``from graphpass.x import y`` counts as
    ``graphpass.x.y`` when that is a module, else ``graphpass.x``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            names = [n if n in modules else node.module for n in names]
        else:
            continue
        found.update(n for n in names if n in modules)
    return found


def _graph() -> nx.DiGraph:
    modules = _modules()
    graph = nx.DiGraph()
    for module, path in modules.items():
        graph.add_node(module)
        for target in _imports(path, modules):
            # A package's __init__ only re-exports; importing a submodule runs it, but that is
            # not a dependency of the importer on the package's other modules.
            if target != module and not (target in PACKAGES.values() and module.startswith(target + ".")):
                graph.add_edge(module, target)
    return graph


def test_every_module_imports_only_the_layers_below_it():
    bad = [
        f"{src} ({_layer(src)}) imports {dst} ({_layer(dst)})"
        for src, dst in _graph().edges
        if _layer(dst) not in ALLOWED[_layer(src)]
    ]
    assert not bad, "\n".join(bad)


def test_no_module_imports_itself_through_others():
    graph = _graph()
    graph.remove_nodes_from(PACKAGES.values())  # package __init__s re-export their modules
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, cycles


def test_the_checker_sees_a_planted_cycle_and_a_layer_breach(tmp_path, monkeypatch):
    """The rule is not vacuous: the same walk flags what it is meant to flag."""
    modules = {"graphpass.a": tmp_path / "a.py", "graphpass.runtime.b": tmp_path / "b.py"}
    modules["graphpass.a"].write_text("def f():\n    from graphpass.runtime import b\n")
    modules["graphpass.runtime.b"].write_text("from graphpass.a import f\nimport graphpass.passes\n")
    assert _imports(modules["graphpass.a"], modules) == {"graphpass.runtime.b"}
    assert _imports(modules["graphpass.runtime.b"], modules) == {"graphpass.a"}
    assert _layer("graphpass.a") == "core" and "core" in ALLOWED["runtime"] and "runtime" not in ALLOWED["core"]


def test_a_rank_module_loads_neither_the_planner_nor_the_solver():
    """Importing one runtime module runs the package's __init__, which loads its front door lazily:
    a rank (or a tool) that needs ZeRO's gather does not pay for the planner, the solver and
    OR-Tools, and the front door's names still resolve."""
    import subprocess
    import sys

    code = ("import sys; import graphpass.runtime.zero; "
            "print(sorted(m for m in sys.modules if m in ('graphpass.planner', 'graphpass.cost.solver', "
            "'graphpass.api', 'ortools') or m.startswith('ortools.')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]", loaded
    code = ("import graphpass as gp, graphpass.plan, graphpass.capture; "
            "print(gp.plan.__module__, gp.capture.__module__, gp.compile.__module__, gp.save.__module__)")
    names = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert names == ["graphpass", "graphpass.capture", "graphpass.api", "graphpass.runtime.checkpoint"], names
