"""MuonBP: Muon with block-periodic orthogonalization (Khaled et al., arXiv 2510.16981).

Most steps orthogonalize each device's own block of the momentum independently, with no
communication ("block steps"); every ``period``-th step orthogonalizes the whole matrix as
Muon does ("full steps", through Muon's owner exchange). The two kinds of step have their
own learning rates, each scaled by the dimensions of the matrix it orthogonalizes, so that
block and full updates have the same RMS (the maths: the class docstring). ``period=1`` is
Muon; ``period=None`` never takes a full step (BlockMuon).

Everything but the block step is Muon's (``dobb.optim.muon``): momentum, Newton-Schulz, the
update and the shared-matrix exchange; the optimizer is the owner-exchange driver over
Muon's core with ``BlockSteps`` beside it (``dobb.optim.owner_groups``). This module adds
the tiling of a local piece into blocks (``chunk_sizes``), the block step on those tiles
(``block_muon_update``, the reference, and ``block_muon_updates``, which batches
same-shape tiles across all matrices), and the choice of step (``BlockSteps.schedule``).

Tiling: ``chunk_sizes`` cuts a dim as FSDP2 and DTensor's ``Shard`` lay it out (18 over
4: 5/5/5/3; 3 over 4: 1/1/1/0), and nested splits as a 2-D mesh's ``_StridedShard`` does
(18 over TP 2, then FSDP 2: 5/4/5/4).
"""

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dobb.optim.base import Entry, Local, local_tensors, partition
from dobb.optim.config import COUNT, NON_NEGATIVE, SPLITS, inherit, option, optional
from dobb.optim.muon import (
    NS_STEPS,
    Muon,
    MuonCore,
    apply_update,
    apply_updates,
    batched_newton_schulz,
    lr_scale,
    muon_options,
    nesterov_direction,
    nesterov_directions,
    newton_schulz,
    update_dtype,
)
from dobb.optim.owner_groups import OwnerExchangeOptimizer

Tile = tuple[slice, slice]


def chunk_sizes(size: int, splits: int | Sequence[int]) -> list[int]:
    """Sizes of ``size`` indices split like ``torch.chunk`` into ``splits[0]`` parts, each
    part into ``splits[1]`` parts, and so on (outer split first); empty parts are kept. An
    integer is one split.

    As FSDP2's ``Shard`` (18 over 4: 5/5/5/3); nested: ``_StridedShard`` (18: 5/4/5/4).
    """
    sizes = [size]
    for parts in (splits,) if isinstance(splits, int) else splits:
        sizes = [piece for n in sizes for piece in _chunk(n, parts)]
    return sizes


def block_tiles(shape: tuple[int, int], row_blocks, col_blocks) -> list[Tile]:
    """The ``(rows, cols)`` slices of a ``row_blocks x col_blocks`` tiling of ``shape``.

    ``row_blocks`` / ``col_blocks``: an integer, or a tuple of them for nested splits (see
    ``chunk_sizes``). Tiles may be empty.
    """
    rows = _slices(chunk_sizes(shape[0], row_blocks))
    cols = _slices(chunk_sizes(shape[1], col_blocks))
    return [(r, c) for r in rows for c in cols]


def block_newton_schulz(
    N: Tensor, tiles: list[Tile], steps=NS_STEPS, dtype=torch.bfloat16, coefficients="quintic"
) -> list[Tensor | None]:
    """``NS5`` of each tile of ``N`` on its own (None for an empty tile).

    Tiles of one shape go through one batched call; a lone tile through the plain one.
    """
    shapes: dict[torch.Size, list[int]] = {}
    for i, tile in enumerate(tiles):
        if N[tile].numel():
            shapes.setdefault(N[tile].shape, []).append(i)
    out: list[Tensor | None] = [None] * len(tiles)
    for indices in shapes.values():
        if len(indices) == 1:
            out[indices[0]] = newton_schulz(N[tiles[indices[0]]], steps, dtype, coefficients)
            continue
        # (k, m_b, n_b) stack of equal tiles -> k independent iterations
        stacked = newton_schulz(
            torch.stack([N[tiles[i]] for i in indices]), steps, dtype, coefficients
        )
        for i, update in zip(indices, stacked):
            out[i] = update
    return out


