"""Dobb: Distributed Optimizer with Block-diagonal Eigenbases (arXiv 2610.39412).

Each hidden weight ``W`` (``d_out x d_in``) is preconditioned on its input side only, with
a block-diagonal approximation of the input-activation second moment ``E[xᵀx]``. Momentum
is projected into each block's eigenbasis, normalized by an elementwise sign and rotated
back. A row of the update depends only on the same row of the momentum, so row-sharded
(FSDP, column-parallel TP) matrices are updated with no communication. The maths per
matrix is in the class docstring; the update on plain tensors is ``dobb.optim.dobb_update``,
the statistics ``dobb.optim.dobb_statistics``. Some options at more length than the class
docstring gives them:

Sharding: DTensor parameters are updated on their local shard. Row shards (FSDP
``Shard(0)``, column-parallel TP) need nothing; column shards (row-parallel TP ``Shard(1)``)
must hold whole blocks, else construction raises. ``state_dict()`` averages the statistics
first (a collective when ``stats_group`` is set), so that a checkpoint holds one consistent
copy.

basis_method: how bases are refreshed (``dobb.eigensolve``, all blocks of a size in one
    call): ``"eigh"`` (the reference), ``"jacobi"`` (batched Jacobi sweeps warm-started
    from the previous basis), ``"cholqr"`` / ``"power_qr"`` (one warm-started
    orthogonal-iteration step with Cholesky QR / Householder QR), ``"cupy"`` (CuPy's
    batched ``eigh``), or ``"auto"`` (which of them, per device: the class docstring);
    see ``dobb.eigensolve`` for cold starts and the guard.

row_stats: with ``two_sided``, where ``P_r``'s moments come from: ``"gradients"``
    (default): ``G_r G_rᵀ / d_in`` of the rank's rows (Shampoo's left factor; no
    communication, but an average over the TP ranks under row-parallel TP);
    ``"outputs"``: the layer's output-gradient moments ``E[δ_rᵀ δ_r]`` from a backward
    hook (K-FAC's), averaged over ``stats_group``; not for rows split over data ranks
    (FSDP). Two-sided Dobb needs each rank's rows to be one contiguous run, so not FSDP x
    TP's strided rows.

stats_group: the ranks that see different tokens (``dobb.distributed.groups``): None (one
    process), a ProcessGroup (DDP), or a DeviceMesh whose every axis is a data axis, e.g.
    the FSDP mesh or ``mesh["data_replicate", "data_shard"]`` (HSDP, FSDP x TP). Statistics
    ``C_b`` are averaged over it. A group sharing ranks with an axis that splits a
    matrix's input columns (the TP axis of a row-parallel layer) raises ``ValueError`` at
    construction (at ``track()`` for a ``(d_in, d_out)`` weight).

shard_refresh: with ``stats_group``, each rank of its innermost axis computes ~1/P of the
    bases and one all-gather shares them (default True): the refresh costs 1/P per rank,
    and every replica holds bit-identical bases. False: every rank computes all bases
    itself (no communication besides the statistics).

missing_stats: ``"raise"`` (default) if a Dobb matrix has no statistics at a step with
    ``lr > 0``; ``"identity"`` keeps the current basis (identity before any statistics:
    Signum). A zero-``lr`` step never needs statistics (DCP issues one to build optimizer
    state).

two_sided: also rotate the output side (``dobb.optim.dobb_update``): row blocks ``R_r``
    with eigenbases ``P_r`` of their own second moment, and
    ``U[R_r, I_b] = P_r sign(P_rᵀ N[R_r, I_b] Q_b) Q_bᵀ``. Off by default (the paper's
    update). Needs no communication in ``step()`` in any layout: a row block lies in one
    row shard, and its moments come from ``row_stats``.
"""

