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
from dobb.optim.batching import batches_kernels, foreach_mul_
from dobb.stats import (
    BlockStatistics,
    GramCache,
    layer_weights,
    statistics_hook,
    tracked_layers,
)

UPDATE_SCALE_MODES = ("adamw", "lion", "muon")
# Warm-started solvers need a start: a matrix's first refresh runs eigh (once per run; on
# CUDA the slow per-block loop, but 3 Jacobi sweeps from the identity leave ~1% off-diagonal).
COLD_START = {"power_qr": "eigh", "cholqr": "eigh", "jacobi": "eigh", "auto": "eigh"}
MISSING_STATS_MODES = ("raise", "identity")
STATS_SYNC_MODES = ("refresh", "step")
# Where the block bases come from: Dobb's activation moments, or controls for ablations.
BASIS_SOURCES = ("activations", "gradients", "random", "identity")
STACK_KEYS = (("cov", "basis"), ("cov_tail", "basis_tail"))  # at most two block sizes
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
            basis_method=basis_method,
            basis_source=basis_source,
        )
        super().__init__(params, defaults, nonfinite=nonfinite)

    def _validate_group(self, group: dict[str, Any]) -> None:
        super()._validate_group(group)
        if group["algorithm"] != self.algorithm:
            return
        for key in ("momentum", "stats_beta"):
            if not 0.0 <= group[key] < 1.0:
                raise ValueError(f"invalid {key}: {group[key]} (must be in [0, 1))")
        for key in ("num_blocks", "basis_interval"):
            if not (isinstance(group[key], int) and group[key] >= 1):
                raise ValueError(f"invalid {key}: {group[key]!r} (must be an integer >= 1)")
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

    def _stacks(self, param: Tensor, group: dict[str, Any]) -> tuple[BlockStack, ...]:
        """Blocks of this rank's input columns of ``param`` (all unless they are sharded).

        Derived from shape, placements and ``num_blocks``, so cached here rather than kept in
        the checkpointed state (DTensor offsets are slow to recompute every step).
        """
        dim = self._input_dims.get(param, 1)
        key = (id(param), dim, group["num_blocks"])
        if key not in self._layouts:
            self._layouts[key] = self._local_stacks(param, dim, group["num_blocks"])
        return self._layouts[key]

    def _local_stacks(self, param: Tensor, dim: int, num_blocks: int) -> tuple[BlockStack, ...]:
        stacks = block_stacks(param.shape[dim], num_blocks)
        placement = matrix_placement(param)
        start, stop = placement.span(dim)
        if (start, stop) == (0, param.shape[dim]):
            return stacks
        describe = (
            f"{self.name_of(param)} of shape {tuple(param.shape)}, input dim {dim} split over "
            f"{placement.split_degree(dim)} ranks, num_blocks={num_blocks}"
        )
        return local_block_stacks(stacks, start, stop, describe)

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
            if g["algorithm"] == self.algorithm and g["basis_source"] == "activations"
            for p in g["params"]
        }
        handles = []
        for module, weight, spec in layer_weights(model):
            if weight not in groups:
                continue
            if weight in self._stats:
                raise ValueError(f"{self.name_of(weight)} is already tracked")
            if spec.input_dim != 1:
                self._input_dims[weight] = spec.input_dim
            stacks = self._stacks(weight, groups[weight])
            stats = BlockStatistics(
                stacks, state_dtype(weight), local(weight).device, cache=self._gram_cache
            )
            self._stats[weight] = stats
            handles.append(module.register_forward_pre_hook(statistics_hook(stats)))
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
        self._gram_cache.clear()

    def _extra_inputs(self, matrix_groups):
        return [(p, t) for p, s in self._stats.items() if s.tokens for t in s.sums]

    def _discard_step_inputs(self) -> None:
        for stats in self._stats.values():
            stats.reset()

    def _prepare(self, matrix_groups) -> None:
        if self.missing_stats == "identity":
            return
        for group in matrix_groups:
            if group["lr"] == 0 or group["basis_source"] != "activations":
                continue
            for p in group["params"]:
                stats = self._stats.get(p)
                if p.grad is not None and (stats is None or stats.tokens == 0):
                    raise RuntimeError(
                        f"{self.name_of(p)} has no activation statistics for this step. "
                        "Call opt.track(model) before the forward pass (it hooks nn.Linear "
                        "layers), route the parameter to algorithm='adamw', or construct "
                        "Dobb with missing_stats='identity'."
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
        synced = states if self.stats_sync == "step" else [state for state, _, _ in due]
        self._average_statistics(synced)
        self._refresh(due)
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

    def _batches(self, active: list[tuple[Tensor, dict, dict]]) -> list[list[tuple]]:
        """``active`` split into batches that can share kernels, each of at most
        ``BATCH_ELEMENTS`` elements: same local shape, orientation, block layout, dtypes,
        device and hyperparameters; on CPU one matrix each (``batching.batches_kernels``)."""
        batches: dict[tuple, list[list[tuple]]] = {}
        for entry in active:
            p, state, group = entry
            param, grad, dim = local(p), local(p.grad), self._input_dims.get(p, 1)
            key = (
                tuple(param.shape), dim, self._stacks(p, group), param.dtype, grad.dtype,
                state["momentum"].dtype, param.device, self._scale(p.shape[dim], group),
                *(group[k] for k in ("lr", "momentum", "nesterov", "weight_decay")),
            )  # fmt: skip
            chunks = batches.setdefault(key, [[]])
            full = (len(chunks[-1]) + 1) * param.numel() > BATCH_ELEMENTS
            if chunks[-1] and (full or not batches_kernels(param.device)):
                chunks.append([])
            chunks[-1].append(entry)
        return [chunk for chunks in batches.values() for chunk in chunks]

    def _new_statistics(self, param: Tensor, group: dict[str, Any]) -> list[Tensor] | None:
        """Block moments ``G_bᵀ G_b / rows`` of the gradient (``basis_source="gradients"``)."""
        grad = local(param.grad)
        grad = grad.mT if self._input_dims.get(param, 1) == 0 else grad
        means = []
        for s in self._stacks(param, group):
            cols = grad[:, s.start : s.stop].unflatten(1, (s.count, s.size)).transpose(0, 1)
            cols = cols.to(state_dtype(param))  # (count, rows, size)
            means.append(cols.mT @ cols / max(1, grad.shape[0]))  # G_bᵀ G_b / rows
        return means

    def _fold_statistics(self, active: list[tuple[Tensor, dict, dict]]) -> list[float]:
        """Fold this step's moments ``S_b`` into ``C_b`` for every matrix that has them.

        ``C_b <- S_b`` the first time, else ``C_b <- beta C_b + (1 - beta) S_b``, where
        ``S_b = A_b / n`` (``A_b``: the hooks' sums over ``n`` tokens, then reset). Returns
        every matrix's ``stats_steps`` after the fold.
        """
        stats_steps = torch.stack([state["stats_steps"] for _, state, _ in active]).tolist()
        folding, sums, tokens = [], [], []  # (index, covs, means or None); hook sums
        for i, (p, state, group) in enumerate(active):
            covs = [local(state[cov]) for cov, _ in STACK_KEYS if cov in state]
            stats = self._stats.get(p)
            if group["basis_source"] == "activations" and stats is not None and stats.tokens:
                folding.append((i, covs, None))
                sums += stats.sums
                tokens += [float(stats.tokens)] * len(stats.sums)
                stats.tokens = 0
            elif group["basis_source"] == "gradients":
                folding.append((i, covs, self._new_statistics(p, group)))
        if not folding:
            return stats_steps
        hook_means = iter(torch._foreach_div(sums, tokens) if sums else [])
        if sums:
            torch._foreach_zero_(sums)
        self._gram_cache.clear()
        first, later = ([], []), {}  # (covs, means) to copy; beta -> (covs, means) to lerp
        for i, covs, means in folding:
            means = means or [next(hook_means) for _ in covs]
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
        torch._foreach_add_([active[i][1]["stats_steps"] for i, _, _ in folding], 1.0)
        return stats_steps

    def _average_statistics(self, states: list[dict[str, Any]]) -> None:
        """Average ``C_b`` over the data-parallel ranks (the only communication of Dobb)."""
        covs = [local(state[cov]) for state in states for cov, _ in STACK_KEYS if cov in state]
        all_reduce_(covs, [self._data_parallel_groups] * len(covs), average=True)
        self._unsynced -= {id(state) for state in states}

    def synchronize_statistics(self) -> None:
        """Average every ``C_b`` folded since its last average (a collective under DP).

        Exact at any time, the EMA being linear. Every data-parallel rank must call it.
        """
        states = [s for s in self.state.values() if id(s) in self._unsynced]
        if states:
            self._average_statistics(states)

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
        solver call per method and block size (``eigh`` on a matrix's first statistics)."""
        by_method: dict[str, list[tuple[dict, str, str]]] = {}
        for state, group, stats_steps in due:
            method = group["basis_method"]
            method = COLD_START.get(method, method) if stats_steps == 1 else method
            by_method.setdefault(method, []).extend(
                (state, cov_key, basis_key) for cov_key, basis_key in STACK_KEYS if cov_key in state
            )
        for method, keys in by_method.items():
            targets = [local(state[b]) for state, _, b in keys]
            covs = [local(state[c]) for state, c, _ in keys]
            torch._foreach_copy_(targets, refresh_bases(covs, targets, method, self._run))

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