def block_muon_update(
    param: Tensor,
    grad: Tensor,
    momentum: Tensor,
    tiles: list[Tile],
    *,
    lr: float,
    beta: float,
    nesterov: bool,
    weight_decay: float,
    adjust_lr: str,
    ns_steps: int = NS_STEPS,
    ns_dtype: torch.dtype = torch.bfloat16,
    ns_coefficients: str = "quintic",
) -> None:
    """One block step on a local piece: every tile orthogonalized and scaled on its own.

    ``param``, ``grad`` and ``momentum`` are one rank's piece (or a whole matrix); nothing
    here communicates. ``param`` and ``momentum`` are updated in place.
    """
    direction = nesterov_direction(grad, momentum, beta=beta, nesterov=nesterov)
    # O_b = NS5(N_b), each tile independently
    updates = block_newton_schulz(direction, tiles, ns_steps, ns_dtype, ns_coefficients)
    for (rows, cols), update in zip(tiles, updates):
        if update is None:
            continue
        # W_b <- W_b (1 - lr wd) - lr s(m_b, n_b) O_b: RMS matched by the tile's own shape
        apply_update(
            param[rows, cols],
            update,
            lr=lr,
            weight_decay=weight_decay,
            scale=lr_scale(tuple(update.shape), adjust_lr),
        )


def block_muon_updates(
    params: list[Tensor],
    grads: list[Tensor],
    momenta: list[Tensor],
    tilings: list[list[Tile]],
    *,
    lr: float,
    beta: float,
    nesterov: bool,
    weight_decay: float,
    adjust_lr: str,
    ns_steps: int = NS_STEPS,
    ns_dtype: torch.dtype = torch.bfloat16,
    ns_coefficients: str = "quintic",
    batched: bool = True,
) -> None:
    """``block_muon_update`` of many local pieces sharing hyperparameters (``tilings[i]``:
    piece ``i``'s tiles): foreach kernels, and one NS5 per tile shape across all pieces."""
    directions = nesterov_directions(grads, momenta, beta=beta, nesterov=nesterov)
    # (piece, tile) of every non-empty tile; a tile covering its piece is the piece itself
    tiles = [(i, t) for i, ts in enumerate(tilings) for t in ts if _tile_numel(t, params[i])]
    whole = [len(tilings[i]) == 1 for i, _ in tiles]
    blocks = [directions[i] if w else directions[i][t] for (i, t), w in zip(tiles, whole)]
    # O_b = NS5(N_b), each tile independently, batched by tile shape
    out_dtypes = [update_dtype(params[i].dtype, ns_dtype) for i, _ in tiles]
    updates = batched_newton_schulz(
        blocks, out_dtypes, ns_steps, ns_dtype, ns_coefficients, batched=batched
    )
    # W_b <- W_b (1 - lr wd) - lr s(m_b, n_b) O_b: RMS matched by the tile's own shape
    apply_updates(
        [params[i] if w else params[i][t] for (i, t), w in zip(tiles, whole)],
        updates,
        lr=lr,
        weight_decay=weight_decay,
        scales=[lr_scale(tuple(b.shape), adjust_lr) for b in blocks],
    )


