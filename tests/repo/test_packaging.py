"""The package's metadata: the version written once (``dobb.__version__``, which
pyproject.toml reads), and classifiers that an index accepts (``twine check`` does not look
at them; PyPI refuses an upload with an unknown one). The wheel itself is checked by
``make dist`` and ``.ci/install_check``."""

import ast
import tomllib
from pathlib import Path

import pytest
from packaging.version import Version

import dobb

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_version_is_written_once_in_dobb_init():
    project = PYPROJECT["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "dobb.__version__"}
    # setuptools reads the attribute statically, from a literal assignment (torch is not
    # installed where the wheel is built): exactly one, and the value dobb has
    tree = ast.parse((ROOT / "dobb" / "__init__.py").read_text())
    literals = [
        node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and [getattr(t, "id", None) for t in node.targets] == ["__version__"]
        and isinstance(node.value, ast.Constant)
    ]
    assert literals == [dobb.__version__]
    assert str(Version(dobb.__version__)) == dobb.__version__  # PEP 440, normalized


def test_the_classifiers_are_known_to_the_index():
    trove = pytest.importorskip("trove_classifiers")  # the dev extra
    classifiers = PYPROJECT["project"]["classifiers"]
    assert [c for c in classifiers if c not in trove.classifiers] == []
    # PEP 639: the license is the SPDX expression; a license classifier beside it is an error
    assert not [c for c in classifiers if c.startswith("License ::")]
    assert PYPROJECT["project"]["license"] == "MIT"
    assert all((ROOT / f).is_file() for f in PYPROJECT["project"]["license-files"])
