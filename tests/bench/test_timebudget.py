"""Time-budget benchmark on a tiny GPT: the record's fields, the time schedule, rendering.
The budget runs on a clock that counts its readings (``TICK`` a reading), and the harness's
step times ``opt.step()`` on a finer one, so the number of steps the budget holds is a count,
not a measurement."""

import itertools
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

from bench import timebudget
from bench.optimizers import in_table
from bench.timebudget import report as timebudget_report
from bench.timebudget import train as timebudget_train
from dobb.registry import PAPER_DOBB, recommended_lr
from dobb.train import trainer
from dobb.train.data import write_bin_shard


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """Random byte-vocabulary shards (the tiny config's vocabulary)."""
    path = tmp_path_factory.mktemp("tokens")
    rng = np.random.default_rng(0)
    write_bin_shard(path / "train.bin", rng.integers(0, 256, 20_000), 256)
    write_bin_shard(path / "val.bin", rng.integers(0, 256, 2_000), 256)
    return path


TICK = 0.125  # seconds a reading of the test's clock: a step, 1/8 of the 1 s budget


def ticking_clock(tick: float):
    """A clock that moves ``tick`` at every reading (exact in binary): what a timed span
    lasts on it counts readings, whatever the span took."""
    return itertools.count(0.0, tick).__next__


@pytest.fixture(scope="module")
def record(data_dir, tmp_path_factory):
    """The run of the budget's tests: the loop reads its clock before and after each step,
    so a step takes ``TICK`` of training time; the harness's step times ``opt.step()``
    between two readings of a finer one (``TICK / 8``)."""
    out = tmp_path_factory.mktemp("run") / "timebudget.json"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trainer, "time", SimpleNamespace(perf_counter=ticking_clock(TICK / 8)))
        timebudget_train.run(
            data_dir,
            ("dobb_paper", "adamw"),
            config="tiny",
            budget_s=1.0,
            device="cpu",
            batch_size=4,
            evals=2,
            eval_batches=1,
            lrs={"adamw": 3e-3},
            out=out,
            command="test",
            clock=ticking_clock(TICK),
        )
    return json.loads(out.read_text())


def test_each_optimizer_trained_for_the_budget(record):
    meta = record["meta"]
    assert meta["complete"] and meta["budget_s"] == 1.0 and meta["tokens_per_step"] == 4 * 64
    assert meta["data"]["train_tokens"] == 20_000 and meta["data"]["val_tokens"] == 2_000
    assert list(record["optimizers"]) == ["dobb_paper", "adamw"]
    for name, entry in record["optimizers"].items():
        assert entry["steps"] >= 1 and not entry["diverged"], name
        # stops at the first step that reaches the budget: 8 steps of 1/8 s, not a 9th
        assert entry["steps"] == 8 and entry["train_s"] == 1.0
        assert entry["tokens_per_s"] == pytest.approx(
            entry["steps"] * 4 * 64 / entry["train_s"], rel=1e-9
        )
        assert entry["opt_ms"]["mean"] > 0 and entry["fwd_bwd_ms"]["median"] > 0
        assert entry["eval_s"] > 0
        points = entry["points"]
        assert 1 <= len(points) <= 2 and points[-1]["time_s"] >= 1.0
        assert points[-1]["step"] == entry["steps"]
        for p in points:
            assert set(p) == {"time_s", "step", "train_loss", "val_loss"}
            # random tokens over 256 ids: loss near ln 256 = 5.55
            assert math.isfinite(p["val_loss"]) and 4 < p["val_loss"] < 8
        assert [row[1] for row in entry["curve"]] == sorted(row[1] for row in entry["curve"])
    assert record["optimizers"]["adamw"]["lr"] == 3e-3  # --lr override
    # the registry's recommended lr at the model's width (64: the table's nearest is 128)
    assert record["optimizers"]["dobb_paper"]["lr"] == recommended_lr("dobb_paper", 64)
    # the record names what trained beyond the class's defaults: the paper's configuration
    paper = {k: v for k, v in PAPER_DOBB.items() if k != "lr"}
    assert record["optimizers"]["dobb_paper"]["options"] == paper


