"""Optimizer-call benchmark on a tiny config: every optimizer timed, sane numbers, state
bytes equal to the formulas, Dobb's period holding exactly one refresh."""

import json
import math

import pytest
import torch

from dobb.bench import calltime
from dobb.bench.costmodel import OPTIMIZERS, state_bytes
from dobb.bench.workload import Matrix, hidden_matrices


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    out = tmp_path_factory.mktemp("calltime") / "tiny.json"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # steadier timings; restored below
    try:
        result = calltime.run(
            "tiny", 1, tokens=32, repeats=2, basis_interval=3, num_blocks=4, out=out
        )
    finally:
        torch.set_num_threads(threads)
    result["path"] = out
    return result


def test_every_optimizer_has_positive_finite_call_times(record):
    assert set(record["optimizers"]) == set(OPTIMIZERS)
    for name, entry in record["optimizers"].items():
        spread = entry["call_s"]
        assert 0 < spread["min"] <= spread["q1"] <= spread["median"] <= spread["q3"]
        assert spread["q3"] <= spread["max"] < 10, name
        assert len(entry["amortized_s"]) == 2
    assert record["optimizers"]["dobb"]["ratio_vs_dobb"] == 1.0
    assert all(math.isfinite(e["ratio_vs_dobb"]) for e in record["optimizers"].values())


def test_dobb_period_is_one_refresh_plus_steady_calls(record):
    dobb = record["optimizers"]["dobb"]
    assert [len(p) for p in dobb["period_calls"]] == [3, 3]
    assert {"refresh_call_s", "steady_call_s", "forward_with_hooks_s"} <= set(dobb)
    assert [len(p) for p in record["optimizers"]["muon"]["period_calls"]] == [1, 1]


def test_muonbp_period_is_one_full_step_plus_block_steps(record):
    muonbp = record["optimizers"]["muonbp"]
    assert record["meta"]["period"] == 5 and record["meta"]["row_blocks"] == 4
    assert [len(p) for p in muonbp["period_calls"]] == [5, 5]
    assert {"full_call_s", "block_call_s"} <= set(muonbp)
    assert "MuonBP: full-step call" in calltime.format_table(record)


def test_state_bytes_per_param_match_the_formulas(record):
    matrices = hidden_matrices("tiny", 1)
    numel = sum(m.numel for m in matrices)
    for name, entry in record["optimizers"].items():
        expected = sum(state_bytes(name, m, num_blocks=4) for m in matrices)
        assert entry["state_bytes"] == expected, name
    per_param = {n: e["state_bytes_per_param"] for n, e in record["optimizers"].items()}
    assert per_param["muon"] == 4.0
    assert per_param["adamw"] == pytest.approx(8.0, abs=1e-3)
    # tiny: d = 64, 4 blocks of 16 (d_in = 64) or of 64 (d_in = 256): C_b and Q_b
    blocks = sum(2 * 4 * m.d_in * (m.d_in // 4) for m in matrices)
    assert per_param["dobb"] == pytest.approx(4 + (blocks + 8 * len(matrices)) / numel)
    r = 4  # ceil(64 / 16) for every tiny matrix
    dion = sum(4 * m.d_in * r + 4 for m in matrices)
    assert per_param["dion"] == pytest.approx(4 + dion / numel)


def test_hook_overhead_is_recorded(record):
    hooks = record["hooks"]
    assert hooks["hooks_alone_s"]["median"] > 0
    assert 0 < hooks["share_hooks_alone"] < 1


def test_json_is_written_complete(record):
    saved = json.loads(record["path"].read_text())
    assert saved["meta"]["complete"] and saved["meta"]["config"] == "tiny"
    assert "| dobb |" in calltime.format_table(saved)


def test_linear_stack_gradients_are_cotangent_times_input():
    mats = [Matrix("a.q", 6, 4, "a.ln"), Matrix("a.k", 6, 4, "a.ln"), Matrix("a.fc", 8, 4)]
    stack = calltime.LinearStack(mats, tokens=5)
    calltime.forward_backward(stack, autocast=False)
    for m, layer in zip(mats, stack.layers.values()):
        expected = stack.cotangents[m.d_out].T @ stack.inputs[m.input].detach()
        torch.testing.assert_close(layer.weight.grad, expected)
    assert stack.inputs["a.ln"] is not stack.inputs["a.fc"]  # q and k share; fc has its own


def test_bad_layer_count_raises():
    with pytest.raises(ValueError, match="layers must be in"):
        hidden_matrices("tiny", 3)


def test_basis_method_option_reaches_dobb(tmp_path):
    out = tmp_path / "power_qr.json"
    args = ["--config", "tiny", "--tokens", "16", "--repeats", "1", "--optimizers", "dobb"]
    calltime.main([*args, "--basis-interval", "2", "--basis-method", "power_qr", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["meta"]["complete"] and saved["meta"]["basis_method"] == "power_qr"
    assert calltime.optimizer_overrides("dobb", 4, 2, 0.5, basis_method="power_qr") == {
        "num_blocks": 4,
        "basis_interval": 2,
        "basis_method": "power_qr",
    }
    assert "basis_method" not in calltime.optimizer_overrides("dobb", 4, 2, 0.5)
    assert "basis_method" not in calltime.optimizer_overrides("muon", 4, 2, 0.5, basis_method="x")
    with pytest.raises(ValueError, match="basis_method"):  # Dobb itself rejects the name
        calltime.main([*args, "--basis-method", "no-such-solver"])
