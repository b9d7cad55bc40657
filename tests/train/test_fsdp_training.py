"""`train(cfg)` on 2 gloo ranks with FSDP2: it learns, matches one process, and resumes,
with an EMA of the weights (eval_ema) kept on the shards, evaluated and checkpointed."""

import json
import math
import shutil

import pytest
import torch
from multirank import run_ranks

from dobb.train.config import TrainConfig
from dobb.train.trainer import train

SETTINGS = dict(model="tiny", batch_size=8, steps=6, warmup_steps=1, eval_interval=3)
SETTINGS |= dict(eval_batches=2, optimizer="dobb", grad_clip=1.0, checkpoint_interval=3)
# the recommended Dobb keeps one row block per rank's rows: one process equals 2 FSDP ranks
# with two row blocks (each rank's rows one block)
SETTINGS |= dict(eval_ema=0.5, optimizer_options={"row_blocks": 2})


def train_on_rank(rank, world, out, resume):
    cfg = TrainConfig(**SETTINGS, layout="fsdp", out_dir=out, resume=resume, progress=False)
    return train(cfg)


def test_fsdp_run_learns_matches_one_process_and_resumes(tmp_path):
    out = tmp_path / "fsdp"
    summaries = run_ranks(train_on_rank, 2, str(out), False, timeout=120)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 0.1
    assert summaries[0] == summaries[1]  # every rank returns the same (averaged) numbers
    assert summaries[0]["world_size"] == 2

    torch.set_num_threads(1)
    single = train(TrainConfig(**SETTINGS, out_dir=str(tmp_path / "single"), progress=False))
    for key in ("final_val_loss", "final_val_loss_live"):  # EMA weights, live weights
        assert summaries[0][key] == pytest.approx(single[key], rel=1e-4)
    assert abs(single["final_val_loss"] - single["final_val_loss_live"]) > 1e-3
    assert summaries[0]["state_bytes_per_param"] == pytest.approx(single["state_bytes_per_param"])

    # resume under FSDP from the step-3 checkpoint: the same end as the uninterrupted run
    shutil.rmtree(out / "checkpoints" / "step_000006")
    resumed = run_ranks(train_on_rank, 2, str(out), True, timeout=120)
    assert resumed[0]["final_val_loss"] == summaries[0]["final_val_loss"]
    assert resumed[0]["final_val_loss_live"] == summaries[0]["final_val_loss_live"]
