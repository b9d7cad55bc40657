"""Resume semantics: what a resume restores, which settings may change and then take
effect, what stops it (one line naming the field); retention that keeps intact
checkpoints; logs that survive a torn line; saves that fail cleanly; loading runs no code."""

import errno
import json
import math
import pickle
import shutil
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from dobb.train import checkpoint as ckpt
from dobb.train import trainer
from dobb.train.checkpoint import (
    MARKER,
    CheckpointError,
    checkpoint_dirs,
    checkpoint_fault,
    file_manifest,
    intact_checkpoint,
    load_checkpoint,
    prune_checkpoints,
)
from dobb.train.config import ConfigError, TrainConfig
from dobb.train.data import TokenStream
from dobb.train.errors import RunWarning
from dobb.train.model import GPT, gpt_config
from dobb.train.trainer import lr_schedule, train

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def config(out, optimizer="dobb", **overrides) -> TrainConfig:
    settings = dict(model="tiny", batch_size=8, steps=8, warmup_steps=2, eval_interval=4)
    settings |= dict(eval_batches=2, checkpoint_interval=4, keep_checkpoints=0)
    return TrainConfig(
        **(settings | overrides), optimizer=optimizer, out_dir=str(out), progress=False
    )


def records(out) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [
        json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in metrics")) for line in lines
    ]


def losses(out) -> list[tuple]:
    return [(r["step"], r["loss"], r.get("val_loss")) for r in records(out)]


def weights(checkpoint) -> dict[str, torch.Tensor]:
    state = {"model": GPT(gpt_config("tiny")).state_dict()}
    dcp.load(state, checkpoint_id=checkpoint, no_dist=True)
    return state["model"]


def files(root) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """8-step runs with checkpoints at 4 and 8: {optimizer: out_dir}."""
    runs = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    for optimizer in ("dobb", "adamw"):
        out = tmp_path_factory.mktemp(optimizer)
        train(config(out, optimizer))
        runs[optimizer] = out
    torch.set_num_threads(threads)
    return runs


def from_step_4(finished, tmp_path, optimizer="dobb"):
    """A copy of the finished run with its step-8 checkpoint gone: it resumes at step 4."""
    run = tmp_path / "run"
    shutil.copytree(finished[optimizer], run)
    shutil.rmtree(run / "checkpoints" / "step_000008")
    return run


# ---- 1. changed settings take effect, and the records say so -------------------------


@pytest.mark.parametrize(
    "optimizer, rates", [("dobb", {"lr": 0.0, "scalar_lr": 0.0}), ("adamw", {"lr": 0.0})]
)
def test_resume_with_lr_0_trains_with_lr_0(finished, tmp_path, optimizer, rates):
    run = from_step_4(finished, tmp_path, optimizer)
    with pytest.warns(RunWarning, match="changed fields .*lr.*take effect from step 5"):
        summary = train(config(run, optimizer, resume=True, **rates))
    before, after = (
        weights(run / "checkpoints/step_000004"),
        weights(run / "checkpoints/step_000008"),
    )
    for name in before:  # lr 0 in every group: nothing moved
        torch.testing.assert_close(after[name], before[name], rtol=0, atol=0, msg=name)
    resumed = [r for r in records(run) if r["step"] > 4]
    assert [r["lr"] for r in resumed] == [0.0] * 4
    assert all(r.get("scalar_lr", 0.0) == 0.0 for r in resumed)
    assert summary["lr"] == 0.0
    assert json.loads((run / "run.json").read_text())["config"]["lr"] == 0.0


def test_resume_with_longer_schedule_follows_it_from_the_first_resumed_step(finished, tmp_path):
    run = from_step_4(finished, tmp_path)
    cfg = config(run, resume=True, steps=12, warmup_steps=3, decay="linear", lr=2e-3)
    with pytest.warns(RunWarning, match="changed fields"):
        summary = train(cfg)
    rule = lr_schedule(cfg)
    resumed = [r for r in records(run) if r["step"] > 4]
    assert [r["step"] for r in resumed] == list(range(5, 13))
    for r in resumed:  # step s trains with the schedule's rate after s - 1 steps
        assert r["lr"] == pytest.approx(2e-3 * rule(r["step"] - 1), rel=1e-12), r["step"]
    assert summary["steps"] == 12