class BlockSteps(Local):
    """MuonBP's period and block steps: a placement before Muon's (which takes the full
    steps), claiming each matrix whose update this step is a block step.

    ``step``: the updates a matrix has taken (a CPU scalar, as torch.optim's AdamW's);
    update ``k`` (from 0) is full when ``k mod period == 0``.
    """

    def init_state(self, param: Tensor, group: dict[str, Any], name: str) -> dict[str, Tensor]:
        return {"step": torch.tensor(0.0)}

    def claim(self, entries: list[Entry]) -> tuple[list[Entry], list[Entry]]:
        """The block steps (one host read of the CPU step counters for all matrices), and
        the full ones left to the core; every counter advanced."""
        if not entries:
            return [], []
        counters = [state["step"] for _, state, _ in entries]
        steps = torch.stack(counters).tolist()
        torch._foreach_add_(counters, 1)
        block = [
            group["period"] is None or int(k) % group["period"] != 0
            for k, (_, _, group) in zip(steps, entries)
        ]
        return partition(entries, block)

    def run(self, core, entries: list[Entry], *, batched: bool) -> None:
        """``block_muon_updates`` of local pieces, each tiled by the group's blocks."""
        params, grads, states = local_tensors(entries)
        group = entries[0][2]
        block_muon_updates(
            params,
            grads,
            [state["momentum"] for state in states],
            [block_tiles(tuple(p.shape), group["row_blocks"], group["col_blocks"]) for p in params],
            lr=group["lr"] * group["block_lr_ratio"],
            adjust_lr=group["adjust_lr"],
            batched=batched,
            **muon_options(group),
        )


