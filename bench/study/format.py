"""How the study's documents spell losses, optimizers, ablations, counts and tables."""

import math
from typing import Any

from bench.study.stats import NOISE_FACTOR
from bench.tools.markdown import markdown_table
from dobb.registry import get_entry

NOISE = f"{NOISE_FACTOR:g} x"  # "2 x": the noise threshold's factor in prose
_WORDS = ("no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")


def fmt_loss(x: float | None) -> str:
    """A loss to 4 decimals; "diverged" for a non-finite one, "-" for none."""
    return "-" if x is None else f"{x:.4f}" if math.isfinite(x) else "diverged"


def title(name: str) -> str:
    """The optimizer's class name: Dobb, MuonBP, ..."""
    return get_entry(name).cls.__name__


def label(row: dict[str, Any]) -> str:
    """An ablation row as `option=value (note)`."""
    return f"{row['option']}={row['value']}" + (f" ({row['note']})" if row["note"] else "")


def in_words(n: int) -> str:
    """A small count in words ("two"); digits from eleven on."""
    return _WORDS[n] if 0 <= n < len(_WORDS) else str(n)


def times(n: int) -> str:
    """How often: "never", "once", "twice", "three times", ..."""
    return {0: "never", 1: "once", 2: "twice"}.get(n, f"{in_words(n)} times")


def table(headers: str, rows: list[str]) -> str:
    """A Markdown table from `|`-separated header and row strings."""
    return markdown_table(headers.split("|"), [row.split("|") for row in rows])
