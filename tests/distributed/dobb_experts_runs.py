"""The workers of ``test_experts_dobb_distributed``: Dobb on a grouped-experts module
(``tests/expert_layers.py``) under DDP, FSDP2 and expert parallelism, against one process
that sees every rank's tokens.

Rank ``r``'s tokens at a step: ``COUNTS[e]`` rows routed to expert ``e``, drawn from a
generator seeded by the step and ``r``. One process runs each step on every rank's rows of
each expert in rank order (expert ``e``'s rows are rank 0's then rank 1's), with the loss
summed over them. The layouts:

- DDP: each replica runs its own tokens on the whole stack, the loss divided by the world
  size and the gradients added (DDP's average), statistics averaged over the replicas
  (``stats_group``, every step).
- FSDP2: ``fully_shard`` splits the stack along ``E``; each rank runs its tokens on the
  gathered stack; the statistics of every expert are added over the ranks before each
  rank folds its own (``DobbSteps._add_expert_sums``); FSDP averages the gradients.
- expert parallelism: the stack is a ``Shard(0)`` DTensor; rank ``r`` holds its experts
  and runs every rank's rows routed to them (what an all-to-all dispatch delivers, made
  here by drawing all ranks' rows on every rank), with the loss summed, as one process.
"""

import torch
import torch.distributed as dist
from expert_layers import Experts
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

from dobb import Dobb
from dobb._dtensor import DTensor
from dobb.optim.dobb_core import EXPERT_TOKENS

DIM, HIDDEN, STEPS = 6, 6, 4  # square: every C full rank (below)
OPTIONS = {"basis_interval": 2, "lr": 0.01}


def counts_of(experts: int, step: int, rank: int) -> list[int]:
    """Tokens per expert for ``rank`` at ``step``: uneven, 4 to 7 (so that the 2 ranks' give
    every ``C`` full rank: its eigenbasis is then one, whatever the rounding, where a
    rank-deficient ``C``'s null space has any basis), one expert idle at step 2."""
    return [4 + (e + step + rank) % 4 if (step, e) != (2, 0) else 0 for e in range(experts)]


def rows(experts: int, step: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(x, target)`` of each expert's rows on ``rank`` at ``step``."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [
        (
            torch.randn(n, DIM, generator=g, dtype=torch.float64),
            torch.randn(n, DIM, generator=g, dtype=torch.float64),
        )
        for n in counts_of(experts, step, rank)
    ]


def batch(per_expert: list[list[tuple]], experts) -> tuple:
    """Rows sorted by expert (each expert's from every source in order), counts, targets."""
    xs, ts, counts = [], [], []
    for e in experts:
        pieces = [source[e] for source in per_expert]
        xs += [x for x, _ in pieces]
        ts += [t for _, t in pieces]
        counts.append(sum(x.shape[0] for x, _ in pieces))
    return torch.cat(xs), torch.tensor(counts), torch.cat(ts)


