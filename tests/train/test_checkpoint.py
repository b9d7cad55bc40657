"""A killed run resumes from its last complete checkpoint exactly; partial ones are ignored;
a damaged one is skipped for the newest intact one, and with none intact nothing is touched."""

import json
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from multirank import run_ranks

from dobb.optim.dobb import Dobb
from dobb.optim.dobb_core import OLD_NAMES
from dobb.registry import OPTIMIZERS
from dobb.train.checkpoint import (
    MARKER,
    CheckpointError,
    checkpoint_fault,
    complete_checkpoints,
    latest_checkpoint,
    read_metadata,
)
from dobb.train.config import TrainConfig
from dobb.train.data import TokenStream
from dobb.train.errors import RunWarning
from dobb.train.model import GPT, gpt_config
from dobb.train.trainer import train

STEPS, CRASH_AT = 8, 6  # checkpoints at 4 and 8; the crash loses steps 5 and 6


def config(out, optimizer, **overrides) -> TrainConfig:
    settings = dict(model="tiny", batch_size=8, steps=STEPS, warmup_steps=2, eval_interval=4)
    settings |= dict(eval_batches=2, checkpoint_interval=4, keep_checkpoints=0)
    settings |= overrides
    return TrainConfig(**settings, optimizer=optimizer, out_dir=str(out), progress=False)


def crash_at(monkeypatch, step):
    """Make the run die while fetching training batch `step` (after checkpoint 4)."""
    get_batch = TokenStream.get_batch

    def dying(self, split, batch_step, *args):
        if split == "train" and batch_step == step:
            raise KeyboardInterrupt("killed")
        return get_batch(self, split, batch_step, *args)

    monkeypatch.setattr(TokenStream, "get_batch", dying)


def final_params(checkpoint) -> dict[str, torch.Tensor]:
    state = {"model": GPT(gpt_config("tiny")).state_dict()}
    dcp.load(state, checkpoint_id=checkpoint, no_dist=True)
    return state["model"]


def losses(out) -> list[tuple]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"], r.get("val_loss")) for r in map(json.loads, lines)]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_resumed_run_equals_uninterrupted_run(tmp_path, monkeypatch, optimizer):
    whole = train(config(tmp_path / "whole", optimizer))
    with monkeypatch.context() as patch:
        crash_at(patch, CRASH_AT)
        with pytest.raises(KeyboardInterrupt):
            train(config(tmp_path / "split", optimizer))
    assert latest_checkpoint(tmp_path / "split" / "checkpoints").name == "step_000004"
    assert losses(tmp_path / "split")[-1][0] == CRASH_AT  # steps 5 and 6 were logged, then lost
    resumed = train(config(tmp_path / "split", optimizer, resume=True))

    assert resumed["final_val_loss"] == whole["final_val_loss"]
    assert losses(tmp_path / "split") == losses(tmp_path / "whole")  # steps 5, 6 logged once
    a = final_params(tmp_path / "whole" / "checkpoints" / "step_000008")
    b = final_params(tmp_path / "split" / "checkpoints" / "step_000008")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_checkpoint_in_dobbs_old_state_keys_resumes_exactly(tmp_path, monkeypatch):
    """A run saved with Dobb's state under the keys written up to d368fca (``cov``,
    ``cov_tail``, ...) resumes, and ends as the uninterrupted run (DCP reads today's keys
    from the old names: ``LegacyKeysLoadPlanner``)."""
    whole = train(config(tmp_path / "whole", "dobb"))
    state_dict = Dobb.state_dict

    def old_keys(self):
        saved = state_dict(self)
        saved["state"] = {
            i: {OLD_NAMES.get(k, k): v for k, v in entry.items()}
            for i, entry in saved["state"].items()
        }
        return saved

    with monkeypatch.context() as patch:
        patch.setattr(Dobb, "state_dict", old_keys)
        crash_at(patch, CRASH_AT)
        with pytest.raises(KeyboardInterrupt):
            train(config(tmp_path / "split", "dobb"))
    step_4 = tmp_path / "split" / "checkpoints" / "step_000004"
    saved = dcp.FileSystemReader(str(step_4)).read_metadata().state_dict_metadata
    assert any(k.endswith(".cov") for k in saved) and not any("input_cov" in k for k in saved)
    resumed = train(config(tmp_path / "split", "dobb", resume=True))
    assert resumed["final_val_loss"] == whole["final_val_loss"]
    a = final_params(tmp_path / "whole" / "checkpoints" / "step_000008")
    b = final_params(tmp_path / "split" / "checkpoints" / "step_000008")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)


