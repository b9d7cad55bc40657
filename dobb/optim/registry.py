"""Build any optimizer of the comparison by name: one registry for harness, benchmarks, tests.

``build_optimizer("dion", model)`` routes the model's hidden ``nn.Linear`` weights to the
matrix optimizer and everything else (embeddings, LM head, norms, biases) to an AdamW (or
Lion) group of the same optimizer object, through ``dobb.param_groups``; ``"adamw"`` is
``torch.optim.AdamW`` over every parameter (``dobb.optim.state_init.AdamW``, which counts
no step for DCP's state-initialising call). Dobb is also hooked to the model
(``opt.track(model)``), so each step needs a forward pass in training mode before it.

Starting learning rates for a small GPT; not tuned (a sweep will replace them):

==========  ======  =========  ===========================================================
name        lr      scalar lr  why
==========  ======  =========  ===========================================================
dobb        1e-3    1e-3       update RMS is 0.2 lr, as AdamW's, so AdamW rates transfer
dobb2s      1e-3    1e-3       two-sided Dobb (``two_sided=True``): the same RMS as Dobb's
muon        0.02    1e-3       Keller's default; lr in spectral norm per update
muonbp      5e-3    1e-3       update RMS 0.2 lr (the paper's RMS matching) = 1e-3, Muon's
                               0.02 / sqrt(d_in) at d_in = 400 (the study's: 128-512)
blockmuon   5e-3    1e-3       MuonBP with ``period=None``: block steps only, as MuonBP
dion        0.02    1e-3       Muon-like scale (sqrt(d_out/d_in) P Qᵀ); reference uses 0.01;
                               randomized Cholesky QR, the paper's distributed form
normuon     5e-3    1e-3       update RMS 0.2 lr (the paper's rescaling), as MuonBP's
dion2       0.02    1e-3       selected rows get Muon's spectral-norm step (sqrt(d_out/d_in)
                               O), so Muon's 0.02; the authors' code uses 0.01
adamw       1e-3    -          betas (0.9, 0.95), as the scalar groups of the others
==========  ======  =========  ===========================================================

Every other hyperparameter is the class default (see each class). Each entry is the one
place for what the rest of the tree needs to know about its optimizer: the settings the
comparisons run it with (``harness_options``), its tuned learning rate (``tuned_lrs``,
read from the study's committed results), what a parallel job hands it
(``distributed_options``), its periodic work (``period_option``, ``periodic_calls``) and
its cost model (``cost_model``: a module of ``bench.model.costs``, named rather than
imported because the benchmarks sit above the library). It also lists small valid
constructor inputs and invalid ones with the expected error, in the spirit of PyTorch's
``optim_db``, so tests can run over the whole registry.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dobb.groups import param_groups
from dobb.optim.base import MatrixOptimizer
from dobb.optim.dion import Dion
from dobb.optim.dion2 import Dion2
from dobb.optim.dobb import Dobb
from dobb.optim.muon import Muon
from dobb.optim.muonbp import MuonBP
from dobb.optim.normuon import NorMuon
from dobb.optim.scalar import SCALAR_ALGORITHMS
from dobb.optim.state_init import AdamW


@dataclass(frozen=True)
class ErrorInput:
    """Constructor overrides that must fail with ``error`` whose message matches ``regex``."""

    overrides: dict[str, Any]
    error: type[Exception]
    regex: str


@dataclass(frozen=True)
class OptimizerEntry:
    """How to build one optimizer, with its starting hyperparameters and test inputs."""

    name: str
    label: str
    """How reports name it in prose (``"two-sided Dobb"``)."""
    cls: type[torch.optim.Optimizer]
    lr: float
    """Starting learning rate for a small GPT (hidden matrices, or all params for AdamW)."""
    scalar_lr: float | None = None
    """Learning rate of the AdamW/Lion group of a matrix optimizer; None for AdamW itself."""
    hyperparameters: dict[str, Any] = field(default_factory=dict)
    """Constructor arguments other than ``lr`` that differ from the class defaults."""
    small_inputs: tuple[dict[str, Any], ...] = ({},)
    """Valid constructor overrides, small enough for CPU tests."""
    error_inputs: tuple[ErrorInput, ...] = ()
    """Invalid constructor overrides and the error each must raise."""
    splits_columns: bool = True
    """Runs on matrices split along their columns (row-parallel TP); False: rows only."""
    harness_options: dict[str, Any] = field(default_factory=dict)
    """Constructor overrides of the comparisons (``python -m bench compare``, ``python -m bench study``, the
    communication table): the settings compared in the Dobb paper's abstract (Dobb's 16
    blocks, Dion's rank 1/16). Row-blocked optimizers emulate FSDP over 4 ranks in one
    process: MuonBP and BlockMuon tile each matrix's rows as its shards would, Dion2 selects
    rows per such block, two-sided Dobb keeps one row basis per block, with input blocks of
    32 columns (which tile row-parallel TP's column shards over 4 ranks at every width the
    study runs, >= 128)."""
    cost_model: str | None = None
    """Module of its cost model (``bench.model.costs``: state, work, bytes sent in
    ``step()``); None: measured only."""

    @property
    def is_matrix(self) -> bool:
        """True for optimizers built on ``MatrixOptimizer`` (routing, NaN checks, groups)."""
        return issubclass(self.cls, MatrixOptimizer)

    @property
    def needs_statistics(self) -> bool:
        """True if each step needs activation statistics from forward passes (Dobb)."""
        return issubclass(self.cls, Dobb)

    @property
    def period_option(self) -> str | None:
        """The constructor argument setting the period of the optimizer's periodic work
        (Dobb's ``basis_interval``, MuonBP's ``period``); None: every call alike."""
        option = getattr(self.cls, "period_option", None)
        if option is not None and option in self.hyperparameters:
            return option if self.hyperparameters[option] is not None else None
        return option

    @property
    def periodic_calls(self) -> tuple[str, str] | None:
        """Names of the periodic call and of the others (``("refresh", "steady")``);
        None where every call does the same work (BlockMuon: ``period=None``)."""
        return getattr(self.cls, "periodic_calls", None) if self.period_option else None

    def distributed_options(self, data_parallel) -> dict[str, Any]:
        """Constructor arguments for a job whose DDP or FSDP averages the gradients over the
        ranks of ``data_parallel`` (a ProcessGroup or a DeviceMesh of data axes; None: one
        process). The group goes to the argument the class names in its
        ``data_parallel_option`` (``dobb.distributed.groups``); a class that names none,
        or has no such attribute (AdamW), takes nothing."""
        option = getattr(self.cls, "data_parallel_option", None)
        if option is None or data_parallel is None:
            return {}
        return {option: data_parallel}


# Errors every MatrixOptimizer raises (from dobb.optim.base).
MATRIX_ERRORS = (
    ErrorInput({"lr": -1.0}, ValueError, "invalid learning rate"),
    ErrorInput({"weight_decay": -0.1}, ValueError, "invalid weight_decay"),
    ErrorInput({"nonfinite": "ignore"}, ValueError, "nonfinite must be one of"),
)

OPTIMIZERS: dict[str, OptimizerEntry] = {
    entry.name: entry
    for entry in (
        OptimizerEntry(
            name="dobb",
            label="Dobb",
            harness_options={"num_blocks": 16},
            cost_model="bench.model.costs.dobb",
            cls=Dobb,
            lr=1e-3,
            scalar_lr=1e-3,
            small_inputs=(
                {},
                {"num_blocks": 4, "basis_interval": 2},
                {"basis_method": "power_qr", "basis_interval": 1, "nesterov": False},
                {"basis_method": "jacobi", "basis_interval": 2},
                {"update_scale": "muon", "weight_decay": 0.1},
            ),
            error_inputs=MATRIX_ERRORS
            + (
                ErrorInput({"momentum": 1.0}, ValueError, "invalid momentum"),
                ErrorInput({"num_blocks": 0}, ValueError, "invalid num_blocks"),
                ErrorInput({"update_scale": "huge"}, ValueError, "invalid update_scale"),
                ErrorInput({"basis_method": "svd"}, ValueError, "invalid basis_method"),
            ),
        ),
        OptimizerEntry(
            name="dobb2s",
            label="two-sided Dobb",
            harness_options={"row_blocks": 4, "block_size": 32},
            cost_model="bench.model.costs.dobb",
            cls=Dobb,
            lr=1e-3,
            scalar_lr=1e-3,
            hyperparameters={"two_sided": True},
            small_inputs=(
                {},
                {"row_blocks": 2, "block_size": 4, "basis_interval": 2},
                {"coefficients": "adam", "update_scale": 1.0, "row_stats": "outputs"},
            ),
            error_inputs=MATRIX_ERRORS
            + (
                ErrorInput({"row_blocks": 0}, ValueError, "invalid row_blocks"),
                ErrorInput({"row_stats": "weights"}, ValueError, "invalid row_stats"),
                ErrorInput({"coefficients": "lion"}, ValueError, "invalid coefficients"),
            ),
        ),
        OptimizerEntry(
            name="dion",
            label="Dion",
            harness_options={"rank_fraction": 1 / 16},
            cost_model="bench.model.costs.dion",
            cls=Dion,
            lr=0.02,
            scalar_lr=1e-3,
            hyperparameters={"orthogonalize": "cholesky_qr"},  # the paper's form at scale
            small_inputs=(
                {},
                {"rank": 4, "mu": 1.0},
                {"orthogonalize": "cholesky_qr", "rank_fraction": 0.5, "weight_decay": 0.0},
            ),
            error_inputs=MATRIX_ERRORS
            + (
                ErrorInput({"mu": 1.5}, ValueError, "invalid mu"),
                ErrorInput({"rank_fraction": 0.0}, ValueError, "invalid rank_fraction"),
                ErrorInput({"rank": 0}, ValueError, "invalid rank"),
                ErrorInput({"orthogonalize": "svd"}, ValueError, "invalid orthogonalize"),
            ),
        ),
        OptimizerEntry(
            name="muon",
            label="Muon",
            cost_model="bench.model.costs.muon",
            cls=Muon,
            lr=0.02,
            scalar_lr=1e-3,
            small_inputs=(
                {},
                {"ns_dtype": torch.float32, "nesterov": False},
                {"adjust_lr": "match_rms_adamw", "weight_decay": 0.1},
            ),
            error_inputs=MATRIX_ERRORS
            + (
                ErrorInput({"momentum": 1.0}, ValueError, "invalid momentum"),
                ErrorInput({"ns_steps": 0}, ValueError, "invalid ns_steps"),
                ErrorInput({"ns_dtype": torch.int32}, ValueError, "invalid ns_dtype"),
                ErrorInput({"adjust_lr": "sqrt"}, ValueError, "invalid adjust_lr"),
            ),
        ),
        OptimizerEntry(
            name="muonbp",
            label="MuonBP",
            harness_options={"row_blocks": 4},
            cost_model="bench.model.costs.muonbp",
            cls=MuonBP,
            lr=5e-3,
            scalar_lr=1e-3,
            small_inputs=(
                {},
                {"row_blocks": 2, "period": 2, "block_lr_ratio": 0.5},
                {"col_blocks": (2, 2), "period": None, "ns_dtype": torch.float32},
                {"adjust_lr": "spectral", "row_blocks": 4, "period": 1, "weight_decay": 0.1},
            ),
            error_inputs=MATRIX_ERRORS
            + (
                ErrorInput({"momentum": 1.0}, ValueError, "invalid momentum"),
                ErrorInput({"period": 0}, ValueError, "invalid period"),
                ErrorInput({"block_lr_ratio": -1.0}, ValueError, "invalid block_lr_ratio"),
                ErrorInput({"row_blocks": 0}, ValueError, "invalid row_blocks"),
                ErrorInput({"col_blocks": (2, 0)}, ValueError, "invalid col_blocks"),
            ),
        ),
        OptimizerEntry(
            name="blockmuon",
            label="BlockMuon",
            harness_options={"row_blocks": 4},
            cost_model="bench.model.costs.muonbp",
            cls=MuonBP,
            lr=5e-3,
            scalar_lr=1e-3,
            hyperparameters={"period": None},  # no full steps: shard-local only
            small_inputs=({}, {"row_blocks": 2, "col_blocks": 2}),
            error_inputs=MATRIX_ERRORS
            + (ErrorInput({"row_blocks": 0}, ValueError, "invalid row_blocks"),),
        ),
        OptimizerEntry(
            name="normuon",
            label="NorMuon",
            cost_model="bench.model.costs.normuon",
            splits_columns=False,  # normalizes or selects whole rows
            cls=NorMuon,
            lr=5e-3,
            scalar_lr=1e-3,
            small_inputs=(
                {},
                {"ns_dtype": torch.float32, "nesterov": True},
                {"beta2": 0.0, "eps": 1e-10, "weight_decay": 0.1},
            ),
            error_inputs=MATRIX_ERRORS
            + (
                ErrorInput({"momentum": 1.0}, ValueError, "invalid momentum"),
                ErrorInput({"beta2": -0.1}, ValueError, "invalid beta2"),
                ErrorInput({"eps": 0.0}, ValueError, "invalid eps"),
                ErrorInput({"ns_steps": 0}, ValueError, "invalid ns_steps"),
                ErrorInput({"ns_dtype": torch.int32}, ValueError, "invalid ns_dtype"),
            ),
        ),
        OptimizerEntry(
            name="dion2",
            label="Dion2",
            harness_options={"row_blocks": 4},
            cost_model="bench.model.costs.dion2",
            splits_columns=False,  # normalizes or selects whole rows
            cls=Dion2,
            lr=0.02,
            scalar_lr=1e-3,
            small_inputs=(
                {},
                {"fraction": 1.0, "ef_decay": 0.0, "ns_dtype": torch.float32},
                {"fraction": 0.1, "row_blocks": (2, 2), "weight_decay": 0.0},
            ),
            error_inputs=MATRIX_ERRORS
            + (
                ErrorInput({"fraction": 0.0}, ValueError, "invalid fraction"),
                ErrorInput({"ef_decay": 1.5}, ValueError, "invalid ef_decay"),
                ErrorInput({"row_blocks": 0}, ValueError, "invalid row_blocks"),
                ErrorInput({"ns_steps": 0}, ValueError, "invalid ns_steps"),
            ),
        ),
        OptimizerEntry(
            name="adamw",
            label="AdamW",
            cost_model="bench.model.costs.adamw",
            cls=AdamW,
            lr=1e-3,
            hyperparameters={"betas": (0.9, 0.95)},
            small_inputs=({}, {"weight_decay": 0.1}),
            error_inputs=(
                ErrorInput({"lr": -1.0}, ValueError, "Invalid learning rate"),
                ErrorInput({"betas": (1.0, 0.95)}, ValueError, "Invalid beta parameter at index 0"),
            ),
        ),
    )
}


# `python -m bench study` writes its tuned learning rates here (a source checkout; absent from a wheel).
STUDY_RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "study" / "study.json"


def tuned_lrs(path: Path = STUDY_RESULTS) -> dict[str, float]:
    """Best hidden-matrix learning rate of each optimizer in the committed study (section
    (a) of ``benchmarks/STUDY.md``); empty if the file is missing."""
    try:
        return dict(json.loads(Path(path).read_text())["best_lr"])
    except FileNotFoundError:
        return {}


def get_entry(name: str) -> OptimizerEntry:
    """The registry entry called ``name``; ``ValueError`` listing the known names if none."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {sorted(OPTIMIZERS)}")
    return OPTIMIZERS[name]


