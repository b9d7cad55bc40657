"""bench/tools/core_metrics.py measures this checkout, and its numbers agree with the tools
they restate: the code lines with ``.ci/code_lines.py`` run on the modules packed as a
wheel, the options with the configs, the hooks with the classes, the import graph with
``bench.tools.import_graph``."""

import dataclasses
import importlib
import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from bench.tools import core_metrics

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def measured() -> dict:
    """``python -m bench.tools.core_metrics --json`` on this checkout."""
    done = subprocess.run(
        [sys.executable, "-m", "bench.tools.core_metrics", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout)


def test_the_code_lines_are_the_install_checks(measured, tmp_path):
    wheel = tmp_path / "dobb.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for path in sorted((ROOT / "dobb").rglob("*.py")):
            z.write(path, str(path.relative_to(ROOT)))
    unbounded = [f"--max-{k}={10**9}" for k in ("total", "module", "function")]
    done = subprocess.run(
        [sys.executable, ".ci/code_lines.py", str(wheel), *unbounded],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    modules, total = re.search(
        r"holds (\d+) Python modules, (\d+) code lines", done.stdout
    ).groups()
    lines = measured["code_lines"]
    assert (len(lines["modules"]), lines["total"]) == (int(modules), int(total))
    assert sum(lines["modules"].values()) == lines["total"]


def test_the_options_are_the_configs_fields(measured):
    from dobb.registry import OPTIMIZERS

    classes = {
        e.cls
        for e in OPTIMIZERS.values()
        if dataclasses.is_dataclass(getattr(e.cls, "Config", None))
    }
    options = measured["options"]
    per = options["per_optimizer"]
    assert set(per) == {c.__name__ for c in classes}
    for cls in classes:
        fields = [f.name for f in dataclasses.fields(cls.Config)]
        assert per[cls.__name__]["options"] == len(fields)
        assert set(per[cls.__name__]["own_options"]) <= set(fields)
        assert all(options["counts"][f] >= 1 for f in fields)  # its field, at least
        mean = sum(options["counts"][f] for f in fields) / len(fields)
        assert per[cls.__name__]["mean"] == round(mean, 2)
    assert options["mean"] == round(sum(options["counts"].values()) / len(options["counts"]), 2)


def test_the_hooks_are_the_base_classes_methods(measured):
    """The base is a class of dobb that every matrix optimizer derives from (today
    ``MatrixOptimizer``); each hook is one of its methods, overridden by the subclasses
    listed and no other."""
    from dobb.registry import OPTIMIZERS

    hooks = measured["hooks"]
    module, _, name = hooks["base"].rpartition(".")
    base = getattr(importlib.import_module(module), name)
    matrix = [e.cls for e in OPTIMIZERS.values() if hasattr(e.cls, "Config")]
    assert module.startswith("dobb.") and all(issubclass(c, base) for c in matrix)
    subclasses = {c.__name__: c for c in _subclasses(base)}
    assert set(hooks["subclasses"]) == set(subclasses)
    assert hooks["hooks"], "a base class with no hook: say what the tool should measure"
    for name, overriders in hooks["hooks"].items():
        assert name in vars(base) and not name.startswith("__")
        assert overriders == [c for c in hooks["subclasses"] if name in vars(subclasses[c])]


def _subclasses(cls: type) -> set[type]:
    found = set()
    for sub in cls.__subclasses__():
        found |= {sub, *_subclasses(sub)}
    return {c for c in found if c.__module__.startswith("dobb.")}


def test_the_longest_function_and_the_import_graph(measured):
    function = measured["longest"]["function"]
    path, name = function["name"].split(":")
    lengths = core_metrics.code_lines.function_lengths((ROOT / path).read_text())
    assert lengths[name] == function["lines"]
    graph = core_metrics.import_graph
    edges = graph.import_edges(ROOT)
    inner = [e for e in edges if e[1] in graph.modules(ROOT)]
    assert measured["imports"]["edges"] == len(inner)
    assert measured["imports"]["modules"] == len(graph.modules(ROOT))


def test_written_counts_code_not_docstrings_or_comments():
    source = '''"""lr in the module docstring."""
def f(lr, group):
    """lr in a docstring."""
    # lr in a comment
    x = group["lr"] + group.lr + g(lr=lr)
    return f"{lr}"
'''
    # the parameter, the string key, the attribute, the keyword and its value; not the
    # f-string, the docstrings or the comment
    assert core_metrics.written(source)["lr"] == 5
