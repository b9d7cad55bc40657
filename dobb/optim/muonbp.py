"""MuonBP: Muon with block-periodic orthogonalization (Khaled et al., arXiv 2510.16981).

Most steps orthogonalize each device's own block of the momentum independently, with no
communication ("block steps"); every ``period``-th step orthogonalizes the whole matrix as
Muon does ("full steps", through Muon's owner exchange). The two kinds of step have their
own learning rates, each scaled by the dimensions of the matrix it orthogonalizes, so that
block and full updates have the same RMS (the maths: the class docstring). ``period=1`` is
Muon; ``period=None`` never takes a full step (BlockMuon).

Everything but the block step is Muon's (``dobb.optim.muon``): momentum, Newton-Schulz, the
update and the shared-matrix exchange. This module adds the tiling of a local piece into
blocks (``chunk_sizes``), the block step on those tiles (``block_muon_update``, the
reference, and ``block_muon_updates``, which batches same-shape tiles across all
matrices), and the choice of step.

Tiling: ``chunk_sizes`` cuts a dim as FSDP2 and DTensor's ``Shard`` lay it out (18 over
4: 5/5/5/3; 3 over 4: 1/1/1/0), and nested splits as a 2-D mesh's ``_StridedShard`` does
(18 over TP 2, then FSDP 2: 5/4/5/4). Design notes, tilings, phases and checkpoints:
docs/baselines.md, "MuonBP: design notes" and "MuonBP: blocks, group keys and
communication".
"""

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dobb._dtensor import local
from dobb.distributed.exchange import OwnerExchange
from dobb.distributed.placement import matrix_placement
from dobb.optim.batching import group_by
from dobb.optim.config import COUNT, NON_NEGATIVE, SPLITS, inherit, math_key, option, optional
from dobb.optim.muon import (
    NS_STEPS,
    Muon,
    apply_update,
    apply_updates,
    batched_newton_schulz,
    lr_scale,
    nesterov_direction,
    nesterov_directions,
    newton_schulz,
    update_dtype,
)
from dobb.optim.owner_groups import OwnerExchangeOptimizer

Tile = tuple[slice, slice]


def chunk_sizes(size: int, splits: Sequence[int]) -> list[int]:
    """Sizes of ``size`` indices split like ``torch.chunk`` into ``splits[0]`` parts, each
    part into ``splits[1]`` parts, and so on (outer split first); empty parts are kept.

    As FSDP2's ``Shard`` (18 over 4: 5/5/5/3); nested: ``_StridedShard`` (18: 5/4/5/4).
    """
    sizes = [size]
    for parts in splits:
        sizes = [piece for n in sizes for piece in _chunk(n, parts)]
    return sizes


def block_tiles(shape: tuple[int, int], row_blocks, col_blocks) -> list[Tile]:
    """The ``(rows, cols)`` slices of a ``row_blocks x col_blocks`` tiling of ``shape``.

    ``row_blocks`` / ``col_blocks``: an integer, or a tuple of them for nested splits (see
    ``chunk_sizes``). Tiles may be empty.
    """
    rows = _slices(chunk_sizes(shape[0], _splits(row_blocks)))
    cols = _slices(chunk_sizes(shape[1], _splits(col_blocks)))
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


