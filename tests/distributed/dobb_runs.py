"""The worker of Dobb's distributed tests: the layout and a single-device model trained side by
side (``test_dobb_distributed``, ``test_dobb_variants_distributed``)."""

import copy

import torch
from layouts import LAYOUTS, MLP, full, parallelize, train_step

import dobb
from bench.tools.comm_recorder import CommRecorder

STEPS = 4


HYPER = dict(lr=0.02, basis_interval=2, weight_decay=0.1)


# Blocks must tile TP column shards: hidden 18 splits 9/9 over TP 2 (2 blocks of 9), hidden
# 20 over TP 2 or 4 into 10s or 5s (4 blocks of 5); elsewhere 4 ragged blocks of 5,5,4,4.
NUM_BLOCKS = {"ddp": 4, "fsdp": 4, "hsdp": 4, "tp": 4, "fsdp_tp": 2}


def dobb_step(model, opt, step, dp_rank, dp_size, out):
    """A training step; the kinds of the collectives inside ``opt.step()``."""
    return [kind for kind, _, _ in train_step(model, opt, step, dp_rank, dp_size, out)]


def compare_layout(
    rank,
    world,
    layout,
    stats_sync,
    shard_refresh=True,
    basis_method="auto",
    options=None,
    reference_options=None,
):
    """Train the layout and the single-device model side by side (``options`` for both,
    ``reference_options`` on top for the single-device one)."""
    torch.manual_seed(0)
    _, _, hidden, out = LAYOUTS[layout]
    hyper = {**HYPER, "num_blocks": NUM_BLOCKS[layout], "basis_method": basis_method}
    hyper |= options or {}
    reference = MLP(hidden, out)
    model = copy.deepcopy(reference)
    ref_opt = dobb.Dobb(
        dobb.param_groups(reference, exclude="^$"), **hyper | (reference_options or {})
    )
    ref_opt.track(reference)
    model, data, dp_rank, dp_size = parallelize(model, layout, world)
    opt = dobb.Dobb(
        dobb.param_groups(model, exclude="^$"),
        **hyper,
        stats_group=data,
        stats_sync=stats_sync,
        shard_refresh=shard_refresh,
    )
    opt.track(model)
    comms = []
    for step in range(STEPS):
        dobb_step(reference, ref_opt, step, 0, 1, out)
        comms.append(dobb_step(model, opt, step, dp_rank, dp_size, out))
    errors = [
        ((full(p.detach()) - q).norm() / q.norm()).item()
        for p, q in zip(model.parameters(), reference.parameters())
    ]
    keys = ("input_basis_0", "input_basis_1")
    bases = [full(s[k]) for s in opt.state.values() for k in keys if k in s]
    with CommRecorder() as rec:  # after a non-refresh step: averages unless synced every step
        opt.state_dict()
    return {"errors": errors, "comms": comms, "bases": bases, "save": rec.count()}
