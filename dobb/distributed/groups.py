"""The process-group arguments of the optimizers: one name per meaning, one check.

Each matrix optimizer takes at most one group of ranks, named for what it does with it:
``stats_group`` (Dobb: the ranks that see different tokens, over which it averages its
statistics), ``replica_group`` (Muon, MuonBP, NorMuon, Dion2, NorDion2: replicas that share
out the whole-matrix work) and ``sync_group`` (Dion: replicas with unaveraged gradients,
synced by the paper's compressed sync). ``docs/distributed.md`` has the table.

Each argument is None (one process), a ProcessGroup, or a DeviceMesh whose axes are all
such groups, e.g. ``mesh["data_replicate", "data_shard"]``.

A harness whose DDP or FSDP averages the gradients over its data-parallel ranks asks the
optimizer class which argument takes them. The class attribute ``data_parallel_option``
names it; it is None where the optimizer needs no group then (Dion: its compressed sync
needs gradients that are left unaveraged).

``check_stats_group`` refuses a ``stats_group`` that shares ranks with an axis splitting a
matrix's input columns (a tensor-parallel axis): those ranks hold different blocks.
"""

import torch.distributed as dist
from torch import Tensor

from dobb._dtensor import DeviceMesh, DTensor
from dobb.distributed.placement import matrix_placement

GROUP_TYPES = "a DeviceMesh, a ProcessGroup or None"


def check_group(owner: str, name: str, value):
    """``value`` of the group argument ``name`` of ``owner`` (a class name); ``TypeError``
    unless it is a DeviceMesh, a ProcessGroup or None."""
    if value is not None and not isinstance(value, DeviceMesh | dist.ProcessGroup):
        raise TypeError(f"{owner}: {name} must be {GROUP_TYPES}, got {type(value).__name__}")
    return value


def axis_groups(value) -> tuple:
    """One process group per axis of ``value`` (a mesh), ``(value,)`` for a ProcessGroup,
    ``()`` for None. Summing over each in turn sums over all of ``value``'s ranks."""
    if value is None:
        return ()
    if isinstance(value, DeviceMesh):
        return tuple(value.get_group(axis) for axis in range(value.ndim))
    return (value,)


def shared_axis(groups: tuple, others: tuple) -> tuple | None:
    """The first ``(g, o)``, ``g`` of ``groups`` and ``o`` of ``others`` (process groups this
    rank belongs to), that share a rank besides this one; None if there is none.

    Compared by their ranks, not by identity: a second mesh or a ``new_group`` over the same
    ranks is the same set of ranks. Averaging over such a ``g`` mixes this rank's value with
    that of a rank that ``o`` sets apart (one holding another piece of the matrix).
    """
    for g in groups:
        mine = set(dist.get_process_group_ranks(g))
        for o in others:
            if len(mine & set(dist.get_process_group_ranks(o))) > 1:
                return g, o
    return None


def describe_split(param: Tensor, dim: int, group) -> str:
    """``"ranks [..] (mesh axis 'name')"``: the ranks of ``group``, the axis of ``param``'s
    mesh that splits its ``dim``."""
    ranks = dist.get_process_group_ranks(group)
    mesh = param.device_mesh if isinstance(param, DTensor) else None
    for axis in range(mesh.ndim if mesh is not None else 0):
        if dist.get_process_group_ranks(mesh.get_group(axis)) == ranks:
            name = mesh.mesh_dim_names[axis] if mesh.mesh_dim_names else axis
            return f"ranks {ranks} (mesh axis {name!r})"
    return f"ranks {ranks}"


STATS_GROUP_FIX = (
    "pass only the data-parallel axes as stats_group (ranks that see different tokens: the "
    "DDP group, the FSDP/HSDP mesh axes, never a tensor-parallel axis), or stats_group=None "
    "for one data rank"
)


def check_stats_group(stats_groups: tuple, param: Tensor, dim: int, name: str) -> None:
    """``ValueError`` if a ``stats_group`` axis (``stats_groups``: one process group per
    axis) shares ranks with an axis that splits ``param``'s input ``dim``.

    Dobb's input statistics ``C_b = E[x_bᵀ x_b]`` are of the blocks ``b`` of this rank's
    input columns; ranks that hold other columns hold other blocks, so averaging ``C_b``
    over them mixes different blocks (row-parallel TP passed as ``stats_group``; or FSDP of
    a ``(d_in, d_out)`` weight, which shards its inputs over the data ranks).
    """
    if not stats_groups:
        return  # one data rank: nothing is averaged
    pair = shared_axis(stats_groups, matrix_placement(param).groups_splitting(dim))
    if pair is None:
        return
    stats, split = pair
    raise ValueError(
        f"{name}: stats_group averages Dobb's input statistics over ranks "
        f"{dist.get_process_group_ranks(stats)}, but this matrix's input dim {dim} is split "
        f"over {describe_split(param, dim, split)}: they hold different input columns, whose "
        f"statistics are of different blocks; {STATS_GROUP_FIX}. A weight whose input dim is "
        "sharded over the data ranks (FSDP of a (d_in, d_out) weight, as GPT-2's Conv1D) is "
        "not supported: route it to algorithm='adamw'"
    )


def one_group(value):
    """One process group over every rank of ``value`` (a mesh is flattened); None for None."""
    return mesh_group(value) if isinstance(value, DeviceMesh) else value


def mesh_group(mesh: "DeviceMesh"):
    """One process group over every rank of ``mesh`` (its flattened axes)."""
    if mesh.ndim == 1:
        return mesh.get_group()
    if mesh.size() == dist.get_world_size():
        return dist.group.WORLD
    if not mesh.mesh_dim_names:
        raise NotImplementedError(
            f"cannot form one process group over a {mesh.ndim}-D sub-mesh without axis names; "
            "build the mesh with mesh_dim_names"
        )
    return mesh._flatten().get_group()
