"""One live run per out_dir, and the smaller guards: settings that are refused instead of
ignored, data that is what it says, strict JSON logs, a collective timeout."""

import json
import multiprocessing
import os
import shutil
import signal
import time
from datetime import timedelta

import numpy as np
import pytest
import torch
from multirank import run_ranks

from dobb.train import trainer
from dobb.train.config import ConfigError, TrainConfig, load_config
from dobb.train.data import TokenStream, load_tokens
from dobb.train.errors import RunError
from dobb.train.lock import OutDirLock
from dobb.train.parallel import mesh_shape
from dobb.train.trainer import train

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def config(out, **overrides) -> TrainConfig:
    settings = dict(model="tiny", batch_size=8, steps=4, warmup_steps=0, eval_interval=4)
    settings |= dict(eval_batches=1, optimizer="adamw")
    return TrainConfig(**(settings | overrides), out_dir=str(out), progress=False)


def steps(out) -> list[int]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines]


# ---- 3. one live run per out_dir -------------------------------------------------------


def run_until_released(out: str, ready: str, go: str) -> None:
    """Train in `out`, pausing before batch 2 until the file `go` exists."""
    torch.set_num_threads(1)
    get_batch = TokenStream.get_batch

    def paused(self, split, step, *args):
        if split == "train" and step == 2:
            open(ready, "w").close()
            while not os.path.exists(go):
                time.sleep(0.05)
        return get_batch(self, split, step, *args)

    TokenStream.get_batch = paused
    train(config(out, checkpoint_interval=1))


def wait_for(path, process, seconds=120):
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert process.is_alive() and time.monotonic() < deadline, "the first run never started"
        time.sleep(0.05)


@pytest.mark.parametrize("resume", [False, True])
def test_a_second_run_into_a_live_runs_out_dir_is_refused(tmp_path, resume):
    out, ready, go = tmp_path / "run", tmp_path / "ready", tmp_path / "go"
    first = multiprocessing.get_context("spawn").Process(
        target=run_until_released, args=(str(out), str(ready), str(go))
    )
    first.start()
    try:
        wait_for(ready, first)
        with pytest.raises(RunError, match=r"in use by a live run \(pid \d+"):
            train(config(out, checkpoint_interval=1, resume=resume))
    finally:
        go.touch()
        first.join(120)
    assert first.exitcode == 0
    assert steps(out) == [1, 2, 3, 4]  # the first run's log, whole and alone
    assert not (out / ".run.lock").exists()


def lock_and_die(out: str) -> None:
    OutDirLock(out)
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_killed_runs_lock_does_not_block_the_next_run(tmp_path):
    dead = multiprocessing.get_context("spawn").Process(target=lock_and_die, args=(str(tmp_path),))
    dead.start()
    dead.join(60)
    assert dead.exitcode == -signal.SIGKILL and (tmp_path / ".run.lock").exists()
    train(config(tmp_path))
    assert steps(tmp_path) == [1, 2, 3, 4]


def test_a_failed_run_leaves_no_directory_behind(tmp_path):
    with pytest.raises(RunError, match="no data at"):
        train(config(tmp_path / "new" / "run", data=str(tmp_path / "missing.txt")))
    assert not (tmp_path / "new").exists()


def test_an_out_dir_under_a_file_is_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(RunError, match="out_dir .* cannot be created"):
        train(config(tmp_path / "file" / "run"))


# ---- 9. smaller guards -------------------------------------------------------------------


@pytest.mark.parametrize("override", ["lr=inf", "scalar_lr=inf", "lr=nan", "grad_clip=inf"])
def test_non_finite_rates_are_refused(override):
    with pytest.raises(ConfigError, match=f"{override.split('=')[0]}=.* is invalid"):
        load_config(None, [override])


def test_skipped_steps_are_counted_and_logs_stay_strict_json(tmp_path, monkeypatch):
    clip, calls = trainer.clip_grad_norm, []

    def clip_with_a_nan_at_step_2(model, max_norm):
        calls.append(1)
        if len(calls) == 2:
            next(p for p in model.parameters() if p.grad is not None).grad.view(-1)[0] = np.nan
        return clip(model, max_norm)

    monkeypatch.setattr(trainer, "clip_grad_norm", clip_with_a_nan_at_step_2)
    cfg = config(tmp_path, optimizer="dobb", grad_clip=1.0)
    cfg.optimizer_options = {"nonfinite": "skip"}
    summary = train(cfg)

    def strict(constant):
        raise AssertionError(f"{constant} in a log")

    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line, parse_constant=strict) for line in lines]
    assert [r.get("skipped", False) for r in records] == [False, True, False, False]
    assert records[1]["grad_norm"] is None  # was NaN
    assert summary["skipped_steps"] == 1
    assert json.loads((tmp_path / "summary.json").read_text(), parse_constant=strict) == summary


def test_a_model_override_that_does_not_build_is_blamed_on_model_overrides(tmp_path):
    with pytest.raises(ConfigError) as info:
        train(config(tmp_path, model_overrides={"n_head": 3}))
    message = str(info.value)
    assert "model_overrides" in message and "n_head=3" in message and "layout" not in message


def test_the_fsdp_tp_error_names_the_config_key():
    with pytest.raises(ValueError, match=r"set tensor_parallel=") as info:
        mesh_shape("fsdp_tp", 2, 3)
    assert "--tensor-parallel" not in str(info.value)


def tp_run(rank, world, out):
    try:
        train(config(out, layout="tp", tensor_parallel=3))
    except ConfigError as e:
        return str(e)
    return None


def test_a_tp_degree_other_than_the_world_size_is_refused(tmp_path):
    errors = run_ranks(tp_run, 2, str(tmp_path / "run"), timeout=120)
    assert errors[0] is not None and "tensor_parallel=3" in errors[0]
    assert "set tensor_parallel=2" in errors[0] and errors[1] == errors[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_glob_of_text_files_is_read_as_text(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"hello ")
    (tmp_path / "b.txt").write_bytes(b"world")
    tokens, vocab, corpus = load_tokens(str(tmp_path / "*.txt"))
    assert bytes(tokens.astype(np.uint8)) == b"hello world" and vocab == 256
    assert corpus.tokenizer == "bytes"


def test_a_corpus_replaced_at_the_same_path_stops_the_resume(tmp_path):
    data = tmp_path / "corpus.txt"
    data.write_bytes(bytes(range(256)) * 40)
    out = tmp_path / "run"
    cfg = config(out, data=str(data), steps=4, checkpoint_interval=2, keep_checkpoints=0)
    train(cfg)
    shutil.rmtree(out / "checkpoints" / "step_000004")
    data.write_bytes(bytes(reversed(range(256))) * 40)  # same size, other text
    trainer.load_data.cache_clear()
    before = (out / "run.json").read_bytes()
    cfg.resume = True
    with pytest.raises(ConfigError, match="has changed since .*step_000002 was saved"):
        train(cfg)
    assert (out / "run.json").read_bytes() == before


def test_timeout_reaches_the_process_group(tmp_path, monkeypatch):
    seen = {}

    class Joined(Exception):
        pass

    def init_process_group(backend, **kwargs):
        seen.update(kwargs, backend=backend)
        raise Joined

    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.distributed, "init_process_group", init_process_group)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(Joined):
        train(config(tmp_path, timeout=5))
    assert seen == {"backend": "gloo", "timeout": timedelta(seconds=5)}
    with pytest.raises(ConfigError, match="timeout=0.0 is invalid"):
        load_config(None, ["timeout=0"])
