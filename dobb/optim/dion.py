"""Dion: Distributed Orthonormalized Updates (Ahn et al., arXiv 2504.05295).

The optimizer class: parameter groups, lazy state, sketch seeds and the placement of each
matrix; the math (``dion_update``, the reference, and its batched form ``dion_updates``) is in
``dobb.optim.dion_core``, the sharded protocol (``dion_step``) in ``dobb.optim.dion_sharded``.

The momentum buffer accumulates gradients (``B = M + G``, not an EMA); the error feedback
removes a ``1 - mu`` fraction of what the update used. Parameter groups with
``algorithm="adamw"`` or ``"lion"`` (see ``dobb.param_groups``) take the embeddings, the LM
head, norms and biases.

Seeds: ``Q_0`` is drawn from a generator seeded by ``seed`` and the matrix's name; the
sketch of a step from one seeded by ``seed``, the matrix's shape, ``r`` and the step, so
same-shape matrices share it (one draw per stack; each sees a Gaussian ``S`` independent
of its ``P``, all the preconditioner asks) and data-parallel replicas agree.

Sharding: DTensor parameters are updated from their placements (FSDP ``Shard(0)``, TP
``Shard(0)``/``Shard(1)``, FSDP x TP, uneven or empty shards), with the single-device
result up to float rounding: one all-reduce per mesh axis and round of the power
iteration (the rounds, and where we differ from microsoft/dion's code:
``dobb.optim.dion_sharded``).

Batching: whole matrices (one device, DDP without ``sync_group``) run ``dion_updates``:
same-shape matrices share every kernel (``B Q``, ``Bᵀ P`` and ``P Qᵀ`` as bmm, QR,
Cholesky and triangular solves on ``(b, m, r)`` stacks, foreach for the rest); on the CPU
(``foreach`` off) they run ``dion_update`` one by one. A step reads the host once for the
non-finite check and, with ``"cholesky_qr"``, once more: the failure flags of every
matrix's Cholesky QR, since which matrices need the Householder fallback is known only on
the device. ``B = 0`` is handled on the device. Columns of ``R`` are divided by
``max(norm, 1e-8)`` (the reference adds 1e-8), and an all-zero buffer leaves ``M`` and
``Q`` unchanged instead of producing NaN.

``sync_group``: None (gradients already averaged, as a harness's DDP or FSDP does), or the
replicas whose gradients of Dion's matrices are left unaveraged (a ProcessGroup for DDP, a
DeviceMesh of data axes for HSDP): Dion then runs the paper's compressed sync, averaging
``P`` and ``R`` instead of the gradients (how to set it up: docs/distributed.md).
"""

import math
import zlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from dobb._dtensor import DTensor, local
from dobb.distributed.groups import axis_groups, check_group
from dobb.distributed.placement import MatrixPlacement, like_columns, matrix_placement
from dobb.distributed.reduce import all_reduce_
from dobb.optim.base import MatrixOptimizer, state_dtype
from dobb.optim.config import COUNT, OptimizerConfig, between, inherit, one_of, option, optional
from dobb.optim.dion_core import ORTHOGONALIZE_METHODS, dion_update, dion_updates
from dobb.optim.dion_sharded import DionMatrix, dion_step


