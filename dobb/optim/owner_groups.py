"""Optimizers that send whole matrices to an owner rank (Muon, MuonBP, NorMuon, Dion2,
NorDion2).

A DTensor parameter is shared by every rank of its mesh; a plain parameter replicated by
DDP is shared by the ``replica_group`` if one is given, and is otherwise updated locally.
``shared_buckets`` groups the parameters by process group, in an order every rank agrees
on, so that each bucket can build one ``OwnerExchange`` collectively.
``OwnerExchangeOptimizer`` is their common scaffolding: the group argument, the exchanges
planned at construction (and again when a group is added), and the whole-rows check.
Subclasses may override ``_plan_exchanges`` (Dion2 exchanges only the selected rows).
"""

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from dobb._dtensor import DTensor
from dobb.distributed.exchange import OwnerExchange
from dobb.distributed.groups import check_group, mesh_group, one_group
from dobb.distributed.placement import matrix_placement
from dobb.optim.base import MatrixOptimizer
from dobb.optim.config import OptimizerConfig, option


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


@dataclass(frozen=True)
class OwnerExchangeConfig(OptimizerConfig):
    """The options of an optimizer that sends whole matrices to owner ranks."""

    replica_group: Any = option(None, group=False)
    """For plain parameters replicated by DDP with averaged gradients: None (every replica
    does all the work) or their ProcessGroup (or DeviceMesh), whose ranks then share it,
    each matrix orthogonalized on one owner as Keller's distributed Muon does; DTensors
    share over their own mesh."""


class OwnerExchangeOptimizer(MatrixOptimizer):
    """A ``MatrixOptimizer`` whose shared matrices go to owner ranks (``self._exchanges``);
    ``replica_group``: the DDP ranks that split the work on plain parameters (None: none)."""

    # the argument that takes a job's data-parallel ranks (see dobb.distributed.groups)
    data_parallel_option = "replica_group"

    def __init__(self, params):
        """The options: ``self.config`` (an ``OwnerExchangeConfig``), set by the subclass."""
        config = self.config
        self._replica_group = check_group(
            type(self).__name__, "replica_group", config.replica_group
        )
        self._exchanges: list[tuple[OwnerExchange, list[Tensor]]] | None = None  # set below
        super().__init__(
            params, config.defaults(), nonfinite=config.nonfinite, foreach=config.foreach
        )
        self._plan_exchanges()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        if self._exchanges is not None:  # a group added after construction: plan again
            self._plan_exchanges()

    def _plan_exchanges(self) -> None:
        """One ``OwnerExchange`` per process group of shared matrices (collective: every
        rank builds the optimizer, so every rank gets here with the same parameters)."""
        self._exchanges = [
            (OwnerExchange([matrix_placement(p) for p in params], owners), params)
            for owners, params in shared_buckets(self._own_groups(), self._replica_group)
        ]

    def _own_groups(self) -> list[dict[str, Any]]:
        """The parameter groups this optimizer's algorithm updates (not the scalar ones)."""
        return [g for g in self.param_groups if g["algorithm"] == self.algorithm]

    def _shared(self) -> set[Tensor]:
        """The parameters that go through an exchange (the others update locally)."""
        return {p for _, params in self._exchanges for p in params}

    def _require_whole_rows(self, group: dict[str, Any], why: str) -> None:
        """``NotImplementedError`` for a parameter split along its columns (row-parallel
        TP's ``Shard(1)``): ``why`` says what the optimizer does with whole rows."""
        for p in group["params"]:
            if isinstance(p, DTensor) and len(matrix_placement(p).cols) != p.shape[1]:
                raise NotImplementedError(
                    f"{self.name_of(p)} is split along its columns ({tuple(p.placements)}); "
                    f"{why}, so shard its rows only (FSDP Shard(0)) or give it to Muon"
                )