def test_half_written_checkpoints_are_ignored(tmp_path, monkeypatch):
    out = tmp_path / "run"
    with monkeypatch.context() as patch:
        crash_at(patch, CRASH_AT)
        with pytest.raises(KeyboardInterrupt):
            train(config(out, "dobb"))
    root = out / "checkpoints"
    # a save killed before the rename, and a directory whose marker was never written
    (root / "step_000006.tmp").mkdir()
    (root / "step_000006.tmp" / ".metadata").write_bytes(b"partial")
    (root / "step_000005").mkdir()
    (root / "step_000005" / "__0_0.distcp").write_bytes(b"partial")
    assert [p.name for p in complete_checkpoints(root)] == ["step_000004"]
    assert latest_checkpoint(root).name == "step_000004"
    assert read_metadata(root / "step_000004")["step"] == 4

    with pytest.warns(RunWarning, match="step_000005: no COMPLETE marker"):  # .tmp: silent
        summary = train(config(out, "dobb", resume=True))
    whole = train(config(tmp_path / "whole", "dobb"))
    assert summary["final_val_loss"] == whole["final_val_loss"]
    assert (root / "step_000008" / MARKER).is_file()


def test_keep_prunes_oldest_and_missing_root_has_none(tmp_path):
    assert latest_checkpoint(tmp_path / "nowhere") is None
    cfg = config(tmp_path, "adamw", checkpoint_interval=2, keep_checkpoints=2)
    train(cfg)
    assert [p.name for p in complete_checkpoints(tmp_path / "checkpoints")] == [
        "step_000006",
        "step_000008",
    ]


# ---- damaged checkpoints --------------------------------------------------------------


def truncate(path):
    data = (path / "__0_0.distcp").read_bytes()
    (path / "__0_0.distcp").write_bytes(data[: len(data) // 2])


def flip_a_byte(path):
    data = bytearray((path / "__0_0.distcp").read_bytes())
    data[len(data) // 2] ^= 0x01  # same size, loads without complaint: only the checksum sees it
    (path / "__0_0.distcp").write_bytes(bytes(data))


def delete_a_file(path):
    (path / "rng_rank0.pt").unlink()


def remove_the_marker(path):
    (path / MARKER).unlink()


DAMAGE = {  # how a checkpoint is damaged -> the fault the warning names
    truncate: r"__0_0.distcp has \d+ bytes, \d+ were saved",
    flip_a_byte: "__0_0.distcp fails its SHA-256 check",
    delete_a_file: "rng_rank0.pt is missing",
    remove_the_marker: "no COMPLETE marker",
}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """An uninterrupted 8-step Dobb run with both checkpoints (4 and 8) kept."""
    out = tmp_path_factory.mktemp("finished")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every test here: bit-for-bit comparisons need equal threads
    train(config(out, "dobb"))
    torch.set_num_threads(threads)
    return out


def files(root) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_marker_records_size_and_checksum_of_every_file(finished_run):
    path = finished_run / "checkpoints" / "step_000008"
    listed = read_metadata(path)["files"]
    assert sorted(listed) == sorted(p.name for p in path.iterdir() if p.name != MARKER)
    assert all(listed[name]["bytes"] == (path / name).stat().st_size for name in listed)
    assert checkpoint_fault(path) is None


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("damage", DAMAGE, ids=lambda f: f.__name__)
def test_damaged_checkpoint_is_skipped_and_the_resumed_run_is_exact(tmp_path, finished_run, damage):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    damage(run / "checkpoints" / "step_000008")
    assert checkpoint_fault(run / "checkpoints" / "step_000004") is None

    with pytest.warns(
        RunWarning, match=f"skipping damaged checkpoint .*step_000008: {DAMAGE[damage]}"
    ):
        summary = train(config(run, "dobb", resume=True))  # from step 4: steps 5..8 again

    whole = json.loads((finished_run / "summary.json").read_text())
    assert summary["final_val_loss"] == whole["final_val_loss"]
    assert losses(run) == losses(finished_run)
    assert checkpoint_fault(run / "checkpoints" / "step_000008") is None  # saved again
    a = final_params(finished_run / "checkpoints" / "step_000008")
    b = final_params(run / "checkpoints" / "step_000008")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)


def test_no_intact_checkpoint_stops_and_touches_nothing(tmp_path, finished_run):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    flip_a_byte(run / "checkpoints" / "step_000004")
    truncate(run / "checkpoints" / "step_000008")
    before = files(run)
    message = "no intact checkpoint in .*step_000008: .*bytes.*; step_000004: .*SHA-256"
    with pytest.warns(RunWarning), pytest.raises(CheckpointError, match=message):
        train(config(run, "dobb", resume=True))
    assert files(run) == before


def resume_on_rank(rank, world, out):
    """Resume `out` under FSDP; return this rank's CheckpointError message (or None)."""
    try:
        train(config(out, "dobb", layout="fsdp", resume=True))
    except CheckpointError as e:
        return str(e)
    return None


def test_every_rank_stops_with_rank_0s_verdict(tmp_path, finished_run):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    delete_a_file(run / "checkpoints" / "step_000004")
    remove_the_marker(run / "checkpoints" / "step_000008")
    before = files(run)
    errors = run_ranks(resume_on_rank, 2, str(run), timeout=120)
    assert errors[0] is not None and errors[0].startswith("no intact checkpoint")
    assert errors[1] == errors[0]  # rank 0 checked the files; rank 1 got its answer
    assert files(run) == before
