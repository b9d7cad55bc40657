"""Dion2: orthonormalize a selected fraction of the momentum's rows, feed back the rest.

Ahn, Amsel, Langford, "Dion2: A Simple Method to Shrink Matrix in Muon",
https://arxiv.org/abs/2512.16928. Each step adds the gradient to an error-feedback
momentum, picks the rows of largest norm, orthonormalizes only those (Muon's Newton-Schulz
on a ``k x n`` matrix instead of ``m x n``), updates only those rows of the weight and
decays only those rows of the momentum; the other rows keep accumulating. For a rank's
piece ``W`` (whole rows of a ``d_out x d_in`` matrix) cut into row blocks ``b`` of ``m_b``
rows (``row_blocks``):

.. code-block:: text

    M <- M + G
    S = the max(1, ceil(f m_b)) rows of largest ||M_i||_1 in each block b   (k rows in all)
    O = NS(M_S)          (k x d_in: the selected rows of every rank; Muon's Newton-Schulz)
    M_S <- ef_decay M_S                (the unselected rows keep all of M)
    W <- W (1 - lr wd);   W_S <- W_S - lr sqrt(d_out / d_in) O

The functional core is ``dion2_direction`` (momentum, selection, selective decay) and
``apply_rows`` (the sparse weight update) around Muon's ``newton_schulz``; ``dion2_update``
runs them on one matrix (the reference). Unshared matrices run ``dion2_updates``, its
batched form: one selection and one Newton-Schulz per stack of same-shape matrices.
Sharded, each rank selects among its own rows and only the selected rows travel to the
matrix's owner and back, through Muon's ``OwnerExchange`` on the ``k x n`` matrix of
selected rows (``Dion2Core.exchanged_rows``; the driver, ``dobb.optim.owner_groups``,
plans it).
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from dobb.optim.batching import chunk_sizes, foreach_mul_, group_by, solo
from dobb.optim.config import SPLITS, between, inherit, option, optional
from dobb.optim.dion_core import shape_scale
from dobb.optim.muon import (
    NS_STEPS,
    NewtonSchulzConfig,
    OwnerExchangeOptimizer,
    momentum_state,
    newton_schulz,
    orthogonalize,
)
from dobb.optim.owner_groups import ExchangeCore


def selected_count(rows: int, row_fraction: float) -> int:
    """``max(1, ceil(row_fraction rows))`` rows of a non-empty block are selected; 0 of none."""
    return max(1, math.ceil(row_fraction * rows)) if rows else 0


def select_rows(momentum: Tensor, blocks: list[int], row_fraction: float) -> Tensor:
    """Ascending indices of the ``selected_count`` rows of largest L1 norm in each block
    of consecutive rows (``blocks``: their sizes, summing to ``momentum.shape[-2]``).
    ``(m, n)`` gives ``(k,)``; a ``(b, m, n)`` stack gives ``(b, k)``, per matrix."""
    # ||M_i||_1 per row (the authors' code; the paper allows any row norm)
    norms = momentum.abs().sum(dim=-1)
    picks, start = [], 0
    for size in blocks:
        k = selected_count(size, row_fraction)
        if k:
            picks.append(norms[..., start : start + size].topk(k).indices.sort().values + start)
        start += size
    if not picks:
        return torch.zeros(norms.shape[:-1] + (0,), dtype=torch.long, device=norms.device)
    return torch.cat(picks, dim=-1)


def dion2_direction(
    grad: Tensor, momentum: Tensor, blocks: list[int], *, row_fraction: float, ef_decay: float
) -> tuple[Tensor, Tensor]:
    """Update ``momentum`` in place; return the selected rows' indices and values (k x n)."""
    # M <- M + G
    momentum.add_(grad.to(momentum.dtype))
    # S = the top ceil(f m_b) rows of each block b by ||M_i||_1
    rows = select_rows(momentum, blocks, row_fraction)
    selected = momentum[rows]
    # M_S <- ef_decay M_S   (the unselected rows keep all of M: error feedback)
    momentum.index_copy_(0, rows, selected * ef_decay)
    return rows, selected


def apply_rows(
    param: Tensor, rows: Tensor, update: Tensor, *, lr: float, weight_decay: float, scale: float
) -> None:
    """``W <- W (1 - lr wd)``, then ``W_S <- W_S - lr scale O`` on the rows ``S`` only."""
    # W <- W (1 - lr wd)
    param.mul_(1 - lr * weight_decay)
    # W_S <- W_S - lr s O
    param.index_add_(0, rows, update.to(param.dtype), alpha=-lr * scale)


