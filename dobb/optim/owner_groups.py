"""Which ranks share a matrix's whole-matrix work (Muon, MuonBP, NorMuon, Dion2).

A DTensor parameter is shared by every rank of its mesh; a plain parameter replicated by
DDP is shared by the ``replica_group`` if one is given, and is otherwise updated locally.
``shared_buckets`` groups the parameters by process group, in an order every rank agrees
on, so that each bucket can build one ``OwnerExchange`` collectively.
"""

from typing import Any

from torch import Tensor

from dobb._dtensor import DTensor
from dobb.distributed.groups import mesh_group, one_group


def holders(param: Tensor, replica_group):
    """The process group whose ranks share ``param``'s update, None for a local update."""
    if isinstance(param, DTensor):
        return mesh_group(param.device_mesh)
    return one_group(replica_group)


def shared_buckets(groups: list[dict[str, Any]], replica_group) -> list[tuple[Any, list[Tensor]]]:
    """``(process group, its parameters)`` for every group of shared matrices."""
    buckets: dict[str, tuple[Any, list[Tensor]]] = {}
    for group in groups:
        for p in group["params"]:
            owners = holders(p, replica_group)
            if owners is not None:
                buckets.setdefault(owners.group_name, (owners, []))[1].append(p)
    return list(buckets.values())
