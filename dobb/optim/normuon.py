"""NorMuon: Muon's orthogonalized update with neuron-wise (per-row) normalization.

Li, Liu, Liang, Chen, Zhao, "NorMuon: Making Muon more efficient and scalable",
https://arxiv.org/abs/2510.05491. After Muon's Newton-Schulz step, each row (an output
neuron) of the orthogonalized update ``O`` (``m x n``) is divided by the root of an EMA
``v`` (``m`` numbers) of its mean square, and the whole update is rescaled to RMS 0.2, so
``lr`` is in AdamW's units (the maths: the class docstring).

The momentum, the Newton-Schulz iteration and the weight update are Muon's
(``dobb.optim.muon``); this module adds ``neuron_normalize`` and the RMS rescaling.
``normuon_update`` is the per-matrix reference; unshared matrices run ``normuon_updates``,
its batched form (one Newton-Schulz and one normalization per stack of same-shape
matrices). The distributed path runs them after Muon's owner exchange, on each rank's own
rows. Design notes and where we chose against the authors' code: docs/baselines.md,
"NorMuon: design notes".
"""

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from dobb._dtensor import local
from dobb.distributed.exchange import OwnerExchange
from dobb.optim.base import state_dtype
from dobb.optim.batching import group_by, solo
from dobb.optim.config import BOOL, POSITIVE, UNIT, inherit, math_key, option
from dobb.optim.muon import (
    NS_STEPS,
    NewtonSchulzConfig,
    apply_update,
    apply_updates,
    nesterov_direction,
    nesterov_directions,
    newton_schulz,
    ns_arguments,
)
from dobb.optim.owner_groups import OwnerExchangeOptimizer

TARGET_RMS = 0.2  # the paper's 0.2 sqrt(m n) / ||Ô||_F: AdamW's typical update RMS
NORM_FLOOR = 1e-12  # ||Ô||_F below this (a zero update) is not divided by


def neuron_normalize(update: Tensor, v: Tensor, *, beta2: float, eps: float) -> Tensor:
    """Row-normalized ``Ô`` of the orthogonalized ``O`` (m x n); ``v`` (m x 1) in place.
    Also on stacks: ``O`` (b, m, n) with ``v`` (b, m, 1)."""
    update = update.to(v.dtype)
    # v <- β2 v + (1 - β2) mean_cols(O ⊙ O)
    v.lerp_(update.square().mean(dim=-1, keepdim=True), 1 - beta2)
    # Ô = O ⊘ (sqrt(v) + ε)
    return update / (v.sqrt() + eps)


def rms_factor(shape: tuple[int, int], square_norm: Tensor) -> Tensor:
    """``0.2 sqrt(m n) / ||Ô||_F`` from ``||Ô||_F²``: the factor giving ``Ô`` RMS 0.2."""
    m, n = shape
    return TARGET_RMS * math.sqrt(m * n) / square_norm.sqrt().clamp_min(NORM_FLOOR)


def normuon_update(
    param: Tensor,
    grad: Tensor,
    momentum: Tensor,
    row_second_moment: Tensor,
    *,
    lr: float,
    beta: float,
    beta2: float,
    nesterov: bool,
    weight_decay: float,
    eps: float,
    ns_steps: int = NS_STEPS,
    ns_dtype: torch.dtype = torch.bfloat16,
    ns_coefficients: str = "quintic",
) -> None:
    """One NorMuon update of a whole ``(m, n)`` matrix; ``param`` and the state in place."""
    direction = nesterov_direction(grad, momentum, beta=beta, nesterov=nesterov)
    # O = NS5(M)
    update = newton_schulz(direction, ns_steps, ns_dtype, ns_coefficients)
    update = neuron_normalize(update, row_second_moment, beta2=beta2, eps=eps)
    # Ô <- 0.2 sqrt(m n) Ô / ||Ô||_F
    update.mul_(rms_factor(update.shape, update.square().sum()))
    apply_update(param, update, lr=lr, weight_decay=weight_decay, scale=1.0)


