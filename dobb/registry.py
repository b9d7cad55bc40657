"""Build any optimizer by name: the library's registry of optimizers and their defaults.

``build_optimizer("dion", model)`` routes the model's hidden ``nn.Linear`` weights to the
matrix optimizer and everything else (embeddings, LM head, norms, biases) to an AdamW (or
Lion) group of the same optimizer object, through ``dobb.param_groups``; ``"adamw"`` is
``dobb.optim.state_init.AdamW`` (``torch.optim.AdamW`` that counts no step for DCP's
state-initialising call) over every parameter, in the same two groups (one lr; the scalar
group's weight decay is ``scalar_weight_decay`` there too). Dobb is also hooked to the
model (``opt.track(model)``), so each step needs a forward pass in training mode before it.

An entry holds what building the optimizer needs: its class (whose ``Config`` holds every
default), the settings of a named variant (``dobb_paper``: Dobb as the paper specifies it;
``dobb_sign``: two-sided Dobb with the sign; ``blockmuon``'s ``period``, ``adamw``'s betas),
and the argument that takes a job's data-parallel ranks (``distributed_options``). Its
learning rate by model width is ``TUNED_LR``'s (``recommended_lr``; rendered in
docs/baselines.md, "The registry's learning rates"). What the benchmarks know of an
optimizer (labels, harness settings, cost models) lives in the lab's own table
(``bench/optimizers.py`` in the repository), and test inputs in the tests' ``optim_db``.
"""

import inspect
import math
import warnings
from dataclasses import dataclass, field
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
from dobb.optim.nordion2 import NorDion2
from dobb.optim.normuon import NorMuon
from dobb.optim.scalar import SCALAR_ALGORITHMS, SCALAR_DEFAULTS
from dobb.optim.state_init import AdamW
from dobb.stats import layer_weights

SCALAR_LR = SCALAR_DEFAULTS["adamw"]["lr"]  # the AdamW/Lion group's, every matrix optimizer
# Dobb as the paper specifies it: input blocks only (16 per matrix), the sign, statistics
# averaged on refresh steps only (the amortized form its call times assume)
PAPER_DOBB = {
    "two_sided": False,
    "num_blocks": 16,
    "coefficients": "sign",
    "stats_sync": "refresh",
    "lr": 2e-3,
}
# The recommended hidden-matrix learning rate of each entry (all parameters for AdamW), by
# model width (n_embd): its tuned lr on the lab's GPT (4 layers, 409,600 tokens per run,
# benchmarks/STUDY.md (f); Dion2's from (a), at width 128 only), for the configuration the
# entry builds. One table: ``build_optimizer``, ``dobb train``, the docs and the examples
# read it (``recommended_lr``), each class's default lr is its value at width 256, and a test
# holds it to the study's JSON. Where an lr halves with the width, wider models want less.
TUNED_LR: dict[str, dict[int, float]] = {
    "dobb": {128: 8e-3, 256: 4e-3, 512: 8e-3},  # with its width rule (update_scale="width")
    "dobb_paper": {128: 2e-3, 256: 2e-3},
    "dobb_sign": {128: 8e-3, 256: 8e-3, 512: 4e-3},
    "dion": {128: 1e-2, 256: 1e-2},
    "muon": {128: 2e-2, 256: 2e-2, 512: 2e-2},
    "muonbp": {128: 5e-3, 256: 5e-3},
    "blockmuon": {128: 5e-3, 256: 5e-3, 512: 2.5e-3},
    "normuon": {128: 1e-2, 256: 5e-3},
    "dion2": {128: 2e-2},
    "nordion2": {128: 2e-2, 256: 2e-2, 512: 2e-2},
    "adamw": {128: 2e-3, 256: 1e-3},
}


# Entries renamed before the first release, old -> new: the old names are refused with the
# new one (``get_entry``), and the lab maps them on loading its earlier records
RENAMED = {"dobb2s": "dobb_sign"}