def dion2_update(
    param: Tensor,
    grad: Tensor,
    momentum: Tensor,
    blocks: list[int],
    *,
    lr: float,
    row_fraction: float,
    ef_decay: float,
    weight_decay: float,
    scale: float,
    ns_steps: int = NS_STEPS,
    ns_dtype: torch.dtype = torch.bfloat16,
    ns_coefficients: str = "quintic",
) -> None:
    """One Dion2 update of a local piece of whole rows; ``param`` and ``momentum`` in place."""
    rows, selected = dion2_direction(
        grad, momentum, blocks, row_fraction=row_fraction, ef_decay=ef_decay
    )
    # O = NS5(M_S)
    update = newton_schulz(selected, ns_steps, ns_dtype, ns_coefficients)
    apply_rows(param, rows, update, lr=lr, weight_decay=weight_decay, scale=scale)


def dion2_updates(
    params: list[Tensor],
    grads: list[Tensor],
    momenta: list[Tensor],
    blocks: list[list[int]],
    *,
    lr: float,
    row_fraction: float,
    ef_decay: float,
    weight_decay: float,
    scales: list[float],
    ns_steps: int = NS_STEPS,
    ns_dtype: torch.dtype = torch.bfloat16,
    ns_coefficients: str = "quintic",
    batched: bool = True,
    normalize: Callable[[list[int], Tensor, Tensor], Tensor] | None = None,
) -> None:
    """``dion2_update`` of many local pieces sharing hyperparameters (``blocks[i]``,
    ``scales[i]``: piece ``i``'s); ``params`` and ``momenta`` in place.

    ``M + G`` and the weight decay are foreach ops over all pieces; pieces agreeing on
    shape, blocks, dtypes and scale form one ``(b, m, n)`` stack that selects its rows,
    decays them, runs NS5 on the ``(b, k, n)`` selected rows and updates them at once. The
    row indices of slice ``j`` are offset by ``j m`` into the ``(b m, n)`` view of the
    stack, so the gather, the decay and the update are the reference's row ops.
    ``normalize(indices, rows, O)``, if given, maps a stack's ``(b, k, n)`` O to its update.
    """
    if not params:
        return
    # M <- M + G
    torch._foreach_add_(momenta, [g.to(m.dtype) for g, m in zip(grads, momenta, strict=True)])
    # W <- W (1 - lr wd)
    foreach_mul_(params, 1 - lr * weight_decay)
    stacks = group_by(
        range(len(params)),
        lambda i: (
            (
                tuple(momenta[i].shape),
                tuple(blocks[i]),
                momenta[i].dtype,
                params[i].dtype,
                momenta[i].device,
                scales[i],
            )
            + solo(i, batched)
        ),
    )
    targets, results = [], []
    for (shape, sizes, _, param_dtype, device, scale, *_), indices in stacks.items():
        m, n = shape
        M, W = torch.stack([momenta[i] for i in indices]), torch.stack([params[i] for i in indices])
        # S = the top ceil(f m_b) rows of each block b by ||M_i||_1, per matrix: (b, k)
        rows = select_rows(M, list(sizes), row_fraction)
        # rows of the (b m, n) views
        flat = (rows + torch.arange(len(indices), device=device)[:, None] * m).flatten()
        selected = M.view(-1, n)[flat]
        # M_S <- ef_decay M_S   (the unselected rows keep all of M: error feedback)
        M.view(-1, n).index_copy_(0, flat, selected * ef_decay)
        # O = NS5(M_S), one per stack of (k, n) selected rows
        update = newton_schulz(
            selected.view(len(indices), -1, n), ns_steps, ns_dtype, ns_coefficients
        )
        if normalize is not None:
            update = normalize(indices, rows, update)
        # W_S <- W_S - lr s O
        W.view(-1, n).index_add_(0, flat, update.reshape(-1, n).to(param_dtype), alpha=-lr * scale)
        targets += [momenta[i] for i in indices] + [params[i] for i in indices]
        results += list(M.unbind()) + list(W.unbind())
    torch._foreach_copy_(targets, results)


def selection_blocks(rows: int, row_blocks) -> list[int]:
    """Sizes of the selection blocks of a local piece with ``rows`` rows (``row_blocks``)."""
    return chunk_sizes(rows, row_blocks)


