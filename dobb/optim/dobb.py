"""Dobb: Distributed Optimizer with Block-diagonal Eigenbases (arXiv 2610.39412).

Each hidden weight ``W`` (``d_out x d_in``) is preconditioned on its input side only, with
a block-diagonal approximation of the input-activation second moment ``E[xᵀx]``. Momentum
is projected into each block's eigenbasis, normalized by an elementwise sign and rotated
back. A row of the update depends only on the same row of the momentum, so row-sharded
(FSDP, column-parallel TP) matrices are updated with no communication.
"""

import math
import zlib
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from dobb._dtensor import DTensor, local
from dobb.blocks import BlockStack, block_stacks
from dobb.distributed.groups import axis_groups, group_argument
from dobb.distributed.placement import matrix_placement
from dobb.distributed.reduce import all_reduce_
from dobb.distributed.sharding import block_state_like, local_block_stacks, split_over_ranks
from dobb.eigensolve import BASIS_METHODS, refresh_bases
from dobb.optim.base import MatrixOptimizer, state_dtype
from dobb.optim.batching import batches_kernels, foreach_mul_, group_by, solo
from dobb.optim.dobb_variants import COEFFICIENTS, dobb_variant_update
from dobb.stats import (
    BlockStatistics,
    GramCache,
    layer_weights,
    output_gradient_hook,
    statistics_hook,
    tracked_layers,
)

UPDATE_SCALE_MODES = ("adamw", "lion", "muon")
# Warm-started solvers need a start: a matrix's first refresh runs batched Jacobi from the
# identity with more sweeps (dobb.eigensolve.COLD_METHODS; no per-block eigh loop, no host
# read), or eigh where "auto" means eigh (CPU).
COLD_START = {
    "power_qr": "jacobi_cold", "cholqr": "jacobi_cold", "jacobi": "jacobi_cold",
    "auto": "auto_cold",
}  # fmt: skip
MISSING_STATS_MODES = ("raise", "identity")
STATS_SYNC_MODES = ("refresh", "step")
# Where the block bases come from: Dobb's activation moments, or controls for ablations.
BASIS_SOURCES = ("activations", "gradients", "random", "identity")
STACK_KEYS = (("cov", "basis"), ("cov_tail", "basis_tail"))  # at most two block sizes
ROW_KEYS = (("row_cov", "row_basis"), ("row_cov_tail", "row_basis_tail"))  # two-sided
ALL_KEYS = STACK_KEYS + ROW_KEYS
# group options a batch of matrices must share (with shape, layout, dtypes and device)
VARIANT_OPTIONS = (
    "lr", "momentum", "nesterov", "weight_decay", "two_sided", "coefficients",
    "coefficient_beta",
)  # fmt: skip
# Where two-sided Dobb's output-side moments come from: the output gradient of a backward
# hook (K-FAC's factor; local in every layout) or the local rows' G Gᵀ (Shampoo's).
ROW_STATS = ("gradients", "outputs")
# Largest batch of same-shape matrices updated together (elements of the stacked momentum);
# bounds the batched step's temporary memory at a few copies of this many state elements.
BATCH_ELEMENTS = 1 << 26


def dobb_update(
    param: Tensor,
    grad: Tensor,
    momentum: Tensor,
    bases: list[Tensor],
    stacks: tuple[BlockStack, ...],
    *,
    lr: float,
    beta: float,
    nesterov: bool,
    weight_decay: float,
    scale: float,
) -> None:
    """One Dobb update of a ``(rows, d_in)`` matrix (a whole matrix or a row shard).

    ``bases[i]`` is ``(count, size, size)``: the orthonormal basis ``Q_b`` of each block in
    ``stacks[i]``. Updates ``param`` and ``momentum`` in place.
    """
    grad = grad.to(momentum.dtype)
    # M <- mu M + (1 - mu) G
    momentum.lerp_(grad, 1 - beta)
    # N = (1 - mu) G + mu M  (Nesterov),  else  N = M
    direction = grad.lerp(momentum, beta) if nesterov else momentum
    # W <- W (1 - lr wd)
    param.mul_(1 - lr * weight_decay)
    for basis, s in zip(bases, stacks, strict=True):
        blocks = direction[:, s.start : s.stop].unflatten(1, (s.count, s.size)).transpose(0, 1)
        # U_b = sign(N_b Q_b) Q_bᵀ   (count, rows, size)
        update = torch.bmm(torch.bmm(blocks, basis).sign_(), basis.mT)
        # W_b <- W_b - lr alpha U_b
        target = param[:, s.start : s.stop].unflatten(1, (s.count, s.size))
        target.add_(update.transpose(0, 1), alpha=-lr * scale)