@dataclass(frozen=True)
class OptimizerEntry:
    """How to build one optimizer: its class, whose config holds every default, and the
    settings that make this entry a named variant of it."""

    name: str
    cls: type[torch.optim.Optimizer]
    hyperparameters: dict[str, Any] = field(default_factory=dict)
    """Constructor arguments that make this entry a named variant (``dobb_sign``: two-sided
    Dobb); every other option, ``lr`` included, is the class's default."""

    @property
    def lr(self) -> float:
        """Starting learning rate for a small GPT (hidden matrices, or all parameters for
        AdamW): the entry's, else the class's default."""
        if "lr" in self.hyperparameters:
            return self.hyperparameters["lr"]
        config = getattr(self.cls, "Config", None)
        if config is not None:
            return config.lr
        return inspect.signature(self.cls).parameters["lr"].default

    @property
    def scalar_lr(self) -> float | None:
        """Learning rate of a matrix optimizer's AdamW/Lion group; None for AdamW itself."""
        return SCALAR_LR if self.is_matrix else None

    @property
    def is_matrix(self) -> bool:
        """True for optimizers built on ``MatrixOptimizer`` (routing, NaN checks, groups)."""
        return issubclass(self.cls, MatrixOptimizer)

    @property
    def needs_statistics(self) -> bool:
        """True if each step needs activation statistics from forward passes (Dobb)."""
        return issubclass(self.cls, Dobb)

    def settings(self, options: dict[str, Any] | None = None) -> dict[str, Any]:
        """What this entry builds beyond its class's defaults, the lr aside: its class's name
        and its hyperparameters with ``options`` on top. Run logs record it
        (``optimizer_settings``), so a log keeps saying what trained after an entry's meaning
        changes (``dobb``'s did: the paper's configuration, then the recommended one)."""
        named = {k: v for k, v in self.hyperparameters.items() if k != "lr"}
        return {"class": self.cls.__name__, "options": named | dict(options or {})}

    def distributed_options(self, data_parallel) -> dict[str, Any]:
        """Constructor arguments for a job whose DDP or FSDP averages the gradients over
        ``data_parallel`` (a ProcessGroup or a mesh of data axes; None: one process): the
        group, under the class's ``data_parallel_option`` name, if it has one."""
        option = getattr(self.cls, "data_parallel_option", None)
        return {} if option is None or data_parallel is None else {option: data_parallel}


OPTIMIZERS: dict[str, OptimizerEntry] = {
    entry.name: entry
    for entry in (
        OptimizerEntry("dobb", Dobb),  # the recommended configuration: the class's defaults
        OptimizerEntry("dobb_paper", Dobb, PAPER_DOBB),
        OptimizerEntry("dobb_sign", Dobb, {"two_sided": True, "coefficients": "sign", "lr": 8e-3}),
        OptimizerEntry("dion", Dion),
        OptimizerEntry("muon", Muon),
        OptimizerEntry("muonbp", MuonBP),
        OptimizerEntry("blockmuon", MuonBP, {"period": None}),  # no full steps: shard-local
        OptimizerEntry("normuon", NorMuon),
        OptimizerEntry("dion2", Dion2),
        OptimizerEntry("nordion2", NorDion2),
        OptimizerEntry("adamw", AdamW, {"betas": (0.9, 0.95)}),
    )
}


def recommended_lr(name: str, width: int = 256) -> float:
    """Entry ``name``'s recommended lr for a model of width (``n_embd``) ``width``: its
    ``TUNED_LR`` at the nearest tuned width (by ratio: 200 takes 256's), else the entry's
    starting lr.

    The evidence ends at the table's widest width. Beyond it the rule is the same (the
    widest width's lr, unchanged), though the trend may change: a ``UserWarning``, once per
    entry, says so and lists the widths tuned. Narrower models than the narrowest take the
    narrowest's lr, silently. The recommended Dobb scales its update by 256/width
    (``update_scale="width"``), so one lr serves it from width 128 to 512: STUDY.md (f)
    gives what its default lr costs against the tuned one at each width."""
    tuned = TUNED_LR.get(get_entry(name).name)
    if not tuned:
        return get_entry(name).lr
    widest = max(tuned)
    if width > widest and name not in _WARNED_BEYOND:
        _WARNED_BEYOND.add(name)
        warnings.warn(
            f"recommended_lr({name!r}, {width}): {name}'s lr is tuned at widths "
            f"{sorted(tuned)} only; width {width} takes width {widest}'s, {tuned[widest]:g}, "
            "which may be too large there; tune it, or pass lr= yourself",
            UserWarning,
            stacklevel=2,
        )
    nearest = min(tuned, key=lambda w: (abs(math.log(w / width)), -w))
    return tuned[nearest]


