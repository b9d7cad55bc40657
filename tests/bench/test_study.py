"""`python -m bench study`: the lr-grid edge extension, the seed statistics, and the tiny
pipeline end to end (document, plots, numbers from the runs' own JSON, resumability)."""

import fcntl
import itertools
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from bench import cli as lab
from bench import compare, study
from bench.study import format as study_format
from bench.study import moe_report
from bench.study import report as study_report
from bench.study import runs as study_runs
from bench.study import stats as study_stats
from dobb.optim.base import NonFiniteGradientError
from dobb.train.config import ConfigError, TrainConfig


# ------------------------------------------------------------------ lr sweeps
class FakeRunner:
    """Loss (log lr - log target)^2, NaN above `diverge`; records each call's lrs."""

    def __init__(self, target: float, diverge: float = math.inf):
        self.target, self.diverge, self.calls = target, diverge, []

    def __call__(self, configs):
        self.calls.append(sorted(c.lr for c in configs))
        return [
            {
                "lr": c.lr,
                "run": c.out_dir,
                "final_val_loss": math.nan
                if c.lr > self.diverge
                else math.log(c.lr / self.target) ** 2,
            }
            for c in configs
        ]


def sweep(name, grid, max_extensions):
    return study_runs.Sweep(
        lambda lr: TrainConfig(lr=lr, out_dir=f"{name}-{lr}"), grid, max_extensions
    )


GRID = [1e-3 * 2**i for i in range(5)]  # 0.001 ... 0.016


def test_interior_best_is_not_extended():
    runner = FakeRunner(target=0.004)
    runs = study_runs.tune(runner, {"a": sweep("a", GRID, 3)})["a"]
    assert runner.calls == [GRID] and not study_runs.at_edge(runs)
    assert study_runs.best_run(runs)["lr"] == 0.004


def test_best_at_the_top_edge_extends_upward_until_interior():
    runner = FakeRunner(target=0.064)
    runs = study_runs.tune(runner, {"a": sweep("a", GRID, 5)})["a"]
    # one point per round at the edge's spacing (x2) until the best (0.064) is interior
    assert runner.calls == [GRID, [0.032], [0.064], [0.128]]
    assert [s["lr"] for s in runs] == GRID + [0.032, 0.064, 0.128]
    assert study_runs.best_run(runs)["lr"] == 0.064 and not study_runs.at_edge(runs)


def test_extensions_stop_at_the_limit_and_extend_downward():
    runner = FakeRunner(target=1e-5)
    runs = study_runs.tune(runner, {"a": sweep("a", GRID, 1)})["a"]
    assert runner.calls == [GRID, [0.0005]]
    assert study_runs.best_run(runs)["lr"] == 0.0005 and study_runs.at_edge(runs)


def test_diverged_runs_count_as_worst():
    runner = FakeRunner(target=1.0, diverge=0.01)  # 0.016 diverges: 0.008 is interior
    runs = study_runs.tune(runner, {"a": sweep("a", GRID, 3)})["a"]
    assert len(runner.calls) == 1 and study_runs.best_run(runs)["lr"] == 0.008
    assert study_runs.edge_extension([{"lr": 1.0, "final_val_loss": math.nan}] * 2) is None


def test_sweeps_run_side_by_side_and_shared_runs_once():
    runner = FakeRunner(target=0.064)
    sweeps = {"a": sweep("a", GRID, 1), "b": sweep("b", [0.064, 0.128], 0)}
    sweeps["c"] = sweep("b", [0.064], 0)  # the same run as one of b's
    results = study_runs.tune(runner, sweeps)
    assert runner.calls[0] == sorted(GRID + [0.064, 0.128])  # one round, shared run once
    assert runner.calls[1:] == [[0.032]]
    assert results["c"] == [results["b"][0]]


# ------------------------------------------------------------------ statistics
def test_seed_comparison_uses_pooled_std_and_welch_t():
    a = study_stats.seed_stats(
        [{"run": str(i), "final_val_loss": x} for i, x in enumerate([1, 2, 3])]
    )
    b = study_stats.seed_stats([{"run": "x", "final_val_loss": x} for x in (5, 7)])
    assert (a["mean"], a["std"], b["mean"], b["std"]) == (2, 1, 6, pytest.approx(math.sqrt(2)))
    p = study_stats.compare_seeds(a, b)
    pooled = math.sqrt((2 * 1 + 1 * 2) / 3)
    assert p["diff"] == -4 and p["pooled_std"] == pytest.approx(pooled)
    assert p["welch_t"] == pytest.approx(-4 / math.sqrt(1 / 3 + 2 / 2))
    assert p["exceeds"]  # 4 > 2 x 1.15


