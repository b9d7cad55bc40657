"""Placement helpers: which part of a (possibly DTensor) matrix a rank holds, and how data
parallelism is described to the optimizers.

We say *axis* for a DeviceMesh axis and *dim* for a tensor dimension.
"""

import torch
import torch.distributed as dist
from torch import Tensor

from dobb.blocks import BlockStack
from dobb.optim.base import DTensor

# torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single
ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

try:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
except ImportError:  # torch built without distributed support
    DeviceMesh = ()


def local_range(param: Tensor, dim: int) -> tuple[int, int]:
    """Global ``[start, stop)`` of the indices along ``dim`` that this rank holds."""
    if not isinstance(param, DTensor):
        return 0, param.shape[dim]
    shape, offset = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements
    )
    return offset[dim], offset[dim] + shape[dim]


def shard_degree(param: Tensor, dim: int) -> int:
    """How many ranks split ``dim`` of ``param`` (1 if it is not a sharded DTensor)."""
    if not isinstance(param, DTensor):
        return 1
    degree = 1
    for axis, placement in enumerate(param.placements):
        if getattr(placement, "dim", None) in (dim, dim - param.ndim):
            degree *= param.device_mesh.size(axis)
    return degree


def local_block_stacks(
    stacks: tuple[BlockStack, ...], start: int, stop: int, describe: str
) -> tuple[BlockStack, ...]:
    """The blocks inside columns ``[start, stop)``, re-based to local column 0.

    Raises ``ValueError`` (using ``describe`` to name the matrix) if a block straddles a
    shard boundary: the update would then need another rank's columns.
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
            f"{describe}: the input blocks do not tile this rank's columns [{start}, {stop}); "
            "choose num_blocks so that every column shard holds whole blocks (e.g. a "
            "multiple of the tensor-parallel degree that divides d_in), or route the "
            "parameter to algorithm='adamw'"
        )
    return tuple(local)


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


def data_parallel_groups(data_parallel) -> list:
    """Process groups whose ranks see different tokens (DP replicas, FSDP shards).

    ``data_parallel`` is None (one process), a ProcessGroup, or a DeviceMesh whose every
    axis carries data parallelism (e.g. ``mesh["dp_replicate", "dp_shard"]``; never the
    tensor-parallel axis).
    """
    if data_parallel is None:
        return []
    if isinstance(data_parallel, DeviceMesh):
        return [data_parallel.get_group(axis) for axis in range(data_parallel.ndim)]
    if isinstance(data_parallel, dist.ProcessGroup):
        return [data_parallel]
    raise TypeError(
        f"data_parallel must be a DeviceMesh, a ProcessGroup or None, got {type(data_parallel)}"
    )


def average_(tensors: list[Tensor], groups: list) -> None:
    """Average ``tensors`` in place over every group (one flat all-reduce per group)."""
    if not groups or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    for group in groups:
        dist.all_reduce(flat, group=group)
        flat /= dist.get_world_size(group)
    for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(part.view_as(t))


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
