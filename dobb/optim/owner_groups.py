"""Which ranks share a matrix's whole-matrix work (NorMuon, Dion2), as Muon decides it.

A DTensor parameter is shared by every rank of its mesh; a plain parameter replicated by
DDP is shared by the ``data_parallel`` group if one is given, and is otherwise updated
locally. ``shared_buckets`` groups the parameters by process group, in an order every
rank agrees on, so that each bucket can build one ``OwnerExchange`` collectively.
"""

from typing import Any

import torch.distributed as dist
from torch import Tensor

from dobb.distributed.placement import mesh_group
from dobb.optim.base import DTensor

try:
    from torch.distributed.device_mesh import DeviceMesh
except ImportError:  # torch built without distributed support
    DeviceMesh = ()


def check_data_parallel(data_parallel) -> None:
    """``TypeError`` unless ``data_parallel`` is a DeviceMesh, a ProcessGroup or None."""
    if data_parallel is not None and not isinstance(data_parallel, DeviceMesh | dist.ProcessGroup):
        raise TypeError(
            f"data_parallel must be a DeviceMesh, a ProcessGroup or None, got {type(data_parallel)}"
        )


def holders(param: Tensor, data_parallel):
    """The process group whose ranks share ``param``'s update, None for a local update."""
    if isinstance(param, DTensor):
        return mesh_group(param.device_mesh)
    if isinstance(data_parallel, DeviceMesh):
        return mesh_group(data_parallel)
    return data_parallel


def shared_buckets(groups: list[dict[str, Any]], data_parallel) -> list[tuple[Any, list[Tensor]]]:
    """``(process group, its parameters)`` for every group of shared matrices."""
    buckets: dict[str, tuple[Any, list[Tensor]]] = {}
    for group in groups:
        for p in group["params"]:
            owners = holders(p, data_parallel)
            if owners is not None:
                buckets.setdefault(owners.group_name, (owners, []))[1].append(p)
    return list(buckets.values())