def test_resume_with_changed_weight_decay_applies_it(finished, tmp_path):
    same = from_step_4(finished, tmp_path / "a")
    decayed = from_step_4(finished, tmp_path / "b")
    train(config(same, resume=True))
    with pytest.warns(RunWarning, match="weight_decay"):
        train(config(decayed, resume=True, weight_decay=0.5))
    a, b = weights(same / "checkpoints/step_000008"), weights(decayed / "checkpoints/step_000008")
    assert not torch.equal(a["blocks.0.mlp.fc.weight"], b["blocks.0.mlp.fc.weight"])


STRUCTURAL = [  # an override that changes the run -> the field the one line names
    ({"model_overrides": {"n_layer": 1}}, "model_overrides"),
    ({"optimizer": "muon"}, "optimizer"),
    ({"optimizer_options": {"num_blocks": 4}}, "optimizer_options.num_blocks"),
    ({"optimizer_options": {"momentum": 0.9}}, "optimizer_options.momentum"),
    ({"optimizer_options": {"basis_interval": 3}}, "optimizer_options.basis_interval"),
    ({"optimizer_options": {"update_scale": 1.0}}, "optimizer_options.update_scale"),
    ({"seed": 1}, "seed"),
    ({"batch_size": 4}, "batch_size"),
    ({"steps": 3}, "steps"),
]


@pytest.mark.parametrize("change, field", STRUCTURAL, ids=[f for _, f in STRUCTURAL])
def test_resume_that_changes_the_run_stops_with_one_line_and_touches_nothing(
    finished, tmp_path, change, field
):
    run = from_step_4(finished, tmp_path)
    before = files(run)
    cfg = config(run, resume=True, **{k: v for k, v in change.items() if k != "optimizer"})
    cfg = replace(cfg, optimizer=change.get("optimizer", cfg.optimizer))
    with pytest.raises(ConfigError) as info:
        train(cfg)
    message = str(info.value)
    assert "\n" not in message and f"resume: {field}" in message, message
    assert "another out_dir" in message
    assert files(run) == before


def test_a_checkpoint_of_a_larger_model_is_refused_by_load_checkpoint(finished):
    smaller = GPT(gpt_config("tiny", n_layer=1))
    opt = torch.optim.AdamW(smaller.parameters())
    with pytest.raises(CheckpointError, match="model tensor.* this model lacks.*blocks.1"):
        load_checkpoint(finished["adamw"] / "checkpoints/step_000008", smaller, opt)


def test_dcp_failures_become_one_line(finished):
    wider = GPT(gpt_config("tiny", n_embd=128))
    opt = torch.optim.AdamW(wider.parameters())
    with pytest.raises(CheckpointError) as info:  # DCP raises a BaseException here
        load_checkpoint(finished["adamw"] / "checkpoints/step_000008", wider, opt)
    assert "\n" not in str(info.value) and "does not load into this model" in str(info.value)


# ---- 2. retention verifies before it deletes -----------------------------------------


