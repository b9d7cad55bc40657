"""`python -m bench compare --quick`: the table, the plots and summary.md, from the runs' logs."""

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from bench import cli as lab
from bench import compare
from bench.optimizers import with_options
from dobb import cli
from dobb.registry import get_entry, recommended_lr

# each optimizer at its best lr from the study's committed JSON (registry lr if untuned)
RUNS = sorted(
    f"{name}-lr{recommended_lr(name, 64):.4g}"
    for name in compare.OPTIMIZERS  # tiny: width 64
)


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_quick_compare_writes_table_plots_and_summary(tmp_path, capsys, monkeypatch):
    out = tmp_path / "report"
    assert lab.main(["compare", "--quick", "--steps", "4", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert re.search(r"\| optimizer +\| lr", printed) and "final val loss" in printed
    for name in ("dobb_paper", "dobb", "dion", "muon", "adamw"):
        assert f"| {name} " in printed

    assert sorted(p.name for p in (out / "runs").iterdir()) == RUNS
    for png in ("val_loss_vs_step.png", "val_loss_vs_time.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = (out / "summary.md").read_text()
    results = json.loads((out / "results.json").read_text())
    sha = json.loads((out / "runs" / RUNS[0] / "run.json").read_text())["corpus"]["sha256"]
    assert sha in summary and "stdlib-py" in summary and torch.__version__ in summary
    assert f"python -m bench compare --quick --steps 4 --out {out}" in summary
    assert "## Learning rates used" in summary and "rank_fraction=0.0625" in summary
    assert "num_blocks=16" in summary and "](val_loss_vs_step.png)" in summary
    for name, best in results["best"].items():  # the table holds the runs' own numbers
        run = json.loads((out / "runs" / f"{name}-lr{best['lr']:.4g}" / "summary.json").read_text())
        assert f"{run['final_val_loss']:.4f}" in summary

    # finished runs are not repeated
    monkeypatch.setattr(compare, "train", lambda cfg: pytest.fail("retrained a finished run"))
    compare.compare(out, quick=True, steps=4, log=lambda *_: None)
    # ... but a different budget in the same folder is refused
    with pytest.raises(FileExistsError, match="different config .*steps"):
        compare.compare(out, ["adamw"], quick=True, steps=5, log=lambda *_: None)


def test_lr_sweep_plots_loss_against_lr_and_writes_the_best(tmp_path):
    out = tmp_path / "sweep"
    argv = ["compare", "--quick", "--steps", "3", "--out", str(out), "--optimizers", "adamw,dobb"]
    argv += ["--lr-factors", "0.5,2", "--lrs", "dobb=1e-3,4e-3"]
    assert lab.main(argv) == 0
    names = sorted(p.name for p in (out / "runs").iterdir())
    assert names == ["adamw-lr0.0005", "adamw-lr0.002", "dobb-lr0.001", "dobb-lr0.004"]
    best = json.loads((out / "best_lrs.json").read_text())
    results = json.loads((out / "results.json").read_text())["results"]
    for name, runs in results.items():
        assert best[name] == min(runs, key=lambda s: s["final_val_loss"])["lr"]
    assert (out / "lr_sweep.png").read_bytes()[:4] == b"\x89PNG"
    assert "## Learning-rate sweep" in (out / "summary.md").read_text()


def test_compare_rejects_per_run_overrides(tmp_path, capsys):
    assert lab.main(["compare", "--quick", "--out", str(tmp_path), "optimizer=adamw"]) == 2
    assert "compare sets ['optimizer'] per run" in capsys.readouterr().err


def test_train_command_reports_config_errors(capsys):
    assert cli.main(["train", "stepz=3"]) == 2
    assert "unknown config key 'stepz'" in capsys.readouterr().err


def test_a_run_logged_before_eval_ema_existed_is_the_same_config(tmp_path, monkeypatch):
    """An old run.json without a later field (eval_ema) means its default (None): off."""
    cfg = compare.run_config(compare.base_config(quick=True), "adamw", None, tmp_path)
    out = tmp_path / "runs" / compare.run_name("adamw", cfg.lr)
    out.mkdir(parents=True)
    old = {k: v for k, v in cfg.to_dict().items() if k != "eval_ema"}
    (out / "run.json").write_text(json.dumps({"config": old}))
    (out / "summary.json").write_text(json.dumps({"final_val_loss": 1.5}))
    monkeypatch.setattr(compare, "train", lambda cfg: pytest.fail("retrained a finished run"))
    assert compare.run(cfg, log=lambda *_: None) == {"final_val_loss": 1.5}
    with pytest.raises(FileExistsError, match=r"different config \(eval_ema\)"):
        compare.run(replace(cfg, eval_ema=0.9), log=lambda *_: None)


@pytest.mark.parametrize("optimizer, decay", [("dion", 0.01), ("adamw", 0.01), ("muon", 0.0)])
def test_a_run_logged_before_the_weight_decay_protocol_reads_as_it_trained(
    tmp_path, monkeypatch, optimizer, decay
):
    """An old run.json without weight_decay trained with its class's default on the hidden
    matrices, inherited by the scalar group: a Dion run then is not a run of the protocol
    (none on either) and is refused, loudly, while a Muon run is the same config."""
    cfg = compare.run_config(compare.base_config(quick=True), optimizer, None, tmp_path)
    old = {k: v for k, v in cfg.to_dict().items() if "weight_decay" not in k}
    assert compare.weight_decay_of(old) == {"weight_decay": decay, "scalar_weight_decay": decay}
    out = Path(cfg.out_dir)
    out.mkdir(parents=True)
    (out / "run.json").write_text(json.dumps({"config": old}))
    (out / "summary.json").write_text(json.dumps({"final_val_loss": 1.5}))
    monkeypatch.setattr(compare, "train", lambda cfg: pytest.fail("retrained a finished run"))
    if decay:
        with pytest.raises(FileExistsError, match="scalar_weight_decay, weight_decay"):
            compare.run(cfg, log=lambda *_: None)
        legacy = replace(cfg, weight_decay=decay, scalar_weight_decay=decay)
        assert compare.run(legacy, log=lambda *_: None) == {"final_val_loss": 1.5}
    else:
        assert compare.run(cfg, log=lambda *_: None) == {"final_val_loss": 1.5}


def test_the_collective_timeout_does_not_change_what_a_run_computes(tmp_path, monkeypatch):
    """A run logged before `timeout` existed, or with another one, is the same config: the
    committed study's runs are reused by `python -m bench study`, not refused."""
    cfg = compare.run_config(compare.base_config(quick=True), "adamw", None, tmp_path)
    out = tmp_path / "runs" / compare.run_name("adamw", cfg.lr)
    out.mkdir(parents=True)
    old = {k: v for k, v in cfg.to_dict().items() if k != "timeout"}
    (out / "run.json").write_text(json.dumps({"config": old}))
    (out / "summary.json").write_text(json.dumps({"final_val_loss": 1.5}))
    monkeypatch.setattr(compare, "train", lambda cfg: pytest.fail("retrained a finished run"))
    for timeout in (cfg.timeout, 30.0):
        assert compare.run(replace(cfg, timeout=timeout), log=lambda *_: None)["final_val_loss"]


@pytest.mark.parametrize(
    "logged, now, same",
    [
        ({"num_blocks": 16}, {}, True),  # before the lab pinned the paper's defaults
        ({"num_blocks": 16, "block_size": 32}, {"block_size": 32}, True),  # the width won
        ({"num_blocks": 16, "two_sided": True}, {}, False),
        ({"num_blocks": 16}, {"coefficients": "adam"}, False),
    ],
)
def test_a_dobb_run_logged_before_the_recommended_defaults_reads_as_it_trained(
    tmp_path, logged, now, same
):
    """A "dobb" run logged when the class's defaults were the paper's (one-sided, the sign,
    averaged on refresh steps), before logs named what their entry built, and a block width
    overrode the count is the same config as the lab's ``dobb_paper`` now; a run that named
    another setting is not."""
    cfg = compare.run_config(compare.base_config(quick=True), "dobb_paper", None, tmp_path)
    cfg = replace(cfg, optimizer_options=with_options("dobb_paper", now))
    old = {"config": cfg.to_dict() | {"optimizer": "dobb", "optimizer_options": logged}}
    new = compare.settings_record(cfg)
    assert (compare.comparable_config(old) == compare.comparable_config(new)) == same


def test_the_recommended_dobb_is_not_a_paper_run_logged_under_its_name(tmp_path):
    """Today's "dobb" (the recommended configuration) logs what it built, so a directory
    holding an old "dobb" run (the paper's) under the same name is refused, not reused; the
    trainer's own log is what ``settings_record`` says."""
    base = compare.base_config(quick=True)
    # the recommended Dobb with the paper's block count: only the rest of its options differ
    cfg = replace(
        compare.run_config(base, "dobb", None, tmp_path), optimizer_options={"num_blocks": 16}
    )
    old = {"config": cfg.to_dict()}  # the same name and options, logged before the settings
    recommended = compare.settings_record(cfg)
    assert recommended["optimizer_settings"] == {"class": "Dobb", "options": {"num_blocks": 16}}
    assert compare.comparable_config(old) != compare.comparable_config(recommended)
    paper = compare.settings_record(replace(cfg, optimizer="dobb_paper"))
    assert compare.comparable_config(old) == compare.comparable_config(paper)
    compare.train(replace(cfg, steps=1, warmup_steps=0, eval_interval=1, checkpoint_interval=0))
    logged = json.loads((Path(cfg.out_dir) / "run.json").read_text())
    assert logged["optimizer_settings"] == recommended["optimizer_settings"]


def test_a_run_logged_under_a_renamed_optimizer_reads_as_the_new_name(tmp_path):
    """A run logged as ``dobb2s`` (now ``dobb_sign``: ``dobb.registry.RENAMED``) is the same
    config as the lab's ``dobb_sign`` run, so a study finds it done; another name is not."""
    cfg = compare.run_config(compare.base_config(quick=True), "dobb_sign", None, tmp_path)
    new = compare.comparable_config(compare.settings_record(cfg))
    assert compare.comparable_config({"config": cfg.to_dict() | {"optimizer": "dobb2s"}}) == new
    other = {"config": cfg.to_dict() | {"optimizer": "dobb_paper"}}
    assert compare.comparable_config(other) != new


def test_a_renamed_optimizer_is_refused_with_its_new_name():
    with pytest.raises(ValueError, match="'dobb2s' is now called 'dobb_sign'"):
        get_entry("dobb2s")