def dobb_update_batched(
    params: list[Tensor],
    grads: list[Tensor],
    momenta: list[Tensor],
    bases: list[Tensor],
    stacks: tuple[BlockStack, ...],
    *,
    lr: float,
    beta: float,
    nesterov: bool,
    weight_decay: float,
    scale: float,
    transposed: bool = False,
) -> None:
    """``dobb_update`` for ``n`` matrices of one local shape, in a fixed number of kernels.

    ``params``, ``grads`` and ``momenta`` hold ``n`` tensors of one shape: ``(rows, d_in)``, or
    ``(d_in, rows)`` with ``transposed=True`` (GPT-2's ``Conv1D``). ``bases[i]`` is
    ``(n, count, size, size)``: the bases of ``stacks[i]`` for every matrix. The arithmetic is
    ``dobb_update``'s, op for op, on ``(n, ...)`` stacks; updates in place.
    """
    n, dtype = len(params), momenta[0].dtype
    if grads[0].dtype != dtype:  # e.g. bf16 gradients, fp32 momentum
        grads = torch.stack(grads).to(dtype).unbind(0)
    # M <- mu M + (1 - mu) G
    torch._foreach_lerp_(momenta, grads, 1 - beta)
    # N = (1 - mu) G + mu M  (Nesterov),  else  N = M
    direction = torch.stack(torch._foreach_lerp(grads, momenta, beta) if nesterov else momenta)
    direction = direction.mT if transposed else direction  # (n, rows, d_in)
    rows, d_in = direction.shape[1:]
    update = direction.new_empty(n, rows, d_in)
    for basis, s in zip(bases, stacks, strict=True):
        blocks = direction[..., s.start : s.stop].unflatten(2, (s.count, s.size)).transpose(1, 2)
        blocks = blocks.reshape(n * s.count, rows, s.size)  # (n count, rows, size)
        basis = basis.reshape(n * s.count, s.size, s.size)
        # U_b = sign(N_b Q_b) Q_bᵀ
        block_update = torch.bmm(torch.bmm(blocks, basis).sign_(), basis.mT)
        target = update[..., s.start : s.stop].unflatten(2, (s.count, s.size))
        target.copy_(block_update.unflatten(0, (n, s.count)).transpose(1, 2))
    update = update.mT if transposed else update
    # W <- W (1 - lr wd) - lr alpha U
    if weight_decay:
        foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_add_(params, update.unbind(0), alpha=-lr * scale)


