"""An import graph read from the source (the AST), not by importing, and the layers the
repository's two packages keep: dobb's (``tests/repo/test_import_graph.py`` holds it to
them) and the lab's (``tests/repo/test_bench_layers.py``). ``bench.tools.core_metrics``
measures a checkout with it.

A module is a file under the package (a package is its ``__init__.py``); an edge
``a -> b`` is an ``import`` or ``from ... import`` in ``a`` naming ``b`` (``from p import m``
names the submodule ``p.m`` if there is one, else ``p``; relative imports are resolved).
The implicit import of a module's parent packages is not an edge: every module would
otherwise depend on ``dobb/__init__.py``, which imports the optimizers. Each edge says
whether it runs when the module is imported (its top level, class bodies, ``if``/``try``
blocks) or later (inside a function): cycles are sought among the first, layers hold for
both (a deferred import is still a dependency).

A layer table lists the layers bottom to top; an entry holds the module of that name and,
but for a package's front (an entry without a dot: ``dobb``, ``bench``), the modules under
it (``dobb.optim`` holds ``dobb.optim.base``); the longest entry holding a module places
it. A module may import from its own layer (no cycle) or any layer below.
"""

import ast
from pathlib import Path

LAYERS: dict[str, list[list[str]]] = {
    # the DTensor shim; the maths and statistics helpers; the distributed primitives; the
    # optimizers; the harness and the integrations; the command line and the package's front
    "dobb": [
        ["dobb._dtensor"],
        ["dobb.eigensolve", "dobb.stats", "dobb.groups"],
        ["dobb.distributed"],
        ["dobb.optim", "dobb.registry"],
        ["dobb.train", "dobb.integrations"],
        ["dobb.cli", "dobb.__main__", "dobb"],
    ],
    # the lab's tools; the cost model (its vocabulary, one cost module per optimizer family,
    # the pricing); the lab's table of optimizers (which names each entry's cost module);
    # what runs and reports the optimizers (the main job, the measurements and RESULTS.md,
    # the GPU checks, the time-budget runs); the study (built on the main job); the
    # evidence page (rendered from every report); the command line and the front
    "bench": [
        ["bench.tools"],
        ["bench.model"],
        ["bench.optimizers"],
        ["bench.compare", "bench.results", "bench.gpu", "bench.timebudget"],
        ["bench.study"],
        ["bench.evidence", "bench.plan"],
        ["bench.cli", "bench.__main__", "bench"],
    ],
}
"""Each package's layers, bottom to top: those its code has."""


def modules(root: Path, package: str = "dobb") -> dict[str, Path]:
    """The modules of ``package`` under ``root`` by dotted name (a package by its name)."""
    found = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(node: ast.AST, at_import: bool):
    """(import node, run when the module is imported) for every import under ``node``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, at_import
        deferred = isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        yield from _imports(child, at_import and not deferred)


def import_edges(root: Path, package: str = "dobb") -> dict[tuple[str, str], bool]:
    """Every edge ``(importer, imported)`` among modules, or from a module of ``package`` to
    an outside top-level name (``torch``, ``bench``), with whether it runs at import time
    (True if any of its imports does)."""
    mods = modules(root, package)
    edges: dict[tuple[str, str], bool] = {}
    for name, path in mods.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node, at_import in _imports(ast.parse(path.read_text()), True):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names
                ]
            for target in targets:
                while target not in mods and "." in target:  # `import a.b.c` of a non-module
                    target = target.rpartition(".")[0]
                if target in mods or target.split(".")[0] != package:
                    key = (name, target)
                    edges[key] = edges.get(key, False) or at_import
    return edges


def cycles(edges) -> list[list[str]]:
    """The import cycles: strongly connected components of more than one module, or a
    module importing itself (Tarjan's algorithm), each sorted."""
    graph: dict[str, list[str]] = {}
    for a, b in edges:
        graph.setdefault(a, []).append(b)
        graph.setdefault(b, [])
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1 or v in graph[v]:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(found)


def layer(module: str, layers: list[list[str]] = LAYERS["dobb"]) -> int | None:
    """The layer of ``module`` in ``layers`` (0: bottom); None if no entry holds it."""
    held = [
        (len(entry), i)
        for i, entries in enumerate(layers)
        for entry in entries
        if module == entry or ("." in entry and module.startswith(entry + "."))
    ]
    return max(held)[1] if held else None


def upward(edges, layers: list[list[str]] = LAYERS["dobb"]) -> list[tuple[str, str]]:
    """The edges from a module to one in a higher layer of ``layers``."""
    found = []
    for a, b in edges:
        low, high = layer(a, layers), layer(b, layers)
        if low is not None and high is not None and high > low:
            found.append((a, b))
    return sorted(found)