def weights(experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w1 = torch.randn(experts, HIDDEN, DIM, generator=g, dtype=torch.float64)
    return w1, torch.randn(experts, DIM, HIDDEN, generator=g, dtype=torch.float64)


def dobb_for(model: nn.Module, options: dict, group=None) -> Dobb:
    opt = Dobb(
        [{"params": [("w1", model.w1), ("w2", model.w2)]}], stats_group=group, **OPTIONS, **options
    )
    opt.track(model)
    return opt


def step(model, opt, x, counts, target, scale=1.0, reduce=None):
    opt.zero_grad()
    (model(x, counts) * target).sum().mul(scale).backward()
    if reduce is not None:
        reduce(model)
    opt.step()


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def one_process(experts: int, world: int, options: dict) -> list[torch.Tensor]:
    model = Experts(*weights(experts))
    opt = dobb_for(model, options)
    for s in range(STEPS):
        x, counts, target = batch([rows(experts, s, r) for r in range(world)], range(experts))
        step(model, opt, x, counts, target, scale=1.0 / world)
    return [model.w1.detach(), model.w2.detach(), opt.state[model.w1]["input_cov_0"]]


def layout_run(rank: int, world: int, layout: str, experts: int, options: dict):
    """(one process, this layout) stacks and ``w1``'s first input ``C``, gathered."""
    alone = one_process(experts, world, options)
    if layout == "ep_fsdp":
        return alone, *ep_fsdp_run(rank, world, experts, options)
    mesh = init_device_mesh("cpu", (world,))
    w1, w2 = weights(experts)
    model = Experts(w1, w2)
    reduce, scale = None, 1.0 / world  # one process's loss: every row once, / world
    if layout == "fsdp":  # FSDP averages the ranks' gradients: / world
        fully_shard(model, mesh=mesh)
        scale = 1.0
    elif layout == "ep":  # each expert's rows all here, its gradient not reduced
        model.w1 = nn.Parameter(distribute_tensor(w1, mesh, [Shard(0)]))
        model.w2 = nn.Parameter(distribute_tensor(w2, mesh, [Shard(0)]))
    else:  # ddp: the replicas' gradients added

        def reduce(m):
            for p in m.parameters():
                dist.all_reduce(p.grad)

    opt = dobb_for(model, options, mesh)
    for s in range(STEPS):
        if layout == "ep":
            mine = local_experts(model.w1)
            x, counts, target = batch([rows(experts, s, r) for r in range(world)], mine)
        else:
            x, counts, target = batch([rows(experts, s, rank)], range(experts))
        step(model, opt, x, counts, target, scale=scale, reduce=reduce)
    return alone, *gathered(model, opt)


def gathered(model, opt) -> tuple:
    """The whole stacks and ``w1``'s first input ``C``, its placements, its token counts."""
    state = opt.state[model.w1]
    cov = state["input_cov_0"]
    placements = tuple(cov.placements) if isinstance(cov, DTensor) else None
    sharded = [full(model.w1.detach()), full(model.w2.detach()), full(cov)]
    tokens = full(state[EXPERT_TOKENS])
    dist.barrier()
    return sharded, placements, tokens


def ep_fsdp_run(rank: int, world: int, experts: int, options: dict, ep: int = 2) -> tuple:
    """FSDP2 over expert parallelism, as torchtitan lays it out: ``ep`` ranks split the
    experts (``Shard(0)`` on the ``ep`` axis of an ``(efsdp, ep)`` mesh), FSDP2 shards each
    one's experts over ``efsdp`` (placements ``(_StridedShard(0), Shard(0))``) and gathers
    them for the forward, whose grouped GEMM sees the ``ep`` rank's experts. The ranks of
    one ``efsdp`` index form an expert-parallel group: rank ``(f, k)`` runs its group's rows
    routed to ``ep`` rank ``k``'s experts (what its all-to-all brings). FSDP averages the
    gradients over ``efsdp``: the loss is scaled by ``ep / world`` (one process's ``1 /
    world``); Dobb adds each expert's sums over ``efsdp``, the ranks with the same experts."""
    mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("efsdp", "ep"))
    f, k = mesh.get_coordinate()
    w1, w2 = weights(experts)
    model = Experts(w1, w2)
    model.w1 = nn.Parameter(distribute_tensor(w1, mesh["ep"], [Shard(0)]))
    model.w2 = nn.Parameter(distribute_tensor(w2, mesh["ep"], [Shard(0)]))
    fully_shard(model, mesh=mesh["efsdp"])
    opt = dobb_for(model, options, mesh)
    window = range(k * experts // ep, (k + 1) * experts // ep)
    group = [f * ep + j for j in range(ep)]
    for s in range(STEPS):
        x, counts, target = batch([rows(experts, s, r) for r in group], window)
        step(model, opt, x, counts, target, scale=ep / world)
    return gathered(model, opt)


def local_experts(stack) -> list[int]:
    """The global numbers of this rank's experts of a ``Shard(0)`` stack."""
    from dobb.optim.experts import expert_indices

    return expert_indices(stack)
