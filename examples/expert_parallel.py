"""Expert parallelism without torchtitan: Dobb on expert stacks split over the ranks.

    torchrun --nproc-per-node 2 examples/expert_parallel.py      # CPU, gloo

A grouped-experts module keeps its experts as two stacks, ``w1`` ``(E, hidden, dim)`` and
``w2`` ``(E, dim, hidden)``, and runs them through ``_grouped_mm(A=, B_t=, offs=)``, first
for ``w1``, then for ``w2``: the protocol that ``dobb.stats.register_experts`` hooks, so that
Dobb preconditions each expert with the statistics of the tokens routed to it. Expert
parallelism is then two steps of the model's own code, none of the optimizer's:

1. each stack becomes a ``Shard(0)`` DTensor on the expert-parallel mesh (rank ``r`` holds
   experts ``r E / W`` to ``(r + 1) E / W - 1``), and the forward calls ``to_local()`` so
   that the grouped GEMM runs on this rank's experts only;
2. each step, every rank routes its own tokens and sends each to the rank holding its
   expert (``all_to_all_single``), which runs them on its experts.

Dobb then steps each rank's experts where they live: the statistics of an expert are its
owner's routed rows, every expert has one owner, and ``step()`` sends nothing (no
``stats_group``: no rank shares an expert). Here the loss is computed where the tokens
land, against a fixed teacher, so the dispatch carries inputs and targets and no gradient
crosses ranks; a model that combines the experts' outputs back on the tokens' ranks sends
them with the reverse all-to-all, through an autograd-aware one
(``torch.distributed.nn.functional.all_to_all_single``). The routing is a fixed rule here
(a learned router is a replicated parameter: its gradient is all-reduced like any other).
``tests/examples/test_expert_parallel.py`` holds this against one process that runs every
rank's tokens.
"""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import dobb
from dobb.stats import register_experts

EXPERTS, DIM, HIDDEN, TOKENS, STEPS = 4, 16, 32, 64, 30


class GroupedExperts(nn.Module):
    """``w2_e gelu(w1_e x)`` for each row ``x`` routed to expert ``e`` (rows sorted by
    expert, ``counts[e]`` of them expert ``e``'s)."""

    grouped_mm_calls = ("w1", "w2")  # the stacks, in the order _grouped_mm sees them

    def __init__(self, experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts, hidden, dim) / dim**0.5)
        self.w2 = nn.Parameter(torch.randn(experts, dim, hidden) / hidden**0.5)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        w1, w2 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        h = F.gelu(self._grouped_mm(A=x, B_t=w1.mT, offs=offs))
        return self._grouped_mm(A=h, B_t=w2.mT, offs=offs)

    def _grouped_mm(self, *, A, B_t, offs):
        """``A[rows of e] @ B_t[e]`` for each expert ``e`` of the stack (a loop here; a GPU
        model calls ``torch._grouped_mm``, which Dobb's hook sees alike)."""
        out, start = [], 0
        for e, stop in enumerate(offs.tolist()):
            out.append(A[start:stop] @ B_t[e])
            start = stop
        return torch.cat(out)


register_experts(GroupedExperts, GroupedExperts.grouped_mm_calls)


def tokens(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s rows at ``step``, each row's expert (a fixed rule: the largest of a
    fixed projection) and its target (a fixed teacher)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(TOKENS, DIM, generator=g)
    fixed = torch.Generator().manual_seed(0)
    route, teacher = (
        torch.randn(DIM, EXPERTS, generator=fixed),
        torch.randn(DIM, DIM, generator=fixed),
    )
    return x, (x @ route).argmax(1), torch.tanh(x @ teacher)


def by_expert(x, target, expert, experts: int):
    """Rows and targets sorted by expert (a stable sort: rows keep their order within an
    expert), and the rows' count per expert: the grouped GEMM's input."""
    order = torch.argsort(expert, stable=True)
    return x[order], torch.bincount(expert, minlength=experts), target[order]


def dispatch(x, target, expert, world: int):
    """Send every row (and its target) to the rank holding its expert; returns this rank's
    rows sorted by its local expert, their counts, and their targets (rows arrive in the
    order of the rank they came from, which the stable sort keeps within each expert)."""
    per_rank = EXPERTS // world
    order = torch.argsort(expert, stable=True)  # by expert, so by destination rank too
    x, target, expert = x[order], target[order], expert[order]
    send = torch.bincount(expert // per_rank, minlength=world)
    receive = torch.empty_like(send)
    dist.all_to_all_single(receive, send)  # how many rows each rank sends here
    payload = torch.cat([x, target, expert[:, None].to(x.dtype)], 1)
    got = payload.new_empty(int(receive.sum()), payload.shape[1])
    splits = dict(output_split_sizes=receive.tolist(), input_split_sizes=send.tolist())
    dist.all_to_all_single(got, payload, **splits)
    local = got[:, -1].long() % per_rank
    return by_expert(got[:, :DIM], got[:, DIM : 2 * DIM], local, per_rank)


def loss_of(model: nn.Module, rows, counts, targets, world: int) -> torch.Tensor:
    """This rank's share of the mean squared error over every rank's rows."""
    return (model(rows, counts) - targets).square().sum() / (TOKENS * world * DIM)


def train(steps: int = STEPS) -> tuple[list[float], torch.Tensor, torch.Tensor]:
    """Train on the initialized process group; returns the losses (the mean over every
    rank's rows) and the whole stacks at the end."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    torch.manual_seed(0)  # the same initial stacks on every rank, before they are split
    model = GroupedExperts(EXPERTS, DIM, HIDDEN)
    for name in model.grouped_mm_calls:  # this rank keeps its experts only
        stack = distribute_tensor(getattr(model, name).detach(), mesh, [Shard(0)])
        setattr(model, name, nn.Parameter(stack))
    params = [("w1", model.w1), ("w2", model.w2)]
    opt = dobb.Dobb([{"params": params}], lr=dobb.recommended_lr("dobb", width=DIM))
    opt.track(model)  # hooks the grouped GEMMs: statistics per expert
    losses = []
    for step in range(steps):
        x, expert, target = tokens(step, dist.get_rank())
        rows, counts, targets = dispatch(x, target, expert, world)
        loss = loss_of(model, rows, counts, targets, world)
        opt.zero_grad()
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)  # the mean over every rank's rows, for the log only
        losses.append(float(total))
    return losses, model.w1.full_tensor(), model.w2.full_tensor()


if __name__ == "__main__":
    dist.init_process_group("gloo")
    losses, _, _ = train()
    if int(os.environ.get("RANK", 0)) == 0:
        for step in range(0, STEPS, 5):
            print(f"step {step:3d}  loss {losses[step]:.4f}")
        print(f"step {STEPS - 1:3d}  loss {losses[-1]:.4f}")
    dist.destroy_process_group()
