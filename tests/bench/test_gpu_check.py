"""``bench.gpu.check`` (the new phases of ``benchmarks/gpu_calltime.sh``) on CPU tiny shapes:
every phase runs, writes its JSON and, CPU against CPU, agrees with itself exactly; only
the CUDA-only calls (graph capture and replay, the CUDA device) are left to the GPU. The
merged file renders in RESULTS.md's GPU section."""

import json

import pytest
import torch

from bench.gpu import check
from bench.results import eigensolve
from bench.results.sections import gpu_section

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    """The three checks on the CPU, each into its file, then merged into gpu_check.json."""
    out = tmp_path_factory.mktemp("gpu_check")
    names = ["dobb", "adamw", "no-such-optimizer"]
    check.correctness(CPU, out / "correctness.json", steps=2, names=names)
    check.captured(CPU, out / "captured.json", steps=8, repeats=3)
    check.compiled(CPU, out / "compiled.json", steps=2, backend="eager")
    parts = [str(out / f"{name}.json") for name in ("correctness", "captured", "compiled")]
    check.main(["merge", str(out / "gpu_check.json"), *parts, str(out / "absent.json")])
    return out / "gpu_check.json"


def test_correctness_rows_match_cpu_to_cpu_and_record_errors(checks):
    rows = json.loads(checks.read_text())["checks"]["correctness"]["optimizers"]
    assert rows["dobb"]["options"] == {"basis_method": "cholqr"}
    for name in ("dobb", "adamw"):
        assert rows[name]["max_param_diff"] == rows[name]["max_loss_diff"] == 0.0
        assert rows[name]["max_param"] > 0 and len(rows[name]["losses_cpu"]) == 2
    assert rows["no-such-optimizer"]["error"].startswith("ValueError: unknown optimizer")


def test_captured_steps_are_built_for_both_kinds_and_match_eager(checks):
    record = json.loads(checks.read_text())["checks"]["captured"]
    assert record["graphs"] == {"steady": True, "refresh": True}
    assert record["max_loss_diff"] == record["max_param_diff"] == 0.0
    timing = record["timing"]
    assert all(timing[k] > 0 for k in ("steady_replay_s", "refresh_replay_s", "steady_eager_s"))


def test_compiled_tracked_model_counts_breaks_and_the_hooks_share(checks):
    record = json.loads(checks.read_text())["checks"]["compiled"]
    assert isinstance(record["graph_breaks"], int) and record["graphs_at_end"] >= 1
    assert record["max_loss_diff"] == pytest.approx(0.0, abs=1e-5)
    hooks = record["hooks"]
    assert 0 < hooks["forward_backward_s"] and 0 < hooks["forward_backward_hooks_s"]
    assert hooks["share"] < 1


def test_the_merged_checks_render_in_the_gpu_section(checks):
    merged = json.loads(checks.read_text())
    assert merged["missing"] == ["absent"] and not (checks.parent / "captured.json").exists()
    text = gpu_section([checks])
    assert "### GPU checks `gpu_check.json`" in text
    assert "| adamw | 0 |" in text and "unknown optimizer" in text
    assert "graphs captured: steady, refresh" in text
    assert f"{merged['checks']['compiled']['graph_breaks']} graph breaks" in text
    assert "Did not finish: absent." in text


def test_the_solver_rows_are_reported_as_they_go_and_render_with_errors(tmp_path):
    seen = []  # rows done at each on_row call (main rewrites its JSON there)
    rows = eigensolve.benchmark(
        [(8, 2)], "cpu", ("cholqr", "cupy"), repeats=1, on_row=lambda r: seen.append(len(r))
    )
    assert seen == [1, 2]
    data = {"command": "eigensolve", "device_name": "cpu", "torch": "x", "rows": rows}
    (tmp_path / "solvers.json").write_text(json.dumps(data))
    text = gpu_section([tmp_path / "solvers.json"])
    cholqr = next(line for line in text.splitlines() if line.startswith("| cholqr | 8 | 2 |"))
    assert f"| {rows[0]['ops']} | 0 |" in cholqr  # ops, no host read
    assert "| cupy | 8 | 2 | – |" in text and "needs CuPy" in text
