"""The process-group arguments of the optimizers: one name per meaning, one check.

``stats_group`` (Dobb: averages its statistics), ``replica_group`` (the Muon family: shares
out the whole-matrix work) and ``sync_group`` (Dion: the compressed sync of unaveraged
gradients), each None, a ProcessGroup or a DeviceMesh of such axes (``docs/distributed.md``).
A class's ``data_parallel_option`` names the one a harness's DDP/FSDP ranks go to.
"""

import torch.distributed as dist

from dobb._dtensor import DeviceMesh

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


def one_group(value):
    """One process group over every rank of ``value`` (a mesh is flattened); None for None."""
    if isinstance(value, DeviceMesh):
        return mesh_group(value)
    return value


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
