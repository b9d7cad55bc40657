"""Dobb's input blocks across ranks: the whole blocks a column shard holds
(``local_block_stacks``), their state laid out like that shard (``block_state_like``), and
a batch of per-block work shared out over ranks (``split_over_ranks``).

Which columns a rank holds comes from ``dobb.distributed.placement``. We say *axis* for a
DeviceMesh axis and *dim* for a tensor dimension.
"""

import torch
import torch.distributed as dist
from torch import Tensor

from dobb._dtensor import DTensor, Replicate, Shard
from dobb.blocks import BlockStack, block_stacks
from dobb.distributed.placement import matrix_placement

# torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single
ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


COLUMN_ADVICE = (
    "choose num_blocks so that every column shard holds whole blocks (e.g. a multiple of "
    "the tensor-parallel degree that divides d_in)"
)


def local_block_stacks(
    stacks: tuple[BlockStack, ...],
    start: int,
    stop: int,
    describe: str,
    advice: str = COLUMN_ADVICE,
    what: str = "input blocks do not tile this rank's columns",
) -> tuple[BlockStack, ...]:
    """The blocks inside indices ``[start, stop)``, re-based to local index 0.

    Raises ``ValueError`` (``describe`` names the matrix, ``advice`` says what to change)
    if a block straddles a shard boundary: the update would then need another rank's
    columns (or rows, for two-sided Dobb's row blocks).
    """
    local = []
    for s in stacks:
        first = max(0, -(-(start - s.start) // s.size))  # first block starting >= start
        last = min(s.count, (stop - s.start) // s.size)  # blocks ending <= stop
        if last > first:
            local.append(BlockStack(s.start + first * s.size - start, s.size, last - first))
    covered = sum(s.size * s.count for s in local)
    if covered != stop - start:
        raise ValueError(
            f"{describe}: the {what} [{start}, {stop}); {advice}, or route the parameter "
            "to algorithm='adamw'"
        )
    return tuple(local)


def param_block_stacks(
    param: Tensor, dim: int, num_blocks: int, name: str, rows: bool = False
) -> tuple[BlockStack, ...]:
    """``num_blocks`` blocks along ``param``'s ``dim`` (its rows if ``rows``: two-sided
    Dobb), those of this rank's shard, re-based (``local_block_stacks``)."""
    stacks = block_stacks(param.shape[dim], num_blocks)
    placement = matrix_placement(param)
    start, stop = placement.span(dim)
    if (start, stop) == (0, param.shape[dim]):
        return stacks
    describe = (
        f"{name} of shape {tuple(param.shape)}, {'output' if rows else 'input'} dim {dim} "
        f"split over {placement.split_degree(dim)} ranks, "
        f"{'row_blocks' if rows else 'num_blocks'}={num_blocks}"
    )
    if not rows:
        return local_block_stacks(stacks, start, stop, describe)
    advice = "choose row_blocks as a multiple of the number of row shards, or None"
    return local_block_stacks(
        stacks, start, stop, describe, advice, "row blocks do not tile this rank's rows"
    )


def block_state_like(local_stack: Tensor, param: Tensor, input_dim: int) -> Tensor:
    """Wrap a per-block ``(count, s, s)`` stack as a DTensor on ``param``'s mesh.

    Blocks are split like ``param``'s input dim (Shard(0) where that is sharded) and
    replicated elsewhere, so checkpoints save each rank's own blocks. Plain tensors for
    plain parameters.
    """
    if not isinstance(param, DTensor):
        return local_stack
    sharded = (input_dim, input_dim - param.ndim)
    placements = [
        Shard(0) if getattr(p, "dim", None) in sharded else Replicate() for p in param.placements
    ]
    return DTensor.from_local(local_stack, param.device_mesh, placements, run_check=False)


def split_over_ranks(fn, *stacks: Tensor, group) -> Tensor:
    """``fn(*stacks)`` for ``(n, ...)`` stacks, each rank of ``group`` computing ~n/P of it.

    Rank ``r`` evaluates ``fn`` on rows ``[r c, (r + 1) c)`` (``c = ceil(n / P)``; the end is
    padded with copies of the last row, a valid input for any solver) and one all-gather
    assembles the result, so every rank ends with the same bits, computed once.
    """
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    n = stacks[0].shape[0]
    chunk = -(-n // size)
    rows = torch.arange(rank * chunk, (rank + 1) * chunk, device=stacks[0].device).clamp_max(n - 1)
    mine = [t.index_select(0, rows) for t in stacks]
    result = fn(*mine).contiguous()
    gathered = result.new_empty(size * chunk, *result.shape[1:])
    ALL_GATHER_SINGLE(gathered, result, group=group)
    return gathered[:n]
