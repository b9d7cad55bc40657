"""Distributed Muon equals the single-device run under DDP, FSDP2, HSDP, TP and FSDP x TP.

Each matrix is gathered to one owner rank, orthogonalized there and sent back (one
all_to_all each way per step). The layout helpers here are shared with
``test_dion_distributed``.

Tolerance: with ``ns_dtype=torch.float32`` the owner runs the same Newton-Schulz on the
same matrix as one device, so parameters agree to float rounding; we allow a relative
error of 1e-5 (measured: ~1e-7).
"""

import copy

import pytest
import torch
import torch.distributed as dist
from multirank import run_ranks
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel

import dobb
from dobb.distributed import CommRecorder

D, BATCH, STEPS = 16, 8, 3
TOLERANCE = 1e-5
# layout -> (mesh shape (None: 1-D over the world), mesh axis names, hidden, output width).
# Hidden width 18 splits unevenly (18 rows over 4: 5/5/5/3; over TP x FSDP 2 x 2: 5/4/5/4);
# an output width of 3 over 4 FSDP ranks leaves one rank an empty shard of fc2. Under plain
# TP the hidden activations must split evenly (DTensor's TP assumes it): 20.
LAYOUTS = {
    "ddp": (None, None, 18, 16),
    "fsdp": (None, ("data_shard",), 18, 3),
    "hsdp": ((2, 2), ("data_replicate", "data_shard"), 18, 3),
    "tp": (None, ("tensor",), 20, 16),
    "fsdp_tp": ((2, 2), ("data_shard", "tensor"), 18, 16),
}


class MLP(nn.Module):
    def __init__(self, hidden, out, bias=True):
        super().__init__()
        self.fc1 = nn.Linear(D, hidden, bias=bias)
        self.fc2 = nn.Linear(hidden, out, bias=bias)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def global_batch(step, out):
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, 3, D, generator=gen) * torch.linspace(0.5, 2.0, D)
    return x, torch.sin(x.flip(-1))[..., :out]


def parallelize(model, layout, world, *, compressed=False):
    """Apply ``layout``; return (model, data-parallel group/mesh, dp rank, dp size).

    ``compressed``: gradients of the weight matrices are left unaveraged across replicas
    (DDP ignores them; HSDP shards over data_shard only), for Dion's compressed sync.
    """
    shape, names, _, _ = LAYOUTS[layout]
    if layout == "ddp":
        if compressed:
            weights = ["fc1.weight", "fc2.weight"]
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, weights)
        return DistributedDataParallel(model), dist.group.WORLD, dist.get_rank(), world
    mesh = init_device_mesh("cpu", shape or (world,), mesh_dim_names=names)
    if "tensor" in names:
        plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
        parallelize_module(model, mesh["tensor"], plan)
        if layout == "tp":
            return model, None, 0, 1
    data = mesh["data_shard"] if layout == "fsdp_tp" else mesh
    # compressed HSDP: shard over data_shard only; the replicas are plain copies whose
    # gradients nobody averages (Dion's P and R sync replaces that all-reduce)
    shard = mesh["data_shard"] if compressed else data
    for module in (model.fc1, model.fc2, model):
        fully_shard(module, mesh=shard)
    dp_rank = 0
    for axis, coordinate in enumerate(data.get_coordinate()):  # row-major over data axes
        dp_rank = dp_rank * data.size(axis) + coordinate
    return model, data, dp_rank, data.size()


def train_step(model, opt, step, dp_rank, dp_size, out):
    """One step on this rank's share of the global batch; the collectives inside step()."""
    x, y = global_batch(step, out)
    rows = slice(dp_rank * BATCH // dp_size, (dp_rank + 1) * BATCH // dp_size)
    opt.zero_grad()
    nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
    with CommRecorder() as rec:
        opt.step()
    return [(e.kind, e.group_size, e.numel) for e in rec.events]


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def build(name, model, options, data_parallel=None):
    """Optimizer ``name`` over ``model`` (weights: the matrix algorithm; biases: AdamW)."""
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    cls = {"muon": dobb.Muon, "dion": dobb.Dion}[name]
    groups = dobb.param_groups(inner, cls.algorithm, exclude="^$")
    return cls(groups, **options, data_parallel=data_parallel)


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
        for exchange, _ in opt._exchanges
        for j in range(len(exchange.shapes))
    ]


MUON = {"ns_dtype": torch.float32, "lr": 0.05, "weight_decay": 0.1}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "layout, world",
    [("ddp", 2), ("fsdp", 2), ("fsdp", 4), ("hsdp", 4), ("tp", 2), ("fsdp_tp", 4)],
)
def test_sharded_muon_equals_single_device(layout, world):
    # under DDP the replicas share the work (Keller's distributed Muon): data_parallel set
    results = run_ranks(compare_layout, world, layout, "muon", MUON, layout == "ddp", timeout=110)
    for result in results:
        assert max(result["errors"]) <= TOLERANCE, result["errors"]
    # one all_to_all to the owners (none under DDP: every rank holds N whole), one back,
    # over every rank of the mesh (or the DDP group)
    expected = [("all_to_all", world)] * (1 if layout == "ddp" else 2)
    for result in results:
        for step in result["comms"]:
            assert [(kind, size) for kind, size, _ in step] == expected
    # elements, all ranks together: the owner receives each piece it lacks once (a piece
    # held by several replicas is sent by one), and sends every other rank its piece
    plan = results[0]["plan"]
    replicas = 2 if layout in ("ddp", "hsdp") else 1
    lacking = sum(sum(sizes) // replicas - sizes[owner] for owner, sizes in plan)
    returned = sum(sum(sizes) - sizes[owner] for owner, sizes in plan)
    for step in range(STEPS):
        moved = [sum(r["comms"][step][i][2] for r in results) for i in range(len(expected))]
        assert moved == ([returned] if layout == "ddp" else [lacking, returned])


def checkpoint_run(rank, world, path, phase, layout):
    """phase "save": 2 steps, DCP save, 2 more; "load": DCP load, the last 2 steps."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    out = 16
    model, _, dp_rank, dp_size = parallelize(MLP(18, out), layout, world)
    opt = build("muon", model, MUON)
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
    momenta = [type(s["momentum"]).__name__ for s in opt.state.values() if "momentum" in s]
    return [full(p.detach()) for p in model.parameters()], momenta


@pytest.mark.timeout(120)
def test_dcp_resume_on_another_mesh_equals_uninterrupted(tmp_path):
    """Save under FSDP x TP on 4 ranks, resume under FSDP on 2."""
    uninterrupted, momenta = run_ranks(
        checkpoint_run, 4, str(tmp_path), "save", "fsdp_tp", timeout=110
    )[0]
    assert momenta == ["DTensor", "DTensor"]  # momentum state sharded like the weights
    resumed, _ = run_ranks(checkpoint_run, 2, str(tmp_path), "load", "fsdp", timeout=110)[0]
    for a, b in zip(uninterrupted, resumed):
        torch.testing.assert_close(a, b, rtol=TOLERANCE, atol=1e-7)
