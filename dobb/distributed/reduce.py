"""Batched all-reduce: ``all_reduce_(tensors, groups)`` sums ``tensors[i]`` over each group
of ``groups[i]`` (``average=True``: divided by its size), one flat buffer per distinct group
and dtype, groups visited in first-seen order (the same on every rank that lists its
matrices in parameter order, so ranks on different groups do not deadlock).
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
