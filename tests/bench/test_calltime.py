"""Optimizer-call benchmark on a tiny config: every optimizer timed over whole periods and
summarized from its own samples (no claim on how long a call takes), state bytes equal to
the formulas, Dobb's (and two-sided Dobb's) period holding exactly one refresh; two-sided
Dobb measured without a cost model, through results' tables."""

import json
import math

import pytest
import torch

from bench.model.costmodel import state_bytes
from bench.model.hardware import H100
from bench.model.workload import Matrix, hidden_matrices
from bench.results import calltime, linear_stack
from bench.results import sections as results_sections
from bench.results.calltime import OPTIMIZERS
from bench.tools.timing import spread
from dobb.stats import block_stacks


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


def test_every_optimizer_is_timed_and_summarized_from_its_own_calls(record):
    """What the record computes from its samples, not how long they took: each repeat times
    one whole period (its number of calls), the amortized time is the period's mean, the
    spread is of those means, and the ratio is to Dobb's median."""
    assert tuple(record["optimizers"]) == OPTIMIZERS  # the cost model's optimizers
    assert OPTIMIZERS[:3] == ("dobb_paper", "dobb", "dobb_sign")
    meta = record["meta"]
    options = {"basis_interval": meta["basis_interval"], "period": meta["period"]}
    dobb_median = record["optimizers"]["dobb_paper"]["call_s"]["median"]
    for name, entry in record["optimizers"].items():
        periods = entry["period_calls"]
        assert len(periods) == meta["repeats"] == 2, name
        calls = calltime.calls_per_period(name, options, calls=meta["calls"])
        assert [len(p) for p in periods] == [calls, calls], name
        assert all(t > 0 and math.isfinite(t) for p in periods for t in p), name
        assert entry["amortized_s"] == [sum(p) / len(p) for p in periods], name
        assert entry["call_s"] == spread(entry["amortized_s"]), name
        assert entry["ratio_vs_dobb_paper"] == entry["call_s"]["median"] / dobb_median, name
    assert record["optimizers"]["dobb_paper"]["ratio_vs_dobb_paper"] == 1.0


@pytest.mark.parametrize("name", ["dobb_paper", "dobb_sign"])
def test_dobb_period_is_one_refresh_plus_steady_calls(record, name):
    dobb = record["optimizers"][name]
    assert [len(p) for p in dobb["period_calls"]] == [3, 3]
    assert {"refresh_call_s", "steady_call_s", "forward_with_hooks_s"} <= set(dobb)
    assert len(dobb["forward_s"]) == 2 * 3  # a forward (statistics) before every call
    assert [len(p) for p in record["optimizers"]["muon"]["period_calls"]] == [1, 1]


def test_dobb_sign_refresh_call_is_periodic_as_dobbs():
    options = {"basis_interval": 7, "period": 5}
    assert calltime.calls_per_period("dobb_sign", options, calls=1) == 7
    assert calltime.periodic_calls("dobb_sign") == calltime.periodic_calls("dobb_paper")
    assert calltime.periodic_calls("dobb_sign") == ("refresh_call_s", "steady_call_s")
    assert calltime.periodic_calls("muon") is None
    assert calltime.calls_per_period("muon", options, calls=2) == 2
    # the first call of each period is the refresh: summarize splits it off
    res = {"period_calls": [[0.5, 0.1, 0.2]], "amortized_s": [0.8 / 3], "forward_s": []}
    params = [torch.ones(1, requires_grad=True)]
    out = calltime.summarize({"dobb_sign": res}, {"dobb_sign": torch.optim.SGD(params)}, params)
    assert out["dobb_sign"]["refresh_call_s"]["median"] == 0.5
    assert out["dobb_sign"]["steady_call_s"]["median"] == pytest.approx(0.15)


def test_each_timed_period_opens_with_the_call_the_library_schedules(monkeypatch):
    """``periodic_flags`` reads the library's schedule (Dobb refreshes at calls 1, 1 + k,
    ...; MuonBP's full steps at 1, 1 + P, ...; Muon has no periodic work), and a timed period
    that would not open with its one periodic call is refused, not mislabelled."""
    options = {"basis_interval": 3, "period": 5}
    assert calltime.periodic_flags("dobb_paper", options, 4, 3) == [True, False, False]
    assert calltime.periodic_flags("dobb_sign", options, 2, 3) == [False, False, True]
    assert calltime.periodic_flags("muonbp", options, 6, 5) == [True] + [False] * 4
    assert calltime.periodic_flags("muon", options, 1, 2) == [False, False]
    stack = linear_stack.LinearStack([Matrix("w", 8, 16)], tokens=8)
    linear_stack.forward_backward(stack, autocast=False)
    monkeypatch.setattr(calltime, "periodic_flags", lambda *args: [False, True, False])
    with pytest.raises(RuntimeError, match="do not open with its one periodic call"):
        calltime.time_optimizers(stack, ("dobb_paper",), repeats=1, basis_interval=3, num_blocks=4)


