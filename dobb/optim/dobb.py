"""Dobb: Distributed Optimizer with Block-diagonal Eigenbases (arXiv 2610.39412).

Each hidden weight ``W`` (``d_out x d_in``) is preconditioned on its input side with a
block-diagonal approximation of the input-activation second moment ``E[xᵀx]``. Momentum
is projected into each block's eigenbasis, normalized elementwise and rotated back. In the
paper's update (one-sided, the sign: ``dobb.registry.PAPER_DOBB``) a row of the update
depends only on the same row of the momentum, so row-sharded (FSDP, column-parallel TP)
matrices are updated with no communication. The defaults are the configuration the study
measured best (``docs/algorithm.md``): also the output side, by row blocks that each lie
in one rank's rows (``two_sided``), and Adam coefficients in place of the sign; still no
communication in ``step()`` besides the statistics' average. The maths per matrix is in
the class docstring.

Dobb's code is five modules: this one (the options, the class, each matrix's layout, old
checkpoints), its core ``dobb.optim.dobb_core`` (the state and the maths on plain tensors),
its placement ``dobb.optim.dobb_steps`` (the step's order, its collectives, the batches),
its inputs ``dobb.optim.dobb_statistics`` (the hooks it holds and their checks) and
``dobb.stats`` (the hooks and their sums), beside the solvers of ``dobb.eigensolve``.
``Dobb`` is the driver (``dobb.optim.base``) over ``DobbCore``, with ``DobbSteps`` as its
only placement and its ``DobbStatistics`` as the step's ``inputs``.
Some options at more length than the class docstring gives them:

Sharding: DTensor parameters are updated on their local shard. Row shards (FSDP
``Shard(0)``, column-parallel TP) need nothing; column shards (row-parallel TP ``Shard(1)``)
must hold whole blocks, else construction raises. A checkpoint holds one consistent copy
of the statistics: with ``stats_sync="refresh"`` (the default for DTensor parameters)
``state_dict()`` averages them first, a collective; with ``"step"`` (the default for plain,
DDP parameters) they are averaged after every step and ``state_dict()`` sends nothing.

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

two_sided: also rotate the output side (``dobb.optim.dobb_core``): row blocks ``R_r``
    with eigenbases ``P_r`` of their own second moment, and
    ``U[R_r, I_b] = P_r sign(P_rᵀ N[R_r, I_b] Q_b) Q_bᵀ``. On by default (off: the paper's
    update). Needs no communication in ``step()`` in any layout but FSDP x TP, whose
    strided rows it refuses: a row block lies in one row shard, and its moments come from
    ``row_stats``.

A matrix's layout (``MatrixLayout``) is derived, never checkpointed: from the parameter
(shape, DTensor placements), its layer (the orientation: ``(d_in, d_out)`` weights such as
GPT-2's ``Conv1D`` have their input features along dim 0, learnt when ``track`` hooks the
layer) and its group's options marked ``layout`` (``Layouts``, once per parameter,
orientation and options). Both sides are one kind of thing (``Side``): blocks of this
rank's indices along one parameter dim, a source of second moments ``C``, the process
groups ``C`` is averaged over, and per stack of same-size blocks a ``(count, s, s)`` ``C``
and basis in the optimizer's state. Fold, average, refresh and update loop over a
matrix's sides.

Old checkpoints: a DCP checkpoint holding Dobb's state in the keys written up to commit
d368fca (``cov``, ``cov_tail``, ``row_basis``, ...: ``dobb_core.LEGACY_KEYS``) loads through
``LegacyKeysLoadPlanner``, or, for loaders that take no planner (torchtitan's
``CheckpointManager``), once converted by ``convert_legacy_checkpoint(old_dir, new_dir)``.
``Dobb.load_state_dict`` renames such keys itself.
"""

import copy
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp
from torch.distributed.checkpoint.planner import LoadPlan
from torch.utils.hooks import RemovableHandle

