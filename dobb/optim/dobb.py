"""Dobb: Distributed Optimizer with Block-diagonal Eigenbases (arXiv 2610.39412).

Each hidden weight ``W`` (``d_out x d_in``) is preconditioned on its input side only, with
a block-diagonal approximation of the input-activation second moment ``E[xᵀx]``. Momentum
is projected into each block's eigenbasis, normalized by an elementwise sign and rotated
back. A row of the update depends only on the same row of the momentum, so row-sharded
(FSDP, column-parallel TP) matrices are updated with no communication. The maths per
matrix is in the class docstring. ``Dobb`` is the driver (``dobb.optim.base``) over its
core, ``dobb.optim.dobb_core.DobbCore``, which holds the step (counters, fold, average,
refresh, update) and runs under ``Local``, Dobb's only placement; the optimizer keeps the
options, the layouts (``_layout``), the hooks (``track``) and the checkpoints. The update
on plain tensors is ``dobb.optim.dobb_update``, the statistics ``dobb.optim.dobb_statistics``.
Some options at more length than the class docstring gives them:

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

from dataclasses import dataclass
from functools import partial
from typing import Any

from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from dobb._dtensor import DTensor, local
from dobb.blocks import BlockStack
from dobb.distributed.groups import axis_groups, check_group
from dobb.distributed.sharding import split_over_ranks
from dobb.eigensolve import BASIS_METHODS, CAPTURABLE_METHODS, BlockFailures
from dobb.optim.base import MatrixOptimizer
from dobb.optim.config import (
    BOOL,
    COUNT,
    UNIT,
    OptimizerConfig,
    Rule,
    inherit,
    one_of,
    option,
    optional,
)
from dobb.optim.dobb_core import DobbCore
from dobb.optim.dobb_layout import LEGACY_KEYS, Matrix, MatrixLayout, hooked, matrix_layout
from dobb.optim.dobb_statistics import DobbStatistics
from dobb.optim.dobb_update import COEFFICIENTS
from dobb.stats import layer_weights

UPDATE_SCALE_MODES = ("adamw", "lion", "muon")
UPDATE_SCALE = Rule(
    lambda v: v in UPDATE_SCALE_MODES or (isinstance(v, float | int) and v > 0),
    f"a positive number or {one_of(*UPDATE_SCALE_MODES).want}",
)
# Where the block bases come from: Dobb's activation moments, or controls for ablations.
BASIS_SOURCES = ("activations", "gradients", "random", "identity")
PROJECTION_DTYPES = (None, "float32", "bfloat16", "float16")  # the rotations' matmuls
# Where two-sided Dobb's output-side moments come from: the output gradient of a backward
# hook (K-FAC's factor; local in every layout) or the local rows' G Gᵀ (Shampoo's).
ROW_STATS = ("gradients", "outputs")
# The group options a matrix's layout is made from (Dobb._layout).
LAYOUT_OPTIONS = (
    "num_blocks",
    "block_size",
    "two_sided",
    "row_blocks",
    "row_stats",
    "basis_source",
)


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

    The step is ``self.core``'s (``DobbCore``), given at construction the config, the
    statistics, ``_layout``, the shared refresh's runner and ``basis_failures``.
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
        run = partial(split_over_ranks, group=self._data_parallel_groups[-1]) if split else None
        self._input_dims: dict[Tensor, int] = {}  # 0 for (d_in, d_out) weights; set by track
        self._layouts: dict[tuple, MatrixLayout] = {}  # _layout's
        self.statistics = DobbStatistics(name_of=self.name_of, batched=self.batched)
        self.basis_failures = failures = BlockFailures()  # blocks whose new basis was rejected
        self.core = DobbCore(config, self.statistics, self._layout, run, failures)
        super().__init__(
            params, config.defaults(), nonfinite=nonfinite, foreach=foreach, capturable=capturable
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
            self._layout(p, group)

    def _layout(self, param: Tensor, group: dict[str, Any]) -> MatrixLayout:
        """``param``'s layout (``dobb.optim.dobb_layout.matrix_layout``): its orientation
        (``track`` sets it; dim 1 until then) and each side's blocks and groups.

        Derived from shape, placements and the group's options, so made once per
        orientation and options (at construction, and at ``track()`` for ``(d_in, d_out)``
        weights) rather than kept in the checkpointed state (DTensor offsets are slow to
        recompute every step).
        """
        dim = self._input_dims.get(param, 1)
        key = (id(param), dim, *(group[option] for option in LAYOUT_OPTIONS))
        if key not in self._layouts:
            groups, name = self._data_parallel_groups, self.name_of(param)
            self._layouts[key] = matrix_layout(param, dim, group, groups, name)
        return self._layouts[key]

    def _groups(self) -> list[dict[str, Any]]:
        """The Dobb parameter groups (not the AdamW/Lion ones)."""
        return [g for g in self.param_groups if g["algorithm"] == self.algorithm]

    def track(self, model: nn.Module) -> list[RemovableHandle]:
        """Hook every layer of ``model`` whose weight is in a Dobb group whose statistics
        come from hooks (``nn.Linear``, ``transformers``' ``Conv1D``, types added with
        ``dobb.stats.register_layer``); returns the handles (``untrack`` removes all).

        The layer says the weight's orientation: a ``(d_in, d_out)`` weight (``Conv1D``)
        has its input blocks along dim 0. See ``DobbStatistics.track``.
        """
        groups = {p: g for g in self._groups() for p in g["params"]}
        layers = []
        for module, weight, spec in layer_weights(model):
            group = groups.get(weight)
            if group is not None and hooked(group):
                self._input_dims[weight] = spec.input_dim
                layers.append((module, weight, self._layout(weight, group)))
        return self.statistics.track(layers)

    def untrack(self) -> None:
        """Remove every hook ``track`` added and drop the pending statistics."""
        self.statistics.untrack()

    def synchronize_statistics(self) -> None:
        """Average every ``C_b`` folded since its last average (a collective under DP).

        Exact at any time, the EMA being linear. Every data-parallel rank must call it.
        """
        held = [(p, g) for g in self._groups() for p in g["params"] if p in self.state]
        self.statistics.synchronize(
            [Matrix(p, self.state[p], g, self._layout(p, g)) for p, g in held]
        )

    def refresh_due(self) -> bool:
        """Capturable: whether the next ``step()`` may refresh a basis (replay the refresh
        graph, not the steady one; a matrix's first step runs eagerly). Host counts only: no
        device read. When due it also reports the solver's failures (``basis_failures``,
        counted on the device by the previous refreshes) whose non-blocking copy has
        reached the host."""
        return self.core.refresh_due(self._groups())

    def count_replay(self) -> None:
        """Capturable: count a replayed step, steady or refresh (a CUDA graph replay runs
        no Python)."""
        self.core.count_replay()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load state; saved statistics were averaged when saved (see ``state_dict``).

        A checkpoint in the keys written up to commit d368fca (``cov``, ``cov_tail``,
        ``row_basis``, ...) loads too: they are renamed (``LEGACY_KEYS``).
        """
        state = {
            index: {LEGACY_KEYS.get(key, key): value for key, value in entry.items()}
            for index, entry in state_dict["state"].items()
        }
        super().load_state_dict({**state_dict, "state": state})
        self.core.forget()  # capturable's host counts, the stacked bases
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

    @property
    def stats_groups(self) -> list:
        """The process groups ``C_b`` is averaged over, one per data axis (empty: none)."""
        return list(self._data_parallel_groups)

    def local_blocks(self, param: Tensor) -> tuple[BlockStack, ...]:
        """The blocks of this rank's input columns of ``param`` (a matrix of a Dobb group)."""
        groups = [g for g in self._groups() if any(q is param for q in g["params"])]
        if not groups:
            raise ValueError(f"{self.name_of(param)} is not in a Dobb parameter group")
        return self._layout(param, groups[0]).input.stacks
