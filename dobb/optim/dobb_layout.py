"""Dobb's layout of one matrix: its orientation, its sides, and the state keys of their blocks.

A matrix ``W`` is preconditioned on its input side (blocks ``I_b`` of the input features,
bases ``Q_b``) and, two-sided, on its row side (blocks ``R_r`` of the output features,
bases ``P_r``): ``U[R_r, I_b] = P_r D(P_rᵀ N[R_r, I_b] Q_b) Q_bᵀ``. Both sides are one kind
of thing (``Side``): blocks of this rank's indices along one parameter dim, a source of
second moments ``C``, the process groups ``C`` is averaged over, and per stack of same-size
blocks a ``(count, s, s)`` ``C`` and basis in the optimizer's state. Fold, average, refresh
and update loop over a matrix's sides.

``MatrixLayout`` is derived, never checkpointed: from the parameter (shape, DTensor
placements), its layer (the orientation: ``(d_in, d_out)`` weights such as GPT-2's
``Conv1D`` have their input features along dim 0, learnt when ``Dobb.track`` hooks the
layer) and its group's options. ``Dobb._layout`` makes it, once per parameter, orientation
and options.

State keys: stack ``i`` of side ``s`` keeps ``C`` under ``"{s}_cov_{i}"`` and its basis under
``"{s}_basis_{i}"`` (``input_cov_0``, ``row_basis_1``), ``i`` in ``dobb.blocks.block_stacks``'
order (the longer blocks first). By stack index, not block size, for two reasons. The keys
are then one to one with those written before (``LEGACY_KEYS``: ``cov``, ``cov_tail``, ...,
which ``Dobb.load_state_dict`` renames and ``dobb.optim.dobb_checkpoint`` reads through
DCP). And a name holds no shape, which is the tensor's to say: where the block size
depends on the world size (two-sided ``row_blocks=None``: one block of each rank's rows), a
resume onto another world size finds the same key with another shape, which DCP refuses
in one line naming both shapes, rather than a key that is missing.
"""

import zlib
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from dobb._dtensor import local
from dobb.blocks import BlockStack, block_stacks
from dobb.distributed.groups import STATS_GROUP_FIX, check_stats_group, shared_axis
from dobb.distributed.placement import matrix_placement
from dobb.distributed.sharding import block_state_like, param_block_stacks

INPUT, ROW = "input", "row"  # the sides' names, the prefix of their state keys
# Where a side's moments come from: the layer's hooks (``dobb.stats``), this step's
# gradient, or nowhere (a fixed basis: "random", "identity").
HOOKED = ("activations", "outputs")
GRADIENTS = "gradients"
# State keys up to commit d368fca: a side's prefix, "_tail" on its second stack's keys.
LEGACY_KEYS = {
    f"{prefix}{kind}{tail}": f"{side}_{kind}_{i}"
    for side, prefix in ((INPUT, ""), (ROW, "row_"))
    for kind in ("cov", "basis")
    for i, tail in enumerate(("", "_tail"))
}
OLD_NAMES = {new: old for old, new in LEGACY_KEYS.items()}


@dataclass(frozen=True)
class Side:
    """One side of a matrix: the blocks of this rank's indices along parameter dim ``dim``.

    ``name``: ``"input"`` (blocks ``I_b`` of the input features, bases ``Q_b``) or ``"row"``
    (blocks ``R_r`` of the output features, bases ``P_r``; no stacks when one-sided:
    ``P = I``). ``stacks``: the blocks, by size. ``source``: where ``C`` comes from
    (``"activations"``, ``"outputs"``: the layer's hooks; ``"gradients"``; ``"random"``,
    ``"identity"``: none). ``groups``: the process groups ``C`` is averaged over (one per
    mesh axis; empty: none). ``shared``: every data rank holds the same ``C``, so a refresh
    is shared out over them (``shard_refresh``).
    """

    name: str
    dim: int
    stacks: tuple[BlockStack, ...]
    source: str
    groups: tuple = ()
    shared: bool = False

    @property
    def keys(self) -> list[tuple[str, str]]:
        """``(cov key, basis key)`` of each stack, in the optimizer's state."""
        return [(f"{self.name}_cov_{i}", f"{self.name}_basis_{i}") for i in range(len(self.stacks))]

    @property
    def hooked(self) -> bool:
        """It has blocks here and its moments come from hooks on the layer."""
        return bool(self.stacks) and self.source in HOOKED

    def init_state(self, param: Tensor, name: str, dtype: torch.dtype) -> dict[str, Tensor]:
        """Its state: per stack ``C`` (zeros) and the bases (the identity, or for
        ``"random"`` a fixed random orthogonal one per block, seeded by the matrix's
        ``name`` and the stack's key as named before, ``OLD_NAMES``), laid out like
        ``param``'s ``dim`` (``block_state_like``)."""
        device, state = local(param).device, {}
        for (cov_key, basis_key), s in zip(self.keys, self.stacks):
            cov = torch.zeros(s.count, s.size, s.size, dtype=dtype, device=device)
            basis = torch.eye(s.size, dtype=dtype, device=device).repeat(s.count, 1, 1)
            if self.source == "random":
                seed = torch.Generator().manual_seed(
                    zlib.crc32(f"{name}/{OLD_NAMES[cov_key]}".encode())
                )
                noise = torch.randn(s.count, s.size, s.size, generator=seed)
                basis = torch.linalg.qr(noise.to(dtype)).Q.to(device)
            state[cov_key] = block_state_like(cov, param, self.dim)
            state[basis_key] = block_state_like(basis, param, self.dim)
        return state

    def covs(self, state: dict) -> list[Tensor]:
        """Its ``C`` per stack, local tensors."""
        return [local(state[cov]) for cov, _ in self.keys]


