"""Distributed NorMuon equals the single-device run under DDP, FSDP2 and HSDP.

Muon's owner exchange (one all_to_all to the owners, none under DDP; one back), then each
rank normalizes its own rows and one all_reduce of one float per matrix sums ``||Ô||_F²``
(none under DDP, where every rank holds whole matrices). The worker ``compare`` is shared
with ``test_dion2_distributed``.

Tolerance as Muon's: with ``ns_dtype=torch.float32`` the owner runs the same Newton-Schulz
as one device, so the parameters agree to float rounding (relative error 1e-5).
"""

import copy

import pytest
import torch
from layouts import LAYOUTS, MLP, full, parallelize, train_step
from multirank import run_ranks
from torch.nn.parallel import DistributedDataParallel

import dobb

STEPS = 3
TOLERANCE = 1e-5
OPTIONS = {"ns_dtype": torch.float32, "lr": 0.02, "weight_decay": 0.1}


def build(name, model, options, replica_group=None, row_blocks=None):
    """``name`` over ``model``'s weights (biases: AdamW); Dion2 weights get ``row_blocks``."""
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    cls = {"normuon": dobb.NorMuon, "dion2": dobb.Dion2, "nordion2": dobb.NorDion2}[name]
    weights = [inner.fc1.weight, inner.fc2.weight]
    groups = [
        {"params": [w]} if row_blocks is None else {"params": [w], "row_blocks": row_blocks}
        for w in weights
    ]
    groups.append({"params": [inner.fc1.bias, inner.fc2.bias], "algorithm": "adamw"})
    return cls(groups, **options, replica_group=replica_group)


def compare(rank, world, layout, name, options, reference_blocks=None):
    """Train a single-device reference and ``layout`` on the same global batches.

    ``reference_blocks``: Dion2's ``row_blocks`` on one device (the layout's row shards).
    Returns the relative errors, the collectives of each step and the exchange plans.
    """
    torch.manual_seed(0)
    _, _, hidden, out = LAYOUTS[layout]
    reference = MLP(hidden, out)
    model = copy.deepcopy(reference)
    ref_opt = build(name, reference, options, row_blocks=reference_blocks)
    model, data, dp_rank, dp_size = parallelize(model, layout, world)
    opt = build(name, model, options, data if layout == "ddp" else None)
    comms = []
    for step in range(STEPS):
        train_step(reference, ref_opt, step, 0, 1, out)
        comms.append(train_step(model, opt, step, dp_rank, dp_size, out))
    errors = [
        ((full(p.detach()) - q).norm() / q.norm()).item()
        for p, q in zip(model.parameters(), reference.parameters())
    ]
    plans = [
        [
            (exchange.owners[j], [len(r) * len(c) for r, c in exchange.pieces[j]])
            for j in range(len(exchange.shapes))
        ]
        for exchange, _ in opt.exchanges.exchanges
    ]
    placements = [
        tuple(v.placements) if hasattr(v, "placements") else None
        for s in opt.state.values()
        for key, v in s.items()
        if key == "row_second_moment"
    ]
    return {"errors": errors, "comms": comms, "plans": plans, "placements": placements}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout, world", [("ddp", 2), ("fsdp", 2), ("fsdp", 4), ("hsdp", 4)])
def test_sharded_normuon_equals_single_device(layout, world):
    results = run_ranks(compare, world, layout, "normuon", OPTIONS, timeout=110)
    for result in results:
        assert max(result["errors"]) <= TOLERANCE, result["errors"]
    # Muon's exchange, then the sum of ||Ô||_F² over the mesh (DDP: neither the gather
    # nor the sum: every rank holds N and O whole)
    if layout == "ddp":
        expected = [("all_to_all", world)]
    else:
        expected = [("all_to_all", world), ("all_to_all", world), ("all_reduce", world)]
    for result in results:
        for step in result["comms"]:
            assert [(kind, size) for kind, size, _ in step] == expected
            if layout != "ddp":
                assert step[-1][2] == 2  # one float per matrix (fc1, fc2)
    if layout != "ddp":  # v is sharded like the rows of W
        assert all(p is not None for p in results[0]["placements"])


def construct_on_tp(rank, world):
    model, _, _, _ = parallelize(MLP(20, 16), "tp", world)
    for name in ("normuon", "dion2", "nordion2"):
        with pytest.raises(NotImplementedError, match="split along its columns"):
            build(name, model, OPTIONS)
    return True


@pytest.mark.timeout(60)
def test_column_split_weights_are_rejected():
    # TP's row-parallel fc2 is Shard(1): rows are split over ranks, so neither the row
    # normalization (NorMuon) nor the row selection (Dion2) can run on a rank's piece
    assert all(run_ranks(construct_on_tp, 2, timeout=50))
