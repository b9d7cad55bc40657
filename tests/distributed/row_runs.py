"""The worker of the row-normalizing and row-selecting optimizers' distributed tests (NorMuon,
Dion2, NorDion2): a reference on one device trained beside a layout on the same global
batches. ``test_normuon_distributed``, ``test_dion2_distributed`` and
``test_nordion2_distributed`` run it on their ranks.

Tolerance as Muon's: with ``ns_dtype=torch.float32`` the owner runs the same Newton-Schulz
as one device, so the parameters agree to float rounding (relative error 1e-5).
"""

import copy

import torch
from layouts import LAYOUTS, MLP, full, parallelize, train_step
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
