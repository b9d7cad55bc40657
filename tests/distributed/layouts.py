"""Layouts shared by the distributed tests: a two-layer MLP, each parallel layout applied
to it, and one training step on a rank's share of a fixed global batch."""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel

from bench.tools.comm_recorder import CommRecorder

D, BATCH = 16, 8
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
