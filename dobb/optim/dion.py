"""Dion: Distributed Orthonormalized Updates (Ahn et al., arXiv 2504.05295).

Dion replaces Muon's full Newton-Schulz orthogonalization with one warm-started rank-``r``
power iteration on the momentum buffer per step, and feeds the part of the buffer that the
low-rank update did not use back into the next step (error feedback).

``dion_update`` is the paper's Algorithm 1 on one whole matrix, one line per line of the
box: the reference. The optimizer runs two forms of it. ``dion_updates`` takes whole
matrices (one device, DDP): each line runs once per stack of same-shape matrices, so a
step costs O(shapes) kernels, not O(matrices). ``dion_step`` takes the same steps over a
list of matrices, each whole on this rank or split over ranks (``MatrixPlacement``). Where
a matrix is split, the products that sum over a split dim are completed by batched
all-reduces placed between the steps in straight-line code (one collective per process
group per round, for all matrices together). On whole matrices it computes exactly what
``dion_update`` does; tests hold both forms to it, and the distributed tests hold the
split runs to the one-device run.
"""

import math
import zlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from dobb._dtensor import DTensor, local
from dobb.distributed.groups import axis_groups, group_argument
from dobb.distributed.placement import MatrixPlacement, like_columns, matrix_placement
from dobb.distributed.reduce import all_reduce_
from dobb.optim.base import MatrixOptimizer, state_dtype
from dobb.optim.batching import batches_kernels, foreach_mul_, group_by, solo

ORTHOGONALIZE_METHODS = ("qr", "cholesky_qr")
COLUMN_EPS = 1e-8  # columns of R with a smaller norm are left (near) zero, never divided by 0
# Randomized Cholesky QR sketch: ceil(1.25 r) rows rounded up to a multiple of 128, the
# values of microsoft/dion (dion_reference.py, `orthogonalize`, qr_method="rcqr").
SKETCH_OVERSAMPLE = 1.25
SKETCH_ROW_MULTIPLE = 128


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
) -> None:
    """``dion_update`` of many whole matrices; ``params``, ``momenta``, ``Qs`` in place.

    Matrices agreeing on shape, rank, dtypes, device, scale and sketch seed form one
    ``(b, m, n)`` stack, and each line of Algorithm 1 runs once per stack (bmm, batched
    QR / Cholesky / triangular solves) or once for all matrices (foreach). Matrix ``i``'s
    sketch comes from a generator seeded by ``sketch_seeds[i]`` on its device (what
    ``dion_update`` gets), so matrices with one seed share one sketch.

    Host reads: none for ``orthogonalize="qr"``. Randomized Cholesky QR falls back to
    Householder QR where a factorization fails, which only the device knows: the failure
    flags of all stacks are read once (one read per step; more only when one failed).
    ``B = 0`` (keep ``M`` and ``Q``) is decided on the device: ``P`` is set to 0, so
    ``R``, the error feedback and the update vanish, and ``Q`` is selected by ``where``.
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
                + solo(i, momenta[i].device)
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


@dataclass
class DionMatrix:
    """One matrix of a Dion step: this rank's tensors and where the rest of the matrix is."""

    param: Tensor
    """``W``: this rank's piece (rows x columns of the whole); updated in place."""
    grad: Tensor
    momentum: Tensor
    """``M``, laid out like ``W``; holds ``B = M + G`` during the step."""
    Q: Tensor
    """``(columns here, r)``: the rows of ``Q`` for this rank's columns; updated in place."""
    scale: float
    """The whole matrix's learning-rate factor ``sqrt(d_out / d_in)``."""
    generator: torch.Generator | None = None
    """Seeds the sketch of ``"cholesky_qr"`` (equal on every rank holding the matrix)."""
    placement: MatrixPlacement | None = None
    """How the matrix is split over ranks; None: it is whole here."""
    data_groups: tuple = ()
    """Replicas with their own gradients, over which ``P`` and ``R`` are averaged."""

    @property
    def row_groups(self) -> tuple:
        return self.placement.row_groups if self.placement else ()

    @property
    def col_groups(self) -> tuple:
        return self.placement.col_groups if self.placement else ()


