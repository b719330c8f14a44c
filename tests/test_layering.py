"""fpemu's imports run one way: every module's imports (function-level ones included) are parsed, and an
import into a higher layer or an import cycle fails, naming the modules.

Data flows spec or recorded run -> scenario -> reference model or real adapter -> trace -> comparison ->
report; the layers below are that flow, written once.  KNOWN lists the upward imports and cycles that
were there when this test came (issue 22's redesign removes them): one fixed must leave the list, and any
new one fails.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "fpemu"

# Low to high: a module may import its own layer and the layers before it.
LAYERS = (
    ("base", ("fpemu.version", "fpemu.errors", "fpemu.fileio", "fpemu.figures", "fpemu.host", "fpemu.jax_states",
              "fpemu.framework_logs",
              "fpemu.environments")),  # environments: isolated Pythons that adapters and the matrix run in
    ("core", ("fpemu.formats", "fpemu.blocks", "fpemu.scalers", "fpemu.steps", "fpemu.ranks", "fpemu.strategies")),
    ("traces", ("fpemu.traces",)),
    ("runs", ("fpemu.audits", "fpemu.recorders", "fpemu.emulate")),  # a user's own code, run, recorded, audited
    ("adapters", ("fpemu.adapters",)),  # the real implementations, described and driven
    ("compare", ("fpemu.compare",)),
    ("kinds", ("fpemu.kinds",)),  # scenario kinds: spec schema, reference model, recorder, explanation
    ("specs", ("fpemu.specs",)),  # spec files -> the scenario of their kind
    ("harness", ("fpemu.harness",)),
    ("reports", ("fpemu.reports",)),
    ("entry points", ("fpemu.cli", "fpemu.pytest_plugin", "fpemu.__main__", "fpemu")),
)

# (importer, imported) pairs that run upward, and the cycles (as sorted module tuples), left to remove.
KNOWN_UPWARD = set()
KNOWN_CYCLES = set()


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in PACKAGE.rglob("*.py")}


def _imported(module: str, node) -> list:
    """The fpemu modules one import statement names (``from pkg import name`` names pkg.name where that is a
    module, else pkg)."""
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    else:
        base = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
        for _ in range(max(node.level - 1, 0)):
            base = base.rpartition(".")[0]
        target = (base + ("." + node.module if node.module else "")) if node.level else node.module
        targets = [f"{target}.{alias.name}" if f"{target}.{alias.name}" in MODULES else target for alias in node.names]
    found = []
    for target in targets:
        while target not in MODULES and "." in target:
            target = target.rpartition(".")[0]
        if target in MODULES and target != module:
            found.append(target)
    return found


def import_graph() -> dict:
    """module -> the fpemu modules it imports anywhere in its body."""
    graph = {}
    for module, path in MODULES.items():
        nodes = ast.walk(ast.parse(path.read_text(), str(path)))
        graph[module] = {t for node in nodes if isinstance(node, (ast.Import, ast.ImportFrom))
                         for t in _imported(module, node)}
    return graph


def layer_of(module: str) -> int:
    matches = [(len(prefix), index) for index, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes
               if module == prefix or module.startswith(prefix + ".")]
    assert matches, f"{module}: in no layer of tests/test_layering.py's LAYERS"
    return max(matches)[1]


def cycles(graph: dict) -> set:
    """The strongly connected components of more than one module (Tarjan), as sorted tuples."""
    index, low, stack, on_stack, found = {}, {}, [], set(), set()

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.add(tuple(sorted(component)))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_every_module_has_a_layer():
    for module in MODULES:
        layer_of(module)


def test_no_import_runs_upward():
    graph = import_graph()
    upward = {(module, target) for module, targets in graph.items() for target in targets
              if layer_of(target) > layer_of(module)}
    new = sorted(upward - KNOWN_UPWARD)
    assert not new, "imports into a higher layer: " + "; ".join(
        f"{m} ({LAYERS[layer_of(m)][0]}) imports {t} ({LAYERS[layer_of(t)][0]})" for m, t in new)
    assert not KNOWN_UPWARD - upward, f"fixed, take them out of KNOWN_UPWARD: {sorted(KNOWN_UPWARD - upward)}"


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found - KNOWN_CYCLES, f"import cycles: {sorted(found - KNOWN_CYCLES)}"
    assert not KNOWN_CYCLES - found, f"gone, take them out of KNOWN_CYCLES: {sorted(KNOWN_CYCLES - found)}"


def test_the_analysis_sees_function_level_imports():
    """A lazy import that dodges a cycle is still a cycle."""
    graph = import_graph()
    assert "fpemu.kinds" in graph["fpemu.harness.matrix"]  # imported inside a function
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == {("a", "b", "c")}


def _package(module: str) -> str:
    """The package a module belongs to for privacy: fpemu.<first part> (fpemu itself for its top-level modules)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 and (PACKAGE / parts[1]).is_dir() else "fpemu"


def private_imports() -> list:
    """(importer, what) for every import of a private module or name (a ``_`` part) from another package."""
    found = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom) or node.level or not (node.module or "").startswith("fpemu"):
                continue
            for alias in node.names:
                named = f"{node.module}.{alias.name}"
                private = any(part.startswith("_") and not part.startswith("__") for part in named.split(".")[1:])
                if private and _package(node.module) != _package(module):
                    found.append((module, named))
    return found


def test_no_private_name_is_imported_across_packages():
    assert not private_imports(), "private names imported from another package: " + "; ".join(
        f"{m} imports {n}" for m, n in private_imports())
