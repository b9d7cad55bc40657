"""Sharded MuonBP equals MuonBP on one device with the matching tiling (FSDP2, TP, FSDP x TP).

On a block step each rank orthogonalizes its own shard, with no communication; on a full
step the whole matrix goes through Muon's owner exchange. A single-device run whose
``row_blocks``/``col_blocks`` cut each matrix as the layout shards it takes the same
steps. Schedule here: period 3 over 4 steps, so full, block, block, full.

Tolerance as Muon's (``ns_dtype=torch.float32``): a relative error of 1e-5 on the
parameters (the single device batches equal tiles in one Newton-Schulz call, each rank
runs its own tile alone: the same products, rounded alike up to the matmul kernels).
"""

import copy

import pytest
import torch
from layouts import LAYOUTS, MLP, full, parallelize, train_step
from multirank import run_ranks
from muon_runs import checkpoint_run

import dobb
from dobb.optim.muonbp import MuonBP

STEPS = 4
TOLERANCE = 1e-5
OPTIONS = {"ns_dtype": torch.float32, "lr": 0.05, "weight_decay": 0.1}
BLOCK = {"period": 3, "block_lr_ratio": 0.5}
# The single-device tiling of (fc1, fc2), as (row_blocks, col_blocks), that each layout's
# shards make on its world size. fc1 is 18 (20 under TP) x 16, fc2 out x 18 (see LAYOUTS).
TILINGS = {
    ("fsdp", 2): ((2, 1), (2, 1)),  # rows over FSDP
    ("fsdp", 4): ((4, 1), (4, 1)),  # 18 rows: 5/5/5/3; fc2's 3 rows: 1/1/1/0
    ("tp", 2): ((2, 1), (1, 2)),  # column-parallel fc1: rows; row-parallel fc2: columns
    # fc1: rows over TP, each TP shard's rows over FSDP (_StridedShard): 5/4/5/4;
    # fc2: rows over FSDP x columns over TP
    ("fsdp_tp", 4): (((2, 2), 1), (2, 2)),
}


def build(model, tiling, **extra):
    """MuonBP over ``model``: one group per weight, tiled as given; biases to AdamW."""
    groups = [
        {"params": [layer.weight], "row_blocks": rows, "col_blocks": cols}
        for layer, (rows, cols) in zip((model.fc1, model.fc2), tiling)
    ]
    groups.append({"params": [model.fc1.bias, model.fc2.bias], "algorithm": "adamw"})
    return MuonBP(groups, **OPTIONS, **BLOCK, **extra)


def drop_fc2_grad_on_step(opt, fc2, step):
    """Before the ``step``-th optimizer step, fc2's weight loses its gradient (its phase
    then lags fc1's: on the last step fc1 is due for a full step and fc2 for a block step)."""
    calls = iter(range(STEPS))

    def hook(optimizer, args, kwargs):
        if next(calls) == step:
            fc2.weight.grad = None

    opt.register_step_pre_hook(hook)


def compare(rank, world, layout, out_of_phase):
    """Reference on one device and ``layout``, trained on the same global batches.

    ``out_of_phase``: the sharded fc1 is further cut into 2 row tiles per shard (the
    reference nests the splits), and fc2 skips step 1 (see ``drop_fc2_grad_on_step``).
    """
    torch.manual_seed(0)
    _, _, hidden, out = LAYOUTS[layout]
    reference = MLP(hidden, out)
    model, muon_model = copy.deepcopy(reference), copy.deepcopy(reference)
    tiling = TILINGS[layout, world]
    local_tiling = ((1, 1), (1, 1))
    if out_of_phase:
        (rows, cols), fc2_tiling = tiling
        tiling = (((rows, 2), cols), fc2_tiling)
        local_tiling = ((2, 1), (1, 1))
    ref_opt = build(reference, tiling)
    model, _, dp_rank, dp_size = parallelize(model, layout, world)
    opt = build(model, local_tiling)
    if out_of_phase:
        drop_fc2_grad_on_step(ref_opt, reference.fc2, 1)
        drop_fc2_grad_on_step(opt, model.fc2, 1)
    comms = []
    for step in range(STEPS):
        train_step(reference, ref_opt, step, 0, 1, out)
        comms.append(train_step(model, opt, step, dp_rank, dp_size, out))
    # the collectives of one step of Muon on the same layout
    muon_model, _, dp_rank, dp_size = parallelize(muon_model, layout, world)
    groups = dobb.param_groups(muon_model, "muon", exclude="^$")
    muon = train_step(muon_model, dobb.Muon(groups, **OPTIONS), 0, dp_rank, dp_size, out)
    errors = [
        ((full(p.detach()) - q).norm() / q.norm()).item()
        for p, q in zip(model.parameters(), reference.parameters())
    ]
    return {"errors": errors, "comms": comms, "muon": muon}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "layout, world, out_of_phase",
    [
        ("fsdp", 2, False),
        ("fsdp", 4, False),
        ("tp", 2, False),
        ("fsdp_tp", 4, False),
        ("fsdp", 2, True),
    ],
)
def test_sharded_muonbp_equals_single_device_with_matching_tiling(layout, world, out_of_phase):
    results = run_ranks(compare, world, layout, out_of_phase, timeout=110)
    for result in results:
        assert max(result["errors"]) <= TOLERANCE, result["errors"]
    for result in results:
        full_0, block_1, block_2, full_3 = result["comms"]
        # block steps: no collective at all
        assert block_1 == [] and block_2 == []
        # full steps: Muon's exchange, one all_to_all to the owners and one back
        assert [kind for kind, _, _ in result["muon"]] == ["all_to_all"] * 2
        assert full_0 == result["muon"]
        if out_of_phase:  # fc1 alone is due: an exchange of just fc1, planned on first use
            assert [event for event in full_3 if event[0] == "all_to_all"] != full_0
            assert [kind for kind, _, _ in full_3].count("all_to_all") == 2
        else:
            assert full_3 == result["muon"]


@pytest.mark.timeout(120)
def test_dcp_resume_mid_period_on_another_mesh_equals_uninterrupted(tmp_path):
    """Save under HSDP on 2 x 2 ranks after updates 0 (full) and 1 (block) of period 3,
    resume under FSDP on 2: update 2 is a block step and 3 a full one only if ``step``
    round-trips.

    Blocks are the local shards, so most mesh changes change the block steps' math (and
    ``row_blocks``/``col_blocks`` come back from the checkpoint with the param groups, so a
    new tiling cannot make up for it). HSDP shards each matrix over its data_shard axis of
    2 exactly as FSDP on 2 does (fc1 18 x 16: 9/9 rows, fc2 16 x 18: 8/8): the same math.
    """
    options = {**OPTIONS, **BLOCK}
    args = (str(tmp_path), "save", "hsdp", "muonbp", options)
    uninterrupted, _ = run_ranks(checkpoint_run, 4, *args, timeout=110)[0]
    args = (str(tmp_path), "load", "fsdp", "muonbp", options)
    resumed, _ = run_ranks(checkpoint_run, 2, *args, timeout=110)[0]
    for a, b in zip(uninterrupted, resumed):
        torch.testing.assert_close(a, b, rtol=TOLERANCE, atol=1e-7)
