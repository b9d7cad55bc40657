"""dobb's import graph (issue #33): no import cycles among its modules, no import from a
lower layer up, and nothing of the lab (``bench``) or of the tests imported.

The graph is read from the source (the AST), not by importing. A module is a file under
``dobb/`` (a package is its ``__init__.py``); an edge ``a -> b`` is an ``import`` or
``from ... import`` in ``a`` naming ``b`` (``from p import m`` names the submodule ``p.m`` if
there is one, else ``p``; relative imports are resolved). The implicit import of a
module's parent packages is not an edge: every module would otherwise depend on
``dobb/__init__.py``, which imports the optimizers.

- cycles: among the imports run when a module is imported (its top level, class bodies,
  ``if``/``try`` blocks), not those inside functions, which run later;
- layers: every import, inside functions too (a deferred import is still a dependency).

The layers, bottom to top, are those the code has: the DTensor shim; the maths and
statistics helpers; the distributed primitives; the optimizers; the harness and the
integrations; the command line and the package's front (``dobb/__init__.py``). A module may
import from its own layer (no cycle) or any layer below. ``bench/`` may import dobb; dobb
never imports bench.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

LAYERS = [
    ["dobb._dtensor"],
    ["dobb.eigensolve", "dobb.stats", "dobb.groups"],
    ["dobb.distributed"],
    ["dobb.optim", "dobb.registry"],
    ["dobb.train", "dobb.integrations"],
    ["dobb.cli", "dobb.__main__", "dobb"],
]
"""Bottom to top. An entry holds the module of that name and, but for the package's front
``dobb``, the modules under it (``dobb.optim`` holds ``dobb.optim.base``)."""

FOREIGN = ("bench", "tests", "examples")  # the lab, the tests: never imported by dobb
TRAIN_EXTRA = ("numpy", "yaml", "tqdm")  # dobb[train]: the harness's, not the optimizers'


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


def layer(module: str) -> int | None:
    """The layer of ``module`` (0: bottom); None if no entry of ``LAYERS`` holds it."""
    held = [
        (len(entry), i)
        for i, entries in enumerate(LAYERS)
        for entry in entries
        if module == entry or (entry != "dobb" and module.startswith(entry + "."))
    ]
    return max(held)[1] if held else None


def upward(edges) -> list[tuple[str, str]]:
    """The edges from a module to one in a higher layer."""
    return sorted(
        (a, b)
        for a, b in edges
        if layer(b) is not None and layer(a) is not None and layer(b) > layer(a)
    )


EDGES = import_edges(ROOT)


def test_every_module_has_a_layer():
    placed = {m: layer(m) for m in modules(ROOT)}
    assert not [m for m, n in placed.items() if n is None], "add the module to LAYERS"


def test_no_import_cycles():
    at_import = [edge for edge, runs in EDGES.items() if runs]
    assert cycles(at_import) == []


def test_no_import_from_a_lower_layer_up():
    assert upward(EDGES) == []


def test_dobb_imports_nothing_of_the_lab_or_the_tests():
    assert [(a, b) for a, b in EDGES if b.split(".")[0] in FOREIGN] == []


def test_only_the_harness_imports_the_train_extra():
    """The bare wheel (torch alone) holds every optimizer: numpy, yaml and tqdm are imported
    by ``dobb.train`` only, and importing ``dobb`` or ``dobb.cli`` reaches none of them."""
    users = {a for a, b in EDGES if b.split(".")[0] in TRAIN_EXTRA}
    assert users and all(a.startswith("dobb.train.") for a in users), sorted(users)
    at_import = [edge for edge, runs in EDGES.items() if runs]
    for start in ("dobb", "dobb.cli"):
        reached, todo = set(), [start]
        while todo:
            module = todo.pop()
            parents = [module.rsplit(".", i)[0] for i in range(1, module.count(".") + 1)]
            for m in [module, *parents]:  # importing a.b.c runs a and a.b first
                if m not in reached:
                    reached.add(m)
                    todo.extend(b for a, b in at_import if a == m)
        assert not {m.split(".")[0] for m in reached} & set(TRAIN_EXTRA), (start, sorted(reached))


@pytest.fixture
def tree(tmp_path):
    """A package ``dobb`` of four modules: ``dobb.optim.base`` imports ``dobb.stats`` (down),
    ``dobb.stats`` imports ``dobb.optim`` inside a function (up, deferred), and
    ``dobb.optim`` (a package) imports its ``base`` relatively, which imports the package
    back at import time (a cycle)."""
    files = {
        "dobb/__init__.py": "",
        "dobb/stats.py": "import torch\n\n\ndef f():\n    from dobb.optim import base\n",
        "dobb/optim/__init__.py": "from .base import X\n",
        "dobb/optim/base.py": "from dobb import stats\nfrom dobb.optim import Y\nX = 1\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def test_the_graph_finds_cycles_and_upward_imports(tree):
    edges = import_edges(tree)
    assert edges == {
        ("dobb.stats", "torch"): True,
        ("dobb.stats", "dobb.optim.base"): False,
        ("dobb.optim", "dobb.optim.base"): True,
        ("dobb.optim.base", "dobb.stats"): True,
        ("dobb.optim.base", "dobb.optim"): True,
    }
    assert cycles([e for e, runs in edges.items() if runs]) == [["dobb.optim", "dobb.optim.base"]]
    assert cycles(edges) == [["dobb.optim", "dobb.optim.base", "dobb.stats"]]
    assert upward(edges) == [("dobb.stats", "dobb.optim.base")]