def test_spec_tiny_section_merges_into_full():
    full, tiny = study_runs.load_spec(), study_runs.load_spec(tiny=True)
    assert tiny.seeds == 2 and len(tiny.lr_factors) == 2
    assert tiny.train["data"] == full.train["data"] and tiny.train["steps"] < full.train["steps"]


def test_spec_is_the_labs_and_a_missing_one_is_named(tmp_path):
    assert study_runs.DEFAULT_CONFIG.parent == Path(study_runs.__file__).parent  # bench/study
    with pytest.raises(ConfigError, match="study config '.*nope.yaml': no such file"):
        study_runs.load_spec(tmp_path / "nope.yaml")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"many_shards_widths": [96]}, "does not tune the recommended Dobb at \\[96\\]"),
        ({"many_shards_seeded": [[256, 3]]}, "\\[\\[256, 3\\]\\] is not a \\[width, count\\]"),
        ({"many_shards_retuned": [[128, 4]]}, "many_shards_retuned: \\[\\[128, 4\\]\\]"),
    ],
)
def test_many_shards_pairs_must_be_measured_widths_and_counts(change, message):
    from bench.study.shards import check_many_shards
    from bench.study.tuning import tuned

    spec = study_runs.load_spec()
    check_many_shards(spec, tuned(spec))  # the budget's own
    for key, value in change.items():
        setattr(spec, key, value)
    with pytest.raises(ConfigError, match=message):
        check_many_shards(spec, tuned(spec))


def test_spec_rejects_per_run_keys(tmp_path):
    path = tmp_path / "s.yaml"
    spec = study_runs.load_spec().__dict__ | {"train": {"seed": 3}}
    path.write_text(json.dumps({"full": spec}))
    with pytest.raises(ConfigError, match="sets \\['seed'\\] per run"):
        study_runs.load_spec(path)


@pytest.mark.parametrize(
    "moe, message",
    [
        ({"moe_optimizers": ["adamw", "sgd"]}, r"moe_optimizers=\['adamw', 'sgd'\] is invalid"),
        ({"moe_model": {"expert_top_k": 2}}, r"moe_model=\{'expert_top_k': 2\} is invalid"),
        ({"moe_model": {"n_experts": 4, "experts": 2}}, r"moe_model=.*unknown GPTConfig fields"),
        ({"moe_seeds": 1}, r"moe_seeds=1 is invalid"),
        ({"moe_tuned": ["Dobb"]}, r"\['Dobb'\] is not the front label of a configuration of \(f\)"),
        ({"moe_tuned": ["Muon"]}, r"name \['Muon'\] twice: \(g\)'s rows need distinct names"),
        ({"moe_tuned": ["AdamW", "AdamW"], "moe_optimizers": []}, r"name \['AdamW'\] twice"),
        (
            {"moe_tuned": ["Dobb, recommended"], "tuning_widths": [256]},
            r"\(g\)'s width 128, which tuning_widths=\[256\] leaves out",
        ),
        ({"moe_tuned": ["Dobb, recommended"], "tuning_widths": [128]}, None),  # the budget's
    ],
)
def test_spec_refuses_a_bad_moe_part_naming_the_key(tmp_path, moe, message):
    """As the study reads its config: ``load_spec``, then (g)'s (f) entries checked."""
    from bench.study.moe import check_moe_tuned

    path = tmp_path / "s.yaml"
    path.write_text(json.dumps({"full": study_runs.load_spec().__dict__ | moe}))
    if message is None:
        spec = study_runs.load_spec(path)
        check_moe_tuned(spec)
        assert spec.moe_tuned == moe["moe_tuned"]
        return
    with pytest.raises(ConfigError, match=message):
        check_moe_tuned(study_runs.load_spec(path))


def test_a_runs_model_fields_are_named_first_and_set_on_top_of_the_study_model(tmp_path):
    base = study_runs.base_config(study_runs.load_spec())
    moe = {"n_experts": 8, "expert_top_k": 2}
    cfg = study_runs.run_config(base, tmp_path, "muon", 0.02, seed=1, model=moe)
    assert Path(cfg.out_dir).name == "muon-n_experts-8-expert_top_k-2-lr0.02-s1"
    assert cfg.model_overrides == base.model_overrides | moe
    plain = study_runs.run_config(base, tmp_path, "muon", 0.02)  # (a)'s names are unchanged
    assert Path(plain.out_dir).name == "muon-lr0.02" and "n_experts" not in plain.model_overrides


