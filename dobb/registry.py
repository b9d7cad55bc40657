"""Build any optimizer by name: the library's registry of optimizers and their defaults.

``build_optimizer("dion", model)`` routes the model's hidden ``nn.Linear`` weights to the
matrix optimizer and everything else (embeddings, LM head, norms, biases) to an AdamW (or
Lion) group of the same optimizer object, through ``dobb.param_groups``; ``"adamw"`` is
``dobb.optim.state_init.AdamW`` (``torch.optim.AdamW`` that counts no step for DCP's
state-initialising call) over every parameter, in the same two groups (one lr; the scalar
group's weight decay is ``scalar_weight_decay`` there too). Dobb is also hooked to the
model (``opt.track(model)``), so each step needs a forward pass in training mode before it.

An entry holds what building the optimizer needs: its class (whose ``Config`` holds every
default, the starting lr included, so class and registry cannot differ), the settings of a
named variant (``dobb2s``'s ``two_sided``, ``blockmuon``'s ``period``, ``adamw``'s betas),
and the argument that takes a job's data-parallel ranks (``distributed_options``). Each
entry's starting learning rates, and why: docs/baselines.md, "The registry's starting
learning rates" (a test holds that table to ``OPTIMIZERS``). What the benchmarks know of an
optimizer (labels, harness settings, cost models, tuned rates) lives in the lab's own table
(``bench/optimizers.py`` in the repository), and test inputs in the tests' ``optim_db``.
"""

import inspect
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
from dobb.optim.scalar import SCALAR_ALGORITHMS
from dobb.optim.state_init import AdamW

SCALAR_LR = 1e-3  # the AdamW/Lion group's learning rate for every matrix optimizer


@dataclass(frozen=True)
class OptimizerEntry:
    """How to build one optimizer: its class, whose config holds every default, and the
    settings that make this entry a named variant of it."""

    name: str
    cls: type[torch.optim.Optimizer]
    hyperparameters: dict[str, Any] = field(default_factory=dict)
    """Constructor arguments that make this entry a named variant (``dobb2s``: two-sided
    Dobb); every other option, ``lr`` included, is the class's default."""

    @property
    def lr(self) -> float:
        """Starting learning rate for a small GPT (hidden matrices, or all parameters for
        AdamW): the class's default."""
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

    def distributed_options(self, data_parallel) -> dict[str, Any]:
        """Constructor arguments for a job whose DDP or FSDP averages the gradients over
        ``data_parallel`` (a ProcessGroup or a mesh of data axes; None: one process): the
        group, under the class's ``data_parallel_option`` name, if it has one."""
        option = getattr(self.cls, "data_parallel_option", None)
        if option is None or data_parallel is None:
            return {}
        return {option: data_parallel}


OPTIMIZERS: dict[str, OptimizerEntry] = {
    entry.name: entry
    for entry in (
        OptimizerEntry("dobb", Dobb),
        OptimizerEntry("dobb2s", Dobb, {"two_sided": True}),
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
    scalar_weight_decay: float = 0.0,
    **overrides: Any,
) -> torch.optim.Optimizer:
    """Build optimizer ``name`` for ``model`` (and hook Dobb's statistics to it).

    Args:
        lr: learning rate of the hidden matrices (of all parameters for ``"adamw"``);
            default: the entry's starting value.
        scalar_lr / scalar_algorithm: learning rate and algorithm (``"adamw"`` or
            ``"lion"``) of the group holding embeddings, head, norms and biases.
        scalar_weight_decay: decoupled weight decay of that group (default none), for
            every optimizer alike; ``weight_decay=`` (an override) is the hidden matrices'.
            For ``"adamw"`` the same two groups are made, so its scalars follow this too.
        overrides: further constructor arguments, e.g. ``rank_fraction=0.25`` for Dion.
    """
    entry = get_entry(name)
    kwargs = {"lr": entry.lr if lr is None else lr, **entry.hyperparameters, **overrides}
    if not scalar_weight_decay >= 0:
        raise ValueError(f"scalar_weight_decay must be >= 0, got {scalar_weight_decay!r}")
    if not entry.is_matrix:
        if scalar_lr is not None or scalar_algorithm != "adamw":
            raise ValueError(
                f"{name!r} has one learning rate for every parameter; drop "
                "scalar_lr/scalar_algorithm (scalar_weight_decay applies)"
            )
        groups = param_groups(model, scalar_options={"weight_decay": scalar_weight_decay})
        return entry.cls([without_algorithm(g) for g in groups], **kwargs)
    if scalar_algorithm not in SCALAR_ALGORITHMS:
        raise ValueError(
            f"scalar_algorithm must be one of {SCALAR_ALGORITHMS}, got {scalar_algorithm!r}"
        )
    groups = param_groups(
        model,
        entry.cls.algorithm,
        scalar_algorithm=scalar_algorithm,
        scalar_options={
            "lr": entry.scalar_lr if scalar_lr is None else scalar_lr,
            "weight_decay": scalar_weight_decay,
        },
    )
    optimizer = entry.cls(groups, **kwargs)
    if entry.needs_statistics and kwargs.get("basis_source", "activations") == "activations":
        optimizer.track(model)
    return optimizer


def without_algorithm(group: dict[str, Any]) -> dict[str, Any]:
    """A ``param_groups`` group for a torch optimizer, which has no ``algorithm`` key."""
    return {key: value for key, value in group.items() if key != "algorithm"}