_WARNED_BEYOND: set[str] = set()  # the entries recommended_lr has warned of once


def model_width(model: nn.Module) -> int | None:
    """The width of ``model`` as the study measures it: the narrowest input of its hidden
    matrices (``n_embd`` of a GPT); None if it has none."""
    widths = [w.shape[spec.input_dim] for _, w, spec in layer_weights(model)]
    return min(widths) if widths else None


def get_entry(name: str) -> OptimizerEntry:
    """The registry entry called ``name``; ``ValueError`` listing the known names if none,
    or giving the new name of a renamed entry (``RENAMED``)."""
    if name in RENAMED:
        raise ValueError(f"optimizer {name!r} is now called {RENAMED[name]!r}")
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
    scalar_weight_decay: float = 0.0,
    experts: str | None = None,
    **overrides: Any,
) -> torch.optim.Optimizer:
    """Build optimizer ``name`` for ``model`` (and hook Dobb's statistics to it).

    Args:
        lr: learning rate of the hidden matrices (of all parameters for ``"adamw"``);
            default: ``recommended_lr`` at the model's width (``model_width``).
        scalar_lr / scalar_algorithm: learning rate and algorithm (``"adamw"`` or
            ``"lion"``) of the group holding embeddings, head, norms and biases.
        scalar_weight_decay: decoupled weight decay of that group (default none), for
            every optimizer alike; ``weight_decay=`` (an override) is the hidden matrices'.
            For ``"adamw"`` the same two groups are made, so its scalars follow this too.
        experts: regex of a mixture of experts' ``(E, d_out, d_in)`` stacks, stepped with
            the hidden matrices (``dobb.param_groups``; Dobb's statistics per expert need
            their module registered: ``dobb.stats.register_experts``); None: every 3-D
            parameter with the scalars.
        overrides: further constructor arguments, e.g. ``rank_fraction=0.25`` for Dion.
    """
    entry = get_entry(name)
    if lr is None:
        width = model_width(model)
        lr = entry.lr if width is None else recommended_lr(name, width)
    kwargs = {**entry.hyperparameters, "lr": lr, **overrides}
    if not scalar_weight_decay >= 0:
        raise ValueError(f"scalar_weight_decay must be >= 0, got {scalar_weight_decay!r}")
    decay = {"weight_decay": scalar_weight_decay}
    if not entry.is_matrix:
        if scalar_lr is not None or scalar_algorithm != "adamw":
            raise ValueError(
                f"{name!r} has one learning rate for every parameter; drop "
                "scalar_lr/scalar_algorithm (scalar_weight_decay applies)"
            )
        groups = param_groups(model, scalar_options=decay, experts=experts)
        return entry.cls([without_algorithm(g) for g in groups], **kwargs)
    if scalar_algorithm not in SCALAR_ALGORITHMS:
        raise ValueError(
            f"scalar_algorithm must be one of {SCALAR_ALGORITHMS}, got {scalar_algorithm!r}"
        )
    groups = param_groups(
        model,
        entry.cls.algorithm,
        scalar_algorithm=scalar_algorithm,
        scalar_options={"lr": entry.scalar_lr if scalar_lr is None else scalar_lr, **decay},
        experts=experts,
    )
    optimizer = entry.cls(groups, **kwargs)
    if entry.needs_statistics and kwargs.get("basis_source", "activations") == "activations":
        optimizer.track(model)
    return optimizer


def without_algorithm(group: dict[str, Any]) -> dict[str, Any]:
    """A ``param_groups`` group for a torch optimizer, which has no ``algorithm`` key."""
    return {key: value for key, value in group.items() if key != "algorithm"}
