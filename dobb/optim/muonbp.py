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
same-shape tiles across all matrices), and the choice of step (``full_step_due``, which
``BlockSteps`` reads).

Tiling: ``chunk_sizes`` cuts a dim as FSDP2 and DTensor's ``Shard`` lay it out (18 over
4: 5/5/5/3; 3 over 4: 1/1/1/0), and nested splits as a 2-D mesh's ``_StridedShard`` does
(18 over TP 2, then FSDP 2: 5/4/5/4).
"""

import dataclasses
import itertools
from dataclasses import dataclass

import torch
from torch import Tensor

from dobb._dtensor import local
from dobb.optim.batching import chunk_sizes, group_by
from dobb.optim.config import COUNT, NON_NEGATIVE, SPLITS, inherit, option, optional
from dobb.optim.muon import (
    NS_STEPS,
    Muon,
    MuonCore,
    OwnerExchangeOptimizer,
    apply_update,
    lr_scale,
    muon_updates,
    nesterov_direction,
    newton_schulz,
)
from dobb.optim.parts import Batch, Matrix, Placement, Step, local_batch, partition

Tile = tuple[slice, slice]


def full_step_due(step: int, period: int | None) -> bool:
    """Whether a matrix's ``step``-th update (from 1) is a full step, every ``period``
    (``P``) updates: steps 1, 1 + P, ... (``period=None``: never; the cost model's schedule
    too)."""
    return period is not None and (step - 1) % period == 0


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
    update_scale: str,
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
            scale=lr_scale(tuple(update.shape), update_scale),
        )


def tiled(params: list[Tensor], grads: list[Tensor], momenta: list[Tensor], tilings):
    """The non-empty tiles of each piece (``tilings[i]``: piece ``i``'s) as views of
    ``params``, ``grads`` and ``momenta`` (a tile covering its piece: the piece itself)."""
    tiles = [(i, t) for i, ts in enumerate(tilings) for t in ts if _tile_numel(t, params[i])]
    whole = [len(tilings[i]) == 1 for i, _ in tiles]
    return tuple(
        [tensors[i] if w else tensors[i][t] for (i, t), w in zip(tiles, whole)]
        for tensors in (params, grads, momenta)
    )


def block_muon_updates(
    params, grads, momenta, tilings, *, lr, update_scale, batched=True, **options
) -> None:
    """``block_muon_update`` of many local pieces sharing hyperparameters (``tilings[i]``:
    piece ``i``'s tiles): ``muon_updates`` of their tiles, one NS5 per tile shape across
    all pieces, each tile's lr scaled by its own shape; ``options``: ``muon_updates``'."""
    tiles = tiled(params, grads, momenta, tilings)
    scales = [lr_scale(tuple(t.shape), update_scale) for t in tiles[0]]
    muon_updates(*tiles, lr=lr, scales=scales, batched=batched, **options)


class BlockSteps(Placement):
    """MuonBP's period and block steps: a placement before Muon's (which takes the full
    steps), claiming each matrix whose update this step is a block step, which it steps by
    the core's update (Muon's) on the tiles of each local piece, each tile on its own, at
    the block steps' learning rate.

    ``step``: the updates a matrix has taken (a CPU scalar, as torch.optim's AdamW's); the
    next one is full when ``full_step_due`` says so.
    """

    def init_state(self, param: Tensor, config, name: str) -> dict[str, Tensor]:
        return {"step": torch.tensor(0.0)}

    def claim(self, matrices: list[Matrix]) -> tuple[list[Matrix], list[Matrix]]:
        """The block steps (one host read of the CPU step counters for all matrices), and
        the full ones left to the core; every counter advanced."""
        if not matrices:
            return [], []
        counters = [m.state["step"] for m in matrices]
        steps = torch.stack(counters).tolist()
        torch._foreach_add_(counters, 1)
        period = [m.config.period for m in matrices]
        block = [not full_step_due(int(k) + 1, p) for k, p in zip(steps, period)]
        return partition(matrices, block)

    def step(self, matrices: list[Matrix], core: MuonCore, step: Step) -> None:
        """The core's update of every tile of the local pieces, per set of math options and
        device; the tiles take the lr scale of their own shape (``MuonCore``: of the
        matrices it is given) and ``lr block_lr_ratio``."""
        by_options = group_by(matrices, lambda m: (m.config.math_key(), local(m.param).device))
        for indices in by_options.values():
            mine = [matrices[i] for i in indices]
            config = mine[0].config
            params, grads, states = local_batch(mine)
            momenta = [state["momentum"] for state in states]
            tilings = [
                block_tiles(tuple(p.shape), config.row_blocks, config.col_blocks) for p in params
            ]
            params, grads, momenta = tiled(params, grads, momenta, tilings)
            if not params:  # only empty tiles (an empty FSDP shard)
                continue
            block = dataclasses.replace(config, lr=config.lr * config.block_lr_ratio)
            core.updates(Batch(params, grads, [{"momentum": m} for m in momenta]), block)


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
          s(m, n) = 0.2 sqrt(max(m, n))   ("adamw": update RMS 0.2 lr, any shape)

    Blocks: on a DTensor parameter, the rank's local shard (FSDP ``Shard(0)``: its rows; TP
    row-parallel ``Shard(1)``: its columns; FSDP x TP: the intersection), cut into
    ``row_blocks x col_blocks`` tiles (default None: the shard itself). On a plain tensor
    (one device, or DDP) the local piece is the whole matrix, so the tiles emulate a shard
    layout: ``row_blocks=4`` is FSDP over 4 ranks, ``col_blocks=2`` TP row-parallel over 2,
    ``row_blocks=(2, 2)`` the rows of a column-parallel weight on a 2 x 2 FSDP x TP mesh.
    Such a single-device run equals the sharded one.

    Learning rates (the paper's rule, as far as we could read it: two stepsizes, each
    update scaled by the square root of the dimensions of the matrix it orthogonalizes,
    matching update RMS): ``lr`` is the full steps' rate, ``block_lr_ratio * lr`` the block
    steps', and ``s`` is Muon's ``lr_scale`` of the full shape on full steps and of the
    block's shape on block steps. With the default ``update_scale="adamw"`` a block
    and a full update both have RMS ``0.2 lr`` (for an exactly orthogonal ``O``), so
    ``block_lr_ratio=1`` (our default: the paper's theory lets the two rates differ, and we
    could not read the ratio its experiments used) changes only the direction, not the size.
    ``update_scale="spectral"`` applies Keller's ``sqrt(max(1, m/n))`` the same way; it keeps
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
        (``update_scale="adamw"``), as AdamW's."""
        update_scale: str = inherit(Muon.Config, "update_scale", "adamw")
        """Muon's, here by default the paper's RMS matching ``0.2 sqrt(max(m, n))`` of the
        shape each step orthogonalizes (the whole matrix, or a block)."""
        period: int | None = option(5, optional(COUNT), math=True)
        """``P``: a full step every ``P`` updates, the first included (the paper's 5, as
        secondary sources report it); ``1`` is Muon, None BlockMuon."""
        block_lr_ratio: float = option(1.0, NON_NEGATIVE, math=True)
        """The block steps' learning rate over ``lr``."""
        row_blocks: int | tuple[int, ...] | None = option(None, optional(SPLITS), math=True)
        """Row tiles of each local piece (a tuple: nested splits, as ``chunk_sizes``); on one
        device ``row_blocks=4`` tiles as FSDP over 4 ranks shards. None: each rank's piece
        is one tile (as Dobb's and Dion2's None)."""
        col_blocks: int | tuple[int, ...] | None = option(None, optional(SPLITS), math=True)
        """Column tiles of each local piece, as ``row_blocks`` (Dobb's input blocks are
        ``num_blocks`` per matrix, not per piece)."""


def _slices(sizes: list[int]) -> list[slice]:
    starts = list(itertools.accumulate(sizes, initial=0))
    return [slice(a, b) for a, b in zip(starts, starts[1:])]


def _tile_numel(tile: Tile, piece: Tensor) -> int:
    (rows, cols), (m, n) = tile, piece.shape
    return len(range(m)[rows]) * len(range(n)[cols])