def build_optimizer(
    name: str,
    model: nn.Module,
    lr: float | None = None,
    *,
    scalar_lr: float | None = None,
    scalar_algorithm: str = "adamw",
    **overrides: Any,
) -> torch.optim.Optimizer:
    """Build optimizer ``name`` for ``model`` (and hook Dobb's statistics to it).

    Args:
        lr: learning rate of the hidden matrices (of all parameters for ``"adamw"``);
            default: the entry's starting value.
        scalar_lr / scalar_algorithm: learning rate and algorithm (``"adamw"`` or
            ``"lion"``) of the group holding embeddings, head, norms and biases.
        overrides: further constructor arguments, e.g. ``rank_fraction=0.25`` for Dion.
    """
    entry = get_entry(name)
    kwargs = {"lr": entry.lr if lr is None else lr, **entry.hyperparameters, **overrides}
    if not entry.is_matrix:
        if scalar_lr is not None or scalar_algorithm != "adamw":
            raise ValueError(
                f"{name!r} has no separate scalar group; drop scalar_lr/scalar_algorithm"
            )
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        return entry.cls(params, **kwargs)
    if scalar_algorithm not in SCALAR_ALGORITHMS:
        raise ValueError(
            f"scalar_algorithm must be one of {SCALAR_ALGORITHMS}, got {scalar_algorithm!r}"
        )
    groups = param_groups(
        model,
        entry.cls.algorithm,
        scalar_algorithm=scalar_algorithm,
        scalar_options={"lr": entry.scalar_lr if scalar_lr is None else scalar_lr},
    )
    optimizer = entry.cls(groups, **kwargs)
    if entry.needs_statistics and kwargs.get("basis_source", "activations") == "activations":
        optimizer.track(model)
    return optimizer
