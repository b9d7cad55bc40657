"""The workers of the owner-exchange optimizers' distributed tests (Muon, MuonBP, Dion): a
reference on one device trained beside a layout on the same global batches, and a DCP
checkpoint saved on one mesh and resumed on another. ``test_muon_distributed``,
``test_muonbp_distributed`` and ``test_dion_distributed`` run them on their ranks.
"""

import copy

import torch
from layouts import LAYOUTS, MLP, full, parallelize, train_step
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

import dobb

STEPS = 3


# each optimizer's process-group argument (dobb.distributed.groups): Muon's replicas share
# the work; Dion's replicas run its compressed sync
GROUP_ARGUMENT = {"muon": "replica_group", "muonbp": "replica_group", "dion": "sync_group"}


def build(name, model, options, group=None):
    """Optimizer ``name`` over ``model`` (weights: the matrix algorithm; biases: AdamW);
    ``group`` goes to its process-group argument."""
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    cls = {"muon": dobb.Muon, "muonbp": dobb.MuonBP, "dion": dobb.Dion}[name]
    groups = dobb.param_groups(inner, cls.algorithm, exclude="^$")
    return cls(groups, **options, **{GROUP_ARGUMENT[name]: group})


def compare_layout(rank, world, layout, name, options, data_parallel=False, compressed=False):
    """Train a reference on one device and ``layout`` on the same global batches.

    ``data_parallel``: pass the layout's data-parallel group/mesh to the optimizer.
    ``compressed``: and leave the weights' gradients unaveraged (see ``parallelize``).
    """
    torch.manual_seed(0)
    _, _, hidden, out = LAYOUTS[layout]
    # compressed HSDP averages nothing over the replicas: no biases there (AdamW would see
    # unaveraged gradients); DDP ignores just the weights
    reference = MLP(hidden, out, bias=not compressed or layout == "ddp")
    model = copy.deepcopy(reference)
    ref_opt = build(name, reference, options)
    model, data, dp_rank, dp_size = parallelize(model, layout, world, compressed=compressed)
    opt = build(name, model, options, data if data_parallel else None)
    comms = []
    for step in range(STEPS):
        train_step(reference, ref_opt, step, 0, 1, out)
        comms.append(train_step(model, opt, step, dp_rank, dp_size, out))
        if compressed and step == 0:  # replicas' momenta differ; state_dict averages them
            opt.state_dict()
            momenta = [full(s["momentum"]).clone() for s in opt.state.values() if "Q" in s]
    errors = [
        ((full(p.detach()) - q).norm() / q.norm()).item()
        for p, q in zip(model.parameters(), reference.parameters())
    ]
    return {
        "errors": errors,
        "comms": comms,
        "plan": _plan(opt),
        "momenta": momenta if compressed else None,
    }


def _plan(opt):
    """Muon's owners and piece sizes: (owner, [numel per rank]) per matrix."""
    if not isinstance(opt, dobb.Muon):
        return None
    return [
        (exchange.owners[j], [exchange._numel(j, h) for h in range(exchange.size)])
        for exchange, _ in opt.exchanges.exchanges
        for j in range(len(exchange.shapes))
    ]


MUON = {"ns_dtype": torch.float32, "lr": 0.05, "weight_decay": 0.1}


def checkpoint_run(rank, world, path, phase, layout, name="muon", options=None):
    """phase "save": 2 steps, DCP save, 2 more; "load": DCP load, the last 2 steps.

    Returns the final parameters and, per optimizer-state tensor, (key, placements or None,
    full value). Shared with ``test_dion_distributed`` and ``test_muonbp_distributed``.
    """
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    out = 16
    model, _, dp_rank, dp_size = parallelize(MLP(18, out), layout, world)
    opt = build(name, model, MUON if options is None else options)
    if phase == "save":
        for step in range(2):
            train_step(model, opt, step, dp_rank, dp_size, out)
        dcp.save(
            {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)},
            checkpoint_id=path,
        )
    else:
        before = [full(p.detach()).clone() for p in model.parameters()]
        # DCP builds the optimizer state with a zero-gradient, lr = 0 step: no change, no NaN
        state = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}
        for a, p in zip(before, model.parameters()):
            assert torch.equal(a, full(p.detach()))
        assert all(torch.isfinite(full(t)).all() for s in opt.state.values() for t in s.values())
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])
        set_optimizer_state_dict(model, opt, state["optim"])
    for step in range(2, 4):
        train_step(model, opt, step, dp_rank, dp_size, out)
    states = [
        (key, tuple(v.placements) if isinstance(v, DTensor) else None, full(v))
        for s in opt.state.values()
        for key, v in s.items()
        if key in ("momentum", "Q")
    ]
    return [full(p.detach()) for p in model.parameters()], states
