"""The README and the docs link only to files in the repository, and each figure of the
front page's table ("Where it stands") and of the reports' list (docs/evidence.md) is
quoted from a file that the same row or bullet links to."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
LINK = re.compile(r"\]\(([^)\s]+)\)")
# a number on its own (not part of a name such as H200 or gpt2): 836,736  2.2795  +135%  1.64
NUMBER = re.compile(r"(?<![\w.])\d+(?:[,.]\d+)*")
SMALL_COUNTS = ("1", "2", "4")  # ranks, cores, blocks: counts in the prose, not quoted figures


def section(text: str, title: str) -> str:
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def bullets(text: str) -> list[str]:
    """Markdown bullets with their continuation lines joined."""
    items = []
    for line in text.splitlines():
        if line.startswith("- "):
            items.append(line[2:])
        elif items and line.startswith("  "):
            items[-1] += " " + line.strip()
    return items


def table_rows(text: str) -> list[str]:
    """The body rows of the Markdown tables in ``text`` (header and rule rows dropped)."""
    rows = [line for line in text.splitlines() if line.startswith("|")]
    return [r for i, r in enumerate(rows) if i > 1 and not set(r) <= set("|-: ")]


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.name)
def test_relative_links_point_at_files_in_the_repository(page):
    links = [t.split("#")[0] for t in LINK.findall(page.read_text()) if "://" not in t]
    targets = [(page.parent / t).resolve() for t in links if t]
    missing = [str(t.relative_to(ROOT)) for t in targets if not t.exists()]
    assert not missing, f"{page.name} links to files that are not in the repository: {missing}"
    ignored = [t for t in targets if t.relative_to(ROOT).parts[:1] == ("runs",)]
    assert not ignored, f"{page.name} links into runs/, which git ignores: {ignored}"


def test_the_docs_are_linked_from_the_readme():
    linked = {(ROOT / t).resolve() for t in LINK.findall(README.read_text()) if "://" not in t}
    assert DOCS and all(page.resolve() in linked for page in DOCS)


@pytest.mark.parametrize(
    "page, items, least",
    [
        (README, lambda text: table_rows(section(text, "Where it stands")), 8),
        (ROOT / "docs" / "evidence.md", bullets, 4),
        (
            ROOT / "docs" / "evidence.md",
            lambda text: table_rows(section(text, "Where it stands: the full table")),
            8,
        ),
    ],
    ids=["front page", "reports", "the full table"],
)
def test_figures_are_quoted_from_the_linked_files(page, items, least):
    items = items(page.read_text())
    assert len(items) >= least
    for item in items:
        links = LINK.findall(item)
        prose = LINK.sub("]", item)  # link targets are not figures
        numbers = [n for n in NUMBER.findall(prose) if n not in SMALL_COUNTS]
        files = [(page.parent / t) for t in links if "://" not in t]
        files = [f for f in files if f.is_file()]
        if not files:  # a bullet of figures must cite a file, or an outside source
            assert not numbers or any("://" in t for t in links), item
            continue
        sources = "\n".join(f.read_text() for f in files)
        absent = [n for n in numbers if n not in sources]
        assert not absent, f"{absent} not found in {[str(f) for f in files]}: {item}"
