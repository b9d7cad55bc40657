"""Dion's functional core (Ahn et al., arXiv 2504.05295): the update on plain tensors.

Dion replaces Muon's full Newton-Schulz orthogonalization with one warm-started rank-``r``
power iteration on the momentum buffer per step, and feeds the part of the buffer that the
low-rank update did not use back into the next step (error feedback). For a weight ``W``
of shape ``(m, n)``, momentum ``M`` ``(m, n)`` and right factor ``Q`` ``(n, r)``:

.. code-block:: text

    B = M + G
    P = Orthogonalize(B Q)          (m, r)
    R = Bᵀ P                        (n, r)
    M <- B - (1 - mu) P Rᵀ          (error feedback)
    Q <- ColumnNormalize(R)
    W <- W (1 - lr wd) - lr sqrt(m / n) P Qᵀ

``dion_update`` is the paper's Algorithm 1 on one whole matrix, one line per line of the
paper's box: the reference. ``dion_updates`` takes whole matrices (one device, DDP): each
line runs once per stack of same-shape matrices, so a step costs O(shapes) kernels, not
O(matrices). Both are pure: nothing here communicates. Matrices split over ranks run the
same steps in ``dobb.optim.dion_sharded.dion_step``, which completes the sums over split
dims with all-reduces between them. The optimizer's core (``dobb.optim.dion.DionCore``)
runs these on whole matrices; ``rank_of`` and ``shape_scale`` are what it and the sharded
placement read from a matrix's shape.

Matrices agreeing on shape, rank, dtypes, device, scale and sketch seed form one
``(b, m, n)`` stack, and each line of Algorithm 1 runs once per stack (bmm, batched
QR / Cholesky / triangular solves) or once for all matrices (foreach). Matrix ``i``'s
sketch comes from a generator seeded by ``sketch_seeds[i]`` on its device (what
``dion_update`` gets), so matrices with one seed share one sketch.

Host reads: none for ``orthogonalize="qr"``. Randomized Cholesky QR falls back to
Householder QR where a factorization fails, which only the device knows: the failure
flags of all stacks are read once (one read per step; more only when one failed).
``B = 0`` (keep ``M`` and ``Q``) is decided on the device: ``P`` is set to 0, so ``R``,
the error feedback and the update vanish, and ``Q`` is selected by ``where``.
"""

import math

import torch
from torch import Tensor

from dobb.optim.batching import foreach_mul_, group_by, solo

ORTHOGONALIZE_METHODS = ("qr", "cholesky_qr")
COLUMN_EPS = 1e-8  # columns of R with a smaller norm are left (near) zero, never divided by 0
# Randomized Cholesky QR sketch: ceil(1.25 r) rows rounded up to a multiple of 128, the
# values of microsoft/dion (dion_reference.py, `orthogonalize`, qr_method="rcqr").
SKETCH_OVERSAMPLE = 1.25
SKETCH_ROW_MULTIPLE = 128


def rank_of(shape: tuple[int, int], rank_fraction: float, rank: int | None = None) -> int:
    """``r`` for a ``(d_out, d_in)`` matrix: ``rank``, else ``ceil(rank_fraction min)``,
    capped at ``min(d_out, d_in)``."""
    smaller = min(shape)
    # round first so that float error cannot bump the rank (0.07 * 100 = 7.000000000000001)
    r = rank or math.ceil(round(rank_fraction * smaller, 9))
    return min(r, smaller)


def shape_scale(shape: tuple[int, int]) -> float:
    """The Dion papers' learning-rate factor ``sqrt(d_out / d_in)`` of the whole matrix (no
    ``max(1, .)`` as in Muon; Dion2 and NorDion2 take it too)."""
    return math.sqrt(shape[0] / shape[1])


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
    """One Dion step (Algorithm 1) on a whole ``(m, n)`` matrix; ``param``, ``momentum``, ``Q``
    in place. The reference that ``dion_step`` is tested against.

    ``Q`` is the ``(n, r)`` right factor of the previous step; ``scale`` the learning-rate
    factor (the paper's ``sqrt(m / n)``). The transposed variant (Q of shape ``(m, r)``) is
    this function applied to ``.mT`` views, with the same ``scale``. ``generator`` seeds the
    sketch of ``orthogonalize="cholesky_qr"``.
    """
    # B = M + G   (the momentum tensor holds B from here on)
    B = momentum.add_(grad.to(momentum.dtype))
    # W <- W (1 - lr wd)
    param.mul_(1 - lr * weight_decay)
    if not B.any():  # B = 0: keep M and Q (ColumnNormalize(0) has no direction)
        return
    # P = Orthogonalize(B Q);  R = Bᵀ P   (one warm-started power iteration)
    P, R = power_step(B, Q, orthogonalize, generator=generator)
    # M <- B - (1 - mu) P Rᵀ   (error feedback)
    error_feedback(B, P, R, mu)
    # Q <- ColumnNormalize(R)
    Q.copy_(column_normalize(R))
    # W <- W - lr scale P Qᵀ
    param.addmm_(P.to(param.dtype), Q.mT.to(param.dtype), alpha=-lr * scale)


