"""Dion's sharded protocol: Algorithm 1 on matrices split over ranks, every collective here.

``ShardedSteps`` is Dion's placement (``dobb.optim.base.Local``) of the matrices that other
ranks share: those split over ranks (DTensors) or under compressed sync (``sync_group``).
It claims them before ``Local`` takes the whole ones, and steps them with ``dion_step``.

``dion_step`` takes the steps of ``dobb.optim.dion_core.dion_update`` over a list of
matrices (``DionMatrix``), each whole on this rank or split over ranks
(``MatrixPlacement``); the maths of each step is a pure function of ``dion_core``, and the
sums over a split dim are completed here, by batched all-reduces placed between the steps
in straight-line code: one collective per process group and round, for all matrices of a
step together. On whole matrices it computes exactly what ``dion_update`` does (a test
holds it to the reference); the distributed tests hold split runs to one device.

Rounds, per step and mesh axis (``k = ceil(1.25 r)`` rounded up to 128):

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

``Q`` is kept split like ``W``'s columns and replicated over the row axes: ``R`` is
all-reduced, not reduce-scattered, because ``P Qᵀ`` needs every row of ``Q`` where rows are
split (a reduce-scatter plus an all-gather would move the same bytes). Its optimizer state
is a DTensor laid out that way, so DCP checkpoints hold one ``(d_in, r)`` ``Q``.
Householder QR cannot run on split rows: with ``orthogonalize="qr"`` (and for ``P`` with
``m <= r``, or where Cholesky QR fails) the rows of ``P`` are all-gathered and every rank
runs the single-device QR. The zero-buffer test (``B = 0`` keeps ``M`` and ``Q``) rides on
the reductions above, so every rank holding a piece takes the same branch.

Where we differ from microsoft/dion's code: it orients FSDP-sharded matrices the other way
(the shard dim on ``Q``'s side), so ``P`` needs a reduce-scatter/all-gather over a batch of
matrices and each rank orthonormalizes whole ``P``'s, while ``R`` needs no reduction. We
keep Algorithm 1's orientation (``Q`` is ``d_in x r`` for every matrix), which the paper's
distributed Cholesky QR serves; their code also transposes unsharded wide matrices so the
QR runs along the longer side, which changes only which factor is column-normalized
(``dion_update`` runs either, on ``.mT`` views).
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from dobb._dtensor import DTensor, local
from dobb.distributed.placement import MatrixPlacement, matrix_placement
from dobb.distributed.reduce import all_reduce_
from dobb.optim.batching import group_by
from dobb.optim.dion_core import (
    cholesky_orthonormalize,
    column_normalize,
    error_feedback,
    orthonormalize,
    precondition,
    shape_scale,
    sketch,
)
from dobb.optim.experts import is_experts
from dobb.optim.parts import Matrix, Placement, Step, partition


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


class ShardedSteps(Placement):
    """Dion's placement of matrices split over ranks or under compressed sync: ``dion_step``
    once per set of math options, its all-reduces complete the sums over split dims and
    average ``P`` and ``R`` over ``sync_groups`` (``dobb.distributed.groups.axis_groups``
    of ``sync_group``: one process group per data axis).

    The layout of each matrix (``placement_of``) is derived, recomputed rather than
    checkpointed (a checkpoint may load into another mesh).
    """

    def __init__(self, sync_groups: tuple):
        self.sync_groups = sync_groups
        self._placements: dict[Tensor, MatrixPlacement] = {}
        self._data_groups: dict[Tensor, tuple] = {}

    def placement_of(self, param: Tensor) -> MatrixPlacement | None:
        """How ``param`` is split over ranks; None for a plain tensor (raises for a Partial
        placement)."""
        if not isinstance(param, DTensor):
            return None
        if param not in self._placements:
            self._placements[param] = matrix_placement(param)
        return self._placements[param]

    def data_groups(self, param: Tensor) -> tuple:
        """The ``sync_groups`` along which ``param`` is copied (compressed sync): those not
        splitting it; derived once per parameter, as its placement (a plain tensor, an
        expert's view included, is copied along all of them)."""
        if not isinstance(param, DTensor) or is_experts(param):  # whole on this rank
            return tuple(self.sync_groups)
        if param not in self._data_groups:
            placement = self.placement_of(param)
            splitting = () if placement is None else placement.row_groups + placement.col_groups
            split = [dist.get_process_group_ranks(g) for g in splitting]
            self._data_groups[param] = tuple(
                g for g in self.sync_groups if dist.get_process_group_ranks(g) not in split
            )
        return self._data_groups[param]

    def claim(self, matrices: list[Matrix]) -> tuple[list[Matrix], list[Matrix]]:
        """The matrices split over ranks (DTensors) or copied over ``sync_groups``."""
        return partition(
            matrices,
            [
                self.placement_of(m.param) is not None or bool(self.data_groups(m.param))
                for m in matrices
            ],
        )

    def step(self, matrices: list[Matrix], core, step: Step) -> None:
        """``dion_step`` of ``matrices`` per set of math options; ``core`` (``DionCore``)
        advances their step counters and gives their sketch seeds. ``dion_step`` batches its
        collectives; each matrix's maths runs on its own."""
        for indices in group_by(matrices, lambda m: m.config.math_key()).values():
            mine = [matrices[i] for i in indices]
            seeds = core.step_seeds([m.state for m in mine], [m.param.shape for m in mine])
            config = mine[0].config
            dion_step(
                [
                    DionMatrix(
                        local(m.param),
                        local(m.param.grad),
                        local(m.state["momentum"]),
                        local(m.state["Q"]),
                        scale=shape_scale(m.param.shape),  # the whole matrix's
                        generator=torch.Generator(local(m.param).device).manual_seed(seed),
                        placement=self.placement_of(m.param),
                        data_groups=self.data_groups(m.param),
                    )
                    for m, seed in zip(mine, seeds)
                ],
                lr=config.lr,
                mu=config.momentum,
                weight_decay=config.weight_decay,
                orthogonalize=config.orthogonalize,
            )
