"""Dion: Distributed Orthonormalized Updates (Ahn et al., arXiv 2504.05295).

``Dion`` is the driver (``dobb.optim.base.MatrixOptimizer``) over ``DionCore``, its maths
on whole local matrices (``dion_update``, the reference, and its batched form
``dion_updates``, both in ``dobb.optim.dion_core``), and two placements: ``ShardedSteps``
(``dobb.optim.dion_sharded``) claims the matrices other ranks share (split over ranks or
under compressed sync) and steps them by Dion's sharded protocol (``dion_step``, which
holds every collective), then ``Local`` steps the rest by the core. The class keeps its
options, the check of its groups' placements and ``state_dict``'s averaging of momenta.

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

import zlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dobb._dtensor import local
from dobb.distributed.groups import axis_groups, check_group
from dobb.distributed.placement import like_columns
from dobb.distributed.reduce import all_reduce_
from dobb.optim.base import MatrixOptimizer
from dobb.optim.config import COUNT, OptimizerConfig, between, inherit, one_of, option, optional
from dobb.optim.dion_core import (
    ORTHOGONALIZE_METHODS,
    dion_update,
    dion_updates,
    rank_of,
    shape_scale,
)
from dobb.optim.dion_sharded import ShardedSteps
from dobb.optim.experts import is_experts
from dobb.optim.parts import Core, Local, state_dtype


class DionCore(Core):
    """Dion's maths on whole local matrices: ``dion_updates`` stacked by shape, or on the
    CPU (``foreach`` off) ``dion_update`` one by one (no stacking copies); no communication.

    State per ``(d_out, d_in)`` matrix: ``step`` (a CPU scalar), the momentum ``M`` (laid
    out like ``W``) and the right factor ``Q`` (``(d_in, r)``, ``r = rank_of``; a DTensor's
    holds this rank's rows of ``Q`` for its columns, ``like_columns``).

    ``seed``: the base seed, which with a matrix's name seeds its ``Q_0``;
    ``placement_of(param)``: its ``MatrixPlacement``, None if whole.
    """

    def __init__(self, seed: int, placement_of):
        self.seed, self.placement_of = seed, placement_of

    def init_state(self, param: Tensor, config, name: str) -> dict[str, Any]:
        """``Q_0 ~ N(0, 1)`` of the whole matrix, drawn on the CPU (any device agrees) from
        ``seed`` and the name (crc32 is stable, hash() not, so every replica draws alike);
        this rank's columns of it for a DTensor. ``M = 0``, ``step = 0``."""
        dtype, device = state_dtype(param), local(param).device
        name_seed = zlib.crc32(f"{self.seed}/{name}".encode())
        d_in = param.shape[1]
        generator = torch.Generator().manual_seed(name_seed)
        rank = rank_of(param.shape, config.rank_fraction, config.rank)
        Q = torch.randn(d_in, rank, generator=generator)
        placement = self.placement_of(param)
        if placement is not None:  # this rank's columns of the one Q_0 of the whole matrix
            Q = Q[placement.cols]
        return {
            "step": torch.tensor(0.0),
            "momentum": torch.zeros_like(param, dtype=dtype),
            "Q": like_columns(Q.to(device=device, dtype=dtype), param, d_in),
        }

    def sketch_seed(self, shape: tuple[int, int], rank: int, step: int) -> int:
        """The seed of the sketch of every ``shape`` matrix of rank ``rank`` at ``step``:
        equal on every rank holding such a matrix, and one per shape, so that a stack of
        same-shape matrices draws one sketch (a Gaussian ``S`` independent of each ``P``,
        which is all the preconditioner needs)."""
        m, n = shape
        return zlib.crc32(f"{self.seed}/sketch/{m}x{n}/{rank}".encode()) * 1_000_003 + step

    def step_seeds(self, states: list[dict[str, Any]], shapes: list) -> list[int]:
        """Advance each matrix's step counter (CPU scalars: one host read for all) and return
        its sketch seed at the new step; ``shapes``: the whole matrices'. The one place
        both forms of the step (here and ``ShardedSteps``) count steps."""
        steps = [state["step"] for state in states]
        torch._foreach_add_(steps, 1.0)
        return [
            self.sketch_seed(shape, state["Q"].shape[1], int(step))
            for shape, state, step in zip(shapes, states, torch.stack(steps).tolist())
        ]

    def updates(self, batch, config) -> None:
        """``step_seeds``, then ``dion_updates`` or (not ``batched``) ``dion_update`` of each
        whole ``(d_out, d_in)`` matrix, with the lr factor ``sqrt(d_out / d_in)``."""
        params, grads, states = batch
        seeds = self.step_seeds(states, [p.shape for p in params])
        momenta, Qs = [state["momentum"] for state in states], [state["Q"] for state in states]
        scales = [shape_scale(p.shape) for p in params]
        hp = dict(
            lr=config.lr,
            mu=config.momentum,
            weight_decay=config.weight_decay,
            orthogonalize=config.orthogonalize,
        )
        if config.batched(params[0].device):
            dion_updates(params, grads, momenta, Qs, scales=scales, sketch_seeds=seeds, **hp)
            return
        sketched = config.orthogonalize == "cholesky_qr"  # the only use of a generator
        for p, grad, momentum, Q, scale, seed in zip(params, grads, momenta, Qs, scales, seeds):
            generator = torch.Generator(p.device).manual_seed(seed) if sketched else None
            dion_update(p, grad, momentum, Q, scale=scale, generator=generator, **hp)


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

    Parts: ``core`` a ``DionCore``; ``placements`` ``(ShardedSteps, Local())``, the first
    also ``self.sharded`` (each matrix's ``MatrixPlacement`` and compressed-sync groups).
    """

    algorithm = "dion"
    # A job whose DDP/FSDP averages the gradients hands Dion no group: its compressed sync
    # (sync_group) needs them unaveraged (see dobb.distributed.groups).
    data_parallel_option = None

    @dataclass(frozen=True)
    class Config(OptimizerConfig):
        """Dion's options (``dobb.optim.config``)."""

        lr: float = inherit(OptimizerConfig, "lr", 0.01)
        """Learning rate, scaled per matrix by ``sqrt(d_out/d_in)``, the paper's factor (no
        ``max(1, .)`` as in Muon: wide matrices take smaller steps); microsoft/dion's
        reference's 0.01, the tuned value at widths 128 and 256 (``dobb.registry.TUNED_LR``)."""
        renamed = {"mu": "momentum"}  # the authors' name (microsoft/dion's Dion)

        momentum: float = option(0.95, between(0, 1, high_open=False), math=True)
        """``mu``, the momentum's decay in the error feedback (Muon's and Dobb's name):
        ``M <- B - (1 - mu) P Rᵀ``; ``mu = 1`` keeps the whole buffer."""
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

    def __init__(self, params, lr=None, **options):
        self.config = config = self.Config.from_options("Dion", lr, options)
        self.sharded = ShardedSteps(
            axis_groups(check_group("Dion", "sync_group", config.sync_group))
        )
        self.placements = (self.sharded, Local())
        self.core = DionCore(config.seed, self.sharded.placement_of)
        super().__init__(params, config)

    def _validate_group(self, group: dict[str, Any]) -> None:
        super()._validate_group(group)
        if group["algorithm"] != self.algorithm:
            return
        for p in group["params"]:
            if not is_experts(p):  # experts: whole on each rank (dobb.optim.experts)
                self.sharded.placement_of(p)  # rejects Partial placements now, not mid-step

    def state_dict(self) -> dict[str, Any]:
        """The state; under compressed sync the replicas' momenta are averaged first (a
        collective), so that a checkpoint holds one consistent ``M`` (the update depends on
        the replicas' momenta only through their mean, so this changes nothing)."""
        momenta = [
            (local(self.state[p]["momentum"]), self.sharded.data_groups(p))
            for g in self.param_groups
            if g["algorithm"] == self.algorithm
            for p in g["params"]
            if "momentum" in self.state[p]
        ]
        all_reduce_([m for m, _ in momenta], [gs for _, gs in momenta], average=True)
        return super().state_dict()