def sketch_rows(r: int) -> int:
    """Rows ``k`` of the sketch for rank ``r``: ``ceil(1.25 r)`` rounded up to 128."""
    return SKETCH_ROW_MULTIPLE * math.ceil(SKETCH_OVERSAMPLE * r / SKETCH_ROW_MULTIPLE)


def sketch(
    m: int, r: int, *, generator: torch.Generator | None, device, dtype: torch.dtype
) -> Tensor:
    """The Gaussian sketch ``S`` (``k x m``, ``k = sketch_rows(r)``)."""
    k = sketch_rows(r)
    # S ~ N(0, 1/k), so that E[Sᵀ S] = I
    return torch.randn(k, m, generator=generator, device=device, dtype=dtype).div_(math.sqrt(k))


def precondition(P: Tensor, SP: Tensor) -> Tensor:
    """``P₁ = P R₁⁻¹`` with ``S P = Q₁ R₁`` (QR of a small ``k x r`` matrix); rowwise in P."""
    R1 = torch.linalg.qr(SP, mode="r").R
    return torch.linalg.solve_triangular(R1, P, upper=True, left=False)


def cholesky_orthonormalize(P1: Tensor, gram: Tensor) -> Tensor | None:
    """``P₂ = P₁ R₂⁻¹`` with ``P₁ᵀ P₁ = R₂ᵀ R₂`` (Cholesky; ``gram = P₁ᵀ P₁``); rowwise in
    P₁. None if the factorization fails or is not finite (both read from ``gram`` only,
    so every rank holding the same ``gram`` decides alike)."""
    R2, info = torch.linalg.cholesky_ex(gram, upper=True)
    if info.item() != 0 or not bool(torch.isfinite(R2).all()):
        return None
    return torch.linalg.solve_triangular(R2, P1, upper=True, left=False)


def randomized_cholesky_qr(P: Tensor, *, generator: torch.Generator | None = None) -> Tensor | None:
    """Orthonormal basis of the columns of a tall ``(m, r)`` matrix by randomized Cholesky QR.

    A Gaussian sketch ``S`` (``k x m``, ``k ~ 1.25 r``) gives a cheap triangular
    preconditioner ``R₁`` from the small QR of ``S P``; ``P R₁⁻¹`` is well conditioned, so
    one Cholesky QR pass then orthonormalizes it to working precision. Only ``S P`` and
    Gram matrices touch all rows, which is what makes it cheap when ``P`` is row-sharded
    (``dion_step`` runs these same steps with those two products summed over shards).
    Returns None if a factorization fails (``P`` numerically rank-deficient).
    """
    m, r = P.shape
    S = sketch(m, r, generator=generator, device=P.device, dtype=P.dtype)
    P1 = precondition(P, S @ P)
    P2 = cholesky_orthonormalize(P1, P1.mT @ P1)
    return P2 if P2 is not None and bool(torch.isfinite(P2).all()) else None


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


def column_normalize(R: Tensor, eps: float = COLUMN_EPS, *, norms: Tensor | None = None) -> Tensor:
    """``R`` with unit-norm columns; columns of norm below ``eps`` are divided by ``eps``.

    ``norms`` (``1 x r``): the column norms when ``R`` holds only some rows of the matrix.
    """
    norms = R.norm(dim=-2, keepdim=True) if norms is None else norms
    return R / norms.clamp_min(eps)


# The batched form of ``dion_update``: many whole matrices sharing hyperparameters, one
# stack per shape, so a step costs O(shapes) kernels, not O(matrices). ``dion_update`` is
# its reference (a test holds the two together).


def orthonormalize_stack(
    P: Tensor, method: str = "qr", *, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor | None]:
    """``orthonormalize`` of each ``(m, r)`` slice of a ``(b, m, r)`` stack, without reading
    the host: the bases, and for randomized Cholesky QR a ``(b,)`` flag of the slices whose
    factorization failed (their bases are garbage; the caller redoes them by Householder
    QR), else None. Every slice is sketched with the same ``S`` (one draw per stack)."""
    b, m, r = P.shape
    if method != "cholesky_qr" or m <= r:
        return torch.linalg.qr(P).Q, None
    S = sketch(m, r, generator=generator, device=P.device, dtype=P.dtype)
    # P₁ = P R₁⁻¹ with S P = Q₁ R₁   (S P: (b, k, r))
    P1 = precondition(P, S @ P)
    # P₂ = P₁ R₂⁻¹ with P₁ᵀ P₁ = R₂ᵀ R₂
    R2, info = torch.linalg.cholesky_ex(P1.mT @ P1, upper=True)
    P2 = torch.linalg.solve_triangular(R2, P1, upper=True, left=False)
    # failed: as cholesky_orthonormalize and randomized_cholesky_qr decide, per slice
    finite = torch.isfinite(R2).flatten(1).all(1) & torch.isfinite(P2).flatten(1).all(1)
    return P2, (info != 0) | ~finite