def test_a_diverged_run_is_recorded_and_not_repeated(tmp_path, monkeypatch):
    cfg = TrainConfig(optimizer="dobb", lr=10.0, out_dir=str(tmp_path / "dobb-lr10"))

    def diverge(cfg, log):
        raise NonFiniteGradientError("non-finite gradient in h.0.fc.weight")

    monkeypatch.setattr(compare, "run", diverge)
    first = study_runs.run_one(cfg)
    assert math.isnan(first["final_val_loss"]) and study_runs.loss_of(first) == math.inf
    monkeypatch.setattr(compare, "run", lambda cfg, log: pytest.fail("repeated a diverged run"))
    assert study_runs.is_done(cfg) and study_runs.run_one(cfg)["diverged"] == first["diverged"]


def test_a_run_in_progress_elsewhere_is_refused(tmp_path):
    cfg = TrainConfig(optimizer="adamw", lr=1e-3, out_dir=str(tmp_path / "adamw-lr0.001"))
    (tmp_path / "adamw-lr0.001").mkdir()
    with open(tmp_path / "adamw-lr0.001" / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as a worker that outlived a killed study would
        with pytest.raises(RuntimeError, match="another process is training"):
            study_runs.run_one(cfg)


def test_the_ordering_sentence_names_each_swapped_pair_against_the_noise():
    def side(diff, exceeds):
        return {"diff": diff, "pooled_std": 0.01, "welch_t": diff / 0.01, "exceeds": exceeds}

    rows = [
        {"name": n, "label": label, "seeds": {"mean": m}}
        | {"dense": {"seeds": {"mean": d}, "source": "(a)"}}
        for n, label, m, d in (("a", "A", 1.0, 1.1), ("b", "B", 1.2, 1.05), ("c", "C", 2.0, 2.0))
    ]
    pairs = [
        {"a": "a", "b": "b", "moe": side(-0.2, True), "dense": side(0.05, False)},
        {"a": "a", "b": "c", "moe": side(-1.0, True), "dense": side(-0.9, True)},
        {"a": "b", "b": "c", "moe": side(-0.8, True), "dense": side(-0.95, True)},
    ]
    report = {"n_experts": 8, "expert_top_k": 2, "n_embd": 128, "rows": rows, "pairs": pairs}
    report |= {"order": ["a", "b", "c"], "dense_order": ["b", "a", "c"], "holds": False}
    sentence = moe_report.ordering_sentence(report)
    assert moe_report.swaps(report) == [
        "A and B swap places, beyond the seed noise with experts, within it dense"
    ]
    assert "the dense ordering does not hold (A and B swap places, beyond the seed" in sentence
    assert sentence.endswith("dense, (a): B (1.0500) < A (1.1000) < C (2.0000)")
    pairs[0] |= {"moe": side(0.2, False)}  # the same order both ways: no swap
    assert moe_report.swaps(report) == []


def test_loss_curves_leave_out_a_run_without_its_step_log(tmp_path):
    for run in ("muon-lr0.02", "adamw-lr0.002"):
        (tmp_path / "runs" / run).mkdir(parents=True)
    (tmp_path / "runs" / "muon-lr0.02" / "metrics.jsonl").write_text("")
    seeds = {"muon": {"runs": ["muon-lr0.02"]}, "adamw": {"runs": ["adamw-lr0.002"]}}
    curves, unlogged = study_report.curve_runs(tmp_path, seeds, {"muon": 0.02, "adamw": 0.002})
    assert curves == {"muon (lr 0.02)": tmp_path / "runs" / "muon-lr0.02"}
    assert unlogged == ["adamw"]


# ------------------------------------------------------------------ the tiny pipeline
def test_an_invocation_records_the_code_it_started_with(tmp_path, monkeypatch):
    """A commit made while the study runs is not the code that ran."""
    stages = []  # the stages are stubs here: only the invocation record is under test
    monkeypatch.setattr(study, "run_study", lambda *a: {"best_lr": {}})
    monkeypatch.setattr(study, "run_gap", lambda *a: {})
    monkeypatch.setattr(study, "run_tuning", lambda *a: stages.append("trained") or {})
    monkeypatch.setattr(study, "run_many_shards", lambda *a: {})
    monkeypatch.setattr(study, "run_moe", lambda *a: {})
    monkeypatch.setattr(study, "analyse", lambda *a: {})
    monkeypatch.setattr(study, "write_document", lambda *a: None)
    monkeypatch.setattr(study, "code_version", lambda: {"commit": str(len(stages)), "dirty": 0})
    (tmp_path / "study").mkdir()
    report = study.study(tmp_path / "study", tiny=True, log=lambda *_: None)
    assert stages and report["invocations"][-1]["commit"] == "0"


def test_tiny_study_writes_the_document_from_the_runs_and_resumes(tmp_path):
    out, doc = tmp_path / "study", tmp_path / "STUDY.md"
    assert lab.main(["study", "--tiny", "--out", str(out)]) == 0
    text = doc.read_text()
    report = json.loads((out / "study.json").read_text())
    for heading in ("## What the data show", "## (a) Tuned comparison", "## (b) Dobb ablations"):
        assert heading in text
    assert "## (c) Width trend" in text and f"python -m bench study --tiny --out {out}" in text
    assert re.search(r"\| optimizer +\| options ", text)
    assert re.search(r"\| Dobb vs +\| difference of means", text)
    assert "| option " in text and "| n_embd | parameters |" in text
    for link in re.findall(r"\]\(([^)]+\.png)\)", text):  # every plot exists and is a PNG
        assert (doc.parent / link).read_bytes()[:4] == b"\x89PNG"
    assert {"lr_sweep.png", "ablations.png", "width.png", "val_loss_vs_step.png"} <= {
        p.name for p in out.glob("*.png")
    }

    def summary(run):
        return json.loads((out / "runs" / run / "summary.json").read_text())

    for name, s in report["seeds"].items():  # seed statistics come from the runs' own JSON
        losses = [summary(run)["final_val_loss"] for run in s["runs"]]
        assert len(losses) == 2 and summary(s["runs"][0])["lr"] == report["best_lr"][name]
        assert s["mean"] == pytest.approx(np.mean(losses))
        assert s["std"] == pytest.approx(np.std(losses, ddof=1))
        assert f"{s['mean']:.4f} ± {s['std']:.4f}" in text
        if name != "dobb_paper":
            diff = report["seeds"]["dobb_paper"]["mean"] - s["mean"]
            assert report["pairs"][name]["diff"] == pytest.approx(diff)
    for row in report["ablations"]:
        assert row["loss"] == min(summary(run)["final_val_loss"] for run in row["runs"])
    assert report["checks"]["stats_sync=step"] == 0  # one process: identical runs
    # the seeded ablations (the batched refreshes): each seed mean against Dobb's seeds
    for solver in ("jacobi", "cholqr"):
        (row,) = [r for r in report["ablations"] if r["value"] == solver]
        losses = [summary(run)["final_val_loss"] for run in row["seeds"]["runs"]]
        assert row["seeds"]["n"] == 4 and row["seeds"]["mean"] == pytest.approx(np.mean(losses))
        assert row["seeds"]["pair"]["diff"] == pytest.approx(
            np.mean(losses) - report["seeds"]["dobb_paper"]["mean"]
        )
        assert f"4 seeds: mean {row['seeds']['mean']:.4f}" in text

    # (d): MuonBP of (a) with only the period changed, against its seed-0 run
    assert "## (d) MuonBP's period" in text and (out / "muonbp_period.png").exists()
    periods = [r for r in report["ablations"] if r["optimizer"] == "muonbp"]
    assert [r["value"] for r in periods] == [1, 2, 20, None]
    reference = summary(report["seeds"]["muonbp"]["runs"][0])
    for row in periods:
        for run in row["runs"]:
            config = json.loads((out / "runs" / run / "run.json").read_text())["config"]
            options = compare.OPTIONS["muonbp"] | {"period": row["value"]}
            assert config["optimizer"] == "muonbp" and config["optimizer_options"] == options
        assert row["delta"] == pytest.approx(row["loss"] - reference["final_val_loss"])
        best = report["best_lr"]["muonbp"]  # a small sweep around MuonBP's tuned lr
        grid = {study_runs.round_lr(best * f) for f in report["spec"]["ablation_lr_factors"]}
        assert grid <= set(row["lrs"])
        assert re.search(rf"\| period +\| 5 +\| {row['value']} +\|", text)
    # (e): variants, row shards and widths, each number from the runs' own JSON
    gap = report["gap"]
    assert "## (e) Closing the gap to Muon" in text and (out / "row_shards.png").exists()
    for row in gap["rows"][2:]:  # the variants (after Dobb and two-sided Dobb of (a))
        assert row["loss"] == min(row["losses"]) and len(row["lrs"]) >= 2
    seeded = [row for row in gap["rows"][2:] if row["seeds"]]
    assert len(seeded) == report["spec"]["gap_seeded"] and seeded[0]["seeds"]["n"] == 2
    shard_width, count = gap["shard_width"], report["spec"]["shard_counts"][0]
    (run,) = (out / "runs").glob(f"dobb_sign-row_blocks-{count}-w{shard_width}-lr*")
    assert gap["shards"]["dobb_sign"][0] == summary(run.name)["final_val_loss"]
    for entry in gap["widths"]:
        best = entry["losses"][entry["best_local"]]
        assert entry["gap"] == pytest.approx(best - entry["losses"]["muon"])
        assert f"n_embd {entry['n_embd']}: best shard-local:" in text
    # (f): every configuration tuned at every width, each number from the runs' own JSON
    tuning = report["tuning"]
    assert "## (f) Every optimizer tuned at every width" in text and (out / "tuning.png").exists()
    spec = report["spec"]
    seeded_keys = {(w, r["label"]) for r in tuning["rows"] for w in spec["tuning_widths"]}
    for w in spec["tuning_wide_widths"]:  # Muon and the best shard-local ones by seed 0
        at = {r["label"]: min(e["losses"]) for r in tuning["rows"] for e in r["widths"]
              if e["n_embd"] == w}  # fmt: skip
        local = sorted((k for k in at if _label_row(tuning, k)["shard_local"]), key=at.get)
        seeded_keys |= {(w, k) for k in ["Muon", *local[: spec["tuning_wide_seeded"]]]}
    for row in tuning["rows"]:
        for entry in row["widths"]:
            assert entry["best_lr"] == entry["lrs"][entry["losses"].index(min(entry["losses"]))]
            first = summary(entry["seeds"]["runs"][0])
            trained = entry["run_lrs"][entry["lrs"].index(entry["best_lr"])]  # the rule's: x unit
            assert first["lr"] == trained and first["final_val_loss"] == min(entry["losses"])
            grid = ", ".join(f"{lr:.4g}" for lr in entry["lrs"])
            lr = f"{entry['best_lr']:.4g}"
            assert f"width {entry['n_embd']}: {row['label']} tuned lr {lr} (grid {grid})" in text
            seeded = (entry["n_embd"], row["label"]) in seeded_keys
            assert entry["seeds"]["n"] == (report["spec"]["tuning_seeds"] if seeded else 1)
        assert f"- {row['label']}: " in text  # does its lr transfer?
    assert any("Muon's RMS scale" in r["label"] for r in tuning["rows"])  # tuning_scale_rules
    _check_width_rule(tuning, text, out, summary)
    for entry in tuning["best_local"]:
        assert f"width {entry['n_embd']}: best shard-local: {entry['label']}" in text
        local, muon = (_label_row(tuning, k) for k in (entry["label"], "Muon"))
        (a, b) = (next(e for e in r["widths"] if e["n_embd"] == entry["n_embd"])["seeds"]
                  for r in (local, muon))  # fmt: skip
        noise = study_stats.compare_seeds(a, b)  # both seeded: Muon and the best shard-local one
        verdict = "beyond" if noise["exceeds"] else "within"
        assert f"(f), width {entry['n_embd']}: best shard-local: {entry['label']}" in text
        assert f"pooled seed std {2 * noise['pooled_std']:.4f}: {verdict} the noise" in text
    assert "Goal on the tuned gaps" in text and "Goal at (a)'s lrs" in text
    shards = tuning["shards"]
    assert [r["row_shards"] for r in shards["rows"]] == report["spec"]["tuning_shard_counts"]
    (run,) = (out / "runs").glob("blockmuon-row_blocks-8-lr*")
    assert shards["rows"][2]["losses"]["BlockMuon"] == summary(run.name)["final_val_loss"]
    # at the harness's count no new run, but for the configuration whose own count is
    # another: the recommended Dobb's one row block (in one process: all rows)
    new = {r.name.split("-lr")[0] for r in (out / "runs").glob("*row_blocks-4-*")}
    assert new == {
        "dobb_sign-block_size-None-num_blocks-1-row_blocks-4-coefficients-adam-update_scale-1.0"
    }
    blockmuon = next(r for r in tuning["rows"] if r["label"] == "BlockMuon")
    (at,) = [e for e in blockmuon["widths"] if e["n_embd"] == shards["n_embd"]]
    assert shards["rows"][1]["losses"]["BlockMuon"] == min(at["losses"])
    # (f) variants: the Cholesky-QR refresh at Dobb's tuned lr and seeds of each width
    (variant,) = tuning["variants"]  # one tuning width
    (at,) = [e for e in _label_row(tuning, variant["of"])["widths"] if e["n_embd"] == 64]
    assert variant["n_embd"] == 64 and variant["lr"] == at["best_lr"]
    assert variant["reference"]["runs"] == at["seeds"]["runs"]
    losses = [summary(run)["final_val_loss"] for run in variant["seeds"]["runs"]]
    assert len(losses) == spec["tuning_seeds"] and variant["seeds"]["losses"] == losses
    for run in variant["seeds"]["runs"]:
        config = json.loads((out / "runs" / run / "run.json").read_text())["config"]
        assert config["optimizer_options"]["basis_method"] == "cholqr"
        assert config["lr"] == at["best_lr"]
    pair = study_stats.compare_seeds(variant["seeds"], variant["reference"])
    assert pair["diff"] == pytest.approx(np.mean(losses) - at["seeds"]["mean"])
    verdict = "beyond" if pair["exceeds"] else "within"
    sentence = (
        f"{variant['label']} vs Dobb, 16 blocks at its tuned lrs: width 64: Δ of means "
        f"{pair['diff']:+.4f} (2 x pooled std {2 * pair['pooled_std']:.4f}, Welch t "
        f"{pair['welch_t']:.2f}): {verdict} the noise."
    )
    assert f"- {sentence}" in text and f"- (f) {sentence}" in text  # section and summary
    _check_many_shards(report, text, out, summary)
    # (g): the mixture of experts, each optimizer tuned on its own grid, beside (a)'s dense
    _check_moe(report, text, out, summary)
    assert report["compute"]["runs"] == report["new_runs"] == len(list((out / "runs").iterdir()))
    for run in (out / "runs").iterdir():  # each run names the code that trained it
        (start,) = json.loads((run / "code.json").read_text())
        assert re.fullmatch("[0-9a-f]{40}", start["commit"]) and start["dirty"] in (True, False)
    assert report["invocations"][-1]["commit"] == start["commit"]
    assert report["compute"]["code_records"] == report["compute"]["runs"]
    assert f"- code: {report['compute']['runs']} of {report['compute']['runs']} runs" in text

    # a second call trains nothing; a run lost to a kill is the only one redone
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("runs/*/summary.json")}
    assert study.study(out, tiny=True, log=lambda *_: None)["new_runs"] == 0
    assert stamps == {p: p.stat().st_mtime_ns for p in out.glob("runs/*/summary.json")}
    (out / "runs" / report["seeds"]["muon"]["runs"][1] / "summary.json").unlink()
    again = study.study(out, tiny=True, log=lambda *_: None)
    assert again["new_runs"] == 1 and len(again["invocations"]) == 3


