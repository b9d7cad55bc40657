"""Dion: Distributed Orthonormalized Updates (Ahn et al., arXiv 2504.05295).

Dion replaces Muon's full Newton-Schulz orthogonalization with one warm-started rank-``r``
power iteration on the momentum buffer per step, and feeds the part of the buffer that the
low-rank update did not use back into the next step (error feedback). This module holds the
paper's Algorithm 1 on one whole local matrix, split into small pure functions (the power
step, orthonormalization, error feedback, column normalization) so that the distributed
version can run the same pieces with its collectives in between.
"""

import math
import zlib
from typing import Any

import torch
from torch import Tensor

from dobb.optim.base import MatrixOptimizer, local, state_dtype
from dobb.optim.muon import check_unsharded

ORTHOGONALIZE_METHODS = ("qr", "cholesky_qr")
COLUMN_EPS = 1e-8  # columns of R with a smaller norm are left (near) zero, never divided by 0
# Randomized Cholesky QR sketch: ceil(1.25 r) rows rounded up to a multiple of 128, the
# values of microsoft/dion (dion_reference.py, `orthogonalize`, qr_method="rcqr").
SKETCH_OVERSAMPLE = 1.25
SKETCH_ROW_MULTIPLE = 128


def randomized_cholesky_qr(P: Tensor, *, generator: torch.Generator | None = None) -> Tensor | None:
    """Orthonormal basis of the columns of a tall ``(m, r)`` matrix by randomized Cholesky QR.

    A Gaussian sketch ``S`` (``k x m``, ``k ~ 1.25 r``) gives a cheap triangular
    preconditioner ``R₁`` from the small QR of ``S P``; ``P R₁⁻¹`` is well conditioned, so
    one Cholesky QR pass then orthonormalizes it to working precision. Only ``S P`` and
    Gram matrices touch all rows, which is what makes it cheap when ``P`` is row-sharded.
    Returns None if a factorization fails (``P`` numerically rank-deficient).
    """
    m, r = P.shape
    k = SKETCH_ROW_MULTIPLE * math.ceil(SKETCH_OVERSAMPLE * r / SKETCH_ROW_MULTIPLE)
    # S ~ N(0, 1/k), so that E[Sᵀ S] = I
    S = torch.randn(k, m, generator=generator, device=P.device, dtype=P.dtype).div_(math.sqrt(k))
    # S P = Q₁ R₁  (QR of a small k x r matrix);  P₁ = P R₁⁻¹
    R1 = torch.linalg.qr(S @ P, mode="r").R
    P1 = torch.linalg.solve_triangular(R1, P, upper=True, left=False)
    # P₁ᵀ P₁ = R₂ᵀ R₂  (Cholesky);  P₂ = P₁ R₂⁻¹
    R2, info = torch.linalg.cholesky_ex(P1.mT @ P1, upper=True)
    if info.item() != 0:
        return None
    P2 = torch.linalg.solve_triangular(R2, P1, upper=True, left=False)
    return P2 if bool(torch.isfinite(P2).all()) else None


def orthonormalize(
    P: Tensor, method: str = "qr", *, generator: torch.Generator | None = None
) -> Tensor:
    """Orthonormal basis of the column span of ``P`` (``(m, r)``, ``m >= r``).

    ``"qr"``: Householder QR. ``"cholesky_qr"``: randomized Cholesky QR for tall ``P``
    (``m > r``), falling back to Householder QR when a Cholesky factorization fails.
    """
    if method == "cholesky_qr" and P.shape[0] > P.shape[1]:
        basis = randomized_cholesky_qr(P, generator=generator)
        if basis is not None:
            return basis
    return torch.linalg.qr(P).Q


