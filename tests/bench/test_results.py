"""``python -m bench.results --render``: RESULTS.md from a measuring run's JSON alone."""

import json
import shutil

from bench import results
from bench.results import calibrate, calltime, calltime_sharded
from bench.results.report import CALIBRATION_FILE, CALLTIME_FILE, RUN_FILE
from bench.tools.records import read_record


def refuse(*args, **kwargs):
    raise AssertionError("rendering measured something")


def edit_json(path, edit):
    """Rewrite the JSON in ``path`` by ``edit(data)``."""
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def test_render_writes_the_json_numbers_and_measures_nothing(tmp_path, monkeypatch):
    for module, name in ((calibrate, "calibrate"), (calltime, "run"), (calltime_sharded, "run")):
        monkeypatch.setattr(module, name, refuse)
    monkeypatch.setattr(results, "measure", refuse)
    run = json.loads((results.BENCHMARKS / RUN_FILE).read_text())
    for name in (RUN_FILE, CALIBRATION_FILE, CALLTIME_FILE, *run["sharded"]):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(results.BENCHMARKS / name, tmp_path / name)
    # distinctive numbers in every kind of file, to find in the document
    edit_json(tmp_path / RUN_FILE, lambda r: r.update(date="1999-12-31T23:59:59+00:00"))
    edit_json(tmp_path / CALIBRATION_FILE, lambda hw: hw["rates"].update(gemm_fp32=98765.4e9))
    edit_json(
        tmp_path / CALLTIME_FILE,
        lambda r: r["optimizers"]["dobb_paper"]["call_s"].update(median=0.4321),
    )
    edit_json(tmp_path / run["sharded"][0], lambda r: r.update(command="sharded run 31337"))

    results.main(["--render", "--out-dir", str(tmp_path)])

    text = (tmp_path / "RESULTS.md").read_text()
    assert "- Generated: 1999-12-31T23:59:59+00:00 by `python -m bench.results`" in text
    assert f"by `python -m bench.results --render --out-dir {tmp_path}`" in text
    # as run (the run's record names optimizers as the lab does today: lab_names)
    assert all(
        command in text for command in read_record(results.BENCHMARKS / RUN_FILE)["commands"]
    )
    assert "- fp32 GEMM 98765.4 GFLOP/s (square)" in text
    assert "| dobb_paper | 432.1 |" in text  # the cost-model check against the measured median
    assert "`sharded run 31337`" in text
    assert "## 7. GPU measurements\n\nNo `benchmarks/gpu/*.json` yet" in text


def test_the_state_formula_of_each_timed_optimizer_is_its_measured_state():
    """RESULTS.md section 3 prices each optimizer with the settings its run took (the
    recommended Dobb its own blocks of at most 1,024, not the paper's 16 or dobb_sign's row
    blocks): on the committed record the formula column equals the measured one."""
    from bench.results.sections import state_section

    record = read_record(results.BENCHMARKS / CALLTIME_FILE)
    lines = [x for x in state_section(record).splitlines()[2:] if x.startswith("| ")]
    rows = [line.split("|")[1:4] for line in lines]
    rows = [(n.strip(), measured, formula) for n, measured, formula in rows if "–" not in formula]
    assert "dobb" in {name for name, _, _ in rows}
    for name, measured, formula in rows:
        assert float(formula) == float(measured), name
