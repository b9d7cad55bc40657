"""Markdown tables: the one helper every report (compare, study, benchmarks) writes through."""

from collections.abc import Iterable, Sequence


def markdown_table(
    headers: Sequence[object],
    rows: Iterable[Sequence[object]],
    align: str | None = None,
    pad: bool = True,
) -> str:
    """A GitHub Markdown table of ``rows`` (cells turned into text with ``str``).

    ``align``: one letter per column, ``"l"`` or ``"r"`` (right-aligned: ``---:``);
    default every column left. ``pad``: pad cells to their column's width, so the source
    reads as a table too; ``False`` writes the compact form (``| a | b |``, ``|---|``).
    """
    headers = [str(h) for h in headers]
    rows = [[str(c) for c in row] for row in rows]
    align = align or "l" * len(headers)
    if len(align) != len(headers) or set(align) - {"l", "r"}:
        raise ValueError(f"align needs one 'l' or 'r' per column, got {align!r}")
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"row {row} has {len(row)} cells for {len(headers)} columns")
    if pad:
        widths = [max(len(c) for c in column) for column in zip(headers, *rows)]
    else:
        widths = [3] * len(headers)

    def line(cells):
        return "| " + " | ".join(c.ljust(w) if pad else c for c, w in zip(cells, widths)) + " |"

    rule = ["-" * w if a == "l" else "-" * max(w - 1, 2) + ":" for w, a in zip(widths, align)]
    if not pad:
        rule = ["---:" if a == "r" else "---" for a in align]
        return "\n".join([line(headers), "|" + "|".join(rule) + "|", *map(line, rows)])
    return "\n".join([line(headers), line(rule), *map(line, rows)])