def power_step(
    B: Tensor, Q: Tensor, method: str = "qr", *, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """One power iteration warm-started at ``Q`` (``(n, r)``): ``B ≈ P Rᵀ``, ``Pᵀ P = I``."""
    # P = Orthogonalize(B Q)   (m, r)
    P = orthonormalize(B @ Q, method, generator=generator)
    # R = Bᵀ P                 (n, r)
    R = B.mT @ P
    return P, R


def error_feedback(B: Tensor, P: Tensor, R: Tensor, mu: float) -> None:
    """``M = B - (1 - mu) P Rᵀ``, in place on ``B``: remove the used part of the buffer."""
    B.addmm_(P, R.mT, alpha=-(1 - mu))


def column_normalize(R: Tensor, eps: float = COLUMN_EPS) -> Tensor:
    """``R`` with unit-norm columns; columns of norm below ``eps`` are divided by ``eps``."""
    return R / R.norm(dim=0, keepdim=True).clamp_min(eps)


def dion_update(
    param: Tensor,
    grad: Tensor,
    momentum: Tensor,
    Q: Tensor,
    *,
    lr: float,
    mu: float,
    weight_decay: float,
    scale: float,
    orthogonalize: str = "qr",
    generator: torch.Generator | None = None,
) -> None:
    """One Dion step on a whole ``(m, n)`` matrix; ``param``, ``momentum``, ``Q`` in place.

    ``Q`` is the ``(n, r)`` right factor of the previous step. The transposed variant
    (Q of shape ``(m, r)``) is this function applied to ``.mT`` views, with the same
    ``scale``. ``generator`` seeds the sketch of ``orthogonalize="cholesky_qr"``.
    """
    # B = M + G   (the momentum tensor holds B from here on)
    momentum.add_(grad.to(momentum.dtype))
    # W <- W (1 - lr wd)
    param.mul_(1 - lr * weight_decay)
    if not momentum.any():  # B = 0: no direction to take; keep Q as the next warm start
        return
    P, R = power_step(momentum, Q, orthogonalize, generator=generator)
    # M <- B - (1 - mu) P Rᵀ
    error_feedback(momentum, P, R, mu)
    # Q <- ColumnNormalize(R)
    Q.copy_(column_normalize(R))
    # W <- W - lr scale P Qᵀ
    param.addmm_(P.to(param.dtype), Q.mT.to(param.dtype), alpha=-lr * scale)


class Dion(MatrixOptimizer):
    r"""Dion (arXiv 2504.05295, Algorithm 1) for hidden weight matrices.

    .. code-block:: text

        per matrix W (d_out x d_in), rank r, Q_0 ~ N(0, 1) of shape (d_in, r), step t:
          B = M + G
          P = Orthogonalize(B Q);   R = Bᵀ P               (one warm-started power iteration)
          M <- B - (1 - mu) P Rᵀ                           (error feedback)
          Q <- ColumnNormalize(R)
          W <- W (1 - lr wd) - lr sqrt(d_out/d_in) P Qᵀ

    The momentum buffer accumulates gradients (``B = M + G``, not an EMA); the error
    feedback removes a ``1 - mu`` fraction of what the update used. Parameter groups with
    ``algorithm="adamw"`` or ``"lion"`` (see ``dobb.param_groups``) take the embeddings, the
    LM head, norms and biases.

    Args:
        params: parameters or parameter groups.
        lr: learning rate (default 0.01, microsoft/dion's reference default), scaled per
            matrix by ``sqrt(d_out/d_in)``, the paper's factor (no ``max(1, .)`` as in Muon,
            so wide matrices take smaller steps).
        mu: momentum / error-feedback decay (default 0.95); ``mu = 1`` keeps the buffer.
        weight_decay: decoupled weight decay, multiplied by ``lr`` (default 0.01, as the
            reference).
        rank_fraction: ``r = ceil(rank_fraction * min(d_out, d_in))`` (default 1/16).
        rank: an absolute rank that overrides ``rank_fraction``; ``r`` is capped at
            ``min(d_out, d_in)``.
        orthogonalize: ``"qr"`` (Householder QR, default) or ``"cholesky_qr"``
            (randomized Cholesky QR, the paper's fast distributed form; falls back to
            Householder QR if a Cholesky factorization fails).
        seed: base seed of ``Q_0`` and of the sketches; each matrix draws from a generator
            seeded by ``seed`` and its name, so data-parallel replicas agree.
        nonfinite: ``"raise"`` or ``"skip"`` on NaN/Inf gradients.

    Orientation: we follow Algorithm 1 as written (``Q`` is ``d_in x r`` for every matrix).
    microsoft/dion's implementation transposes unsharded wide matrices (``d_out < d_in``)
    so that the QR runs along the longer side; the two differ only in which factor is
    column-normalized rather than orthonormalized, and ``dion_update`` runs either.
    Columns of ``R`` are divided by ``max(norm, 1e-8)`` (the reference adds 1e-8), and an
    all-zero buffer leaves ``M`` and ``Q`` unchanged instead of producing NaN.
    """

    algorithm = "dion"

    def __init__(
        self,
        params,
        lr: float = 0.01,
        mu: float = 0.95,
        weight_decay: float = 0.01,
        rank_fraction: float = 1 / 16,
        rank: int | None = None,
        *,
        orthogonalize: str = "qr",
        seed: int = 0,
        nonfinite: str = "raise",
    ):
        self.seed = seed
        defaults = dict(
            lr=lr,
            mu=mu,
            weight_decay=weight_decay,
            rank_fraction=rank_fraction,
            rank=rank,
            orthogonalize=orthogonalize,
        )
        super().__init__(params, defaults, nonfinite=nonfinite)

    def _validate_group(self, group: dict[str, Any]) -> None:
        super()._validate_group(group)
        if group["algorithm"] != self.algorithm:
            return
        if not 0.0 <= group["mu"] <= 1.0:
            raise ValueError(f"invalid mu: {group['mu']} (must be in [0, 1])")
        if not 0.0 < group["rank_fraction"] <= 1.0:
            raise ValueError(f"invalid rank_fraction: {group['rank_fraction']} (must be in (0, 1])")
        rank = group["rank"]
        if rank is not None and not (isinstance(rank, int) and rank >= 1):
            raise ValueError(f"invalid rank: {rank!r} (an integer >= 1, or None)")
        if group["orthogonalize"] not in ORTHOGONALIZE_METHODS:
            raise ValueError(
                f"invalid orthogonalize: {group['orthogonalize']!r} "
                f"(one of {ORTHOGONALIZE_METHODS})"
            )
        for p in group["params"]:
            check_unsharded(self, p)

    @staticmethod
    def rank_of(shape: tuple[int, int], group: dict[str, Any]) -> int:
        """``r`` for a ``(d_out, d_in)`` matrix: ``rank``, else ``ceil(fraction * min)``."""
        smaller = min(shape)
        # round first so that float error cannot bump the rank (0.07 * 100 = 7.000000000000001)
        rank = group["rank"] or math.ceil(round(group["rank_fraction"] * smaller, 9))
        return min(rank, smaller)

    def _seed(self, param: Tensor) -> int:
        """A per-matrix seed that every replica computes alike (crc32 is stable, hash() not)."""
        return zlib.crc32(f"{self.seed}/{self.name_of(param)}".encode())

    def _init_matrix_state(self, param: Tensor, group: dict[str, Any]) -> dict[str, Any]:
        dtype, device = state_dtype(param), local(param).device
        generator = torch.Generator().manual_seed(self._seed(param))  # on CPU: any device agrees
        Q = torch.randn(param.shape[1], self.rank_of(param.shape, group), generator=generator)
        return {
            "step": torch.tensor(0.0),
            "momentum": torch.zeros_like(param, dtype=dtype),
            "Q": Q.to(device=device, dtype=dtype),
        }

    def _update_matrix(self, param: Tensor, state: dict[str, Any], group: dict) -> None:
        state["step"] += 1
        generator = None
        if group["orthogonalize"] == "cholesky_qr":  # sketch seeded by (matrix, step)
            seed = self._seed(param) * 1_000_003 + int(state["step"])
            generator = torch.Generator(local(param).device).manual_seed(seed)
        d_out, d_in = param.shape
        dion_update(
            local(param),
            local(param.grad),
            local(state["momentum"]),
            local(state["Q"]),
            lr=group["lr"],
            mu=group["mu"],
            weight_decay=group["weight_decay"],
            scale=math.sqrt(d_out / d_in),  # the paper's shape factor sqrt(d_out/d_in)
            orthogonalize=group["orthogonalize"],
            generator=generator,
        )
