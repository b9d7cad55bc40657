"""dobb's import graph (issue #33): no import cycles among its modules, no import from a
lower layer up, and nothing of the lab (``bench``) or of the tests imported.

The graph is read from the source (``bench.tools.import_graph``: how, and which imports
count for cycles and which for layers). The layers, bottom to top, are those the code has
(``bench.tools.import_graph.LAYERS["dobb"]``): the DTensor shim; the maths and statistics
helpers; the distributed primitives; the optimizers; the harness and the integrations; the
command line and the package's front (``dobb/__init__.py``). A module may import from its
own layer (no cycle) or any layer below. ``bench/`` may import dobb; dobb never imports
bench.
"""

from pathlib import Path

import pytest

from bench.tools.import_graph import cycles, import_edges, layer, modules, upward

ROOT = Path(__file__).resolve().parents[2]
FOREIGN = ("bench", "tests", "examples")  # the lab, the tests: never imported by dobb
TRAIN_EXTRA = ("numpy", "yaml", "tqdm")  # dobb[train]: the harness's, not the optimizers'

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
