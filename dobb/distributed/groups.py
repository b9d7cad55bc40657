"""The process-group arguments of the optimizers: one name per meaning, one check.

Each matrix optimizer takes at most one group of ranks, named for what it does with it:

==================  ===========================  ==========================================
argument            optimizers                   what the optimizer does with the ranks
==================  ===========================  ==========================================
``stats_group``     Dobb                         They see different tokens (DDP / HSDP
                                                 replicas, FSDP shards; never the TP axis).
                                                 Dobb averages its activation statistics
                                                 over them and shares out the basis refresh.
``replica_group``   Muon, MuonBP, NorMuon,       They hold copies of the plain (non-DTensor)
                    Dion2                        matrices, with gradients already averaged
                                                 (DDP). They share out the whole-matrix
                                                 work, about 1/P of the matrices each.
                                                 DTensor parameters share their work over
                                                 their own mesh instead.
``sync_group``      Dion                         They are replicas whose gradients of Dion's
                                                 matrices are *not* averaged (DDP ignoring
                                                 those parameters, HSDP sharded over
                                                 ``data_shard`` only). Dion runs the paper's
                                                 compressed sync over them: it averages
                                                 ``P`` and ``R``, not the gradients.
==================  ===========================  ==========================================

Each argument is None (one process), a ProcessGroup, or a DeviceMesh whose axes are all
such groups, e.g. ``mesh["data_replicate", "data_shard"]``. ``data_parallel=`` is the
spelling all three had before: it still works for one release and warns with the new name.

A harness whose DDP or FSDP averages the gradients over its data-parallel ranks asks
the optimizer class which argument takes them. The class attribute
``data_parallel_option`` names it; it is None where the optimizer needs no group then
(Dion: its compressed sync needs gradients that are left unaveraged).
"""

import warnings

import torch.distributed as dist

from dobb._dtensor import DeviceMesh

GROUP_TYPES = "a DeviceMesh, a ProcessGroup or None"


def group_argument(owner: str, name: str, value, data_parallel):
    """The value of the group argument ``name`` of ``owner`` (a class name), checked.

    ``data_parallel`` is its deprecated spelling. When it is given, a ``DeprecationWarning``
    names ``name``, and its value is used. ``ValueError`` if both are given; ``TypeError``
    unless the value is a DeviceMesh, a ProcessGroup or None.
    """
    if data_parallel is not None:
        if value is not None:
            raise ValueError(
                f"{owner} got both {name}= and data_parallel=; data_parallel is the deprecated "
                f"spelling of {name}, so pass {name} only"
            )
        warnings.warn(
            f"{owner}(data_parallel=...) is deprecated and will be removed in the next "
            f"release; pass {name}=... instead (same value)",
            DeprecationWarning,
            stacklevel=3,
        )
        value = data_parallel
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