class MuonBP(OwnerExchangeOptimizer):
    r"""MuonBP: Muon whose orthogonalization is block-local except every ``period`` steps.

    Khaled, Ozkara, Yu, Hong, Park, "MuonBP: Faster Muon via Block-Periodic
    Orthogonalization", https://arxiv.org/abs/2510.16981.

    .. code-block:: text

        per matrix W (d_out x d_in), its update k = 0, 1, 2, ...:
          M <- mu M + (1 - mu) G;   N = (1 - mu) G + mu M  (Nesterov)  or  N = M
          full step, k mod P == 0:
            O = NS5(N)                                   whole matrix (Muon's exchange)
            W <- W (1 - lr wd) - lr s(d_out, d_in) O
          block step, otherwise: for each block b (m_b x n_b), no communication
            O_b = NS5(N_b)
            W_b <- W_b (1 - lr_b wd) - lr_b s(m_b, n_b) O_b,   lr_b = block_lr_ratio lr
          s(m, n) = 0.2 sqrt(max(m, n))   ("match_rms_adamw": update RMS 0.2 lr, any shape)

    Blocks: on a DTensor parameter, the rank's local shard (FSDP ``Shard(0)``: its rows; TP
    row-parallel ``Shard(1)``: its columns; FSDP x TP: the intersection), cut into
    ``row_blocks x col_blocks`` tiles (default 1 x 1: the shard itself). On a plain tensor
    (one device, or DDP) the local piece is the whole matrix, so the tiles emulate a shard
    layout: ``row_blocks=4`` is FSDP over 4 ranks, ``col_blocks=2`` TP row-parallel over 2,
    ``row_blocks=(2, 2)`` the rows of a column-parallel weight on a 2 x 2 FSDP x TP mesh.
    Such a single-device run equals the sharded one.

    Learning rates (the paper's rule, as far as we could read it: two stepsizes, each
    update scaled by the square root of the dimensions of the matrix it orthogonalizes,
    matching update RMS): ``lr`` is the full steps' rate, ``block_lr_ratio * lr`` the block
    steps', and ``s`` is Muon's ``lr_scale`` of the full shape on full steps and of the
    block's shape on block steps. With the default ``adjust_lr="match_rms_adamw"`` a block
    and a full update both have RMS ``0.2 lr`` (for an exactly orthogonal ``O``), so
    ``block_lr_ratio=1`` (our default: the paper's theory lets the two rates differ, and we
    could not read the ratio its experiments used) changes only the direction, not the size.
    ``adjust_lr="spectral"`` applies Keller's ``sqrt(max(1, m/n))`` the same way; it keeps
    the RMS for row blocks but not for column blocks.

    Differences from the paper, all opt-out or harmless: Muon's momentum conventions (EMA
    form and Nesterov, Keller's defaults; NS5 divides out the EMA's scale, so only Nesterov
    changes the direction: ``nesterov=False`` gives the paper's heavy ball), and decoupled
    weight decay multiplied by the step's own learning rate.

    Options: ``MuonBP.Config`` (Muon's, with its own defaults, and four more).
    ``period``, ``block_lr_ratio``, ``row_blocks`` and ``col_blocks`` are group keys, so one
    optimizer can tile each matrix like its own layout; like every group key they are saved
    in ``state_dict()`` and restored by ``load_state_dict()``. The blocks of a sharded
    matrix are its local shards, so resuming on a mesh that splits the matrices differently
    changes the block steps (the checkpoint itself loads fine).

    Communication: none on block steps; Muon's owner exchange on full steps (one
    ``all_to_all`` of ``N`` to the owners and one back, per mesh or data-parallel group).
    Each matrix counts its own updates (``step``, checkpointed); matrices of one exchange
    out of phase take their full steps over an exchange of just those due
    (``dobb.optim.owner_groups``).
    """

    algorithm = "muonbp"
    core = MuonCore()  # the full steps: Muon's
    piece_steps = BlockSteps()

    @dataclass(frozen=True)
    class Config(Muon.Config):
        """MuonBP's options: Muon's (other defaults) and the schedule and tiling."""

        lr: float = inherit(Muon.Config, "lr", 5e-3)
        """The full steps' learning rate; both kinds of update have RMS ``0.2 lr``
        (``match_rms_adamw``), as AdamW's."""
        adjust_lr: str = inherit(Muon.Config, "adjust_lr", "match_rms_adamw")
        """Muon's, here by default the paper's RMS matching ``0.2 sqrt(max(m, n))`` of the
        shape each step orthogonalizes (the whole matrix, or a block)."""
        period: int | None = option(5, optional(COUNT), math=True)
        """``P``: a full step every ``P`` updates, the first included (the paper's 5, as
        secondary sources report it); ``1`` is Muon, None BlockMuon."""
        block_lr_ratio: float = option(1.0, NON_NEGATIVE, math=True)
        """The block steps' learning rate over ``lr``."""
        row_blocks: int | tuple[int, ...] = option(1, SPLITS, math=True)
        """Row tiles of each local piece (a tuple: nested splits, as ``chunk_sizes``); on one
        device ``row_blocks=4`` tiles as FSDP over 4 ranks shards."""
        col_blocks: int | tuple[int, ...] = option(1, SPLITS, math=True)
        """Column tiles of each local piece, as ``row_blocks``."""

    def __init__(
        self,
        params,
        lr: float = Config.lr,
        momentum: float = Config.momentum,
        nesterov: bool = Config.nesterov,
        weight_decay: float = Config.weight_decay,
        ns_steps: int = Config.ns_steps,
        *,
        period: int | None = Config.period,
        block_lr_ratio: float = Config.block_lr_ratio,
        row_blocks: int | tuple[int, ...] = Config.row_blocks,
        col_blocks: int | tuple[int, ...] = Config.col_blocks,
        ns_dtype: torch.dtype = Config.ns_dtype,
        ns_coefficients: str = Config.ns_coefficients,
        adjust_lr: str = Config.adjust_lr,
        replica_group=Config.replica_group,
        nonfinite: str = Config.nonfinite,
        foreach: bool | None = Config.foreach,
    ):
        super().__init__(params, self.Config.from_arguments(locals()))


def _chunk(n: int, parts: int) -> list[int]:
    # torch.chunk: parts of ceil(n / parts) each, the last ones short or empty
    step = -(-n // parts)
    return [min(step, max(0, n - i * step)) for i in range(parts)]


def _slices(sizes: list[int]) -> list[slice]:
    starts = list(itertools.accumulate(sizes, initial=0))
    return [slice(a, b) for a, b in zip(starts, starts[1:])]


def _tile_numel(tile: Tile, piece: Tensor) -> int:
    (rows, cols), (m, n) = tile, piece.shape
    return len(range(m)[rows]) * len(range(n)[cols])