import zlib
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from dobb._dtensor import DTensor, local
from dobb.blocks import BlockStack, block_stacks
from dobb.distributed.groups import (
    STATS_GROUP_FIX,
    axis_groups,
    check_group,
    check_stats_group,
    shared_axis,
)
from dobb.distributed.placement import matrix_placement
from dobb.distributed.sharding import block_state_like, param_block_stacks, split_over_ranks
from dobb.eigensolve import BASIS_METHODS, CAPTURABLE_METHODS, BlockFailures, refresh_bases
from dobb.optim.base import MatrixOptimizer, state_dtype
from dobb.optim.batching import each
from dobb.optim.config import (
    BOOL,
    COUNT,
    UNIT,
    OptimizerConfig,
    Rule,
    inherit,
    math_key,
    one_of,
    option,
    optional,
)
from dobb.optim.dobb_statistics import ROW_KEYS, STACK_KEYS, DobbStatistics
from dobb.optim.dobb_update import COEFFICIENTS, dobb_update, dobb_update_batched, update_alpha

UPDATE_SCALE_MODES = ("adamw", "lion", "muon")
UPDATE_SCALE = Rule(
    lambda v: v in UPDATE_SCALE_MODES or (isinstance(v, float | int) and v > 0),
    f"a positive number or {one_of(*UPDATE_SCALE_MODES).want}",
)
# Warm-started solvers need a start: a matrix's first refresh runs batched Jacobi from the
# identity with more sweeps (dobb.eigensolve.COLD_METHODS; no per-block eigh loop, no host
# read), or eigh where "auto" means eigh (CPU), or CuPy's eigh (CUDA, CuPy installed).
COLD_START = {
    "power_qr": "jacobi_cold",
    "cholqr": "jacobi_cold",
    "jacobi": "jacobi_cold",
    "auto": "auto_cold",
}
# Where the block bases come from: Dobb's activation moments, or controls for ablations.
BASIS_SOURCES = ("activations", "gradients", "random", "identity")
PROJECTION_DTYPES = (None, "float32", "bfloat16", "float16")  # the rotations' matmuls
# Where two-sided Dobb's output-side moments come from: the output gradient of a backward
# hook (K-FAC's factor; local in every layout) or the local rows' G Gᵀ (Shampoo's).
ROW_STATS = ("gradients", "outputs")
# Largest batch of same-shape matrices updated together (elements of the stacked momentum);
# bounds the batched step's temporary memory at a few copies of this many state elements.
BATCH_ELEMENTS = 1 << 26


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

    Options: ``Dobb.Config`` (its fields, and the tables of ``docs/algorithm.md``
    rendered from them).

    Sharding: each shard updates alone; column shards must hold whole blocks (else
    construction raises). ``state_dict()`` averages the statistics first (a collective).
    """

    algorithm = "dobb"
    # the argument that takes a job's data-parallel ranks (see dobb.distributed.groups)
    data_parallel_option = "stats_group"

    @dataclass(frozen=True)
    class Config(OptimizerConfig):
        """Dobb's options (``dobb.optim.config``)."""

        lr: float = inherit(OptimizerConfig, "lr", 1e-3)
        """Learning rate; the update's RMS is ``alpha lr``, so AdamW's rates transfer at
        ``alpha = 0.2``."""
        momentum: float = option(0.95, UNIT, math=True)
        """``mu``, the momentum's EMA factor."""
        nesterov: bool = option(True, BOOL, math=True)
        """Nesterov momentum (the direction ``(1 - mu) G + mu M``), else ``M``."""
        num_blocks: int = option(16, COUNT, math=True)
        """``B``, input blocks per matrix, of near-equal size; ``B >= d_in`` gives block
        size 1, i.e. Signum."""
        stats_beta: float = option(0.95, UNIT, math=True)
        """``beta2``, the EMA factor of the second-moment blocks ``C_b``."""
        basis_interval: int = option(10, COUNT, math=True)
        """``k``: the eigenbases are refreshed every ``k`` steps."""
        update_scale: float | str = option(0.2, UPDATE_SCALE, math=True)
        """``alpha``: a number, ``"adamw"`` (0.2), ``"lion"`` (1.0) or ``"muon"``
        (``1/sqrt(d_in)``, the RMS of Muon's spectrally scaled update; in STUDY.md (f) it
        keeps one-block Dobb's tuned lr from width 128 to 256, where 0.2 halves it, at the
        same loss)."""
        block_size: int | None = option(None, optional(COUNT), math=True)
        """Blocks of at most this many columns (``B = ceil(d_in / block_size)`` per
        matrix) instead of ``num_blocks`` (the paper's 100 and 400)."""
        two_sided: bool = option(False, BOOL, math=True)
        """Also rotate the output side, by row blocks ``R_r`` that each lie inside one row
        shard: ``U[R_r, I_b] = P_r sign(P_rᵀ N[R_r, I_b] Q_b) Q_bᵀ``."""
        row_blocks: int | None = option(None, optional(COUNT), math=True)
        """Two-sided Dobb's row blocks per matrix; None: one per rank's rows (the whole
        matrix in one process); an integer must tile every rank's rows, else construction
        raises."""
        row_stats: str = option("gradients", one_of(*ROW_STATS), math=True)
        """Two-sided Dobb's row moments: ``"gradients"``, ``G_r G_rᵀ / d_in`` of the rank's
        rows (Shampoo's left factor; no communication under DDP, FSDP, HSDP and
        column-parallel TP, a refresh-step average over the TP ranks under row-parallel
        TP), or ``"outputs"``, the output gradient's ``E[δ_rᵀ δ_r]`` from a backward hook
        (K-FAC's factor; not for rows split over data ranks)."""
        coefficients: str = option("sign", one_of(*COEFFICIENTS), math=True)
        """``"sign"``, or ``"adam"``: ``C / (sqrt(V_hat) + eps)`` with a SOAP-style second
        moment ``V`` of the coefficients, kept in the eigenbasis (+4 bytes per parameter;
        use ``update_scale=1.0``)."""
        coefficient_beta: float = option(0.95, UNIT, math=True)
        """The EMA factor of ``V`` (``coefficients="adam"``)."""
        projection_dtype: str | None = option(None, one_of(*PROJECTION_DTYPES), math=True)
        """dtype of the rotations' matmuls (``"bfloat16"``: half their bytes, tensor
        cores; None: the state's dtype); parameters, momentum, statistics and the
        eigensolver stay fp32."""
        basis_method: str = option("auto", one_of(*BASIS_METHODS), math=True)
        """How bases are refreshed (``dobb.eigensolve``): ``"auto"`` picks by device
        (``torch.linalg.eigh`` on CPU, CuPy's batched ``eigh`` or ``"cholqr"`` on CUDA,
        ``"cholqr"`` if ``capturable``); ``"eigh"``, ``"jacobi"`` (warm-started sweeps,
        batched kernels only), ``"cholqr"`` / ``"power_qr"`` (one warm-started orthogonal
        iteration, Cholesky-QR / Householder), ``"cupy"`` (CuPy's batched ``eigh``, if
        installed). A batched solver's non-orthonormal or non-finite block keeps its
        previous basis, counted in ``basis_failures``."""
        basis_source: str = option("activations", one_of(*BASIS_SOURCES), math=True)
        """Dobb's bases; controls for ablations: ``"gradients"`` (eigenbases of the blocks
        of ``E[Gᵀ G]``, unsharded matrices only), ``"random"`` (a fixed random orthogonal
        basis per block), ``"identity"`` (Signum)."""
        missing_stats: str = option("raise", one_of("raise", "identity"), group=False)
        """A matrix with no statistics at a step with ``lr > 0`` raises; ``"identity"``
        keeps its current basis (Signum before any)."""
        stats_group: Any = option(None, group=False)
        """The mesh or process group over which ranks see different tokens
        (``docs/distributed.md``): ``C_b`` is averaged over it. An axis of it that splits a
        matrix's input columns (row-parallel TP) raises."""
        stats_sync: str = option("refresh", one_of("refresh", "step"), group=False)
        """Average the statistics only on refresh steps (exact, the EMA being linear), or
        every ``"step"`` (then saving a checkpoint communicates nothing)."""
        shard_refresh: bool = option(True, BOOL, group=False)
        """With ``stats_group``: each rank computes ~1/P of the bases and one all-gather
        shares them; False: every rank computes all."""
        capturable: bool = option(False, BOOL, group=False)
        """Steady and refresh steps with no host read (counters on the device, ``lr`` a
        float or a 0-d tensor, a non-finite batch a device-side no-op counted in
        ``skipped_steps``, a batched solver with its failures counted in
        ``basis_failures``; needs ``nonfinite="skip"``), for CUDA graphs and
        ``torch.compile(fullgraph=True)``: ``docs/gpu.md``."""

        def check(self) -> None:
            if self.row_blocks is not None and not self.two_sided:
                raise ValueError("row_blocks is an option of two-sided Dobb: pass two_sided=True")
            if self.capturable and self.nonfinite != "skip":
                raise ValueError(
                    "capturable=True cannot raise on a non-finite gradient (that needs a host "
                    "read); pass nonfinite='skip': the step is then a no-op on the device and "
                    "skipped_steps (a device tensor) counts it"
                )
            if self.capturable and self.basis_method not in CAPTURABLE_METHODS:
                raise ValueError(
                    f"basis_method={self.basis_method!r} cannot run in a captured step (it "
                    "reads the device or loops over matrices, or CuPy cannot be captured); with "
                    f"capturable=True use one of {CAPTURABLE_METHODS} ('auto' is 'cholqr' there)"
                )

    def __init__(
        self,
        params,
        lr: float = Config.lr,
        momentum: float = Config.momentum,
        nesterov: bool = Config.nesterov,
        weight_decay: float = Config.weight_decay,
        num_blocks: int = Config.num_blocks,
        stats_beta: float = Config.stats_beta,
        basis_interval: int = Config.basis_interval,
        update_scale: float | str = Config.update_scale,
        *,
        block_size: int | None = Config.block_size,
        two_sided: bool = Config.two_sided,
        row_blocks: int | None = Config.row_blocks,
        row_stats: str = Config.row_stats,
        coefficients: str = Config.coefficients,
        coefficient_beta: float = Config.coefficient_beta,
        projection_dtype: str | None = Config.projection_dtype,
        basis_method: str = Config.basis_method,
        basis_source: str = Config.basis_source,
        missing_stats: str = Config.missing_stats,
        stats_group=Config.stats_group,
        stats_sync: str = Config.stats_sync,
        shard_refresh: bool = Config.shard_refresh,
        nonfinite: str = Config.nonfinite,
        foreach: bool | None = Config.foreach,
        capturable: bool = Config.capturable,
    ):
        self.config = config = self.Config.from_arguments(locals())
        self._data_parallel_groups = axis_groups(check_group("Dobb", "stats_group", stats_group))
        # Refresh work is split over the innermost data axis (its ranks hold identical C_b).
        split = shard_refresh and self._data_parallel_groups
        self._run = (
            partial(split_over_ranks, group=self._data_parallel_groups[-1]) if split else None
        )
        self._input_dims: dict[Tensor, int] = {}  # 0 for (d_in, d_out) weights; set by track
        self._layouts: dict[tuple, tuple[BlockStack, ...]] = {}
        self.statistics = DobbStatistics(
            self, self._data_parallel_groups, missing_stats=missing_stats, stats_sync=stats_sync
        )
        self._host_counts: dict[Tensor, list[int]] = {}  # capturable: [step, stats_steps]
        self._basis_stacks: dict[tuple, tuple[list[Tensor], Tensor]] = {}  # _stacked_bases
        self.basis_failures = BlockFailures()  # blocks whose new basis the guard rejected
        super().__init__(
            params,
            config.defaults(),
            nonfinite=nonfinite,
            foreach=foreach,
            capturable=capturable,
        )

    def _validate_group(self, group: dict[str, Any]) -> None:
        super()._validate_group(group)
        if group["algorithm"] != self.algorithm:
            return
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
        if key not in self._layouts:  # at construction, and at track() for (d_in, d_out)
            check_stats_group(self._data_parallel_groups, param, dim, self.name_of(param))
            self._layouts[key] = param_block_stacks(param, dim, num_blocks, self.name_of(param))
        return self._layouts[key]

    def _row_stacks(self, param: Tensor, group: dict[str, Any]) -> tuple[BlockStack, ...]:
        """Two-sided Dobb's blocks of this rank's rows (output features); () one-sided."""
        if not group["two_sided"]:
            return ()
        dim = 1 - self._input_dims.get(param, 1)
        key = (id(param), dim, "rows", group["row_blocks"])
        if key not in self._layouts:
            row_groups = matrix_placement(param).groups_splitting(dim)
            if group["row_stats"] == "outputs" and shared_axis(
                self._data_parallel_groups, row_groups
            ):
                raise NotImplementedError(
                    f"{self.name_of(param)}: row_stats='outputs' keeps each rank's row blocks, "
                    "averaged over stats_group, but this matrix's rows are split over ranks of "
                    "stats_group: FSDP's data ranks (use row_stats='gradients') or a "
                    f"tensor-parallel axis ({STATS_GROUP_FIX})"
                )
            if group["row_blocks"] is None:  # one block of the rows this rank holds
                start, stop = matrix_placement(param).span(dim)
                self._layouts[key] = block_stacks(stop - start, 1) if stop > start else ()
            else:
                self._layouts[key] = param_block_stacks(
                    param, dim, group["row_blocks"], self.name_of(param), rows=True
                )
        return self._layouts[key]

    def track(self, model: nn.Module) -> list[RemovableHandle]:
        """Hook every layer of ``model`` whose weight is in a Dobb group (``nn.Linear``,
        ``transformers``' ``Conv1D``, types added with ``dobb.stats.register_layer``);
        returns the handles. See ``DobbStatistics.track``."""
        return self.statistics.track(model)

    def untrack(self) -> None:
        """Remove every hook ``track`` added and drop the pending statistics."""
        self.statistics.untrack()

    def synchronize_statistics(self) -> None:
        """Average every ``C_b`` folded since its last average (a collective under DP).

        Exact at any time, the EMA being linear. Every data-parallel rank must call it.
        """
        self.statistics.synchronize()

    def _extra_inputs(self, matrix_groups):
        return self.statistics.pending_inputs()

    def _discard_step_inputs(self) -> None:
        self.statistics.discard()

    def _prepare(self, matrix_groups) -> None:
        self.statistics.check_present(matrix_groups)

    def _init_matrix_state(self, param: Tensor, group: dict[str, Any]) -> dict[str, Any]:
        dtype, device = state_dtype(param), local(param).device
        counter = device if self.capturable else "cpu"
        state = {
            "step": torch.zeros((), device=counter),
            "stats_steps": torch.zeros((), device=counter),
            "momentum": torch.zeros_like(param, dtype=dtype),
        }
        self._host_counts[param] = [0, 0]
        self.basis_failures.counter(device)  # made before any capture (see BlockFailures)
        dim = self._input_dims.get(param, 1)
        sides = (  # (keys, blocks, the param dim they tile, random bases)
            (STACK_KEYS, self._stacks(param, group), dim, group["basis_source"] == "random"),
            (ROW_KEYS, self._row_stacks(param, group), 1 - dim, False),
        )
        for keys, stacks, side_dim, random in sides:
            for (cov_key, basis_key), s in zip(keys, stacks):
                cov = torch.zeros(s.count, s.size, s.size, dtype=dtype, device=device)
                basis = torch.eye(s.size, dtype=dtype, device=device).repeat(s.count, 1, 1)
                if random:  # a fixed random orthogonal basis per block, seeded by the name
                    seed = zlib.crc32(f"{self.name_of(param)}/{cov_key}".encode())
                    noise = torch.randn(
                        s.count, s.size, s.size, generator=torch.Generator().manual_seed(seed)
                    )
                    basis = torch.linalg.qr(noise.to(dtype)).Q.to(device)
                state[cov_key] = block_state_like(cov, param, side_dim)
                state[basis_key] = block_state_like(basis, param, side_dim)
        if group["coefficients"] == "adam":
            state["variance"] = torch.zeros_like(param, dtype=dtype)
        return state

    def _matrix_step(self, groups: list[dict[str, Any]]) -> None:
        """The algorithm box for every matrix: statistics EMA, due refreshes, update, each
        phase batched (kernels per distinct shape, not per matrix); the schedule reads CPU
        counters (``tolist``), or host counts if capturable: no device sync."""
        active = list(self._matrices_with_grad(groups))
        if not active:
            return
        states = [state for _, state, _ in active]
        live = self._live
        counters = [state["step"] for state in states]
        torch._foreach_add_(counters, 1.0 if live is None else each(live, counters))
        if live is None:
            steps = torch.stack([state["step"] for state in states]).tolist()
            folded = self.statistics.fold(active)
        else:  # capturable: the schedule on the host, no read
            counts = [self._host_count(p, state) for p, state, _ in active]
            steps = [c[0] + 1 for c in counts]
            folded = self.statistics.fold(active, [c[1] for c in counts], live)
            for c, step, stats_steps in zip(counts, steps, folded):
                c[:] = step, stats_steps
        due = [
            (state, group, stats_steps)
            for (_, state, group), step, stats_steps in zip(active, steps, folded)
            if (int(step) - 1) % group["basis_interval"] == 0 and stats_steps > 0
        ]
        due_ids = {id(state) for state, _, _ in due}
        synced = [m for m in active if self.statistics.stats_sync == "step" or id(m[1]) in due_ids]
        self.statistics.average(synced)
        self._refresh(due)
        if live is not None:  # Adam coefficients' bias correction: the device counts
            steps = [state["step"] for state in states]
        step_of = {id(state): step for state, step in zip(states, steps)}
        for batch in self._batches(active):
            p, _, group = batch[0]
            dim = self._input_dims.get(p, 1)
            stacks, row_stacks = self._stacks(p, group), self._row_stacks(p, group)
            adam = group["coefficients"] == "adam"
            hyper = dict(
                lr=group["lr"],
                beta=group["momentum"],
                nesterov=group["nesterov"],
                weight_decay=group["weight_decay"],
                scale=update_alpha(group["update_scale"], p.shape[dim]),
                beta2=group["coefficient_beta"],
                row_stacks=row_stacks,
                projection_dtype=getattr(torch, group["projection_dtype"] or "", None),
            )
            low = hyper["projection_dtype"] or state_dtype(p)
            if len(batch) == 1 and live is None:  # the reference: no stacking copies
                state = batch[0][1]
                # (d_in, d_out) weights (Conv1D) are updated through their transpose
                orient = (lambda t: t.mT) if dim == 0 else (lambda t: t)
                dobb_update(
                    orient(local(p)),
                    orient(local(p.grad)),
                    orient(local(state["momentum"])),
                    [local(state[b]) for _, b in STACK_KEYS[: len(stacks)]],
                    stacks,
                    row_bases=[local(state[b]) for _, b in ROW_KEYS[: len(row_stacks)]],
                    variance=orient(local(state["variance"])) if adam else None,
                    step=step_of[id(state)],
                    **hyper,
                )
                continue

            dobb_update_batched(
                [local(q) for q, _, _ in batch],
                [local(q.grad) for q, _, _ in batch],
                [local(s["momentum"]) for _, s, _ in batch],
                self._stacked_bases(batch, STACK_KEYS[: len(stacks)], low),
                stacks,
                row_bases=self._stacked_bases(batch, ROW_KEYS[: len(row_stacks)], low) or None,
                variances=[local(s["variance"]) for _, s, _ in batch] if adam else None,
                steps=[step_of[id(s)] for _, s, _ in batch],
                transposed=dim == 0,
                live=live,
                **hyper,
            )

    def _stacked_bases(self, batch: list[tuple], keys, dtype) -> list[Tensor]:
        """``batch``'s bases under each ``(cov, basis)`` key, stacked ``(n, count, s, s)`` in
        ``dtype`` (the projections') once and kept between steps: bases change only in
        ``_refresh``, which refills these copies in place (a captured steady step reads them
        where the capture found them), and on a load, which drops them (memory: a copy of
        the bases)."""
        out = []
        for _, key in keys:
            cache_key = (key, dtype, *(id(state) for _, state, _ in batch))
            if cache_key not in self._basis_stacks:
                bases = [local(state[key]) for _, state, _ in batch]
                self._basis_stacks[cache_key] = (bases, torch.stack(bases).to(dtype))
            out.append(self._basis_stacks[cache_key][1])
        return out

    def _host_count(self, param: Tensor, state: dict) -> list[int]:
        """Capturable: ``[step, stats_steps]`` on the host (read once after a load)."""
        if param not in self._host_counts:
            self._host_counts[param] = [int(state["step"]), int(state["stats_steps"])]
        return self._host_counts[param]

    def refresh_due(self) -> bool:
        """Capturable: whether the next ``step()`` may refresh a basis (replay the refresh
        graph, not the steady one; a matrix's first step runs eagerly). Host counts only: no
        device read. When due it also reports the solver's failures (``basis_failures``,
        counted on the device by the previous refreshes) whose non-blocking copy has
        reached the host."""
        due = any(
            p not in self._host_counts or self._host_counts[p][0] % g["basis_interval"] == 0
            for g in self.param_groups
            if g["algorithm"] == self.algorithm
            for p in g["params"]
        )
        if due:
            self.basis_failures.report()
        return due

    def count_replay(self) -> None:
        """Capturable: count a replayed step, steady or refresh (a CUDA graph replay runs
        no Python)."""
        for counts in self._host_counts.values():
            counts[0] += 1
            counts[1] += counts[1] > 0

    def _batches(self, active: list[tuple[Tensor, dict, dict]]) -> list[list[tuple]]:
        """``active`` split into batches that can share kernels, each of at most
        ``BATCH_ELEMENTS`` elements: same local shape, orientation, block layout, dtypes,
        device and hyperparameters; one matrix each unless ``batched`` (``foreach``)."""
        batches: dict[tuple, list[list[tuple]]] = {}
        for entry in active:
            p, state, group = entry
            param, grad, dim = local(p), local(p.grad), self._input_dims.get(p, 1)
            layout = (tuple(param.shape), dim, self._stacks(p, group), self._row_stacks(p, group))
            dtypes = (param.dtype, grad.dtype, state["momentum"].dtype, param.device)
            key = (*layout, *dtypes, math_key(group, self._math_options))
            chunks = batches.setdefault(key, [[]])
            full = (len(chunks[-1]) + 1) * param.numel() > BATCH_ELEMENTS
            if chunks[-1] and (full or not self.batched(param.device)):
                chunks.append([])
            chunks[-1].append(entry)
        return [chunk for chunks in batches.values() for chunk in chunks]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load state; saved statistics were averaged when saved (see ``state_dict``)."""
        super().load_state_dict(state_dict)
        self._host_counts.clear()  # capturable: read again from the loaded counters
        self._basis_stacks.clear()
        for p in self.state:
            self.basis_failures.counter(local(p).device)
        self.statistics.mark_synced()

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
        solver call per method, side and block size (``COLD_START`` on a matrix's first
        statistics; rejected blocks counted in ``basis_failures``). Input blocks are shared
        out over the data ranks (``shard_refresh``); row blocks are computed where they
        live: an FSDP rank holds only its own."""
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
            solver = dict(failures=self.basis_failures, capturable=self.capturable)
            torch._foreach_copy_(targets, refresh_bases(covs, targets, method, run, **solver))
        if due:  # refill the stacked copies where a captured steady step reads them
            for bases, stacked in self._basis_stacks.values():
                stacked.copy_(torch.stack(bases))

    @property
    def stats_groups(self) -> list:
        """The process groups ``C_b`` is averaged over, one per data axis (empty: none)."""
        return list(self._data_parallel_groups)

    def local_blocks(self, param: Tensor) -> tuple[BlockStack, ...]:
        """The blocks of this rank's input columns of ``param`` (a matrix of a Dobb group)."""
        mine = [g for g in self.param_groups if g["algorithm"] == self.algorithm]
        groups = [g for g in mine if any(q is param for q in g["params"])]
        if not groups:
            raise ValueError(f"{self.name_of(param)} is not in a Dobb parameter group")
        return self._stacks(param, groups[0])
