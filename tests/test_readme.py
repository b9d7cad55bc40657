"""The README links only to files in the repository, and each figure on its front page
("Where it stands") and in its list of reports ("Speed, communication, evidence") is
quoted from a file that the same bullet links to."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
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


def test_relative_links_point_at_files_in_the_repository():
    targets = [t.split("#")[0] for t in LINK.findall(README.read_text()) if "://" not in t]
    assert targets
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert not missing, f"README links to files that are not in the repository: {missing}"
    ignored = [t for t in targets if Path(t).parts[:1] == ("runs",)]
    assert not ignored, f"README links into runs/, which git ignores: {ignored}"


@pytest.mark.parametrize(
    "title, least", [("Where it stands", 6), ("Speed, communication, evidence", 4)]
)
def test_figures_are_quoted_from_the_linked_files(title, least):
    items = bullets(section(README.read_text(), title))
    assert len(items) >= least
    for item in items:
        links = LINK.findall(item)
        prose = LINK.sub("]", item)  # link targets are not figures
        numbers = [n for n in NUMBER.findall(prose) if n not in SMALL_COUNTS]
        files = [ROOT / t for t in links if "://" not in t and (ROOT / t).is_file()]
        if not files:  # a bullet of figures must cite a file, or an outside source
            assert not numbers or any("://" in t for t in links), item
            continue
        sources = "\n".join(f.read_text() for f in files)
        absent = [n for n in numbers if n not in sources]
        assert not absent, f"{absent} not found in {[str(f) for f in files]}: {item}"