class Dion2Core(ExchangeCore):
    """Dion2's core: ``dion2_updates`` on unshared matrices; shared, each rank selects among
    its own rows and only those travel (``M_S``, ``k x n``), ``O`` comes back for them."""

    whole_rows = "Dion2 selects whole rows"

    def init_state(self, param: Tensor, config, name: str) -> dict[str, Tensor]:
        return momentum_state(param)

    def updates(self, batch, config, **normalization) -> None:
        """``dion2_updates`` of ``batch`` (``normalization``: NorDion2's, on the selected
        rows)."""
        params, grads, states = batch
        dion2_updates(
            params,
            grads,
            [state["momentum"] for state in states],
            [selection_blocks(p.shape[0], config.row_blocks) for p in params],
            lr=config.lr,
            row_fraction=config.row_fraction,
            ef_decay=config.ef_decay,
            weight_decay=config.weight_decay,
            scales=[shape_scale(p.shape) for p in params],
            ns_steps=config.ns_steps,
            ns_dtype=config.ns_dtype,
            ns_coefficients=config.ns_coefficients,
            batched=config.batched(params[0].device),
            **normalization,
        )

    def directions(self, grads, states, config) -> tuple[list[Tensor], list]:
        """The selected rows ``M_S`` of each piece, and their indices (for ``apply``)."""
        found = [
            dion2_direction(
                g,
                s["momentum"],
                selection_blocks(len(g), config.row_blocks),
                row_fraction=config.row_fraction,
                ef_decay=config.ef_decay,
            )
            for g, s in zip(grads, states)
        ]
        return [selected for _, selected in found], [rows for rows, _ in found]

    orthogonalize = staticmethod(orthogonalize)

    def result_dtype(self, config) -> torch.dtype:
        return config.ns_dtype

    def exchanged_rows(self, rows: int, config) -> int:
        blocks = selection_blocks(rows, config.row_blocks)
        return sum(selected_count(b, config.row_fraction) for b in blocks)

    def apply(self, params, updates, shapes, rows, config, sums) -> None:
        """``W_S <- W_S - lr s O`` of each piece from its rows of ``O``."""
        for param, update, shape, selected in zip(params, updates, shapes, rows):
            apply_rows(
                param,
                selected,
                update,
                lr=config.lr,
                weight_decay=config.weight_decay,
                scale=shape_scale(shape),
            )


class Dion2(OwnerExchangeOptimizer):
    r"""Dion2 (arXiv 2512.16928) for hidden weight matrices, selecting rows.

    .. code-block:: text

        per matrix W (m x n), step t; rows split into blocks b (a shard's rows, or
        row_blocks consecutive chunks on one device):
          M <- M + G
          S = ∪_b  the ceil(f m_b) rows i of block b with the largest ||M_i||_1
          O = NS5(M_S)                     Muon's Newton-Schulz on the |S| x n rows
          M_S <- ef_decay M_S              only the selected rows decay
          W <- W (1 - lr wd);   W_S <- W_S - lr sqrt(m/n) O

    Options: ``Dion2.Config``.

    Distributed: each rank selects among its own rows (the authors' ``"local"`` scope), so
    nothing but the selected rows moves: each rank's ``k_local x n`` rows go to the matrix's
    owner, which runs NS5 on the ``k x n`` stack of them, and come back as rows of ``O``
    (the driver's owner exchange, ``dobb.optim.owner_groups``; whole rows only, a
    ``Shard(1)`` parameter raises). The selection sizes of a sharded matrix are planned at
    construction from ``row_fraction`` and ``row_blocks``; changing either later raises.

    Where we chose (facts from the authors' code, microsoft/dion ``dion2.py``): the L1 row
    norm; selection along rows always (their code picks the shorter side of an unsharded
    matrix and the sharded side of a sharded one: rows under FSDP); the scale
    ``sqrt(m/n)`` of the whole matrix; Muon's quintic Newton-Schulz (their default is Polar
    Express); momentum in fp32 (or the parameter's wider dtype).
    """

    algorithm = "dion2"
    core = Dion2Core()

    @dataclass(frozen=True)
    class Config(NewtonSchulzConfig):
        """Dion2's options (``dobb.optim.config``)."""

        renamed = {"fraction": "row_fraction"}  # the authors' name (microsoft/dion's Dion2)

        lr: float = inherit(NewtonSchulzConfig, "lr", 0.02)
        """Learning rate, in spectral norm per update of the selected rows (scaled per
        matrix by ``sqrt(d_out/d_in)``; the authors' code: 0.01)."""
        row_fraction: float = option(0.25, between(0, 1, low_open=True, high_open=False), math=True)
        """``f``, the fraction of each block's rows selected (the authors' 0.25, their
        ``fraction``); not Dion's ``rank_fraction``, a rank."""
        ef_decay: float = option(0.95, between(0, 1, high_open=False), math=True)
        """Decay of the selected rows of ``M`` (error feedback; the authors' code's)."""
        weight_decay: float = inherit(NewtonSchulzConfig, "weight_decay", 0.01)
        """Decoupled, multiplied by ``lr`` (the authors' code's 0.01)."""
        row_blocks: int | tuple[int, ...] | None = option(None, optional(SPLITS), math=True)
        """Selection blocks of each local piece, cut as ``chunk_sizes`` (a tuple: nested
        splits); on one device ``row_blocks=4`` selects as FSDP over 4 ranks does. None: each
        rank's piece is one block (as Dobb's and MuonBP's None)."""