def normuon_updates(
    params: list[Tensor],
    grads: list[Tensor],
    momenta: list[Tensor],
    row_second_moments: list[Tensor],
    *,
    lr: float,
    beta: float,
    beta2: float,
    nesterov: bool,
    weight_decay: float,
    eps: float,
    ns_steps: int = NS_STEPS,
    ns_dtype: torch.dtype = torch.bfloat16,
    ns_coefficients: str = "quintic",
    batched: bool = True,
) -> None:
    """``normuon_update`` of many whole matrices sharing hyperparameters; ``params`` and the
    state in place. Muon's foreach momentum and update; per same-shape ``(b, m, n)`` stack
    one NS5, one row normalization and one RMS rescaling (each matrix by its own norm)."""
    if not params:
        return
    directions = nesterov_directions(grads, momenta, beta=beta, nesterov=nesterov)
    updates: list[Tensor] = [None] * len(params)
    stacks = group_by(
        range(len(params)),
        lambda i: (
            (tuple(directions[i].shape), row_second_moments[i].dtype, directions[i].device)
            + solo(i, batched)
        ),
    )
    for indices in stacks.values():
        v = torch.stack([row_second_moments[i] for i in indices])  # (b, m, 1)
        # O = NS5(N)   (b, m, n)
        N = torch.stack([directions[i] for i in indices])
        update = newton_schulz(N, ns_steps, ns_dtype, ns_coefficients)
        update = neuron_normalize(update, v, beta2=beta2, eps=eps)
        # Ô <- 0.2 sqrt(m n) Ô / ||Ô||_F
        update.mul_(rms_factor(update.shape[1:], update.square().sum(dim=(1, 2), keepdim=True)))
        torch._foreach_copy_([row_second_moments[i] for i in indices], list(v.unbind()))
        for i, u in zip(indices, update.unbind()):
            updates[i] = u
    apply_updates(params, updates, lr=lr, weight_decay=weight_decay, scales=[1.0] * len(params))