def _check_many_shards(report: dict, text: str, out: Path, summary) -> None:
    """(f) at many row shards: the recommended Dobb at (f)'s tuned lr of each width, its
    seeds and retuned grids where the spec asks, each loss from the runs' own JSON; Muon's
    seeds of (f) beside it; at (f)'s own width the runs of the row-shard trend."""
    many, spec, tuning = report["many_shards"], report["spec"], report["tuning"]
    recommended = _label_row(tuning, many["label"])
    assert recommended["label"].startswith("recommended Dobb")
    pairs = [(w, n) for w in spec["many_shards_widths"] for n in spec["many_shards_counts"]]
    assert sorted((r["n_embd"], r["row_shards"]) for r in many["rows"]) == sorted(pairs)
    seeded = {tuple(p) for p in spec["many_shards_seeded"]}
    retuned = {tuple(p) for p in spec["many_shards_retuned"]}
    for r in many["rows"]:
        w, n = r["n_embd"], r["row_shards"]
        (at,) = [e for e in recommended["widths"] if e["n_embd"] == w]
        assert r["tuned_lr"] == at["best_lr"]
        assert r["seeds"]["n"] == (spec["many_shards_seeds"] if (w, n) in seeded else 1)
        factors = [1.0, *spec["many_shards_lr_factors"]] if (w, n) in retuned else [1.0]
        assert r["lrs"] == pytest.approx(sorted(at["best_lr"] * f for f in factors))
        for run, loss in zip(r["seeds"]["runs"], r["seeds"]["losses"]):
            config = json.loads((out / "runs" / run / "run.json").read_text())["config"]
            assert config["optimizer_options"]["row_blocks"] == n
            assert config["model_overrides"].get("n_embd", 64) == w
            assert summary(run)["final_val_loss"] == loss
        (muon,) = [e for e in _label_row(tuning, "Muon")["widths"] if e["n_embd"] == w]
        assert r["muon"]["runs"] == muon["seeds"]["runs"]
        assert r["gap"] == pytest.approx(r["seeds"]["mean"] - muon["seeds"]["mean"])
        assert r["best_lr"] == r["lrs"][r["losses"].index(min(r["losses"]))]
        if w == tuning["shards"]["n_embd"] and n in spec["tuning_shard_counts"]:  # shared
            (trend,) = [x for x in tuning["shards"]["rows"] if x["row_shards"] == n]
            assert trend["losses"][many["label"]] == r["seeds"]["losses"][0]
    assert f"{many['label']} at many row shards" in text
    for w in spec["many_shards_widths"]:
        assert f"- (f) {many['label']} at width {w} over " in text


