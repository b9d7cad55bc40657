"""The lab's import graph: no import cycles among bench's modules and no import from a lower
layer up (issue #41, item 6), read from the source as dobb's is
(``bench.tools.import_graph``).

The layers, bottom to top (``bench.tools.import_graph.LAYERS["bench"]``): the tools; the
cost model (``bench.model``: its vocabulary, the cost modules, the pricing); the lab's table
of optimizers (``bench.optimizers``, which names each entry's cost module); what runs and
reports the optimizers (``bench.compare``, ``bench.results``, ``bench.gpu``,
``bench.timebudget``); the study, built on the main job; the evidence page, rendered from
every report; the command line and the front. The library is below all of them: bench may
import dobb, never the tests.
"""

from pathlib import Path

from bench.tools.import_graph import LAYERS, cycles, import_edges, layer, modules, upward

ROOT = Path(__file__).resolve().parents[2]
BENCH = LAYERS["bench"]
EDGES = import_edges(ROOT, "bench")


def test_every_lab_module_has_a_layer():
    unplaced = [m for m in modules(ROOT, "bench") if layer(m, BENCH) is None]
    assert not unplaced, "add the module to LAYERS['bench']"


def test_no_import_cycles_in_the_lab():
    assert cycles([edge for edge, runs in EDGES.items() if runs]) == []


def test_no_lab_import_from_a_lower_layer_up():
    assert upward(EDGES, BENCH) == []


def test_the_lab_imports_nothing_of_the_tests():
    assert [(a, b) for a, b in EDGES if b.split(".")[0] == "tests"] == []


def test_an_upward_import_of_the_lab_is_found():
    """The check can fail: the two imports that ran back up before the layers (the cost
    model importing the lab's table, which imports the cost modules; the calibration in the
    cost model importing the call-time measurement) are upward under these layers."""
    assert upward(
        [
            ("bench.model.costmodel", "bench.optimizers"),
            ("bench.model.calibrate", "bench.results.calltime"),
            ("bench.optimizers", "bench.model.costs.dobb"),
        ],
        BENCH,
    ) == [
        ("bench.model.calibrate", "bench.results.calltime"),
        ("bench.model.costmodel", "bench.optimizers"),
    ]
