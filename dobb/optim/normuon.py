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
matrices). ``NorMuonCore`` gives them to the owner-exchange driver
(``dobb.optim.owner_groups``): shared matrices are normalized after Muon's exchange, on
each rank's own rows, the driver summing ``||Ô||_F²`` over the pieces.
"""

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from dobb.optim.batching import group_by, solo
from dobb.optim.config import BOOL, POSITIVE, UNIT, inherit, option
from dobb.optim.muon import (
    NS_STEPS,
    MuonCore,
    NewtonSchulzConfig,
    OwnerExchangeOptimizer,
    apply_update,
    apply_updates,
    momentum_state,
    nesterov_direction,
    nesterov_directions,
    newton_schulz,
    orthogonalize,
)
from dobb.optim.owner_groups import ExchangeCore
from dobb.optim.parts import state_dtype

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


def row_moment_state(param: Tensor) -> dict[str, Tensor]:
    """The momentum and ``v`` (m x 1), zero; ``v`` sharded like W's rows (a column slice of
    a row-sharded DTensor)."""
    return momentum_state(param) | {
        "row_second_moment": torch.zeros_like(param[:, :1], dtype=state_dtype(param))
    }


class NorMuonCore(ExchangeCore):
    """NorMuon's core: Muon's direction and Newton-Schulz (``MuonCore``'s, composed), with
    ``normuon_updates`` on unshared matrices; shared, the post step normalizes each rank's
    rows and sums ``||Ô||_F²`` over the pieces, and ``apply`` rescales to RMS 0.2."""

    sums = ()  # ||Ô||_F²
    whole_rows = "NorMuon normalizes whole rows"
    muon = MuonCore()  # the direction, the owner's step and its dtype

    def init_state(self, param: Tensor, config, name: str) -> dict[str, Tensor]:
        return row_moment_state(param)

    def updates(self, batch, config) -> None:
        params, grads, states = batch
        normuon_updates(
            params,
            grads,
            [state["momentum"] for state in states],
            [state["row_second_moment"] for state in states],
            lr=config.lr,
            beta=config.momentum,
            beta2=config.beta2,
            nesterov=config.nesterov,
            weight_decay=config.weight_decay,
            eps=config.eps,
            ns_steps=config.ns_steps,
            ns_dtype=config.ns_dtype,
            ns_coefficients=config.ns_coefficients,
            batched=config.batched(params[0].device),
        )

    def directions(self, grads, states, config) -> tuple[list[Tensor], list]:
        return self.muon.directions(grads, states, config)

    orthogonalize = staticmethod(orthogonalize)

    def result_dtype(self, config) -> torch.dtype:
        return self.muon.result_dtype(config)

    def normalize(self, pieces, states, aux, config) -> tuple[list[Tensor], list[Tensor]]:
        """Ô on this rank's rows, and its part of ``||Ô||_F²``."""
        found = [
            neuron_normalize(piece, state["row_second_moment"], beta2=config.beta2, eps=config.eps)
            for piece, state in zip(pieces, states)
        ]
        return found, [update.square().sum().double() for update in found]

    def apply(self, params, updates, shapes, aux, config, sums) -> None:
        for update, shape, square_norm in zip(updates, shapes, sums):
            # Ô <- 0.2 sqrt(m n) Ô / ||Ô||_F
            update.mul_(rms_factor(shape, square_norm))
        apply_updates(
            params,
            updates,
            lr=config.lr,
            weight_decay=config.weight_decay,
            scales=[1.0] * len(params),
        )


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

    Distributed: Muon's owner exchange (``dobb.optim.owner_groups``), then, in its post
    step, each rank updates ``v`` and normalizes its own rows, which must be whole (the
    mean is over whole rows; a ``Shard(1)`` parameter raises), and ``||Ô||_F²`` is summed
    over the pieces (one float per matrix). ``v`` (fp32 state) is sharded like the rows of
    ``W``.

    Where we chose: the paper's box is followed as written (target RMS 0.2); the authors'
    code instead keeps ``||Ô||_F = ||O||_F`` and applies Muon's ``sqrt(max(1, m/n))``.
    """

    algorithm = "normuon"
    core = NorMuonCore()

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
