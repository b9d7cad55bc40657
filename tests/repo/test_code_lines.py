"""The wheel's measure (``.ci/code_lines.py``, run by ``.ci/install_check``): lines holding
code, not docstrings, comments or blank lines."""

import importlib.util
from pathlib import Path

SPEC = importlib.util.spec_from_file_location(
    "code_lines", Path(__file__).resolve().parents[2] / ".ci" / "code_lines.py"
)
code_lines = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(code_lines)

SOURCE = '''"""Module docstring,
on two lines."""
import os  # a comment

X = 1
"""X's docstring."""


class C:
    """Class docstring."""

    def f(self, a):
        """Method docstring."""
        # a comment line
        return (a +
                1)
'''


def test_counts_code_lines_only():
    # import, X = 1, class, def, and the return statement's two lines
    assert code_lines.code_lines(SOURCE) == 6


def test_a_string_that_is_code_counts():
    assert code_lines.code_lines('x = """a\nb"""\n') == 2
