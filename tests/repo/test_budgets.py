"""The wheel's budgets (issue #33, item 6), held on the source tree: the Python modules under
``dobb/`` (what the wheel ships) hold at most 6,500 code lines in all, none over 400, and no
function is longer than 80 lines. Code lines and function lengths are measured as
``.ci/code_lines.py`` measures the built wheel in ``.ci/install_check``. Nothing is packed
past the formatter to meet them: no ``# fmt: skip`` or ``# fmt: off`` in ``dobb/``."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SPEC = importlib.util.spec_from_file_location("code_lines", ROOT / ".ci" / "code_lines.py")
code_lines = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(code_lines)

# 6,000 until mixtures of experts (issue #42: expert stacks as matrices, Dobb's per-expert
# statistics and their hook protocol, the MoE model of dobb.train) added about 400
MAX_TOTAL, MAX_MODULE, MAX_FUNCTION = 6500, 400, 80
SOURCES = {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "dobb").rglob("*.py"))}


def test_the_wheel_holds_at_most_6500_code_lines():
    total = sum(code_lines.code_lines(source) for source in SOURCES.values())
    assert 0 < total <= MAX_TOTAL, f"dobb/ holds {total} code lines (at most {MAX_TOTAL})"


def test_no_module_over_400_code_lines():
    counts = {name: code_lines.code_lines(source) for name, source in SOURCES.items()}
    big = {name: n for name, n in counts.items() if n > MAX_MODULE}
    assert not big, f"modules over {MAX_MODULE} code lines: {big}"


def test_no_function_over_80_lines():
    long = {
        f"{name}:{function}": n
        for name, source in SOURCES.items()
        for function, n in code_lines.function_lengths(source).items()
        if n > MAX_FUNCTION
    }
    assert not long, f"functions over {MAX_FUNCTION} lines (def to last line): {long}"


def test_no_formatter_exemptions():
    marks = [
        f"{name}:{i}"
        for name, source in SOURCES.items()
        for i, line in enumerate(source.splitlines(), 1)
        if any(f"# fmt: {m}" in line for m in ("skip", "off"))
    ]
    assert not marks, f"code packed past ruff format: {marks}"


def test_a_function_is_measured_from_its_def_to_its_last_line():
    """Decorators are not counted; the docstring, comments, blank lines and nested
    functions are. Methods and nested functions are measured too, by qualified name."""
    source = '''
@decorator
@another(
    1,
)
def f(x):
    """Docstring."""

    # a comment
    def inner():
        return 1

    return x


class C:
    @property
    def g(self):
        return (
            1
        )
'''
    assert code_lines.function_lengths(source) == {"f": 8, "f.inner": 2, "C.g": 4}