def dion_step(
    matrices: list[DionMatrix],
    *,
    lr: float,
    mu: float,
    weight_decay: float,
    orthogonalize: str = "qr",
) -> None:
    """One Dion step (Algorithm 1) on every matrix, whole or split over ranks: the steps of
    ``dion_update``, with the sums over split dims completed by batched all-reduces.

    Where rows (dim 0, ``m``) are split, ``Pᵀ P``-type products and ``R = Bᵀ P`` are summed
    over the row axes; where columns (dim 1, ``n``) are split, ``B Q`` and the column norms
    of ``R`` are summed over the column axes; ``P`` and ``R`` are averaged over
    ``data_groups``. With no groups this is exactly the single-device algorithm.
    """
    if not matrices:
        return
    rows = [x.row_groups for x in matrices]
    cols = [x.col_groups for x in matrices]
    data = [x.data_groups for x in matrices]
    for x in matrices:
        # B = M + G   (the momentum tensor holds B from here on)
        x.momentum.add_(x.grad.to(x.momentum.dtype))
        # W <- W (1 - lr wd)
        x.param.mul_(1 - lr * weight_decay)
    # P = B Q: summed over column shards, averaged over replicas. Each matrix's flag B != 0
    # is summed along (and over the row shards with S P below), so that every rank holding
    # a piece of B takes the same branch.
    P = [x.momentum @ x.Q for x in matrices]
    nonzero = [x.momentum.any().to(x.momentum.dtype).reshape(1) for x in matrices]
    all_reduce_(P + nonzero, cols + cols)
    all_reduce_(P + nonzero, data + data, average=True)
    # Orthogonalize(P) with rows split over ranks: randomized Cholesky QR (for tall P), its
    # sketch S the single-device one sliced by this rank's rows; S P and P₁ᵀ P₁ summed
    sketched = [
        i
        for i, x in enumerate(matrices)
        if rows[i] and orthogonalize == "cholesky_qr" and x.placement.shape[0] > P[i].shape[1]
    ]
    split = [i for i in range(len(matrices)) if rows[i]]
    # S P  (k x r), and the flags of all row-split matrices
    SP = [_sketch_rows(matrices[i], P[i]) @ P[i] for i in sketched]
    flags = [nonzero[i] for i in split]
    all_reduce_(SP + flags, [rows[i] for i in sketched] + [rows[i] for i in split])
    active = torch.cat(nonzero).nonzero().flatten().tolist()  # B = 0: keep M and Q as they are
    P1 = {i: precondition(P[i], sp) for i, sp in zip(sketched, SP) if i in active}
    # P₁ᵀ P₁  (r x r)
    gram = [p.mT @ p for p in P1.values()]
    all_reduce_(gram, [rows[i] for i in P1])
    P2 = {i: cholesky_orthonormalize(p, g) for (i, p), g in zip(P1.items(), gram)}
    for i in active:
        x = matrices[i]
        if P2.get(i) is not None:
            P[i] = P2[i]
        elif rows[i]:  # Householder QR needs whole columns: gather P's rows (rare for CQR)
            method = "qr" if i in P2 else orthogonalize  # CQR failed: as one device, Householder
            whole = x.placement.gather_rows(P[i])
            P[i] = x.placement.take_rows(orthonormalize(whole, method, generator=x.generator))
        else:
            P[i] = orthonormalize(P[i], orthogonalize, generator=x.generator)
    # R = Bᵀ P: summed over row shards, averaged over replicas  (columns here x r)
    R = [matrices[i].momentum.mT @ P[i] for i in active]
    all_reduce_(R, [rows[i] for i in active])
    all_reduce_(R, [data[i] for i in active], average=True)
    # squared column norms of R, summed over column shards (used where columns are split)
    squares = [r.square().sum(dim=0, keepdim=True) for r in R]
    all_reduce_(squares, [cols[i] for i in active])
    for i, r, square in zip(active, R, squares):
        x = matrices[i]
        # M <- B - (1 - mu) P Rᵀ
        error_feedback(x.momentum, P[i], r, mu)
        # Q <- ColumnNormalize(R)
        x.Q.copy_(column_normalize(r, norms=square.sqrt() if cols[i] else None))
        # W <- W - lr scale P Qᵀ
        x.param.addmm_(P[i].to(x.param.dtype), x.Q.mT.to(x.param.dtype), alpha=-lr * x.scale)