@dataclass(frozen=True)
class MatrixLayout:
    """A Dobb matrix's orientation (``input_dim``: the parameter dim of its input features)
    and its two sides; the row side has no stacks one-sided. Matrices of one local shape
    and layout can be updated in one batch."""

    input_dim: int
    input: Side
    row: Side

    @property
    def sides(self) -> tuple[Side, Side]:
        return self.input, self.row


class Matrix(NamedTuple):
    """A Dobb matrix in a step: the parameter, its state, its group and its layout."""

    param: Tensor
    state: dict[str, Any]
    group: dict[str, Any]
    layout: MatrixLayout


def sources(group: dict[str, Any]) -> dict[str, str]:
    """Where each side's moments come from, by the group's options."""
    return {
        INPUT: group["basis_source"],
        ROW: group["row_stats"] if group["two_sided"] else "identity",
    }


def hooked(group: dict[str, Any]) -> bool:
    """Whether some side's moments come from hooks on the layer (``Dobb.track``)."""
    return any(source in HOOKED for source in sources(group).values())


def matrix_layout(
    param: Tensor, input_dim: int, group: dict[str, Any], data_groups: tuple, name: str
) -> MatrixLayout:
    """The layout of ``param`` (named ``name``), a matrix of a Dobb ``group`` whose input
    features lie along ``input_dim``, with ``data_groups`` the ranks that see other tokens.

    Input blocks: ``num_blocks``, or ``ceil(d_in / block_size)``, those of this rank's
    columns; a data rank that holds other columns raises (``check_stats_group``), as does
    a column shard that splits a block. Row blocks (two-sided): ``row_blocks`` over the
    rows, or one block of this rank's rows (None); their ``C`` is averaged over the data
    ranks (``row_stats="outputs"``, which refuses rows split over them) or over the ranks
    holding the other columns of the same rows (``"gradients"``).
    """
    num_blocks = group["num_blocks"]
    if group["block_size"] is not None:
        num_blocks = -(-param.shape[input_dim] // group["block_size"])
    check_stats_group(data_groups, param, input_dim, name)
    source = sources(group)
    cols = param_block_stacks(param, input_dim, num_blocks, name)
    columns = Side(INPUT, input_dim, cols, source[INPUT], tuple(data_groups), shared=True)
    dim = 1 - input_dim
    if not group["two_sided"]:
        return MatrixLayout(input_dim, columns, Side(ROW, dim, (), source[ROW]))
    placement = matrix_placement(param)
    if source[ROW] == "outputs" and shared_axis(data_groups, placement.groups_splitting(dim)):
        raise NotImplementedError(
            f"{name}: row_stats='outputs' keeps each rank's row blocks, averaged over "
            "stats_group, but this matrix's rows are split over ranks of stats_group: FSDP's "
            f"data ranks (use row_stats='gradients') or a tensor-parallel axis ({STATS_GROUP_FIX})"
        )
    if group["row_blocks"] is None:  # one block of the rows this rank holds
        start, stop = placement.span(dim)
        rows = block_stacks(stop - start, 1) if stop > start else ()
    else:
        rows = param_block_stacks(param, dim, group["row_blocks"], name, rows=True)
    over = data_groups if source[ROW] == "outputs" else placement.groups_splitting(input_dim)
    return MatrixLayout(input_dim, columns, Side(ROW, dim, rows, source[ROW], tuple(over)))