def _check_moe(report: dict, text: str, out: Path, summary) -> None:
    """Section (g): every number from the runs' own JSON, every run a mixture of experts;
    the optimizers of (a) beside their dense numbers of (a), the configurations of (f)
    beside theirs of (f) at (g)'s width."""
    moe, spec = report["moe"], report["spec"]
    assert "## (g) Mixture of experts" in text and (out / "moe.png").exists()
    assert [r["name"] for r in moe["rows"]] == spec["moe_optimizers"] + spec["moe_tuned"]
    assert "Dobb, recommended" in spec["moe_tuned"]  # the pipeline covers entries of (f)
    assert moe["n_experts"] == spec["moe_model"]["n_experts"] and moe["expert_hidden"] > 0
    fronts = {r["front"]: r for r in report["tuning"]["rows"] if r["front"]}
    for row in moe["rows"]:
        name = row["name"]
        if name in spec["moe_tuned"]:  # (f)'s tuned lr, options and seeds at (g)'s width
            (dense,) = [e for e in fronts[name]["widths"] if e["n_embd"] == moe["n_embd"]]
            source = f"(f) at width {moe['n_embd']}"
            dense_run = dense["seeds"]["runs"][0]
        else:  # (a)'s
            dense = {"best_lr": report["best_lr"][name], "seeds": report["seeds"][name]}
            source, dense_run = "(a)", report["seeds"][name]["runs"][0]
        options = json.loads((out / "runs" / dense_run / "run.json").read_text())["config"]
        assert row["best_lr"] == row["lrs"][row["losses"].index(min(row["losses"]))]
        grid = {study_runs.round_lr(dense["best_lr"] * f) for f in spec["moe_lr_factors"]}
        assert grid <= set(row["lrs"])  # its own grid around its dense tuned lr
        losses = [summary(run)["final_val_loss"] for run in row["seeds"]["runs"]]
        assert row["seeds"]["n"] == spec["moe_seeds"] and row["seeds"]["losses"] == losses
        trained = row["run_lrs"][row["lrs"].index(row["best_lr"])]  # the width rule's: x unit
        assert summary(row["seeds"]["runs"][0])["lr"] == trained
        assert row["seeds"]["mean"] == pytest.approx(np.mean(losses))
        for run in row["runs"] + row["seeds"]["runs"]:
            config = json.loads((out / "runs" / run / "run.json").read_text())["config"]
            assert config["model_overrides"]["n_experts"] == moe["n_experts"]
            assert config["optimizer"] == options["optimizer"] == row["optimizer"]
            assert config["optimizer_options"] == options["optimizer_options"]  # the dense run's
        assert row["dense"]["seeds"] == dense["seeds"] and row["dense"]["source"] == source
        assert row["dense"]["lr"] == dense["best_lr"]
        mean, dense_mean = row["seeds"]["mean"], row["dense"]["seeds"]["mean"]
        assert re.search(rf"\| {re.escape(row['label'])} +\| ", text)
        assert f"{mean:.4f} ± {row['seeds']['std']:.4f}" in text
        assert f"{mean - dense_mean:+.4f}" in text
        assert f"({source}, {study_format.in_words(row['dense']['seeds']['n'])} seeds)" in text
    assert re.search(r"\| Dobb, recommended +\| dobb_sign: row_blocks=None, ", text)
    means = {r["name"]: r["seeds"]["mean"] for r in moe["rows"]}
    assert moe["order"] == sorted(means, key=means.get)
    assert moe["holds"] == (moe["order"] == moe["dense_order"])
    verdict = "holds" if moe["holds"] else "does not hold"
    assert f"the dense ordering {verdict}" in text and ").." not in text
    dense = {r["name"]: r["dense"]["seeds"]["mean"] for r in moe["rows"]}
    labels = {r["name"]: r["label"] for r in moe["rows"]}
    swapped = [
        f"{labels[a]} and {labels[b]} swap places"
        for a, b in itertools.combinations(labels, 2)
        if (means[a] > means[b]) != (dense[a] > dense[b])
    ]
    assert bool(swapped) == (not moe["holds"])  # the order changes where a pair swaps
    for pair in swapped:
        assert pair in text
    assert text.count("swap places") == 2 * len(swapped)  # in the summary and in (g)
    parts = f"AdamW and Muon: (a); {' and '.join(spec['moe_tuned'])}: (f) at width {moe['n_embd']}"
    assert f"; dense ({parts}): " in text  # each row's dense numbers named by their part
    for pair in moe["pairs"]:
        assert pair["moe"]["diff"] == pytest.approx(means[pair["a"]] - means[pair["b"]])
    assert len(moe["pairs"]) == math.comb(len(moe["rows"]), 2)