class MuonBP(Muon):
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

    Blocks: a DTensor's local shard, a plain tensor's whole matrix, each cut into
    ``row_blocks x col_blocks`` tiles, so one device emulates a shard layout
    (``row_blocks=4``: FSDP over 4 ranks) and equals the sharded run.

    Learning rates: both step kinds are RMS-matched (``match_rms_adamw``), so by default a block
    and a full update have RMS ``0.2 lr``; the reasoning and our deviations: ``docs/baselines.md``.

    Options: ``MuonBP.Config`` (Muon's, with its own defaults, and four more).

    Communication: none on block steps; Muon's exchange on full steps (tilings, phases and
    checkpoints: ``docs/baselines.md``).
    """

    algorithm = "muonbp"

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
        self._subset_exchanges: dict[tuple[int, ...], OwnerExchange] = {}
        self.config = self.Config.from_arguments(locals())
        # Muon's scaffolding with MuonBP's config (Muon.__init__ would build Muon's)
        OwnerExchangeOptimizer.__init__(self, params)

    def _plan_exchanges(self) -> None:
        self._subset_exchanges = {}
        super()._plan_exchanges()

    # ------------------------------------------------------------------ step
    def _init_matrix_state(self, param: Tensor, group: dict[str, Any]) -> dict[str, Any]:
        # step: updates taken, which sets the phase; a CPU scalar, as torch.optim's AdamW
        return {**super()._init_matrix_state(param, group), "step": torch.tensor(0.0)}

    @staticmethod
    def _full_steps(states: list[dict[str, Any]], groups: list[dict[str, Any]]) -> list[bool]:
        """Update k (from 0) of a matrix is full when k mod period == 0 (one host read of
        the CPU step counters for all matrices)."""
        if not states:
            return []
        steps = torch.stack([state["step"] for state in states]).tolist()
        return [
            group["period"] is not None and int(k) % group["period"] == 0
            for k, group in zip(steps, groups)
        ]

    def _local_step(self, entries: list[tuple[Tensor, dict, dict]]) -> None:
        """Matrices no other rank shares (one device, no ``replica_group``)."""
        full = self._full_steps([e[1] for e in entries], [e[2] for e in entries])
        due = [e for e, f in zip(entries, full) if f]
        if due:
            super()._local_step(due)
        self._block_steps([(p, group) for (p, _, group), f in zip(entries, full) if not f])
        torch._foreach_add_([state["step"] for _, state, _ in entries], 1)

    def _block_steps(self, entries: list[tuple[Tensor, dict]]) -> None:
        """Block steps of ``(param, group)`` pairs: one ``block_muon_updates`` per set of
        hyperparameters."""
        for indices in group_by(entries, lambda e: math_key(e[1], self._math_options)).values():
            group, params = entries[indices[0]][1], [entries[i][0] for i in indices]
            pieces = [local(p) for p in params]
            block_muon_updates(
                pieces,
                [local(p.grad) for p in params],
                [local(self.state[p]["momentum"]) for p in params],
                [
                    block_tiles(tuple(piece.shape), group["row_blocks"], group["col_blocks"])
                    for piece in pieces
                ],
                lr=group["lr"] * group["block_lr_ratio"],
                beta=group["momentum"],
                nesterov=group["nesterov"],
                weight_decay=group["weight_decay"],
                adjust_lr=group["adjust_lr"],
                ns_steps=group["ns_steps"],
                ns_dtype=group["ns_dtype"],
                ns_coefficients=group["ns_coefficients"],
                batched=self.batched(pieces[0].device),
            )

    def _shared_step(self, exchange: OwnerExchange, entries: list[tuple[Tensor, dict]]) -> None:
        """Block steps locally; the matrices due for a full step through Muon's exchange.

        Every rank holds the same phases (the same matrices get gradients on every rank),
        so every rank takes the same collectives, or none.
        """
        live = [(p, group) for p, group in entries if p.grad is not None]
        for p, group in live:
            if not self.state[p]:
                self.state[p].update(self._init_matrix_state(p, group))
        states = [self.state[p] for p, _ in live]
        full = self._full_steps(states, [group for _, group in live])
        due = [e for e, f in zip(live, full) if f]
        self._block_steps([e for e, f in zip(live, full) if not f])
        if due and len(due) == len(live):  # the usual case: Muon's planned exchange
            super()._shared_step(exchange, entries)
        elif due:
            super()._shared_step(self._subset_exchange(exchange, due), due)
        if states:
            torch._foreach_add_([state["step"] for state in states], 1)

    def _subset_exchange(self, exchange: OwnerExchange, due: list[tuple[Tensor, dict]]):
        """An exchange over just the matrices ``due`` (planned collectively, then kept)."""
        key = (id(exchange), *(id(p) for p, _ in due))
        if key not in self._subset_exchanges:
            placements = [matrix_placement(p) for p, _ in due]
            self._subset_exchanges[key] = OwnerExchange(placements, exchange.group)
        return self._subset_exchanges[key]


def _chunk(n: int, parts: int) -> list[int]:
    # torch.chunk: parts of ceil(n / parts) each, the last ones short or empty
    step = -(-n // parts)
    return [min(step, max(0, n - i * step)) for i in range(parts)]


def _splits(blocks) -> tuple[int, ...]:
    return tuple(blocks) if isinstance(blocks, tuple | list) else (blocks,)


def _slices(sizes: list[int]) -> list[slice]:
    starts = list(itertools.accumulate(sizes, initial=0))
    return [slice(a, b) for a, b in zip(starts, starts[1:])]


def _tile_numel(tile: Tile, piece: Tensor) -> int:
    (rows, cols), (m, n) = tile, piece.shape
    return len(range(m)[rows]) * len(range(n)[cols])
