"""Batched all-reduce: many small tensors, each over its own process groups, in few calls.

``all_reduce_(tensors, groups)`` sums ``tensors[i]`` over every group in ``groups[i]`` (one
after another: summing over two mesh axes sums over their product). Tensors that share a
group (and dtype) travel in one flat buffer, so a round of partial sums over many matrices
costs one collective per distinct group and dtype, not one per matrix. Groups are visited
in the order they first appear, which is the same on every rank when every rank lists its
matrices in the same order (the optimizer's parameter order) and each list of groups in
mesh-axis order; that is what keeps ranks on different groups from deadlocking.

With ``average=True`` each sum is divided by its group's size: this is the library's one
averaging all-reduce (Dobb's statistics, Dion's compressed sync and checkpointed momenta).
"""

import torch
import torch.distributed as dist
from torch import Tensor


def all_reduce_(tensors: list[Tensor], groups: list[tuple], *, average: bool = False) -> None:
    """In place: sum (or average) each ``tensors[i]`` over each group in ``groups[i]``."""
    order: dict[tuple, list[int]] = {}  # (group name, dtype) -> indices of the tensors
    handles = {}
    for i, (t, gs) in enumerate(zip(tensors, groups, strict=True)):
        for g in gs:
            key = (g.group_name, t.dtype)
            order.setdefault(key, []).append(i)
            handles[key] = g
    for key, members in order.items():
        parts = [tensors[i] for i in members]
        flat = torch.cat([t.reshape(-1) for t in parts])
        dist.all_reduce(flat, group=handles[key])
        if average:
            flat /= dist.get_world_size(handles[key])
        for t, piece in zip(parts, flat.split([t.numel() for t in parts])):
            t.copy_(piece.view_as(t))