def _check_width_rule(tuning, text, out, summary):
    """(f)'s recommended Dobb reads the scale-1 runs at lr x 256/width (its grid's lrs map
    onto that configuration's runs), and one run of the lab's `dobb` (the rule itself) per
    width at the tuned lr trains to the same final losses: the same computation."""
    rule = next(r for r in tuning["rows"] if r["label"].startswith("recommended Dobb"))
    for entry in rule["widths"]:
        unit = 256 / entry["n_embd"]
        assert entry["run_lrs"] == [study_runs.round_lr(lr * unit) for lr in entry["lrs"]]
        assert unit != 1  # the tiny widths: the reading is not the identity
    checks = {c["n_embd"]: c for c in tuning["rule_checks"]}
    assert sorted(checks) == sorted(e["n_embd"] for e in rule["widths"])
    for w, c in checks.items():
        (run,) = (out / "runs").glob(f"dobb-{'' if w == 64 else f'w{w}-'}lr{c['lr']:.4g}")
        config = json.loads((run / "run.json").read_text())["config"]
        assert config["optimizer"] == "dobb" and config["lr"] == c["lr"]
        assert c["same_blocks"]  # the tiny widths' matrices fit in one block of BLOCK_WIDTH
        if math.log2(256 / w).is_integer():  # x unit is exact: bit for bit, alpha only scales lr
            assert c["difference"] == 0, c
        else:  # run names keep 4 digits of lr (round_lr): the read run's lr is 5e-5 off at most
            assert 0 < c["difference"] < 1e-3, c
        best = min(next(e for e in rule["widths"] if e["n_embd"] == w)["losses"])
        assert summary(run.name)["final_val_loss"] == pytest.approx(best, abs=c["difference"])
        assert f"- width {w}: `dobb` at lr {c['lr']:.4g} against the scale-1 run" in text


def _label_row(tuning: dict, label: str) -> dict:
    return next(r for r in tuning["rows"] if r["label"] == label)


def test_a_rule_check_on_another_block_layout_is_reported_as_a_measurement():
    """Where the library's defaults cut a matrix into blocks of BLOCK_WIDTH and the read
    configuration keeps one (width 512's 2,048-column inputs), the check is not called one:
    the sentence gives both losses and their difference."""
    from bench.study import tuning, tuning_report

    widest = max(m.d_in for m in tuning.transformer_matrices(512, 1))
    check = {"same_blocks": widest <= 1024, "widest_input": widest, "loss": 1.64, "read_loss": 1.6}
    assert not check["same_blocks"]
    text = tuning_report._rule_outcome(check | {"difference": 0.04})
    assert text.startswith("not the same computation: the library cuts the 2,048-column inputs")
    assert "final val loss 1.6400 against 1.6000 (+0.0400, one seed)" in text
    assert tuning_report._rule_outcome(check | {"same_blocks": True, "difference": 0}) == (
        "the same final losses"
    )