class Dobb(MatrixOptimizer):
    r"""Block-diagonal eigenbasis sign descent for hidden weight matrices.

    .. code-block:: text

        per matrix W (d_out x d_in), input blocks I_b of near-equal size s, step t:
          C_b <- S_b (first step with statistics)  else  C_b <- beta2 C_b + (1 - beta2) S_b
                 where S_b = mean over this step's tokens of x[I_b]ᵀ x[I_b]
          if (t - 1) % k == 0:  Q_b <- eigenvectors(C_b)          (all blocks batched)
          M <- mu M + (1 - mu) G;   N = (1 - mu) G + mu M  (Nesterov)  or  N = M
          U[:, I_b] = sign(N[:, I_b] Q_b) Q_bᵀ                    (RMS(U) = 1)
          W <- W (1 - lr wd) - lr alpha U

    Call ``opt.track(model)`` once so forward pre-hooks collect the statistics. Parameter
    groups with ``algorithm="adamw"`` or ``"lion"`` (see ``dobb.param_groups``) take the
    embeddings, the LM head, norms and biases.

    Args:
        params: parameters or parameter groups.
        lr: learning rate; with ``update_scale=0.2`` the update's RMS is ``0.2 lr``, as for
            AdamW, so AdamW learning rates transfer.
        momentum: ``mu`` (default 0.95). nesterov: use Nesterov momentum (default True).
        weight_decay: decoupled weight decay (multiplied by ``lr``).
        num_blocks: blocks per input dimension, ``B`` (default 16; ``B >= d_in`` gives
            blocks of size 1, i.e. Signum).
        block_size: instead of ``num_blocks``: blocks of at most this many columns
            (``B = ceil(d_in / block_size)`` per matrix; the paper's 16 blocks at GPT-2 XL
            are blocks of 100 and 400). Overrides ``num_blocks`` when set.
        two_sided: also rotate the output side (``dobb.optim.dobb_variants``): row blocks
            ``R_r`` with eigenbases ``P_r`` of their own second moment, and
            ``U[R_r, I_b] = P_r sign(P_rᵀ N[R_r, I_b] Q_b) Q_bᵀ``. Off by default (the paper's
            update). Needs no communication in ``step()`` in any layout: a row block lies in
            one row shard, and its moments come from ``row_stats``.
        row_blocks: with ``two_sided``: row blocks per matrix (near-equal, and each inside one
            row shard, else construction raises); None (default): one block per rank's rows
            (the whole matrix in one process).
        row_stats: with ``two_sided``, where ``P_r``'s moments come from.
            ``"gradients"`` (default): ``G_r G_rᵀ / d_in`` of the rank's rows (Shampoo's left
            factor, EMA'd with ``stats_beta``). ``G`` is already averaged over the data
            ranks, so under DDP, FSDP, HSDP and column-parallel TP this needs no
            communication at all; under row-parallel TP each rank holds ``1/T`` of the
            columns, and the partial moments are averaged over the TP ranks on refresh
            steps (exact, the EMA being linear), as ``C_b`` is over the data ranks.
            ``"outputs"``: ``E[δ_rᵀ δ_r]`` of the layer's output gradient ``δ`` from a
            backward hook (K-FAC's output factor), averaged over ``stats_group`` with
            ``C_b``; not for rows split over data ranks (FSDP), whose row blocks differ
            per rank. Two-sided Dobb does not support FSDP x TP's strided rows.
        coefficients: ``"sign"`` (default) or ``"adam"``: ``C / (sqrt(V_hat) + 1e-8)`` with
            ``V`` an EMA (``coefficient_beta``, bias-corrected) of the squared projected
            gradient, kept in the eigenbasis as SOAP does (4 more bytes per parameter in
            fp32). Its RMS is below 1 (about 0.2 for noisy gradients), so it usually wants
            ``update_scale=1.0``.
        coefficient_beta: the EMA factor of ``V`` (default 0.95, SOAP's).
        stats_beta: EMA factor ``beta2`` of the second-moment blocks (default 0.95).
        basis_interval: refresh the bases every ``k`` steps (default 10).
        update_scale: ``alpha``: a number, or ``"adamw"`` (0.2), ``"lion"`` (1.0), or
            ``"muon"`` (``1/sqrt(d_in)``: the RMS of Muon's spectrally scaled orthogonal
            update ``sqrt(max(1, d_out/d_in)) U Vᵀ``).
        basis_method: how bases are refreshed (``dobb.eigensolve``, all blocks of a size in
            one call): ``"auto"`` (default: ``"eigh"`` on CPU, ``"jacobi"`` on CUDA, where
            ``eigh`` loops over blocks), ``"eigh"`` (the reference), ``"jacobi"`` (batched
            Jacobi sweeps warm-started from the previous basis), ``"cholqr"`` / ``"power_qr"``
            (one warm-started orthogonal-iteration step with Cholesky-QR / Householder QR),
            ``"cupy"`` (CuPy's batched ``eigh``); the warm-started ones run ``eigh`` on a
            matrix's first refresh. A
            batched solver's non-orthonormal or non-finite blocks are redone in fp64 ``eigh``
            with one warning.
        basis_source: ``"activations"`` (Dobb). Controls for ablations: ``"gradients"``
            (eigenbases of the blocks of ``E[Gᵀ G]``, unsharded matrices only), ``"random"``
            (a fixed random orthogonal basis per block), ``"identity"`` (Signum).
        missing_stats: ``"raise"`` (default) if a Dobb matrix has no statistics at a step
            with ``lr > 0``; ``"identity"`` keeps the current basis (identity before any
            statistics: Signum). A zero-``lr`` step never needs statistics (DCP issues one
            to build optimizer state).
        stats_group: the ranks that see different tokens (``dobb.distributed.groups``):
            None (one process), a ProcessGroup (DDP), or a DeviceMesh whose every axis is a
            data axis, e.g. the FSDP mesh or ``mesh["data_replicate", "data_shard"]`` (HSDP,
            FSDP x TP); never the TP axis. Statistics ``C_b`` are averaged over it.
        data_parallel: deprecated spelling of ``stats_group``.
        stats_sync: ``"refresh"`` (default) averages ``C_b`` only when bases are refreshed
            (exact: the EMA is linear, so averaging later gives the same result);
            ``"step"`` averages every step.
        shard_refresh: with ``stats_group``, each rank of its innermost axis computes
            ~1/P of the bases and one all-gather shares them (default True): the refresh
            costs 1/P per rank, and every replica holds bit-identical bases. False: every
            rank computes all bases itself (no communication besides the statistics).
        nonfinite: ``"raise"`` or ``"skip"`` on NaN/Inf gradients or statistics (checked
            per rank: under sharding, rely on a global grad-norm check to skip in step).

    Sharding: DTensor parameters are updated on their local shard. Row shards (FSDP
    ``Shard(0)``, column-parallel TP) need nothing; column shards (row-parallel TP
    ``Shard(1)``) must hold whole blocks, else construction raises. ``state_dict()``
    averages the statistics first (a collective when ``stats_group`` is set), so that a
    checkpoint holds one consistent copy.
    """

    algorithm = "dobb"
    # the argument that takes a job's data-parallel ranks (see dobb.distributed.groups)
    data_parallel_option = "stats_group"

    def __init__(
        self,
        params,
        lr: float,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        num_blocks: int = 16,
        stats_beta: float = 0.95,
        basis_interval: int = 10,
        update_scale: float | str = 0.2,
        *,
        block_size: int | None = None,
        two_sided: bool = False,
        row_blocks: int | None = None,
        row_stats: str = "gradients",
        coefficients: str = "sign",
        coefficient_beta: float = 0.95,
        basis_method: str = "auto",
        basis_source: str = "activations",
        missing_stats: str = "raise",
        stats_group=None,
        data_parallel=None,
        stats_sync: str = "refresh",
        shard_refresh: bool = True,
        nonfinite: str = "raise",
    ):
        if missing_stats not in MISSING_STATS_MODES:
            raise ValueError(f"missing_stats must be one of {MISSING_STATS_MODES}")
        if stats_sync not in STATS_SYNC_MODES:
            raise ValueError(f"stats_sync must be one of {STATS_SYNC_MODES}, got {stats_sync!r}")
        self.missing_stats = missing_stats
        self.stats_sync = stats_sync
        stats_group = group_argument("Dobb", "stats_group", stats_group, data_parallel)
        self._data_parallel_groups = axis_groups(stats_group)
        # Refresh work is split over the innermost data axis (its ranks hold identical C_b).
        split = shard_refresh and self._data_parallel_groups
        self._run = (
            partial(split_over_ranks, group=self._data_parallel_groups[-1]) if split else None
        )
        self._stats: dict[Tensor, BlockStatistics] = {}
        self._row_stats: dict[Tensor, BlockStatistics] = {}  # two-sided, row_stats="outputs"
        self._gram_cache = GramCache()  # layers fed one input tensor (q, k, v) share X_bᵀ X_b
        self._input_dims: dict[Tensor, int] = {}  # 0 for (d_in, d_out) weights; set by track
        self._layouts: dict[tuple, tuple[BlockStack, ...]] = {}
        self._hooks: list[RemovableHandle] = []
        self._unsynced: set[int] = set()  # ids of states with local statistics not yet averaged
        defaults = dict(
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            weight_decay=weight_decay,
            num_blocks=num_blocks,
            stats_beta=stats_beta,
            basis_interval=basis_interval,
            update_scale=update_scale,
            block_size=block_size,
            two_sided=two_sided,
            row_blocks=row_blocks,
            row_stats=row_stats,
            coefficients=coefficients,
            coefficient_beta=coefficient_beta,
            basis_method=basis_method,
            basis_source=basis_source,
        )
        super().__init__(params, defaults, nonfinite=nonfinite)

    def _validate_group(self, group: dict[str, Any]) -> None:
        super()._validate_group(group)
        if group["algorithm"] != self.algorithm:
            return
        for key in ("momentum", "stats_beta", "coefficient_beta"):
            if not 0.0 <= group[key] < 1.0:
                raise ValueError(f"invalid {key}: {group[key]} (must be in [0, 1))")
        for key in ("num_blocks", "basis_interval", "block_size", "row_blocks"):
            if key in ("block_size", "row_blocks") and group[key] is None:
                continue
            if not (isinstance(group[key], int) and group[key] >= 1):
                raise ValueError(f"invalid {key}: {group[key]!r} (must be an integer >= 1)")
        if group["row_blocks"] is not None and not group["two_sided"]:
            raise ValueError("row_blocks is an option of two-sided Dobb: pass two_sided=True")
        if group["row_stats"] not in ROW_STATS:
            raise ValueError(f"invalid row_stats: {group['row_stats']!r} (one of {ROW_STATS})")
        if group["coefficients"] not in COEFFICIENTS:
            raise ValueError(
                f"invalid coefficients: {group['coefficients']!r} (one of {COEFFICIENTS})"
            )
        scale = group["update_scale"]
        if scale not in UPDATE_SCALE_MODES and not (isinstance(scale, float | int) and scale > 0):
            raise ValueError(
                f"invalid update_scale: {scale!r} (a positive number or one of "
                f"{UPDATE_SCALE_MODES})"
            )
        if group["basis_method"] not in BASIS_METHODS:
            raise ValueError(
                f"invalid basis_method: {group['basis_method']!r} (one of {BASIS_METHODS})"
            )
        if group["basis_source"] not in BASIS_SOURCES:
            raise ValueError(f"invalid basis_source: {group['basis_source']!r}")
        if group["basis_source"] == "gradients" and any(
            isinstance(p, DTensor) for p in group["params"]
        ):
            raise NotImplementedError("basis_source='gradients' supports unsharded matrices only")
        for p in group["params"]:
            self._stacks(p, group)
            self._row_stacks(p, group)

    def _stacks(self, param: Tensor, group: dict[str, Any]) -> tuple[BlockStack, ...]:
        """Blocks of this rank's input columns of ``param`` (all unless they are sharded).

        Derived from shape, placements and ``num_blocks``, so cached here rather than kept in
        the checkpointed state (DTensor offsets are slow to recompute every step).
        """
        dim = self._input_dims.get(param, 1)
        num_blocks = group["num_blocks"]
        if group["block_size"] is not None:
            num_blocks = -(-param.shape[dim] // group["block_size"])
        key = (id(param), dim, num_blocks)
        if key not in self._layouts:
            self._layouts[key] = self._local_stacks(param, dim, num_blocks)
        return self._layouts[key]

    def _row_stacks(self, param: Tensor, group: dict[str, Any]) -> tuple[BlockStack, ...]:
        """Two-sided Dobb's blocks of this rank's rows (output features); () one-sided."""
        if not group["two_sided"]:
            return ()
        dim = 1 - self._input_dims.get(param, 1)
        key = (id(param), dim, "rows", group["row_blocks"])
        if key not in self._layouts:
            data = {g.group_name for g in self._data_parallel_groups}
            row_groups = matrix_placement(param).groups_splitting(dim)
            if group["row_stats"] == "outputs" and data & {g.group_name for g in row_groups}:
                raise NotImplementedError(
                    f"{self.name_of(param)}: row_stats='outputs' keeps each rank's row blocks, "
                    "but this matrix's rows are split over data-parallel ranks (FSDP), whose "
                    "output gradients differ; use row_stats='gradients'"
                )
            if group["row_blocks"] is None:  # one block of the rows this rank holds
                start, stop = matrix_placement(param).span(dim)
                self._layouts[key] = block_stacks(stop - start, 1) if stop > start else ()
            else:
                self._layouts[key] = self._local_stacks(param, dim, group["row_blocks"], True)
        return self._layouts[key]

    def _local_stacks(
        self, param: Tensor, dim: int, num_blocks: int, rows: bool = False
    ) -> tuple[BlockStack, ...]:
        stacks = block_stacks(param.shape[dim], num_blocks)
        placement = matrix_placement(param)
        start, stop = placement.span(dim)
        if (start, stop) == (0, param.shape[dim]):
            return stacks
        describe = (
            f"{self.name_of(param)} of shape {tuple(param.shape)}, {'output' if rows else 'input'}"
            f" dim {dim} split over {placement.split_degree(dim)} ranks, "
            f"{'row_blocks' if rows else 'num_blocks'}={num_blocks}"
        )
        if not rows:
            return local_block_stacks(stacks, start, stop, describe)
        advice = "choose row_blocks as a multiple of the number of row shards, or None"
        what = "row blocks do not tile this rank's rows"
        return local_block_stacks(stacks, start, stop, describe, advice, what)

    # ------------------------------------------------------------- statistics
    def track(self, model: nn.Module) -> list[RemovableHandle]:
        """Hook every layer of ``model`` whose weight is in a Dobb group.

        Layer types: ``nn.Linear``, ``transformers``' ``Conv1D`` (weight stored as
        ``(d_in, d_out)``: blocks run along its dim 0), and any type added with
        ``dobb.stats.register_layer``. Returns the hook handles (``untrack`` removes all).
        Statistics buffers follow the activations' device, so the model may move later.
        """
        groups = {
            p: g
            for g in self.param_groups
            if g["algorithm"] == self.algorithm
            and (g["basis_source"] == "activations" or self._tracks_outputs(g))
            for p in g["params"]
        }
        handles = []
        for module, weight, spec in layer_weights(model):
            if weight not in groups:
                continue
            if weight in self._stats or weight in self._row_stats:
                raise ValueError(f"{self.name_of(weight)} is already tracked")
            group, dtype, device = groups[weight], state_dtype(weight), local(weight).device
            if spec.input_dim != 1:
                self._input_dims[weight] = spec.input_dim
            if group["basis_source"] == "activations":
                stacks = self._stacks(weight, group)
                stats = BlockStatistics(stacks, dtype, device, cache=self._gram_cache)
                self._stats[weight] = stats
                handles.append(module.register_forward_pre_hook(statistics_hook(stats)))
            row_stacks = self._row_stacks(weight, group)
            if self._tracks_outputs(group) and row_stacks:  # rows never split over data ranks
                stats = BlockStatistics(row_stacks, dtype, device)
                self._row_stats[weight] = stats
                handles.append(module.register_forward_hook(output_gradient_hook(stats)))
        self._hooks += handles
        if not handles:
            raise ValueError(
                "track() found no layer whose weight is in a Dobb group; known layer types: "
                f"{[t.__name__ for t in tracked_layers()]}"
            )
        return handles

    def untrack(self) -> None:
        """Remove every hook ``track`` added and drop the pending statistics."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._stats.clear()
        self._row_stats.clear()
        self._gram_cache.clear()

    @staticmethod
    def _tracks_outputs(group: dict[str, Any]) -> bool:
        return group["two_sided"] and group["row_stats"] == "outputs"

    def _all_statistics(self):
        """``(param, BlockStatistics)`` of every hook: input side, then output side."""
        return [*self._stats.items(), *self._row_stats.items()]

    def _extra_inputs(self, matrix_groups):
        return [(p, t) for p, s in self._all_statistics() if s.tokens for t in s.sums]

    def _discard_step_inputs(self) -> None:
        for _, stats in self._all_statistics():
            stats.reset()

    def _prepare(self, matrix_groups) -> None:
        if self.missing_stats == "identity":
            return
        for group in matrix_groups:
            if group["lr"] == 0:
                continue
            for p in group["params"]:
                needed = {"activation": self._stats}
                if group["basis_source"] != "activations":
                    needed.clear()
                if self._tracks_outputs(group) and self._row_stacks(p, group):
                    needed["output-gradient"] = self._row_stats
                missing = [k for k, s in needed.items() if p not in s or s[p].tokens == 0]
                if p.grad is not None and missing:
                    raise RuntimeError(
                        f"{self.name_of(p)} has no {missing[0]} statistics for this step. "
                        "Call opt.track(model) before the forward pass (it hooks nn.Linear "
                        "layers) and backward through the layer, route the parameter to "
                        "algorithm='adamw', or construct Dobb with missing_stats='identity'."
                    )

    # ------------------------------------------------------------------- step
    def _init_matrix_state(self, param: Tensor, group: dict[str, Any]) -> dict[str, Any]:
        dtype, device = state_dtype(param), local(param).device
        state = {
            "step": torch.tensor(0.0),
            "stats_steps": torch.tensor(0.0),
            "momentum": torch.zeros_like(param, dtype=dtype),
        }
        for (cov_key, basis_key), s in zip(STACK_KEYS, self._stacks(param, group)):
            cov = torch.zeros(s.count, s.size, s.size, dtype=dtype, device=device)
            basis = torch.eye(s.size, dtype=dtype, device=device).repeat(s.count, 1, 1)
            if group["basis_source"] == "random":
                seed = zlib.crc32(f"{self.name_of(param)}/{cov_key}".encode())
                noise = torch.randn(
                    s.count, s.size, s.size, generator=torch.Generator().manual_seed(seed)
                )
                basis = torch.linalg.qr(noise.to(dtype)).Q.to(device)
            dim = self._input_dims.get(param, 1)
            state[cov_key] = block_state_like(cov, param, dim)
            state[basis_key] = block_state_like(basis, param, dim)
        for (cov_key, basis_key), s in zip(ROW_KEYS, self._row_stacks(param, group)):
            cov = torch.zeros(s.count, s.size, s.size, dtype=dtype, device=device)
            basis = torch.eye(s.size, dtype=dtype, device=device).repeat(s.count, 1, 1)
            dim = 1 - self._input_dims.get(param, 1)
            state[cov_key] = block_state_like(cov, param, dim)
            state[basis_key] = block_state_like(basis, param, dim)
        if group["coefficients"] == "adam":
            state["variance"] = torch.zeros_like(param, dtype=dtype)
        return state

    def _matrix_step(self, groups: list[dict[str, Any]]) -> None:
        """The algorithm box for every matrix: statistics EMA, due refreshes, update.

        Each phase runs batched (foreach kernels, or one ``bmm`` per batch of same-shape
        matrices off the CPU), so a GPU step dispatches a number of kernels set by the
        distinct shapes, not by the number of matrices. Step counters are CPU tensors read
        with ``tolist``: the schedule costs no device sync.
        """
        active = list(self._matrices_with_grad(groups))
        if not active:
            return
        states = [state for _, state, _ in active]
        torch._foreach_add_([state["step"] for state in states], 1.0)
        steps = torch.stack([state["step"] for state in states]).tolist()
        folded = self._fold_statistics(active)
        due = [
            (state, group, stats_steps)
            for (_, state, group), step, stats_steps in zip(active, steps, folded)
            if (int(step) - 1) % group["basis_interval"] == 0 and stats_steps > 0
        ]
        due_ids = {id(state) for state, _, _ in due}
        synced = [m for m in active if self.stats_sync == "step" or id(m[1]) in due_ids]
        self._average_statistics(synced)
        self._refresh(due)
        step_of = {id(state): step for state, step in zip(states, steps)}
        for batch in self._batches(active):
            p, state, group = batch[0]
            dim = self._input_dims.get(p, 1)
            stacks = self._stacks(p, group)
            hyper = dict(
                lr=group["lr"],
                beta=group["momentum"],
                nesterov=group["nesterov"],
                weight_decay=group["weight_decay"],
                scale=self._scale(p.shape[dim], group),
            )
            if self._is_variant(group):
                self._variant_update(batch, [step_of[id(s)] for _, s, _ in batch], hyper)
                continue
            if len(batch) == 1:  # the reference: no stacking copies
                # (d_in, d_out) weights (Conv1D) are updated through their transpose
                orient = (lambda t: t.mT) if dim == 0 else (lambda t: t)
                bases = [local(state[b]) for _, b in STACK_KEYS[: len(stacks)]]
                grad, momentum = local(p.grad), local(state["momentum"])
                dobb_update(
                    orient(local(p)), orient(grad), orient(momentum), bases, stacks, **hyper
                )
                continue
            bases = [
                torch.stack([local(state[basis_key]) for _, state, _ in batch])
                for _, basis_key in STACK_KEYS[: len(stacks)]
            ]
            dobb_update_batched(
                [local(q) for q, _, _ in batch],
                [local(q.grad) for q, _, _ in batch],
                [local(state["momentum"]) for _, state, _ in batch],
                bases,
                stacks,
                transposed=dim == 0,
                **hyper,
            )

    @staticmethod
    def _is_variant(group: dict[str, Any]) -> bool:
        return group["two_sided"] or group["coefficients"] != "sign"

    def _variant_update(self, batch: list[tuple], steps: list[float], hyper: dict) -> None:
        """Two-sided and/or Adam-coefficient update of a batch (``dobb_variant_update``)."""
        p, _, group = batch[0]
        stacks, row_stacks = self._stacks(p, group), self._row_stacks(p, group)

        def stacked(keys, n):
            return [torch.stack([local(s[key]) for _, s, _ in batch]) for _, key in keys[:n]]

        adam = group["coefficients"] == "adam"
        dobb_variant_update(
            [local(q) for q, _, _ in batch],
            [local(q.grad) for q, _, _ in batch],
            [local(s["momentum"]) for _, s, _ in batch],
            stacked(STACK_KEYS, len(stacks)),
            stacks,
            stacked(ROW_KEYS, len(row_stacks)) if row_stacks else None,
            row_stacks,
            [local(s["variance"]) for _, s, _ in batch] if adam else None,
            steps,
            beta2=group["coefficient_beta"],
            transposed=self._input_dims.get(p, 1) == 0,
            **hyper,
        )

    def _batches(self, active: list[tuple[Tensor, dict, dict]]) -> list[list[tuple]]:
        """``active`` split into batches that can share kernels, each of at most
        ``BATCH_ELEMENTS`` elements: same local shape, orientation, block layout, dtypes,
        device and hyperparameters; on CPU one matrix each (``batching.batches_kernels``)."""
        batches: dict[tuple, list[list[tuple]]] = {}
        for entry in active:
            p, state, group = entry
            param, grad, dim = local(p), local(p.grad), self._input_dims.get(p, 1)
            key = (
                tuple(param.shape), dim, self._stacks(p, group), self._row_stacks(p, group),
                param.dtype, grad.dtype, state["momentum"].dtype, param.device,
                self._scale(p.shape[dim], group),
                *(group[k] for k in VARIANT_OPTIONS),
            )  # fmt: skip
            chunks = batches.setdefault(key, [[]])
            full = (len(chunks[-1]) + 1) * param.numel() > BATCH_ELEMENTS
            if chunks[-1] and (full or not batches_kernels(param.device)):
                chunks.append([])
            chunks[-1].append(entry)
        return [chunk for chunks in batches.values() for chunk in chunks]

    def _gradient_moments(self, active: list[tuple[Tensor, dict, dict]]) -> dict:
        """This step's gradient moments, ``{(index into active, side): [per stack]}``: the
        input blocks' ``G_bᵀ G_b / d_out`` (``basis_source="gradients"``) and the row blocks'
        ``G_r G_rᵀ / d_in`` (two-sided, ``row_stats="gradients"``); one ``bmm`` per stack
        for each batch of same-shape matrices (matrix by matrix on CPU)."""
        entries = [  # (index into active, side)
            (i, side)
            for i, (_, state, group) in enumerate(active)
            for side, wanted in (
                ("cols", group["basis_source"] == "gradients"),
                ("rows", "row_cov" in state and not self._tracks_outputs(group)),
            )
            if wanted
        ]

        def key(n: int) -> tuple:
            i, side = entries[n]
            p, state, group = active[i]
            grad = local(p.grad)
            stacks = self._row_stacks(p, group) if side == "rows" else self._stacks(p, group)
            return (side, tuple(grad.shape), self._input_dims.get(p, 1), stacks, grad.dtype,
                    state["momentum"].dtype, grad.device, *solo(n, grad.device))  # fmt: skip

        moments = {}
        batches = group_by(range(len(entries)), key)
        for (side, _, dim, stacks, _, dtype, *_), members in batches.items():
            chunk = [entries[n] for n in members]
            grads = torch.stack([local(active[i][0].grad) for i, _ in chunk]).to(dtype)
            grads = grads.mT if dim == 0 else grads  # (n, d_out, d_in)
            grads = grads.mT if side == "rows" else grads  # blocks along the last dim
            per_stack = []
            for s in stacks:
                cols = grads[..., s.start : s.stop].unflatten(-1, (s.count, s.size))
                cols = cols.movedim(-2, 1)  # (n, count, other, size)
                per_stack.append((cols.mT @ cols / max(1, grads.shape[1])).unbind(0))
            for j, entry in enumerate(chunk):
                moments[entry] = [m[j] for m in per_stack]
        return moments

    def _sources(self, index: int, active: list, moments: dict) -> list[tuple]:
        """``(covs, source)`` for each side of ``active[index]`` that has moments:
        ``source`` is the hooks' ``BlockStatistics`` (None if never tracked) or this step's
        moments (``_gradient_moments``)."""
        param, state, group = active[index]
        sources = []
        covs = [local(state[cov]) for cov, _ in STACK_KEYS if cov in state]
        if group["basis_source"] == "activations":
            sources.append((covs, self._stats.get(param)))
        elif group["basis_source"] == "gradients":
            sources.append((covs, moments[(index, "cols")]))
        row_covs = [local(state[cov]) for cov, _ in ROW_KEYS if cov in state]
        if row_covs and self._tracks_outputs(group):
            sources.append((row_covs, self._row_stats.get(param)))
        elif row_covs:
            sources.append((row_covs, moments[(index, "rows")]))
        return sources

    def _fold_statistics(self, active: list[tuple[Tensor, dict, dict]]) -> list[float]:
        """Fold this step's moments ``S_b`` into ``C_b`` for every matrix that has them.

        ``C_b <- S_b`` the first time, else ``C_b <- beta C_b + (1 - beta) S_b``, where
        ``S_b = A_b / n`` (``A_b``: the hooks' sums over ``n`` tokens, then reset), for the
        input blocks and (two-sided) the row blocks alike. A matrix folds only when every
        side has moments. Returns every matrix's ``stats_steps`` after the fold.
        """
        stats_steps = torch.stack([state["stats_steps"] for _, state, _ in active]).tolist()
        folding, sums, tokens = [], [], []  # (index, sources); hook sums and token counts
        moments = self._gradient_moments(active)
        for i in range(len(active)):
            sources = self._sources(i, active, moments)
            hooks = [src for _, src in sources if not isinstance(src, list)]
            if not sources or any(h is None or h.tokens == 0 for h in hooks):
                for h in hooks:
                    if h is not None:
                        h.reset()
                continue
            folding.append((i, sources))
            for h in hooks:
                sums += h.sums
                tokens += [float(h.tokens)] * len(h.sums)
                h.tokens = 0
        if not folding:
            return stats_steps
        hook_means = iter(torch._foreach_div(sums, tokens) if sums else [])
        if sums:
            torch._foreach_zero_(sums)
        self._gram_cache.clear()
        first, later = ([], []), {}  # (covs, means) to copy; beta -> (covs, means) to lerp
        for i, sources in folding:
            covs = [cov for side, _ in sources for cov in side]
            means = [
                mean
                for side, src in sources
                for mean in (src if isinstance(src, list) else [next(hook_means) for _ in side])
            ]
            _, state, group = active[i]
            beta = group["stats_beta"]
            target = first if stats_steps[i] == 0 else later.setdefault(beta, ([], []))
            target[0].extend(covs)
            target[1].extend(means)
            stats_steps[i] += 1
            self._unsynced.add(id(state))
        if first[0]:
            torch._foreach_copy_(*first)
        for beta, (covs, means) in later.items():
            torch._foreach_lerp_(covs, means, 1 - beta)
        torch._foreach_add_([active[i][1]["stats_steps"] for i, _ in folding], 1.0)
        return stats_steps

    def _average_statistics(self, matrices: list[tuple[Tensor, dict, dict]]) -> None:
        """Average ``C_b`` over the data-parallel ranks (the only communication of Dobb), and
        two-sided Dobb's row moments over the ranks they were computed on: the data ranks
        (``row_stats="outputs"``) or the ranks splitting the columns (``"gradients"``)."""
        covs, groups = [], []
        for param, state, group in matrices:
            row_groups = self._data_parallel_groups
            if group["row_stats"] == "gradients":
                row_groups = matrix_placement(param).groups_splitting(
                    self._input_dims.get(param, 1)
                )
            for keys, over in ((STACK_KEYS, self._data_parallel_groups), (ROW_KEYS, row_groups)):
                new = [local(state[cov]) for cov, _ in keys if cov in state]
                covs += new
                groups += [tuple(over)] * len(new)
        all_reduce_(covs, groups, average=True)
        self._unsynced -= {id(state) for _, state, _ in matrices}

    def synchronize_statistics(self) -> None:
        """Average every ``C_b`` folded since its last average (a collective under DP).

        Exact at any time, the EMA being linear. Every data-parallel rank must call it.
        """
        matrices = [
            (p, self.state[p], group)
            for group in self.param_groups
            if group["algorithm"] == self.algorithm
            for p in group["params"]
            if p in self.state and id(self.state[p]) in self._unsynced
        ]
        if matrices:
            self._average_statistics(matrices)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load state; saved statistics were averaged when saved (see ``state_dict``)."""
        super().load_state_dict(state_dict)
        self._unsynced.clear()

    def state_dict(self) -> dict[str, Any]:
        """The state, statistics averaged first so that every rank saves the same ``C_b``.

        With ``stats_sync="refresh"`` this is a collective between refreshes: call it on all
        data-parallel ranks (DCP and Lightning do). Trainers that save on one rank only
        (Hugging Face ``Trainer`` under DDP) need ``stats_sync="step"``, which keeps the
        statistics averaged after every step so that saving communicates nothing.
        """
        self.synchronize_statistics()
        return super().state_dict()

    def _refresh(self, due: list[tuple[dict[str, Any], dict[str, Any], float]]) -> None:
        """Recompute the bases of ``due`` ``(state, group, stats_steps)`` matrices, one batched
        solver call per method, side and block size (``eigh`` on a matrix's first
        statistics). Input blocks are shared out over the data ranks (``shard_refresh``);
        row blocks are computed where they live: an FSDP rank holds only its own."""
        by_method: dict[tuple[str, bool], list[tuple[dict, str, str]]] = {}
        for state, group, stats_steps in due:
            method = group["basis_method"]
            method = COLD_START.get(method, method) if stats_steps == 1 else method
            for keys, split in ((STACK_KEYS, True), (ROW_KEYS, False)):
                by_method.setdefault((method, split), []).extend(
                    (state, cov_key, basis_key) for cov_key, basis_key in keys if cov_key in state
                )
        for (method, split), keys in by_method.items():
            if not keys:
                continue
            targets = [local(state[b]) for state, _, b in keys]
            covs = [local(state[c]) for state, c, _ in keys]
            run = self._run if split else None
            torch._foreach_copy_(targets, refresh_bases(covs, targets, method, run))

    @staticmethod
    def _scale(d_in: int, group: dict[str, Any]) -> float:
        return update_alpha(group["update_scale"], d_in)

    # ---------------------------------------------------------------- accessors
    @property
    def stats_groups(self) -> list:
        """The process groups ``C_b`` is averaged over, one per data axis (empty: none)."""
        return list(self._data_parallel_groups)

    def local_blocks(self, param: Tensor) -> tuple[BlockStack, ...]:
        """The blocks of this rank's input columns of ``param`` (a matrix of a Dobb group)."""
        group = next(
            (g for g in self.param_groups if g["algorithm"] == self.algorithm and any(
                q is param for q in g["params"])),
            None,
        )  # fmt: skip
        if group is None:
            raise ValueError(f"{self.name_of(param)} is not in a Dobb parameter group")
        return self._stacks(param, group)


def update_alpha(update_scale: float | str, d_in: int) -> float:
    """``alpha`` of ``update_scale`` for a matrix with (global) input width ``d_in``."""
    if update_scale == "muon":
        return 1.0 / math.sqrt(d_in)
    return {"adamw": 0.2, "lion": 1.0}.get(update_scale, update_scale)
