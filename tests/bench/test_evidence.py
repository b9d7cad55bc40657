"""docs/evidence.md's figures are rendered from the committed JSON (``bench.evidence``): the
committed page is the rendering, and the rendering follows the JSON."""

import json
import re
import shutil

import pytest

from bench import evidence

# what the page reads from benchmarks/ (study.json alone of the study's folder)
INPUTS = [
    "results_run.json",
    "calltime_cpu.json",
    "cpu_calibration.json",
    "sharded",
    "gpu",
    "study/study.json",
]


@pytest.fixture(scope="module")
def rendered() -> str:
    return evidence.render()


def test_the_committed_page_is_the_rendered_one(rendered):
    text = evidence.DOC.read_text()
    assert evidence.rewrite(text) == text, "docs/evidence.md is stale: python -m bench.evidence"
    assert rendered in text


def test_no_continuation_line_starts_a_markdown_list(rendered):
    lines = rendered.splitlines()[1:-1]  # between the markers
    items = [line for line in lines if not line.startswith("  ")]
    assert len(items) == 5 and all(line.startswith("- [benchmarks/") for line in items)
    assert not [line for line in lines if re.match(r"  (\d+[.)]|[-*+]) ", line)]


def test_the_page_follows_the_json(tmp_path, rendered):
    """Change a figure in a copy of the JSON: the rendering changes with it, and only there."""
    for name in INPUTS:
        source, target = evidence.BENCHMARKS / name, tmp_path / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target)
        else:
            shutil.copy(source, target)
    assert evidence.render(tmp_path) == rendered
    run = json.loads((tmp_path / "results_run.json").read_text())
    wall = f"{run['wall_s']:.0f} s on the"
    run["wall_s"] = 4321.2
    (tmp_path / "results_run.json").write_text(json.dumps(run))
    gpu = json.loads((tmp_path / "gpu" / evidence.GPU_RECORD).read_text())
    gpu["optimizers"]["muon"]["call_s"]["median"] = 0.0123
    (tmp_path / "gpu" / evidence.GPU_RECORD).write_text(json.dumps(gpu))
    changed = evidence.render(tmp_path)
    assert " ".join(wall.split()) in " ".join(rendered.split())
    flat = " ".join(changed.split())
    assert "4321 s on the" in flat and "against Muon's 12.3 ms" in flat
    assert changed.count("\n") > 10 and changed != rendered


def test_a_page_without_its_markers_is_refused():
    with pytest.raises(ValueError, match="markers"):
        evidence.rewrite("# Speed, communication, evidence\n\nno markers\n")