def test_render_writes_table_and_plot(record, tmp_path):
    path = tmp_path / "timebudget.json"
    path.write_text(json.dumps(record))
    md, png = timebudget_report.render(path, tmp_path / "rendered")
    text = md.read_text()
    assert (
        f"| dobb_paper | {recommended_lr('dobb_paper', 64):.3g} |" in text
        and "| adamw | 0.003 |" in text
    )
    assert "`test`" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_schedule_warms_up_then_decays_to_the_floor():
    factor = [timebudget_train.lr_factor(f, 0.1, 0.2) for f in (0.0, 0.05, 0.1, 0.55, 1.0, 1.5)]
    assert factor == pytest.approx([0.0, 0.5, 1.0, 0.6, 0.2, 0.2])


def test_each_step_is_the_harness_step_at_the_clocks_learning_rate(data_dir, monkeypatch):
    """The loop steps with the harness's ``train_step``, one call a step, each at the lr
    the harness's schedule gives at the budget's clock: 4 steps of 1/8 s fill a 1/2 s
    budget, warming up over its first half, then down the cosine towards 0.1 x."""
    seen = []

    def harness_step(model, opt, *args):
        seen.append(opt.param_groups[0]["lr"])
        return trainer.train_step(model, opt, *args)

    monkeypatch.setattr(timebudget_train, "train_step", harness_step)
    record = timebudget_train.run(
        data_dir,
        ("adamw",),
        config="tiny",
        budget_s=0.5,
        device="cpu",
        batch_size=2,
        evals=1,
        eval_batches=1,
        lrs={"adamw": 1e-3},
        warmup_frac=0.5,
        min_lr_ratio=0.1,
        clock=ticking_clock(TICK),
    )
    assert record["optimizers"]["adamw"]["steps"] == len(seen) == 4
    assert seen == pytest.approx([0.0, 5e-4, 1e-3, 5.5e-4])  # at 0, 1/4, 1/2, 3/4 of it


def test_the_default_optimizers_are_the_labs_time_budget_table():
    assert timebudget_train.NAMES == in_table("timebudget")
    assert timebudget_train.NAMES == ("dobb_paper", "dion", "muon", "blockmuon", "adamw")


def test_bad_inputs_name_the_fix(data_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="timebudget prepare"):
        timebudget_train.run(tmp_path, ("adamw",), config="tiny", device="cpu")
    with pytest.raises(ValueError, match="unknown optimizer"):
        timebudget_train.run(data_dir, ("sgd",), config="tiny", device="cpu")
    with pytest.raises(ValueError, match="NAME=VALUE"):
        timebudget.parse_lrs(["dobb:1e-3"])
    assert timebudget.parse_lrs(["dobb=2e-3"]) == {"dobb": 2e-3}


def test_a_failing_optimizer_is_recorded_and_the_others_still_run(data_dir, tmp_path):
    out = tmp_path / "timebudget.json"
    record = timebudget_train.run(
        data_dir,
        ("dobb_paper", "adamw"),
        config="tiny",
        budget_s=0.3,
        device="cpu",
        batch_size=2,
        evals=1,
        eval_batches=1,
        lrs={"dobb_paper": -1.0},  # the constructor rejects it
        out=out,
    )
    assert record["meta"]["complete"]
    assert "invalid learning rate" in record["optimizers"]["dobb_paper"]["error"]
    assert record["optimizers"]["adamw"]["steps"] >= 1
    md, _ = timebudget_report.render(out, tmp_path)
    assert "| dobb_paper (FAILED: ValueError: invalid learning rate" in md.read_text()


def test_cli_render_writes_the_table_from_the_json(record, tmp_path, capsys):
    path = tmp_path / "timebudget.json"
    path.write_text(json.dumps(record))
    timebudget.main(["render", str(path), "--out-dir", str(tmp_path / "cli")])
    text = (tmp_path / "cli" / "timebudget.md").read_text()
    assert text == timebudget_report.table(record) + "\n" and text in capsys.readouterr().out