def flip_a_byte(path):
    data = bytearray((path / "__0_0.distcp").read_bytes())
    data[len(data) // 2] ^= 0x01
    (path / "__0_0.distcp").write_bytes(bytes(data))


def crash_at(monkeypatch, step):
    get_batch = TokenStream.get_batch

    def dying(self, split, batch_step, *args):
        if split == "train" and batch_step == step:
            raise KeyboardInterrupt("killed")
        return get_batch(self, split, batch_step, *args)

    monkeypatch.setattr(TokenStream, "get_batch", dying)


def test_keep_1_with_a_damaged_newest_checkpoint_keeps_an_intact_one(finished, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished["dobb"], run)
    flip_a_byte(run / "checkpoints/step_000008")
    cfg = config(run, resume=True, checkpoint_interval=1, keep_checkpoints=1)
    with pytest.MonkeyPatch.context() as patch, pytest.warns(RunWarning):
        crash_at(patch, 6)  # saves 5 and 6, then dies
        with pytest.raises(KeyboardInterrupt):
            train(cfg)
    with pytest.warns(RunWarning, match="step_000008"):
        assert intact_checkpoint(run / "checkpoints").name == "step_000006"
    with pytest.warns(RunWarning, match="step_000008"):
        summary = train(cfg)
    assert (
        summary["final_val_loss"]
        == json.loads((finished["dobb"] / "summary.json").read_text())["final_val_loss"]
    )
    assert [p.name for p in checkpoint_dirs(run / "checkpoints")] == ["step_000008"]
    assert checkpoint_fault(run / "checkpoints/step_000008") is None


def fake_checkpoint(root, step, damaged=False):
    path = root / f"step_{step:06d}"
    path.mkdir(parents=True)
    (path / "data").write_bytes(bytes([step]) * 10)
    (path / MARKER).write_text(json.dumps({"step": step, "files": file_manifest(path)}))
    if damaged:
        (path / "data").write_bytes(b"x" * 10)


def test_pruning_never_leaves_fewer_intact_checkpoints_than_asked(tmp_path):
    for step in range(1, 6):
        fake_checkpoint(tmp_path, step, damaged=step >= 4)  # 4 and 5 damaged
    deleted = prune_checkpoints(tmp_path, keep=2)
    assert [p.name for p in deleted] == ["step_000001"]
    assert [p.name for p in checkpoint_dirs(tmp_path)] == [f"step_{s:06d}" for s in (2, 3, 4, 5)]
    assert prune_checkpoints(tmp_path, keep=5) == []  # fewer intact than asked: delete none


# ---- 4. torn metrics line, failing saves, the record of a checkpointed step ----------


def test_a_torn_last_metrics_line_does_not_block_the_resume(finished, tmp_path):
    run = from_step_4(finished, tmp_path)
    first = json.loads((run / "run.json").read_text())
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 9, "loss": 3.1')  # a disk filled up mid-append
    with pytest.warns(RunWarning, match=r"metrics.jsonl: line 9 is not a complete record"):
        train(config(run, resume=True))
    assert losses(run) == losses(finished["dobb"])
    info = json.loads((run / "run.json").read_text())
    assert info["previous"] == [first] and info["resumed_from"].endswith("step_000004")


def no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("where", ["dcp.save", "torch.save"])
def test_a_save_on_a_full_disk_is_one_line_and_leaves_no_tmp(tmp_path, monkeypatch, where):
    monkeypatch.setattr(ckpt.dcp if where == "dcp.save" else ckpt.torch, "save", no_space)
    with pytest.raises(CheckpointError) as info:
        train(config(tmp_path, "adamw"))
    message = str(info.value)
    assert "\n" not in message and "No space left on device" in message and "resume=true" in message
    assert list((tmp_path / "checkpoints").iterdir()) == []  # step_000004.tmp removed


def test_a_kill_after_the_checkpoint_rename_keeps_that_steps_record(
    finished, tmp_path, monkeypatch
):
    save = trainer.save_checkpoint

    def save_then_die(root, step, *args, **kwargs):
        path = save(root, step, *args, **kwargs)
        if step == 4:
            raise KeyboardInterrupt("killed after the rename")
        return path

    monkeypatch.setattr(trainer, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        train(config(tmp_path, "dobb"))
    assert [r["step"] for r in records(tmp_path)] == [1, 2, 3, 4]
    monkeypatch.setattr(trainer, "save_checkpoint", save)
    train(config(tmp_path, "dobb", resume=True))
    assert losses(tmp_path) == losses(finished["dobb"])


# ---- 5. loading runs no code ---------------------------------------------------------


class Payload:
    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return (open, (self.target, "w"))  # creates a file when unpickled


def test_a_crafted_rng_file_is_refused_and_runs_nothing(finished, tmp_path):
    run = from_step_4(finished, tmp_path)
    path, target = run / "checkpoints/step_000004", tmp_path / "pwned"
    with open(path / "rng_rank0.pt", "wb") as f:
        pickle.dump({"torch": Payload(str(target))}, f, protocol=2)
    marker = json.loads((path / MARKER).read_text())
    marker["files"] = file_manifest(path)  # the attacker rewrites the checksums too
    (path / MARKER).write_text(json.dumps(marker))
    with pytest.raises(CheckpointError, match="rng_rank0.pt holds more than RNG tensors"):
        train(config(run, resume=True))
    assert not target.exists()


def test_rng_state_round_trips_through_a_weights_only_file(tmp_path):
    import random

    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    np.random.standard_normal()  # leaves a cached gaussian in numpy's state
    torch.save(ckpt.rng_state(), tmp_path / "rng.pt")
    expected = (torch.rand(3), np.random.standard_normal(3), random.random())
    ckpt.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    got = (torch.rand(3), np.random.standard_normal(3), random.random())
    assert torch.equal(got[0], expected[0]) and np.array_equal(got[1], expected[1])
    assert got[2] == expected[2] and math.isfinite(got[2])