from dobb._dtensor import DTensor, local
from dobb.distributed.groups import (
    STATS_GROUP_FIX,
    axis_groups,
    check_group,
    check_stats_group,
    shared_axis,
)
from dobb.distributed.placement import matrix_placement
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
from dobb.optim.dobb_core import (
    COEFFICIENTS,
    INPUT,
    LEGACY_KEYS,
    OLD_NAMES,
    ROW,
    DobbCore,
    side_keys,
)
from dobb.optim.dobb_statistics import DobbStatistics
from dobb.optim.dobb_steps import DobbSteps, block_state_like, param_block_stacks
from dobb.optim.experts import expert_of, is_experts, stack_groups
from dobb.optim.parts import Matrix, state_dtype
from dobb.stats import (
    BlockStack,
    block_stacks,
    expert_modules,
    fsdp_data_ranks,
    layer_weights,
    several_ranks,
    tracked_layers,
)

UPDATE_SCALE_MODES = ("adamw", "lion", "muon", "width")
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
# The largest input and row blocks the defaults make (block_size, row_block_size None):
# one block per shard up to this width (STUDY.md (f): one input block and one row block per
# shard were best at every width and shard count measured, up to 1,024 columns)
BLOCK_WIDTH = 1024
STATS_SYNC = ("auto", "refresh", "step")
# Where a side's moments come from: the layer's hooks (``dobb.stats``), this step's
# gradient, or nowhere (a fixed basis: "random", "identity").
HOOKED = ("activations", "outputs")


@dataclass(frozen=True)
class Side:
    """One side of a matrix: the blocks of this rank's indices along parameter dim ``dim``.

    ``name``: ``"input"`` (blocks ``I_b`` of the input features, bases ``Q_b``) or ``"row"``
    (blocks ``R_r`` of the output features, bases ``P_r``; no stacks when one-sided:
    ``P = I``). ``stacks``: the blocks, by size. ``source``: where ``C`` comes from
    (``"activations"``, ``"outputs"``: the layer's hooks; ``"gradients"``; ``"random"``,
    ``"identity"``: none). ``groups``: the process groups ``C`` is averaged over (one per
    mesh axis; empty: none). ``shared``: every data rank holds the same ``C``, so a refresh
    is shared out over them (``shard_refresh``).
    """

    name: str
    dim: int
    stacks: tuple[BlockStack, ...]
    source: str
    groups: tuple = ()
    shared: bool = False

    @property
    def keys(self) -> list[tuple[str, str]]:
        """``(C key, basis key)`` of each stack, in the optimizer's state."""
        return side_keys(self.name, len(self.stacks))

    @property
    def hooked(self) -> bool:
        """It has blocks here and its moments come from hooks on the layer."""
        return bool(self.stacks) and self.source in HOOKED

    def init_state(self, param: Tensor, name: str) -> dict[str, Tensor]:
        """Its state: per stack ``C`` (zeros) and the bases (the identity, or for
        ``"random"`` a fixed random orthogonal one per block, seeded by the matrix's
        ``name`` and the stack's key as named before, ``OLD_NAMES``), laid out like
        ``param``'s ``dim`` (``block_state_like``)."""
        dtype, device, state = state_dtype(param), local(param).device, {}
        for (cov_key, basis_key), s in zip(self.keys, self.stacks):
            cov = torch.zeros(s.count, s.size, s.size, dtype=dtype, device=device)
            basis = torch.eye(s.size, dtype=dtype, device=device).repeat(s.count, 1, 1)
            if self.source == "random":
                seed = torch.Generator().manual_seed(
                    zlib.crc32(f"{name}/{OLD_NAMES[cov_key]}".encode())
                )
                noise = torch.randn(s.count, s.size, s.size, generator=seed)
                basis = torch.linalg.qr(noise.to(dtype)).Q.to(device)
            state[cov_key] = block_state_like(cov, param, self.dim)
            state[basis_key] = block_state_like(basis, param, self.dim)
        return state

    def covs(self, state: dict) -> list[Tensor]:
        """Its ``C`` per stack, local tensors."""
        return [local(state[cov]) for cov, _ in self.keys]