class NorMuon(OwnerExchangeOptimizer):
    r"""NorMuon (arXiv 2510.05491, Algorithm 1) for hidden weight matrices.

    .. code-block:: text

        per matrix W (m x n, the nn.Linear layout: a row is an output neuron), step t:
          M <- β1 M + (1 - β1) G          (nesterov=True: N = (1 - β1) G + β1 M, else N = M)
          O = NS5(N)                       Muon's 5 quintic Newton-Schulz steps
          v <- β2 v + (1 - β2) mean_cols(O ⊙ O)          v: one number per row
          Ô = O ⊘ (sqrt(v) + ε)
          W <- W (1 - lr λ) - lr 0.2 sqrt(m n) / ||Ô||_F  Ô       update RMS 0.2 lr

    Options: ``NorMuon.Config``.

    Distributed: Muon's owner exchange, then each rank normalizes its own rows (whole rows
    only: a ``Shard(1)`` parameter raises) and one ``all_reduce`` of a float per matrix
    sums ``||Ô||_F²`` over the pieces (none under DDP); details: ``docs/baselines.md``.

    Where we chose against the authors' code: ``docs/baselines.md``.
    """

    algorithm = "normuon"

    @dataclass(frozen=True)
    class Config(NewtonSchulzConfig):
        """NorMuon's options (``dobb.optim.config``)."""

        lr: float = inherit(NewtonSchulzConfig, "lr", 5e-3)
        """Learning rate: the update's RMS is ``0.2 lr``, as AdamW's (the Dion authors'
        code: 0.01)."""
        momentum: float = option(0.95, UNIT, math=True)
        """``β1``, the momentum's EMA factor (the paper's)."""
        beta2: float = option(0.95, UNIT, math=True)
        """``β2``, the EMA factor of ``v``, each row's mean square of ``O`` (the paper's)."""
        nesterov: bool = option(False, BOOL, math=True)
        """Nesterov momentum; off, as the paper's box (their Keller-derived code: on)."""
        eps: float = option(1e-8, POSITIVE, math=True)
        """``ε`` in ``O ⊘ (sqrt(v) + ε)`` (the Dion authors'; the NorMuon authors' code:
        1e-10)."""

    def __init__(
        self,
        params,
        lr: float = Config.lr,
        momentum: float = Config.momentum,
        beta2: float = Config.beta2,
        nesterov: bool = Config.nesterov,
        weight_decay: float = Config.weight_decay,
        ns_steps: int = Config.ns_steps,
        *,
        eps: float = Config.eps,
        ns_dtype: torch.dtype = Config.ns_dtype,
        ns_coefficients: str = Config.ns_coefficients,
        replica_group=Config.replica_group,
        nonfinite: str = Config.nonfinite,
        foreach: bool | None = Config.foreach,
    ):
        self.config = self.Config.from_arguments(locals())
        super().__init__(params)

    def _validate_group(self, group: dict[str, Any]) -> None:
        super()._validate_group(group)
        if group["algorithm"] == self.algorithm:
            self._require_whole_rows(group, "NorMuon normalizes whole rows")

    # ------------------------------------------------------------------ step
    def _init_matrix_state(self, param: Tensor, group: dict[str, Any]) -> dict[str, Any]:
        dtype = state_dtype(param)
        return {
            "momentum": torch.zeros_like(param, dtype=dtype),
            # v: (m, 1), sharded like W's rows (a column slice of a row-sharded DTensor)
            "row_second_moment": torch.zeros_like(param[:, :1], dtype=dtype),
        }

    def _matrix_step(self, groups: list[dict[str, Any]]) -> None:
        shared = self._shared()
        entries = [e for e in self._matrices_with_grad(groups) if e[0] not in shared]
        # matrices no other rank shares: one normuon_updates per set of hyperparameters
        for indices in group_by(entries, lambda e: math_key(e[2], self._math_options)).values():
            group = entries[indices[0]][2]
            params, states = [entries[i][0] for i in indices], [entries[i][1] for i in indices]
            normuon_updates(
                [local(p) for p in params],
                [local(p.grad) for p in params],
                [local(state["momentum"]) for state in states],
                [local(state["row_second_moment"]) for state in states],
                lr=group["lr"],
                beta=group["momentum"],
                beta2=group["beta2"],
                nesterov=group["nesterov"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                ns_steps=group["ns_steps"],
                ns_dtype=group["ns_dtype"],
                ns_coefficients=group["ns_coefficients"],
                batched=self.batched(local(params[0]).device),
            )
        group_of = {p: g for g in groups for p in g["params"]}
        for exchange, params in self._exchanges:
            self._shared_step(exchange, [(p, group_of[p]) for p in params])

    def _shared_step(self, exchange: OwnerExchange, entries: list[tuple[Tensor, dict]]) -> None:
        """NorMuon on matrices shared by ``exchange``'s ranks (see the class docstring).

        A parameter without a gradient sends a zero direction and stays unchanged.
        """
        directions = []
        for p, group in entries:
            if p.grad is None:
                directions.append(torch.zeros_like(local(p), dtype=state_dtype(p)))
                continue
            state = self.state[p]
            if not state:
                state.update(self._init_matrix_state(p, group))
            directions.append(
                nesterov_direction(
                    local(p.grad),
                    local(state["momentum"]),
                    beta=group["momentum"],
                    nesterov=group["nesterov"],
                )
            )
        # N: every piece to the matrix's owner (one all_to_all)
        whole = exchange.gather(directions)
        # O = NS5(N), for the matrices this rank owns
        results = {j: newton_schulz(N, *ns_arguments(entries[j][1])) for j, N in whole.items()}
        # O: every rank's piece back from the owner (one all_to_all)
        dtypes = [group["ns_dtype"] for _, group in entries]
        buffer_dtype = functools.reduce(torch.promote_types, dtypes)
        pieces = exchange.scatter(results, buffer_dtype, directions[0].device)
        # Ô on this rank's rows, and the part of ||Ô||_F² this rank accounts for
        normalized, square_norms = [], []
        split = _any_split(exchange)
        for j, ((p, group), piece) in enumerate(zip(entries, pieces)):
            v = local(self.state[p]["row_second_moment"]) if p.grad is not None else None
            update = (
                None
                if v is None
                else neuron_normalize(piece, v, beta2=group["beta2"], eps=group["eps"])
            )
            counted = update is not None and (not split or exchange.me in exchange.sources[j])
            normalized.append(update)
            zero = torch.zeros((), dtype=torch.float64, device=piece.device)
            square_norms.append(update.square().sum().double() if counted else zero)
        square_norms = torch.stack(square_norms)
        if split:  # ||Ô||_F² = sum over the distinct pieces (one all_reduce)
            dist.all_reduce(square_norms, group=exchange.group)
        for (p, group), update, square_norm in zip(entries, normalized, square_norms):
            if update is None:
                continue
            # Ô <- 0.2 sqrt(m n) Ô / ||Ô||_F
            update.mul_(rms_factor(p.shape, square_norm))
            apply_update(
                local(p), update, lr=group["lr"], weight_decay=group["weight_decay"], scale=1.0
            )


def _any_split(exchange: OwnerExchange) -> bool:
    """True if some rank holds less than a whole matrix (then ``||Ô||_F`` needs a sum)."""
    return any(
        len(rows) * len(cols) != m * n
        for (m, n), pieces in zip(exchange.shapes, exchange.pieces)
        for rows, cols in pieces
    )
