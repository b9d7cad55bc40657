"""The tests share helpers through helper modules, never through each other: no module under
``tests/`` imports a test module (``test_*``), whose import would collect its tests'
module-level set-up into another's and tie the two files' names together. Read from the
source (``bench.tools.import_graph``)."""

from pathlib import Path

from bench.tools.import_graph import import_edges

ROOT = Path(__file__).resolve().parents[2]


def imports_of_tests(root: Path) -> list[tuple[str, str]]:
    """Edges from any module under ``root/tests`` to a module named ``test_*``: the tests'
    own helpers are imported by their bare names (``tests/conftest.py`` and pytest put
    their folders on ``sys.path``)."""
    edges = import_edges(root, "tests")
    return sorted((a, b) for a, b in edges if b.rpartition(".")[2].startswith("test_"))


def test_no_test_module_imports_another():
    assert imports_of_tests(ROOT) == []


def test_an_import_of_a_test_module_is_found(tmp_path):
    (tmp_path / "tests" / "sub").mkdir(parents=True)
    (tmp_path / "tests" / "test_a.py").write_text("X = 1\n")
    (tmp_path / "tests" / "sub" / "test_b.py").write_text("from test_a import X\n")
    (tmp_path / "tests" / "helper.py").write_text("import torch\n")
    assert imports_of_tests(tmp_path) == [("tests.sub.test_b", "test_a")]