def dion_updates(
    params: list[Tensor],
    grads: list[Tensor],
    momenta: list[Tensor],
    Qs: list[Tensor],
    *,
    lr: float,
    mu: float,
    weight_decay: float,
    scales: list[float],
    orthogonalize: str = "qr",
    sketch_seeds: list[int] | None = None,
    batched: bool = True,
) -> None:
    """``dion_update`` of many whole matrices; ``params``, ``momenta``, ``Qs`` in place.

    Same-shape matrices (rank, dtypes, device, scale and sketch seed alike) form one
    ``(b, m, n)`` stack for each line of Algorithm 1; matrices with one seed share one
    sketch. Host reads: one per step with ``"cholesky_qr"`` (its failure flags), none with
    ``"qr"``; ``B = 0`` is decided on the device (see the module docstring).
    """
    if not params:
        return
    # B = M + G   (the momentum tensors hold B from here on)
    torch._foreach_add_(momenta, [g.to(m.dtype) for g, m in zip(grads, momenta, strict=True)])
    # W <- W (1 - lr wd)
    foreach_mul_(params, 1 - lr * weight_decay)
    stacks = list(
        group_by(
            range(len(params)),
            lambda i: (
                (
                    tuple(momenta[i].shape),
                    Qs[i].shape[1],
                    momenta[i].dtype,
                    params[i].dtype,
                    momenta[i].device,
                    scales[i],
                    None if sketch_seeds is None else sketch_seeds[i],
                )
                + solo(i, batched)
            ),
        ).items()
    )
    B = [torch.stack([momenta[i] for i in indices]) for _, indices in stacks]  # (b, m, n)
    Q = [torch.stack([Qs[i] for i in indices]) for _, indices in stacks]  # (b, n, r)
    nonzero = [b.flatten(1).any(1)[:, None, None] for b in B]  # B != 0, (b, 1, 1)
    # P = Orthogonalize(B Q)   (b, m, r)
    BQ = [b @ q for b, q in zip(B, Q)]
    P, failed = [], []
    for (key, _), bq in zip(stacks, BQ):
        seed = key[6]  # the sketch seed (after it: a CPU index, see batching.solo)
        generator = None if seed is None else torch.Generator(bq.device).manual_seed(seed)
        basis, flags = orthonormalize_stack(bq, orthogonalize, generator=generator)
        P.append(basis)
        failed.append(flags)
    _redo_failed_by_householder(P, BQ, failed, nonzero)
    P = [torch.where(nz, p, 0) for p, nz in zip(P, nonzero)]  # B = 0: P = 0
    # R = Bᵀ P   (b, n, r)
    R = [b.mT @ p for b, p in zip(B, P)]
    for b, p, r in zip(B, P, R):
        # M <- B - (1 - mu) P Rᵀ
        b.baddbmm_(p, r.mT, alpha=-(1 - mu))
    # Q <- ColumnNormalize(R)   (kept where B = 0)
    normalized = [column_normalize(r) for r in R]
    new_Q = [torch.where(nz, q_new, q) for nz, q_new, q in zip(nonzero, normalized, Q)]
    # W <- W - lr scale P Qᵀ   (P Qᵀ = 0 where B = 0)
    pdtypes = [key[3] for key, _ in stacks]
    U = [p.to(dt) @ q.mT.to(dt) for p, q, dt in zip(P, normalized, pdtypes)]
    order = [i for _, indices in stacks for i in indices]
    torch._foreach_copy_([momenta[i] for i in order], [t for b in B for t in b.unbind()])
    torch._foreach_copy_([Qs[i] for i in order], [t for q in new_Q for t in q.unbind()])
    updates = [t for u in U for t in u.unbind()]  # slice j is matrix order[j]
    for scale, slices in group_by(order, lambda i: float(scales[i])).items():
        torch._foreach_add_(
            [params[order[j]] for j in slices], [updates[j] for j in slices], alpha=-lr * scale
        )


def _redo_failed_by_householder(
    P: list[Tensor], BQ: list[Tensor], failed: list[Tensor | None], nonzero: list[Tensor]
) -> None:
    """Householder QR of ``B Q`` for the slices whose Cholesky QR failed (``B != 0``), in
    place in ``P``: one host read of all flags; one more per stack only if some failed."""
    flags = [
        (f & nz.flatten(), i) for i, (f, nz) in enumerate(zip(failed, nonzero)) if f is not None
    ]
    if not flags or not bool(torch.cat([f for f, _ in flags]).any()):
        return
    for f, i in flags:
        redo = f.nonzero().flatten()
        if len(redo):
            P[i][redo] = torch.linalg.qr(BQ[i][redo]).Q