@dataclass(frozen=True)
class MatrixLayout:
    """A Dobb matrix's orientation (``input_dim``: the parameter dim of its input features,
    ``width`` of them in the whole matrix) and its two sides; the row side has no stacks
    one-sided. Matrices of one local shape and layout can be updated in one batch."""

    input_dim: int
    width: int
    input: Side
    row: Side

    @property
    def sides(self) -> tuple[Side, Side]:
        return self.input, self.row


def sources(config) -> dict[str, str]:
    """Where each side's moments come from, by the options."""
    return {INPUT: config.basis_source, ROW: config.row_stats if config.two_sided else "identity"}


def hooked(config) -> bool:
    """Whether some side's moments come from hooks on the layer (``Dobb.track``)."""
    return any(source in HOOKED for source in sources(config).values())


def side_stacks(param: Tensor, dim: int, count, width, name: str, rows: bool = False):
    """The blocks of this rank's indices along ``param``'s ``dim``: ``count`` blocks over the
    whole dim (``param_block_stacks``: they must tile this rank's shard), else near-equal
    blocks of at most ``width`` (None: ``BLOCK_WIDTH``) within this rank's indices."""
    if count is not None:
        return param_block_stacks(param, dim, count, name, rows=rows)
    start, stop = matrix_placement(param).span(dim)
    mine = stop - start
    return block_stacks(mine, -(-mine // (width or BLOCK_WIDTH))) if mine else ()


def matrix_layout(
    param: Tensor, input_dim: int, config, data_groups: tuple, name: str, shared: bool = True
):
    """The ``MatrixLayout`` of ``param`` (named ``name``), a Dobb matrix whose input features
    lie along ``input_dim``, with ``config``'s options and ``data_groups`` the ranks that see
    other tokens.

    Input blocks (``side_stacks``): ``num_blocks`` over the whole ``d_in``, those of this
    rank's columns (a column shard that splits a block raises), or blocks of at most
    ``block_size`` (``BLOCK_WIDTH``) columns within this rank's columns; a data rank that
    holds other columns raises (``check_stats_group``). Row blocks (two-sided), likewise:
    ``row_blocks`` over the rows, or blocks of at most ``row_block_size`` rows within this
    rank's rows; their ``C`` is averaged over the data ranks (``row_stats="outputs"``, which
    refuses rows split over them) or over the ranks holding the other columns of the same
    rows (``"gradients"``). ``shared``: every rank of ``data_groups`` holds this matrix (not
    so for an expert of a stack split along its experts).
    """
    width = param.shape[input_dim]
    check_stats_group(data_groups, param, input_dim, name)
    source = sources(config)
    cols = side_stacks(param, input_dim, config.num_blocks, config.block_size, name)
    columns = Side(INPUT, input_dim, cols, source[INPUT], tuple(data_groups), shared=shared)
    dim = 1 - input_dim
    if not config.two_sided:
        return MatrixLayout(input_dim, width, columns, Side(ROW, dim, (), source[ROW]))
    placement = matrix_placement(param)
    if source[ROW] == "outputs" and shared_axis(data_groups, placement.groups_splitting(dim)):
        raise NotImplementedError(
            f"{name}: row_stats='outputs' keeps each rank's row blocks, averaged over "
            "stats_group, but this matrix's rows are split over ranks of stats_group: FSDP's "
            f"data ranks (use row_stats='gradients') or a tensor-parallel axis ({STATS_GROUP_FIX})"
        )
    rows = side_stacks(param, dim, config.row_blocks, config.row_block_size, name, rows=True)
    over = data_groups if source[ROW] == "outputs" else placement.groups_splitting(input_dim)
    return MatrixLayout(input_dim, width, columns, Side(ROW, dim, rows, source[ROW], tuple(over)))


class Layouts:
    """Each Dobb matrix's layout (``matrix_layout``), made once per parameter, orientation
    and layout options (DTensor offsets are slow to recompute every step) rather than kept
    in the checkpointed state. ``orient`` records a weight's orientation (``Dobb.track``:
    its layer says it; dim 1 until then)."""

    def __init__(self, data_groups: tuple, name_of):
        self.data_groups, self.name_of = data_groups, name_of
        self._input_dims: dict[Tensor, int] = {}
        self._layouts: dict[tuple, MatrixLayout] = {}

    def orient(self, param: Tensor, input_dim: int) -> None:
        self._input_dims[param] = input_dim

    def input_width(self, param: Tensor) -> int:
        """``d_in`` of ``param`` (a matrix, or a stack of experts ``(E, d_out, d_in)``) by its
        recorded orientation, in the whole matrix."""
        return param.shape[param.dim() - 2 + self._input_dims.get(param, 1)]

    def __call__(self, param: Tensor, config) -> MatrixLayout:
        expert = expert_of(param)  # an expert's layout is every expert's of its stack
        anchor = param if expert is None else expert.stack
        dim = self._input_dims.get(param, 1)
        options = (getattr(config, o) for o in config.layout_options())
        key = (id(anchor), expert is not None, dim, *options)
        if key not in self._layouts:
            name, groups, shared = self.name_of(anchor), self.data_groups, True
            if expert is not None:  # its statistics are added up before the fold, not after
                groups, shared = (), not stack_groups(expert.stack)[0]
            self._layouts[key] = matrix_layout(param, dim, config, groups, name, shared)
        return self._layouts[key]


class Dobb(MatrixOptimizer):
    r"""Block-diagonal eigenbasis preconditioning for hidden weight matrices.

    The paper's update (``two_sided=False, coefficients="sign"``, 16 blocks); the defaults
    also rotate the rows (``two_sided``) and take Adam coefficients (``coefficients``):

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
    construction raises). ``state_dict()`` holds averaged statistics (``stats_sync``).

    Parts (``dobb.optim.base``): ``core`` a ``DobbCore``; ``placements`` ``(steps,)``, a
    ``DobbSteps`` (the step's order and its collectives); ``inputs`` its
    ``statistics`` (``DobbStatistics``: the hooks' sums); ``layouts`` each matrix's
    ``MatrixLayout``; ``basis_failures`` the blocks whose new basis was rejected.
    """

    algorithm = "dobb"
    core = DobbCore()
    # the argument that takes a job's data-parallel ranks (see dobb.distributed.groups)
    data_parallel_option = "stats_group"

    @dataclass(frozen=True)
    class Config(OptimizerConfig):
        """Dobb's options (``dobb.optim.config``)."""

        renamed = {"coefficient_beta": "beta2"}  # NorMuon's name for a second moment's EMA

        @classmethod
        def upgrade_group(cls, group: dict[str, Any]) -> dict[str, Any]:
            """``OptimizerConfig.upgrade_group``; a group saved before ``model_width``
            existed, when ``update_scale=None`` with Adam coefficients meant 1.0, keeps 1.0:
            a resumed run goes on with the update it started with."""
            group = super().upgrade_group(group)
            old = "model_width" not in group and group.get("update_scale", 0) is None
            if old and group.get("coefficients") == "adam":
                group["update_scale"] = 1.0
            return group

        lr: float = inherit(OptimizerConfig, "lr", 4e-3)
        """Learning rate; the update's RMS is about ``alpha lr`` (``update_scale``). The
        default is the recommended configuration's tuned rate at width 256; with its width
        rule (``update_scale="width"``) the same lr serves widths 128 to 512 (STUDY.md (f));
        per width: ``dobb.registry.recommended_lr``."""
        momentum: float = option(0.95, UNIT, math=True)
        """``mu``, the momentum's EMA factor."""
        nesterov: bool = option(True, BOOL, math=True)
        """Nesterov momentum (the direction ``(1 - mu) G + mu M``), else ``M``."""
        num_blocks: int | None = option(None, optional(COUNT), math=True, layout=True)
        """``B``, input blocks per matrix (the paper's 16), of near-equal size over the
        whole ``d_in``; each column shard must hold whole blocks; ``B >= d_in`` gives block
        size 1, i.e. Signum. None: blocks of ``block_size``."""
        stats_beta: float = option(0.95, UNIT, math=True)
        """``beta``, the EMA factor of the second-moment blocks ``C_b`` (the paper's
        ``beta2``; SOAP's ``shampoo_beta``). Not ``beta2``, the Adam coefficients' EMA."""
        basis_interval: int = option(10, COUNT, math=True)
        """``k``: the eigenbases are refreshed every ``k`` steps."""
        update_scale: float | str | None = option(None, optional(UPDATE_SCALE), math=True)
        """``alpha``: a number, ``"adamw"`` (0.2), ``"lion"`` (1.0), ``"muon"``
        (``1/sqrt(d_in)``, the RMS of Muon's spectrally scaled update; in STUDY.md (f) it
        keeps one-block Dobb's tuned lr from width 128 to 256, where 0.2 halves it, at the
        same loss) or ``"width"`` (``256 / model_width``: muP's rule for Adam, an lr
        inversely proportional to the width, equal to 1.0 at width 256). None: 0.2 with the
        sign (the update's RMS is then AdamW's), ``"width"`` with Adam coefficients (already
        scaled as Adam's update, whose best lrs at ``alpha = 1`` fell as 1 / width, STUDY.md
        (f)). Weight decay stays ``lr weight_decay``."""
        model_width: int | None = option(None, optional(COUNT), math=True)
        """The width ``update_scale="width"`` divides by; None: the narrowest input width of
        the group's matrices (a GPT's ``n_embd``, as ``dobb.registry.model_width`` reads
        it). One value per group, so a model's matrices keep one lr between them."""
        block_size: int | None = option(None, optional(COUNT), math=True, layout=True)
        """Input blocks of at most this many columns, near-equal, within each rank's
        columns (the paper's 100 and 400); None: ``BLOCK_WIDTH`` (1,024) unless
        ``num_blocks`` is set. One block per shard up to that width is what the study
        measured best (STUDY.md (b), (f))."""
        two_sided: bool = option(True, BOOL, math=True, layout=True)
        """Also rotate the output side, by row blocks ``R_r`` that each lie inside one row
        shard: ``U[R_r, I_b] = P_r sign(P_rᵀ N[R_r, I_b] Q_b) Q_bᵀ``. The default at every
        layout: STUDY.md (f) at many row shards finds it ahead of every configuration with
        no row blocks at every row-shard count measured, though its lead over Muon is gone
        from 8 FSDP ranks on (more ranks, fewer rows per block)."""
        row_blocks: int | None = option(None, optional(COUNT), math=True, layout=True)
        """Two-sided Dobb's row blocks per matrix, near-equal over all its rows; each rank's
        rows must hold whole blocks, else construction raises. None: blocks of
        ``row_block_size``."""
        row_block_size: int | None = option(None, optional(COUNT), math=True, layout=True)
        """Two-sided Dobb's row blocks of at most this many rows, near-equal, within each
        rank's rows; None: ``BLOCK_WIDTH`` (1,024) unless ``row_blocks`` is set (one block
        of each rank's rows up to that many: under FSDP, the rows each rank holds)."""
        row_stats: str = option("gradients", one_of(*ROW_STATS), math=True, layout=True)
        """Two-sided Dobb's row moments: ``"gradients"``, ``G_r G_rᵀ / d_in`` of the rank's
        rows (Shampoo's left factor; no communication under DDP, FSDP, HSDP and
        column-parallel TP, a refresh-step average over the TP ranks under row-parallel
        TP), or ``"outputs"``, the output gradient's ``E[δ_rᵀ δ_r]`` from a backward hook
        (K-FAC's factor; not for rows split over data ranks)."""
        coefficients: str = option("adam", one_of(*COEFFICIENTS), math=True)
        """``"sign"``, or ``"adam"``: ``C / (sqrt(V_hat) + eps)`` with a SOAP-style second
        moment ``V`` of the coefficients, kept in the eigenbasis (+4 bytes per parameter;
        ``update_scale=None`` then takes ``"width"``)."""
        beta2: float = option(0.95, UNIT, math=True)
        """The EMA factor of ``V`` (``coefficients="adam"``), as Adam's and NorMuon's
        ``beta2``."""
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
        basis_source: str = option("activations", one_of(*BASIS_SOURCES), math=True, layout=True)
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
        stats_sync: str = option("auto", one_of(*STATS_SYNC), group=False)
        """When ``C_b`` is averaged over ``stats_group``: on refresh steps only (exact, the
        EMA being linear; ``state_dict()`` then averages first, a collective every data
        rank must call, as DCP does), or every ``"step"`` (every rank holds the same
        ``C_b`` after each step: a checkpoint one rank saves is exact for all, and
        ``state_dict()`` communicates nothing). ``"auto"``: every step for plain
        (replicated: DDP) parameters, whose loops save on one rank (nanoGPT, Hugging Face
        ``Trainer``); on refresh steps for DTensor ones (FSDP, TP, HSDP), which DCP saves
        on every rank."""
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
            if not self.two_sided and (self.row_blocks or self.row_block_size) is not None:
                raise ValueError(
                    "row_blocks and row_block_size are options of two-sided Dobb: pass "
                    "two_sided=True"
                )
            for count, width in (("num_blocks", "block_size"), ("row_blocks", "row_block_size")):
                if getattr(self, count) is not None and getattr(self, width) is not None:
                    raise ValueError(
                        f"pass {count} (blocks per matrix) or {width} (their width), not both"
                    )
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

    def __init__(self, params, lr=None, **options):
        config = self.Config.from_options("Dobb", lr, options)
        data_groups = axis_groups(check_group("Dobb", "stats_group", config.stats_group))
        self.layouts = Layouts(data_groups, self.name_of)
        self.statistics = self.inputs = DobbStatistics(name_of=self.name_of, layouts=self.layouts)
        self.basis_failures = BlockFailures()  # blocks whose new basis was rejected
        # refresh work is split over the innermost data axis (its ranks hold identical C_b)
        split = data_groups[-1] if config.shard_refresh and data_groups else None
        self.steps = DobbSteps(self.statistics, self.layouts, split, self.basis_failures)
        self.placements = (self.steps,)
        self._data_parallel_groups = data_groups
        super().__init__(params, config)

    def configs(self) -> list[tuple[dict, Config]]:
        """Each matrix group's options (``MatrixOptimizer.configs``), ``model_width`` None
        read from the group: the narrowest input width of its matrices, this step's."""
        configs = []
        for group, config in super().configs():
            if config.model_width is None:
                config = copy.copy(config)  # as ``with_group``: a step's reading, not a new one
                width = min(self.layouts.input_width(p) for p in group["params"])
                object.__setattr__(config, "model_width", width)
            configs.append((group, config))
        return configs

    def _validate_group(self, group: dict[str, Any]) -> None:
        super()._validate_group(group)
        if group["algorithm"] != self.algorithm:
            return
        config = self.config.for_group(group)
        if config.basis_source == "gradients" and any(
            isinstance(p, DTensor) for p in group["params"]
        ):
            raise NotImplementedError("basis_source='gradients' supports unsharded matrices only")
        for p in group["params"]:
            if not is_experts(p):
                self.layouts(p, config)
                continue
            if config.two_sided and config.row_stats == "outputs":
                raise NotImplementedError(
                    f"{self.name_of(p)} is a stack of experts: row_stats='outputs' has no "
                    "per-expert output gradients (the grouped GEMM's); use row_stats='gradients'"
                )
            for view in self.expert_views.weights(p)[:1]:  # one expert's layout checks all
                self.layouts(view, config)

    def track(self, model: nn.Module) -> list[RemovableHandle]:
        """Hook every layer of ``model`` whose weight is in a Dobb group whose statistics
        come from hooks (``nn.Linear``, ``transformers``' ``Conv1D``, types added with
        ``dobb.stats.register_layer``); returns the handles (``untrack`` removes all).

        The layer says the weight's orientation: a ``(d_in, d_out)`` weight (``Conv1D``)
        has its input blocks along dim 0. See ``DobbStatistics.track``.
        """
        ranks = fsdp_data_ranks(model) if several_ranks() else 1
        if not self._data_parallel_groups and ranks > 1:
            raise ValueError(
                f"Dobb.track: the model is sharded by FSDP over {ranks} ranks, which see "
                "different tokens, but stats_group is None: each rank would precondition "
                "with its own statistics. Pass the FSDP mesh (its data axes, e.g. "
                'mesh["data_shard"]) as stats_group (docs/distributed.md).'
            )
        configs = {p: c for g, c in self.configs() for p in g["params"]}
        layers = []
        for module, weight, spec in layer_weights(model):
            config = configs.get(weight)
            if config is not None and hooked(config):
                self.layouts.orient(weight, spec.input_dim)
                layers.append((module, weight, self.layouts(weight, config)))
        experts = []
        for module, spec in expert_modules(model):
            stacks = {}
            for name in spec.calls:
                stack = getattr(module, name, None)
                config = configs.get(stack)
                if config is None or not hooked(config):
                    continue
                views = self.expert_views.weights(stack)  # a rank may hold none (uneven)
                if views:
                    layout = self.layouts(views[0], config)
                else:
                    template = torch.empty(stack.shape[1:], device="meta")
                    layout = matrix_layout(template, 1, config, (), self.name_of(stack))
                stacks[name] = (stack, layout)
            if stacks:
                experts.append((module, spec, stacks))
        handles = self.statistics.track(layers) + self.statistics.track_experts(experts)
        if not handles:
            raise ValueError(
                "track() found no layer whose weight is in a Dobb group; known layer types: "
                f"{[t.__name__ for t in tracked_layers()]}, and grouped-experts modules "
                "registered with dobb.stats.register_experts"
            )
        return handles

    def untrack(self) -> None:
        """Remove every hook ``track`` added and drop the pending statistics."""
        self.statistics.untrack()

    def _held(self) -> list[tuple[Matrix, MatrixLayout]]:
        """``(matrix, layout)`` of every matrix with state."""
        held = [
            Matrix(p, self.state[p], c, self.name_of(p))
            for g, c in self.configs()
            for p in g["params"]
            if p in self.state
        ]
        matrices = [e for m in held for e in self._experts_of(m)]
        return [(m, self.layouts(m.param, m.config)) for m in matrices]

    def synchronize_statistics(self) -> None:
        """Average every ``C_b`` folded since its last average (a collective under DP).

        Exact at any time, the EMA being linear. Every data-parallel rank must call it.
        """
        self.steps.synchronize(self._held())

    def refresh_due(self) -> bool:
        """Capturable: whether the next ``step()`` may refresh a basis (replay the refresh
        graph, not the steady one; a matrix's first step runs eagerly). Host counts only: no
        device read. When due it also reports the solver's failures (``basis_failures``,
        counted on the device by the previous refreshes) whose non-blocking copy has
        reached the host."""
        return self.steps.refresh_due([(g["params"], c) for g, c in self.configs()])

    def count_replay(self) -> None:
        """Capturable: count a replayed step, steady or refresh (a CUDA graph replay runs
        no Python)."""
        self.steps.count_replay()

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
        self.steps.forget()  # capturable's host counts, the stacked bases, the unsynced
        for p in self.state:
            self.basis_failures.counter(local(p).device)

    def state_dict(self) -> dict[str, Any]:
        """The state, statistics averaged first so that every rank saves the same ``C_b``.

        With ``stats_sync="refresh"`` (``"auto"``'s choice for DTensor parameters) this is a
        collective between refreshes: call it on all data-parallel ranks (DCP and Lightning
        do). With ``"step"`` (``"auto"``'s choice for plain, DDP parameters) the statistics
        are averaged after every step and saving communicates nothing, so a loop that saves
        on rank 0 only (nanoGPT, Hugging Face ``Trainer``) is exact.
        """
        self.synchronize_statistics()
        return super().state_dict()

    @property
    def stats_groups(self) -> list:
        """The process groups ``C_b`` is averaged over, one per data axis (empty: none)."""
        return list(self._data_parallel_groups)

    def local_blocks(self, param: Tensor) -> tuple[BlockStack, ...]:
        """The blocks of this rank's input columns of ``param`` (a matrix of a Dobb group)."""
        configs = [c for g, c in self.configs() if any(q is param for q in g["params"])]
        if not configs:
            raise ValueError(f"{self.name_of(param)} is not in a Dobb parameter group")
        return self.layouts(param, configs[0]).input.stacks


class LegacyKeysLoadPlanner(DefaultLoadPlanner):
    """DCP's ``DefaultLoadPlanner``, but an entry ``<path>.<key>`` of Dobb's state that the
    checkpoint lacks is read, in place, from ``<path>.<old name of key>`` where the
    checkpoint has that (``OLD_NAMES``: ``input_cov_0`` from ``cov``, ``row_basis_1`` from
    ``row_basis_tail``, ...). A checkpoint in today's keys loads as with the default.

    DCP reads each entry of the state dict it is given (today's keys) by that entry's name,
    so ``Dobb.load_state_dict`` never sees an old checkpoint's keys::

        dcp.load(state, checkpoint_id=path, planner=LegacyKeysLoadPlanner())
    """

    def create_local_plan(self) -> LoadPlan:
        saved = self.metadata.state_dict_metadata
        for key in [k for k in self.state_dict if k not in saved]:
            path, _, name = key.rpartition(".")
            old = f"{path}.{OLD_NAMES.get(name)}"
            if name in OLD_NAMES and old in saved:
                self.state_dict[old] = self.state_dict.pop(key)
                if key in self.mappings:  # its place in the nested dict (flatten_state_dict)
                    self.mappings[old] = self.mappings.pop(key)
        return super().create_local_plan()


def convert_legacy_checkpoint(old: str | Path, new: str | Path) -> int:
    """Write the DCP checkpoint ``old`` to ``new`` with every Dobb matrix state's old keys
    renamed (``LEGACY_KEYS``), for loaders that take no planner; returns how many entries
    were renamed. A Dobb matrix state is a dict holding ``momentum`` and ``stats_steps``;
    nothing else is touched. In one process, holding the whole checkpoint in memory; DCP
    reshards the copy on load as any other."""
    with tempfile.TemporaryDirectory() as tmp:
        whole = Path(tmp) / "whole.pt"
        dcp_to_torch_save(old, whole)
        state = torch.load(whole, weights_only=False)
        renamed = _rename_legacy_keys(state)
        torch.save(state, whole)
        torch_save_to_dcp(whole, new)
    return renamed


def _rename_legacy_keys(tree: Any) -> int:
    """Rename the old keys of every Dobb matrix state in the nested dict ``tree``."""
    if not isinstance(tree, dict):
        return 0
    if {"momentum", "stats_steps"} <= tree.keys():
        old = [key for key in tree if key in LEGACY_KEYS]
        for key in old:
            tree[LEGACY_KEYS[key]] = tree.pop(key)
        return len(old)
    return sum(_rename_legacy_keys(value) for value in tree.values())
