"""The workers of ``test_experts_distributed``: an expert stack trained under a layout."""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard

from dobb._dtensor import DTensor
from dobb.registry import get_entry

D_OUT, D_IN, STEPS = 12, 8, 4


class Experts(nn.Module):
    """``E`` experts as one stack (torchtitan's layout), each applied to its own input."""

    def __init__(self, experts: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts, D_OUT, D_IN, dtype=torch.float64))

    def forward(self, x):
        return torch.einsum("eoi,eti->eto", self.w1, x)


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def build(name: str, model: nn.Module):
    entry = get_entry(name)
    return entry.cls([{"params": [("experts.w1", model.w1)]}], lr=0.02, **entry.hyperparameters)


def train_step(model, opt, step: int, experts: int):
    """One step on the same tokens on every rank: FSDP's average of equal gradients is
    each rank's gradient exactly."""
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(experts, 5, D_IN, generator=gen, dtype=torch.float64)
    y = torch.randn(experts, 5, D_OUT, generator=gen, dtype=torch.float64)
    opt.zero_grad()
    (model(x) * y).sum().backward()
    opt.step()


def fsdp_run(rank, world, name, experts, path=None, phase=None):
    """The stack after ``STEPS`` steps in one process and under FSDP2 over ``world``
    ranks (the stack split along ``E``); with ``path``, "save" writes a DCP checkpoint
    after 2 steps, "load" resumes from it. Returns (one process, FSDP) full stacks."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    alone = Experts(experts)
    opt = build(name, alone)
    for step in range(STEPS):
        train_step(alone, opt, step, experts)
    torch.manual_seed(0)
    model = Experts(experts)
    fully_shard(model)
    opt = build(name, model)
    steps = range(STEPS)
    if phase == "save":
        for step in range(2):
            train_step(model, opt, step, experts)
        dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
        steps = range(2, STEPS)
    elif phase == "load":
        before = build(name, model)  # the weights as the saved run had them
        for step in range(2):
            train_step(model, before, step, experts)
        model.zero_grad()  # as at a resume: DCP builds no state where gradients exist
        state = {"optim": get_optimizer_state_dict(model, opt)}
        dcp.load(state, checkpoint_id=path)
        set_optimizer_state_dict(model, opt, state["optim"])
        steps = range(2, STEPS)
    for step in steps:
        train_step(model, opt, step, experts)
    placements = {key: tuple(v.placements) for key, v in opt.state[model.w1].items()}
    dist.barrier()
    return full(alone.w1.detach()), full(model.w1.detach()), placements


def ep_run(rank, world, name, experts, ep=2):
    """The stack after ``STEPS`` steps in one process and under expert parallelism as
    torchtitan lays it out: ``ep`` ranks split the experts (``Shard(0)`` on the ``ep`` axis
    of an ``(efsdp, ep)`` mesh), then FSDP2 shards each rank's experts over ``efsdp``
    (``world // ep`` ranks), which makes the placements ``(_StridedShard(0), Shard(0))``.
    Each rank runs its experts on their inputs (the tokens an all-to-all would bring).
    Returns (one process, EP) full stacks, the placements of the state, the global index
    of each of this rank's experts (found by its weights) and ``expert_indices``'."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from dobb.optim.experts import expert_indices

    torch.manual_seed(0)
    alone = Experts(experts)
    opt = build(name, alone)
    for step in range(STEPS):
        train_step(alone, opt, step, experts)
    mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("efsdp", "ep"))
    torch.manual_seed(0)
    model = Experts(experts)
    weights = model.w1.detach().clone()
    model.w1 = nn.Parameter(distribute_tensor(model.w1.detach(), mesh["ep"], [Shard(0)]))
    fully_shard(model, mesh=mesh["efsdp"])
    # which experts this rank holds, found by their (distinct, random) weights
    held = [[torch.equal(w, v) for v in weights].index(True) for w in model.w1.to_local()]
    indices = expert_indices(model.w1)
    opt = build(name, model)
    for step in range(STEPS):
        ep_train_step(model, opt, step, experts, mesh["ep"])
    placements = {key: tuple(v.placements) for key, v in opt.state[model.w1].items()}
    dist.barrier()
    return full(alone.w1.detach()), full(model.w1.detach()), placements, held, indices


def ep_train_step(model, opt, step: int, experts: int, ep_mesh):
    """``train_step`` with each expert's inputs on the ``ep`` rank that holds it."""
    from torch.distributed.tensor import Shard, distribute_tensor

    gen = torch.Generator().manual_seed(step)
    x = torch.randn(experts, 5, D_IN, generator=gen, dtype=torch.float64)
    y = torch.randn(experts, 5, D_OUT, generator=gen, dtype=torch.float64)
    x, y = (distribute_tensor(t, ep_mesh, [Shard(0)]) for t in (x, y))
    opt.zero_grad()
    (model(x) * y).sum().backward()
    opt.step()