def test_dobb_sign_takes_dobbs_options_and_its_row_blocks():
    assert calltime.DOBB_SIGN_ROW_BLOCKS == 32
    assert calltime.optimizer_overrides("dobb_sign", 4, 2, 0.5, basis_method="power_qr") == {
        "num_blocks": 4,
        "basis_interval": 2,
        "basis_method": "power_qr",
        "block_size": None,
        "row_blocks": 32,
    }
    # row_blocks= of the call is MuonBP's, not two-sided Dobb's
    assert calltime.optimizer_overrides("dobb_sign", 4, 2, 0.5, row_blocks=4)["row_blocks"] == 32


def test_muonbp_period_is_one_full_step_plus_block_steps(record):
    muonbp = record["optimizers"]["muonbp"]
    assert record["meta"]["period"] == 5 and record["meta"]["row_blocks"] == 4
    assert [len(p) for p in muonbp["period_calls"]] == [5, 5]
    assert {"full_call_s", "block_call_s"} <= set(muonbp)
    assert "MuonBP: full call" in calltime.format_table(record)


def test_state_bytes_per_param_match_the_formulas(record):
    matrices = hidden_matrices("tiny", 1)
    numel = sum(m.numel for m in matrices)
    meta = record["meta"]
    knobs = {k: meta[k] for k in ("num_blocks", "basis_interval", "rank_fraction", "period")}
    for name, entry in record["optimizers"].items():
        options = calltime.optimizer_overrides(name, **knobs)  # as it was timed
        expected = sum(state_bytes(name, m, **options) for m in matrices)
        assert entry["state_bytes"] == expected, name
    per_param = {n: e["state_bytes_per_param"] for n, e in record["optimizers"].items()}
    assert per_param["muon"] == 4.0
    assert per_param["adamw"] == pytest.approx(8.0, abs=1e-3)
    # tiny: d = 64, 4 blocks of 16 (d_in = 64) or of 64 (d_in = 256): C_b and Q_b
    blocks = sum(2 * 4 * m.d_in * (m.d_in // 4) for m in matrices)
    assert per_param["dobb_paper"] == pytest.approx(4 + (blocks + 8 * len(matrices)) / numel)
    # two-sided: plus P_r and its moments, 32 row blocks of d_out / 32 rows (2 or 8)
    rows = sum(2 * 4 * m.d_out * (m.d_out // 32) for m in matrices)
    assert per_param["dobb_sign"] == pytest.approx(per_param["dobb_paper"] + rows / numel)
    # the recommended Dobb: one input block and one row block of each whole matrix (all at
    # most 1,024 wide), V beside the momentum
    whole = sum(2 * 4 * (m.d_in**2 + m.d_out**2) for m in matrices)
    assert per_param["dobb"] == pytest.approx(8 + (whole + 8 * len(matrices)) / numel)
    r = 4  # ceil(64 / 16) for every tiny matrix
    dion = sum(4 * m.d_in * r + 4 for m in matrices)
    assert per_param["dion"] == pytest.approx(4 + dion / numel)


@pytest.mark.parametrize("key", ["hooks", "hooks_recommended"])
def test_hook_overhead_is_recorded(record, key):
    """The hooks' share is computed from the recorded medians (whatever they measured), for
    the paper's blocks and, since the recommended configuration is timed, for its blocks;
    the table reports both."""
    hooks = record[key]
    alone, plain = hooks["hooks_alone_s"]["median"], hooks["forward_backward_s"]["median"]
    assert alone > 0 and plain > 0
    assert hooks["share_hooks_alone"] == alone / (plain + alone)
    hooked = hooks["forward_backward_hooks_s"]["median"]
    assert hooks["share_difference"] == (hooked - plain) / hooked
    which = "the paper's" if key == "hooks" else "the recommended"
    assert f"Statistics hooks, 4 input blocks ({which})" in calltime.format_table(record) or (
        key == "hooks_recommended"
        and "Statistics hooks, input blocks of at most 1,024 columns (the recommended)"
        in calltime.format_table(record)
    )


def test_the_recommended_hooks_cut_the_library_s_blocks():
    """Blocks of at most BLOCK_WIDTH columns where no count is given, as Dobb's defaults:
    1,600 columns make 2 blocks of 800, 6,400 make 7; a count is kept."""
    for width, count in ((1600, 2), (6400, 7), (64, 1)):
        assert linear_stack.input_blocks(width, None) == block_stacks(width, count)
    assert linear_stack.input_blocks(1600, 16) == block_stacks(1600, 16)


def test_json_is_written_complete(record):
    saved = json.loads(record["path"].read_text())
    assert saved["meta"]["complete"] and saved["meta"]["config"] == "tiny"
    assert saved["meta"]["dobb_sign_row_blocks"] == 32
    table = calltime.format_table(saved)
    assert "| dobb_paper |" in table and "| dobb_sign | 3 |" in table
    assert (
        "\nDobb (recommended): refresh call" in table and "\nTwo-sided Dobb: refresh call" in table
    )


def test_results_tables_predict_dobb_sign_and_every_periodic_call(record):
    table, ratios = results_sections.check_table(record, H100)
    rows = table.splitlines()[2:]  # below the header and the rule
    assert len(ratios) == len(rows)  # every row has a prediction
    labels = [r.split("|")[1].strip() for r in rows]
    for name, (periodic, other) in (
        ("dobb_paper", ("refresh", "steady")),
        ("dobb_sign", ("refresh", "steady")),
        ("muonbp", ("full", "block")),
    ):
        assert labels.index(name) + 1 == labels.index(f"{name}, {other} call")
        assert labels.index(name) + 2 == labels.index(f"{name}, {periodic} call")
    (row,) = [r for r in rows if r.startswith("| dobb_sign |")]
    assert row.split("|")[3].strip() != "–"
    assert "dobb_sign" in results_sections.calltime_section(record)
    lines = results_sections.state_section(record).splitlines()
    (state,) = [line for line in lines if line.startswith("| dobb_sign |")]
    measured, expected, formula = (cell.strip() for cell in state.split("|")[2:5])
    assert float(measured) == pytest.approx(float(expected), abs=1e-4)
    assert float(expected) > float(
        next(x for x in lines if x.startswith("| dobb_paper |")).split("|")[3]
    )
    assert "8 m / d_in (P_r and its moments)" in formula


def test_results_tables_tolerate_any_optimizer_without_a_model(record):
    """A measured optimizer unknown to the cost model and to the registry (a record from
    elsewhere) gets a measured-only row, not a KeyError or ValueError; BlockMuon, which the
    cost model does not time, still has its state formula (its registry entry's model)."""
    other = {**record, "optimizers": {**record["optimizers"]}}
    other["optimizers"]["signum"] = record["optimizers"]["muonbp"]
    other["optimizers"]["blockmuon"] = record["optimizers"]["muonbp"]
    rows = results_sections.check_table(other, H100)[0].splitlines()[2:]
    assert any(r.startswith("| signum (signum: measured only, no cost model yet)") for r in rows)
    assert any(
        r.startswith("| blockmuon (BlockMuon: measured only, no cost model yet)") for r in rows
    )
    lines = results_sections.state_section(other).splitlines()
    (state,) = [x for x in lines if "| signum |" in x]
    assert state.endswith("| – | – |")
    (state,) = [x for x in lines if "| blockmuon |" in x]
    measured, expected = (float(cell) for cell in state.split("|")[2:4])
    assert measured == pytest.approx(expected, abs=1e-4)  # MuonBP's state: BlockMuon's too


def test_linear_stack_gradients_are_cotangent_times_input():
    mats = [Matrix("a.q", 6, 4, "a.ln"), Matrix("a.k", 6, 4, "a.ln"), Matrix("a.fc", 8, 4)]
    stack = linear_stack.LinearStack(mats, tokens=5)
    linear_stack.forward_backward(stack, autocast=False)
    for m, layer in zip(mats, stack.layers.values()):
        expected = stack.cotangents[m.d_out].T @ stack.inputs[m.input].detach()
        torch.testing.assert_close(layer.weight.grad, expected)
    assert stack.inputs["a.ln"] is not stack.inputs["a.fc"]  # q and k share; fc has its own


def test_bad_layer_count_raises():
    with pytest.raises(ValueError, match="layers must be in"):
        hidden_matrices("tiny", 3)


def test_basis_method_option_reaches_dobb(tmp_path):
    out = tmp_path / "power_qr.json"
    args = ["--config", "tiny", "--tokens", "16", "--repeats", "1", "--optimizers", "dobb_paper"]
    calltime.main([*args, "--basis-interval", "2", "--basis-method", "power_qr", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["meta"]["complete"] and saved["meta"]["basis_method"] == "power_qr"
    assert calltime.optimizer_overrides("dobb_paper", 4, 2, 0.5, basis_method="power_qr") == {
        "num_blocks": 4,
        "basis_interval": 2,
        "basis_method": "power_qr",
    }  # the rest of the paper's configuration is the registry entry's own
    # the recommended Dobb keeps its own blocks: the comparison's block count is not its
    assert calltime.optimizer_overrides("dobb", 4, 2, 0.5) == {"basis_interval": 2}
    assert "basis_method" not in calltime.optimizer_overrides("dobb_paper", 4, 2, 0.5)
    assert "basis_method" not in calltime.optimizer_overrides("muon", 4, 2, 0.5, basis_method="x")
    with pytest.raises(ValueError, match="basis_method"):  # Dobb itself rejects the name
        calltime.main([*args, "--basis-method", "no-such-solver"])


def test_cli_measures_dobb_sign(tmp_path, capsys):
    out = tmp_path / "dobb_sign.json"
    args = ["--config", "tiny", "--tokens", "16", "--repeats", "1", "--num-blocks", "4"]
    calltime.main(
        [*args, "--optimizers", "dobb_paper,dobb_sign", "--basis-interval", "2", "--out", str(out)]
    )
    saved = json.loads(out.read_text())
    assert list(saved["optimizers"]) == ["dobb_paper", "dobb_sign"]
    assert [len(p) for p in saved["optimizers"]["dobb_sign"]["period_calls"]] == [2]
    assert "Two-sided Dobb: refresh call" in capsys.readouterr().out
    matrices = hidden_matrices("tiny", 1)
    options = calltime.optimizer_overrides("dobb_sign", 4, 2, 0.0625)  # as it was timed
    expected = sum(state_bytes("dobb_sign", m, **options) for m in matrices)
    assert saved["optimizers"]["dobb_sign"]["state_bytes"] == expected


def test_the_muon_family_runs_newton_schulz_in_the_recorded_dtype(record, monkeypatch):
    """The record says which dtype the Muon family iterated in and why (measured here, with
    both timings and whether bf16 is native), the table says so, and the optimizers took it."""
    ns = record["meta"]["newton_schulz"]
    timings = ns["matmul_ms"]
    assert ns["chosen_by"] == "measured" and ns["ns_dtype"] == min(timings, key=timings.get)
    assert set(timings) == {"bfloat16", "float32"} and isinstance(ns["bf16_native"], bool)
    assert f"Newton-Schulz (Muon, MuonBP, NorMuon, Dion2, NorDion2) in {ns['ns_dtype']}" in (
        calltime.format_table(record)
    )
    built = {}
    real = calltime.build_optimizer

    def spy(name, model, **kw):
        built[name] = kw.get("ns_dtype")
        return real(name, model, **kw)

    monkeypatch.setattr(calltime, "build_optimizer", spy)
    stack = linear_stack.LinearStack(hidden_matrices("tiny", 1), 16)
    linear_stack.forward_backward(stack, autocast=False)
    calltime.time_optimizers(
        stack, ("muon", "nordion2", "dobb_paper"), repeats=1, ns_dtype="float32"
    )
    assert built == {"muon": torch.float32, "nordion2": torch.float32, "dobb_paper": None}


def test_a_given_newton_schulz_dtype_is_kept_and_a_bad_one_refused():
    from bench.tools.matmul_dtype import fastest_ns_dtype

    given = fastest_ns_dtype(torch.device("cpu"), "bfloat16")
    assert given["ns_dtype"] == "bfloat16" and given["chosen_by"] == "given"
    with pytest.raises(ValueError, match="ns_dtype must be"):
        fastest_ns_dtype(torch.device("cpu"), "float8")
