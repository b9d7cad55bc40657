"""The reports re-render byte-identical from the committed JSON (issue #33, "Done when"):
benchmarks/RESULTS.md from the measuring run's JSON (``bench.results.report.render``),
benchmarks/STUDY.md from ``study/study.json`` and the runs' logs
(``bench.study.report.write_document``), and the main job's ``summary.md`` and
``results.json`` from its ``results.json`` and runs (``bench.compare.write_report``), and
benchmarks/gpu/gpu_calltime.md from the GPU run's JSON (``python -m bench.results gpu-table``,
as benchmarks/gpu_calltime.sh writes it; its predicted column is today's cost model); each
renders into a copy of its inputs, so the committed files are never touched. The plots are
rendered too but not compared: matplotlib is not pinned, and its version is in each PNG.
(docs/evidence.md: tests/bench/test_evidence.py.)"""

import json
import shutil
from pathlib import Path

from bench.compare import write_report
from bench.results import gpu_section
from bench.results.report import render
from bench.study.report import write_document
from bench.tools.records import read_record, stamped

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def copy(names: list[str], into: Path) -> None:
    """Copy files and folders of benchmarks/ into ``into``, keeping their paths."""
    for name in names:
        source, target = BENCHMARKS / name, into / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target)
        elif source.exists():
            shutil.copy(source, target)


def test_results_md_is_its_json_rendered(tmp_path):
    copy(
        ["results_run.json", "calltime_cpu.json", "cpu_calibration.json", "sharded", "gpu"],
        tmp_path,
    )
    copy(["COMM.md"], tmp_path)
    written = render(tmp_path)
    assert written.read_text() == (BENCHMARKS / "RESULTS.md").read_text(), (
        'benchmarks/RESULTS.md is not its JSON rendered: python -c "from pathlib import Path; '
        "from bench.results.report import render; render(Path('benchmarks'))\""
    )


def test_study_md_is_study_json_rendered(tmp_path):
    copy(["study"], tmp_path)
    report = json.loads((tmp_path / "study" / "study.json").read_text())
    write_document(report, tmp_path / "study", tmp_path / "STUDY.md")
    assert (tmp_path / "STUDY.md").read_text() == (BENCHMARKS / "STUDY.md").read_text()


def test_the_main_jobs_summary_is_its_json_rendered(tmp_path):
    copy(["compare"], tmp_path)
    out = tmp_path / "compare"
    write_report(out, json.loads((out / "results.json").read_text()))
    for name in ("summary.md", "results.json"):
        assert (out / name).read_text() == (BENCHMARKS / "compare" / name).read_text(), name


def test_the_gpu_table_is_its_json_rendered():
    files = sorted((BENCHMARKS / "gpu").glob("*.json"))
    rendered = gpu_section(files) + "\n"  # as ``gpu-table`` prints it
    assert rendered == (BENCHMARKS / "gpu" / "gpu_calltime.md").read_text(), (
        "benchmarks/gpu/gpu_calltime.md is not its JSON rendered: python -m bench.results "
        "gpu-table benchmarks/gpu/*.json > benchmarks/gpu/gpu_calltime.md"
    )


def test_results_md_renders_alike_from_records_under_the_old_names(tmp_path):
    """Records written before ``dobb2s`` became ``dobb_sign`` (``dobb.registry.RENAMED``):
    the committed JSON with the new name put back renders the same RESULTS.md
    (``bench.tools.records.read_record`` maps the old name on load)."""
    copy(
        ["results_run.json", "calltime_cpu.json", "cpu_calibration.json", "sharded", "gpu"],
        tmp_path,
    )
    copy(["COMM.md"], tmp_path)
    old = 0
    for path in tmp_path.rglob("*.json"):
        text = path.read_text()
        old += text.count("dobb_sign")
        path.write_text(text.replace("dobb_sign", "dobb2s"))
    assert old > 10  # the records do name it
    written = render(tmp_path)
    assert written.read_text() == (BENCHMARKS / "RESULTS.md").read_text()


def test_read_record_renames_keys_values_and_fields_but_not_longer_names(tmp_path):
    path = tmp_path / "old.json"
    record = {
        "dobb2s": {"run": "dobb2s-lr0.008", "command": "--optimizers dobb,dobb2s"},
        "dobb2s_row_blocks": 32,
        "names": ["dobb2s, steady call", "xdobb2s", "dobb2sx"],
    }
    path.write_text(json.dumps(record))
    assert read_record(path) == {
        "dobb_sign": {
            "run": "dobb_sign-lr0.008",
            "command": "--optimizers dobb_paper,dobb_sign",  # the lab's dobb then: the paper's
        },
        "dobb_sign_row_blocks": 32,
        "names": ["dobb_sign, steady call", "xdobb2s", "dobb2sx"],
    }


def test_read_record_reads_the_lab_s_old_dobb_as_the_paper_s_where_it_names_an_optimizer(
    tmp_path,
):
    """A record without ``lab_names`` was written when the lab's "dobb" was the paper's
    configuration: where it names an optimizer (a key, a whole value, a run, an
    ``--optimizers`` list, the ratio's field) it reads ``dobb_paper``; the package's name in
    a command and longer names stay. A stamped record is read as written."""
    record = {
        "optimizers": {"dobb": {"ratio_vs_dobb": 1.0}, "dobb_sign": {"ratio_vs_dobb": 2.5}},
        "best": "dobb",
        "runs": ["dobb-lr0.002", "dobb_sign-lr0.008", "dobbx-lr1"],
        "commands": ["python -m dobb train x", "bench --optimizers dobb,muon --out dobb"],
    }
    path = tmp_path / "old.json"
    path.write_text(json.dumps(record))
    assert read_record(path) == {
        "optimizers": {
            "dobb_paper": {"ratio_vs_dobb_paper": 1.0},
            "dobb_sign": {"ratio_vs_dobb_paper": 2.5},
        },
        "best": "dobb_paper",
        "runs": ["dobb_paper-lr0.002", "dobb_sign-lr0.008", "dobbx-lr1"],
        "commands": ["python -m dobb train x", "bench --optimizers dobb_paper,muon --out dobb"],
    }
    path.write_text(json.dumps(stamped(record)))
    assert read_record(path) == stamped(record)