class Dion(MatrixOptimizer):
    r"""Dion (arXiv 2504.05295, Algorithm 1) for hidden weight matrices.

    .. code-block:: text

        per matrix W (d_out x d_in), rank r, Q_0 ~ N(0, 1) of shape (d_in, r), step t:
          B = M + G
          P = Orthogonalize(B Q);   R = Bᵀ P               (one warm-started power iteration)
          M <- B - (1 - mu) P Rᵀ                           (error feedback)
          Q <- ColumnNormalize(R)
          W <- W (1 - lr wd) - lr sqrt(d_out/d_in) P Qᵀ

    ``M`` accumulates gradients (not an EMA); the feedback removes ``1 - mu`` of what the
    update used. ``algorithm="adamw"``/``"lion"`` groups take the other parameters.

    Options: ``Dion.Config``.

    Sharding: DTensors (FSDP, TP, FSDP x TP, uneven shards) equal one device, with one
    all-reduce per mesh axis and round (the rounds: ``dobb.optim.dion_sharded``).
    """

    algorithm = "dion"
    # A job whose DDP/FSDP averages the gradients hands Dion no group: its compressed sync
    # (sync_group) needs them unaveraged (see dobb.distributed.groups).
    data_parallel_option = None

    @dataclass(frozen=True)
    class Config(OptimizerConfig):
        """Dion's options (``dobb.optim.config``)."""

        lr: float = inherit(OptimizerConfig, "lr", 0.02)
        """Learning rate, scaled per matrix by ``sqrt(d_out/d_in)``, the paper's factor (no
        ``max(1, .)`` as in Muon: wide matrices take smaller steps; microsoft/dion's
        reference: 0.01)."""
        mu: float = option(0.95, between(0, 1, high_open=False), math=True)
        """Momentum / error-feedback decay; ``mu = 1`` keeps the whole buffer."""
        weight_decay: float = inherit(OptimizerConfig, "weight_decay", 0.01)
        """Decoupled, multiplied by ``lr`` (the reference's 0.01)."""
        rank_fraction: float = option(
            1 / 16, between(0, 1, low_open=True, high_open=False), math=True
        )
        """``r = ceil(rank_fraction min(d_out, d_in))``."""
        rank: int | None = option(None, optional(COUNT), math=True)
        """An absolute rank that overrides ``rank_fraction``; ``r`` is capped at
        ``min(d_out, d_in)``."""
        orthogonalize: str = option("cholesky_qr", one_of(*ORTHOGONALIZE_METHODS), math=True)
        """``"cholesky_qr"`` (randomized Cholesky QR, the paper's fast distributed form;
        Householder QR where a Cholesky factorization fails) or ``"qr"`` (Householder)."""
        seed: int = option(0, math=True, group=False)
        """Base seed of ``Q_0`` (with the matrix's name) and of the sketches (with the
        shape, ``r`` and the step: shared by same-shape matrices and by replicas)."""
        sync_group: Any = option(None, group=False)
        """None (gradients averaged), or the replicas whose gradients are left unaveraged:
        Dion then averages ``P`` and ``R`` (``docs/distributed.md``)."""

    def __init__(
        self,
        params,
        lr: float = Config.lr,
        mu: float = Config.mu,
        weight_decay: float = Config.weight_decay,
        rank_fraction: float = Config.rank_fraction,
        rank: int | None = Config.rank,
        *,
        orthogonalize: str = Config.orthogonalize,
        seed: int = Config.seed,
        sync_group=Config.sync_group,
        nonfinite: str = Config.nonfinite,
        foreach: bool | None = Config.foreach,
    ):
        self.config = config = self.Config.from_arguments(locals())
        self.seed = seed
        self._sync_groups = axis_groups(check_group("Dion", "sync_group", sync_group))
        # derived layout, recomputed rather than checkpointed (a checkpoint may load
        # into another mesh)
        self._placements: dict[Tensor, MatrixPlacement] = {}
        super().__init__(
            params, config.defaults(), nonfinite=config.nonfinite, foreach=config.foreach
        )

    def _validate_group(self, group: dict[str, Any]) -> None:
        super()._validate_group(group)
        if group["algorithm"] != self.algorithm:
            return
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
        """Per group, the placement decides the form: whole matrices (one device, DDP
        without ``sync_group``) run the local update, split or compressed-sync ones Dion's
        sharded protocol (``dion_step``)."""
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
            local_entries, sharded_entries = [], []
            for (p, state, g), seed in zip(entries, seeds):
                whole = self._placement(p) is None and not self._data_groups(p)
                (local_entries if whole else sharded_entries).append(((p, state, g), seed))
            self._local_step(local_entries, hp)
            self._sharded_step(sharded_entries, hp)

    def _local_step(self, entries: list[tuple[tuple, int]], hp: dict[str, Any]) -> None:
        """Whole matrices, as ``((param, state, group), sketch seed)``: ``dion_updates``
        stacked by shape, or on the CPU (``foreach`` off) ``dion_update`` one by one (no
        stacking copies). No communication."""
        if not entries:
            return
        params = [p for (p, _, _), _ in entries]
        states = [state for (_, state, _), _ in entries]
        scales = [math.sqrt(p.shape[0] / p.shape[1]) for p in params]  # the paper's factor
        if self.batched(local(params[0]).device):
            dion_updates(
                [local(p) for p in params],
                [local(p.grad) for p in params],
                [local(state["momentum"]) for state in states],
                [local(state["Q"]) for state in states],
                scales=scales,
                sketch_seeds=[seed for _, seed in entries],
                **hp,
            )
            return
        sketched = hp["orthogonalize"] == "cholesky_qr"  # the only use of a generator
        for p, state, scale, (_, seed) in zip(params, states, scales, entries):
            generator = torch.Generator(local(p).device).manual_seed(seed) if sketched else None
            momentum, Q = local(state["momentum"]), local(state["Q"])
            dion_update(
                local(p), local(p.grad), momentum, Q, scale=scale, generator=generator, **hp
            )

    def _sharded_step(self, entries: list[tuple[tuple, int]], hp: dict[str, Any]) -> None:
        """Matrices split over ranks or under compressed sync: ``dion_step``, whose
        all-reduces complete the sums over split dims (and average over ``sync_group``)."""
        matrices = [
            DionMatrix(
                local(p),
                local(p.grad),
                local(state["momentum"]),
                local(state["Q"]),
                scale=math.sqrt(p.shape[0] / p.shape[1]),  # the paper's shape factor
                generator=torch.Generator(local(p).device).manual_seed(seed),
                placement=self._placement(p),
                data_groups=self._data_groups(p),
            )
            for (p, state, _), seed in entries
        ]
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