def _sketch_rows(x: DionMatrix, P: Tensor) -> Tensor:
    """The columns of the whole matrix's sketch ``S`` for this rank's rows."""
    m, r = x.placement.shape[0], P.shape[1]
    S = sketch(m, r, generator=x.generator, device=P.device, dtype=P.dtype)
    return S[:, x.placement.rows.to(P.device)]


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
        seed: base seed of ``Q_0`` and of the sketches. ``Q_0`` is drawn from a generator
            seeded by ``seed`` and the matrix's name; the sketch of a step from one seeded
            by ``seed``, the matrix's shape, ``r`` and the step, so same-shape matrices
            share it (one draw per stack; each sees a Gaussian ``S`` independent of its
            ``P``, all the preconditioner asks) and data-parallel replicas agree.
        sync_group: None, or the replicas whose gradients of Dion's matrices are left
            unaveraged (``dobb.distributed.groups``): a ProcessGroup for DDP, a DeviceMesh
            of data axes for HSDP. Dion then runs the paper's compressed data-parallel
            sync: ``P`` and ``R`` are averaged over the axes along which a matrix is
            replicated (never over an axis that splits it), so the replicas' gradients of
            Dion matrices need no all-reduce: use DDP with those parameters ignored, or,
            for HSDP, ``fully_shard`` over the ``data_shard`` axis only, with the replicas
            as plain copies, and pass the whole data mesh. Each replica then keeps its own
            momentum; the update equals the one from averaged gradients, because Dion is
            linear in ``M`` up to ``P`` and ``R``. ``state_dict()`` averages the momenta
            first (exact, for the same reason). Leave it None when gradients are already
            averaged (what a harness's DDP or FSDP does).
        data_parallel: deprecated spelling of ``sync_group``.
        nonfinite: ``"raise"`` or ``"skip"`` on NaN/Inf gradients (checked per rank).

    Batching: whole matrices (one device, DDP without ``sync_group``) run ``dion_updates``:
    same-shape matrices share every kernel (``B Q``, ``Bᵀ P`` and ``P Qᵀ`` as bmm, QR,
    Cholesky and triangular solves on ``(b, m, r)`` stacks, foreach for the rest). A step
    reads the host once for the non-finite check and, with ``"cholesky_qr"``, once more:
    the failure flags of every matrix's Cholesky QR, since which matrices need the
    Householder fallback is known only on the device. ``B = 0`` is handled on the device.

    Sharding: DTensor parameters are updated from their placements (FSDP ``Shard(0)``, TP
    ``Shard(0)``/``Shard(1)``, 2-D FSDP x TP with ``_StridedShard``, uneven or empty
    shards), with the single-device result up to float rounding. Per step, for all Dion
    matrices of a parameter group together, one all-reduce per mesh axis and round:

    ========================  ========================================  ==================
    round                     over                                      floats per matrix
    ========================  ========================================  ==================
    ``B Q`` (+ flag B != 0)   axes splitting columns (row-parallel TP)  ``m_local r + 1``
    ``S P`` (+ flag)          axes splitting rows (FSDP, col-par. TP)   ``k r + 1``
    ``P₁ᵀ P₁``                axes splitting rows                       ``r²``
    ``R = Bᵀ P``              axes splitting rows                       ``n_local r``
    column norms of ``R``     axes splitting columns                    ``r``
    ``P``, ``R`` (mean)       ``sync_group`` axes that copy it          ``m r``, ``n r``
    ========================  ========================================  ==================

    (``k = ceil(1.25 r)`` rounded up to 128.) ``Q`` is kept split like ``W``'s columns and
    replicated over the row axes (``R`` is all-reduced, not reduce-scattered: ``P Qᵀ``
    needs every row of ``Q`` where rows are split; a reduce-scatter plus an all-gather
    would move the same bytes). Its optimizer state is a DTensor laid out that way, so
    DCP checkpoints hold one ``(d_in, r)`` ``Q``. Householder QR cannot run on split
    rows: with ``orthogonalize="qr"`` (and for ``P`` with ``m <= r``, or when Cholesky
    QR fails) the rows of ``P`` are all-gathered and every rank runs the single-device
    QR. The zero-buffer test (``B = 0`` keeps ``M`` and ``Q``) rides on the reductions
    above, so every rank holding a piece takes the same branch.

    microsoft/dion orients FSDP-sharded matrices the other way (the shard dim on ``Q``'s
    side): ``P`` then needs a reduce-scatter/all-gather over a batch of matrices and each
    rank orthonormalizes whole ``P``'s, while ``R`` needs no reduction. We keep Algorithm 1's
    orientation, which the paper's distributed Cholesky QR serves.

    Orientation: we follow Algorithm 1 as written (``Q`` is ``d_in x r`` for every matrix).
    microsoft/dion's implementation transposes unsharded wide matrices (``d_out < d_in``)
    so that the QR runs along the longer side; the two differ only in which factor is
    column-normalized rather than orthonormalized, and ``dion_update`` runs either.
    Columns of ``R`` are divided by ``max(norm, 1e-8)`` (the reference adds 1e-8), and an
    all-zero buffer leaves ``M`` and ``Q`` unchanged instead of producing NaN.
    """

    algorithm = "dion"
    # A job whose DDP/FSDP averages the gradients hands Dion no group: its compressed sync
    # (sync_group) needs them unaveraged (see dobb.distributed.groups).
    data_parallel_option = None

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
        sync_group=None,
        data_parallel=None,
        nonfinite: str = "raise",
    ):
        self.seed = seed
        sync_group = group_argument("Dion", "sync_group", sync_group, data_parallel)
        self._sync_groups = axis_groups(sync_group)
        # derived layout, recomputed rather than checkpointed (a checkpoint may load
        # into another mesh)
        self._placements: dict[Tensor, MatrixPlacement] = {}
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
            self._placement(p)  # rejects Partial placements now rather than mid-step

    def _placement(self, param: Tensor) -> MatrixPlacement | None:
        """How ``param`` is split over ranks; None for a plain tensor."""
        if not isinstance(param, DTensor):
            return None
        if param not in self._placements:
            self._placements[param] = matrix_placement(param)
        return self._placements[param]

    def _data_groups(self, param: Tensor) -> tuple:
        """The ``sync_group`` axes along which ``param`` is copied (compressed sync)."""
        placement = self._placement(param)
        if placement is None:
            return self._sync_groups
        split = [dist.get_process_group_ranks(g) for g in placement.row_groups]
        split += [dist.get_process_group_ranks(g) for g in placement.col_groups]
        return tuple(g for g in self._sync_groups if dist.get_process_group_ranks(g) not in split)

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
        d_in = param.shape[1]
        Q = torch.randn(d_in, self.rank_of(param.shape, group), generator=generator)
        placement = self._placement(param)
        if placement is not None:  # this rank's columns of the one Q_0 of the whole matrix
            Q = Q[placement.cols]
        return {
            "step": torch.tensor(0.0),
            "momentum": torch.zeros_like(param, dtype=dtype),
            "Q": like_columns(Q.to(device=device, dtype=dtype), param, d_in),
        }

    def _sketch_seed(self, shape: tuple[int, int], rank: int, step: int) -> int:
        """The seed of the sketch of every ``shape`` matrix of rank ``rank`` at ``step``:
        equal on every rank holding such a matrix, and one per shape, so that a stack of
        same-shape matrices draws one sketch (a Gaussian ``S`` independent of each ``P``,
        which is all the preconditioner needs)."""
        m, n = shape
        return zlib.crc32(f"{self.seed}/sketch/{m}x{n}/{rank}".encode()) * 1_000_003 + step

    def _matrix_step(self, groups: list[dict[str, Any]]) -> None:
        """Whole matrices (one device, DDP without ``sync_group``) run ``dion_updates``,
        batched by shape; split or compressed-sync ones run ``dion_step``."""
        for group in groups:
            entries = list(self._matrices_with_grad([group]))
            if not entries:
                continue
            steps = [state["step"] for _, state, _ in entries]  # CPU scalars: no device sync
            torch._foreach_add_(steps, 1.0)
            seeds = [
                self._sketch_seed(p.shape, state["Q"].shape[1], int(step))
                for (p, state, _), step in zip(entries, torch.stack(steps).tolist())
            ]
            hp = dict(lr=group["lr"], mu=group["mu"], weight_decay=group["weight_decay"])
            hp["orthogonalize"] = group["orthogonalize"]
            whole = [
                j
                for j, (p, _, _) in enumerate(entries)
                if self._placement(p) is None and not self._data_groups(p)
            ]
            params, batched = [entries[j][0] for j in whole], set(whole)
            if params and not batches_kernels(local(params[0]).device):
                sketched = hp["orthogonalize"] == "cholesky_qr"  # the only use of a generator
                for j, p in zip(whole, params):  # CPU: matrix by matrix, no stacking copies
                    device = local(p).device
                    generator = torch.Generator(device).manual_seed(seeds[j]) if sketched else None
                    momentum, Q = local(entries[j][1]["momentum"]), local(entries[j][1]["Q"])
                    scale = math.sqrt(p.shape[0] / p.shape[1])
                    dion_update(
                        local(p), local(p.grad), momentum, Q, scale=scale, generator=generator, **hp
                    )
                params, whole = [], []
            dion_updates(
                [local(p) for p in params],
                [local(p.grad) for p in params],
                [local(entries[j][1]["momentum"]) for j in whole],
                [local(entries[j][1]["Q"]) for j in whole],
                scales=[math.sqrt(p.shape[0] / p.shape[1]) for p in params],
                sketch_seeds=[seeds[j] for j in whole],
                **hp,
            )
            matrices = []
            for j, (p, state, _) in enumerate(entries):
                if j in batched:
                    continue
                generator = torch.Generator(local(p).device).manual_seed(seeds[j])
                d_out, d_in = p.shape
                matrices.append(
                    DionMatrix(
                        local(p),
                        local(p.grad),
                        local(state["momentum"]),
                        local(state["Q"]),
                        scale=math.sqrt(d_out / d_in),  # the paper's shape factor
                        generator=generator,
                        placement=self._placement(p),
                        data_groups=self._data_groups(p),
                    )
                )
            dion_step(matrices, **hp)

    def state_dict(self) -> dict[str, Any]:
        """The state; under compressed sync the replicas' momenta are averaged first (a
        collective), so that a checkpoint holds one consistent ``M`` (the update depends on
        the replicas' momenta only through their mean, so this changes nothing)."""
        momenta = [
            (local(self.state[p]["momentum"]), self._data_groups(p))
            for g in self.param_groups
            if g["algorithm"] == self.algorithm
            for p in g["params"]
            if "momentum" in self.state[p]
        ]
        all_reduce_([m for m, _ in momenta], [gs for _, gs in momenta], average=True)
        return super().state_dict()
