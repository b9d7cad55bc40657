"""Where the pieces of a 2-D parameter live, read from its DTensor placements.

``matrix_placement(param)`` says which global rows and columns this rank holds and which
mesh axes split dim 0 (rows), split dim 1 (columns) or hold copies. Rows and columns are
global index tensors, computed by DTensor itself (``distribute_tensor`` of an ``arange``
with the parameter's placements, no communication), so uneven and empty FSDP shards and
the ``_StridedShard`` of a 2-D FSDP x TP mesh come out right without assuming contiguous,
rank-ordered rows. Plain tensors are one whole matrix on every rank. ``MatrixPlacement``
is the library's one description of the part of a matrix a rank holds; ``like_columns``
lays out optimizer state indexed by a matrix's columns the way those columns are split.

This is derived layout: the optimizers recompute it and never checkpoint it, so a
checkpoint loads into another mesh.

We say *axis* for a DeviceMesh axis and *dim* for a tensor dimension.
"""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from dobb._dtensor import DeviceMesh, DTensor, Replicate, distribute_tensor


@dataclass(frozen=True, eq=False)
class MatrixPlacement:
    """This rank's piece of one ``(m, n)`` matrix and the process groups around it."""

    shape: tuple[int, int]
    rows: Tensor
    """Global indices of the rows this rank holds (int64, ascending; may be empty)."""
    cols: Tensor
    """Global indices of the columns this rank holds."""
    row_groups: tuple = ()
    """One process group per mesh axis that splits dim 0, in mesh-axis order."""
    col_groups: tuple = ()
    """One process group per mesh axis that splits dim 1."""
    replicate_groups: tuple = ()
    """One process group per mesh axis along which the matrix is copied."""
    mesh: "DeviceMesh | None" = None
    placements: tuple = ()

    @property
    def is_split(self) -> bool:
        return bool(self.row_groups or self.col_groups)

    def span(self, dim: int) -> tuple[int, int]:
        """Global ``[start, stop)`` of the indices this rank holds along ``dim`` (0: rows,
        1: columns); ``ValueError`` if they are not one contiguous run."""
        index = self.rows if dim == 0 else self.cols
        if not len(index):
            return 0, 0
        start, stop = int(index[0]), int(index[-1]) + 1
        if stop - start != len(index):
            raise ValueError(
                f"this rank holds {len(index)} scattered indices along dim {dim} of a "
                f"{self.shape} matrix (a strided shard), not one contiguous run"
            )
        return start, stop

    def groups_splitting(self, dim: int) -> tuple:
        """The process groups of the mesh axes that split ``dim`` (0: rows, 1: columns)."""
        return self.row_groups if dim == 0 else self.col_groups

    def split_degree(self, dim: int) -> int:
        """How many ranks split ``dim`` (1 where no mesh axis splits it)."""
        return math.prod(dist.get_world_size(g) for g in self.groups_splitting(dim))

    def take(self, full: Tensor) -> Tensor:
        """This rank's piece of a whole ``(m, n)`` matrix."""
        return full[self.rows.to(full.device)[:, None], self.cols.to(full.device)]

    def take_rows(self, full: Tensor) -> Tensor:
        """This rank's rows of a whole ``(m, k)`` matrix."""
        return full[self.rows.to(full.device)]

    def gather_rows(self, local_rows: Tensor) -> Tensor:
        """The whole ``(m, k)`` matrix from row pieces laid out like this matrix's rows
        (replicated over the column axes): one all-gather per row axis, by DTensor."""
        placements = [p if _split_dim(p) == 0 else Replicate() for p in self.placements]
        shape = (self.shape[0], local_rows.shape[1])
        piece = DTensor.from_local(
            local_rows, self.mesh, placements, shape=shape, stride=(shape[1], 1), run_check=False
        )
        return piece.full_tensor()


def matrix_placement(param: Tensor) -> MatrixPlacement:
    """Placement of a 2-D parameter: its DTensor layout, or one whole local matrix."""
    m, n = param.shape
    if not isinstance(param, DTensor):
        return MatrixPlacement((m, n), torch.arange(m), torch.arange(n))
    mesh, placements = param.device_mesh, tuple(param.placements)
    roles = {0: [], 1: [], None: []}
    for axis, placement in enumerate(placements):
        if placement.is_partial():
            raise NotImplementedError(
                f"a parameter with a Partial placement ({placements}) has no well-defined "
                "shard to update; redistribute it to Shard or Replicate first"
            )
        roles[_split_dim(placement)].append(mesh.get_group(axis))
    return MatrixPlacement(
        (m, n),
        _indices(m, mesh, [p if _split_dim(p) == 0 else Replicate() for p in placements]),
        _indices(n, mesh, [_on_dim0(p) if _split_dim(p) == 1 else Replicate() for p in placements]),
        tuple(roles[0]),
        tuple(roles[1]),
        tuple(roles[None]),
        mesh,
        placements,
    )


def like_columns(local: Tensor, param: Tensor, rows: int) -> Tensor:
    """Wrap a ``(n_local, k)`` tensor indexed by ``param``'s columns as a DTensor.

    Its dim 0 is split like ``param``'s dim 1 and it is replicated on every other axis, so a
    checkpoint holds one ``(rows, k)`` tensor. Plain tensors stay plain.
    """
    if not isinstance(param, DTensor):
        return local
    placements = [_on_dim0(p) if _split_dim(p) == 1 else Replicate() for p in param.placements]
    shape = (rows, local.shape[1])
    return DTensor.from_local(
        local, param.device_mesh, placements, shape=shape, stride=(shape[1], 1), run_check=False
    )


def _split_dim(placement) -> int | None:
    """The (non-negative, 2-D) tensor dim a placement splits, None if it does not split."""
    dim = getattr(placement, "dim", None)  # Shard and _StridedShard (not a Shard subclass)
    return None if dim is None else dim % 2


def _on_dim0(placement):
    """The same kind of split (keeping a _StridedShard's split factor) applied to dim 0."""
    if hasattr(placement, "split_factor"):
        return type(placement)(0, split_factor=placement.split_factor)
    return type(placement)(0)


def _indices(size: int, mesh: "DeviceMesh", placements: list) -> Tensor:
    """Global indices along one dim that this rank holds, as DTensor lays them out."""
    index = distribute_tensor(torch.arange(size), mesh, placements, src_data_rank=None)
    return index.to_local().cpu()
