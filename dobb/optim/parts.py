"""The contract between the driver (``dobb.optim.base``) and the parts it drives.

The records a step passes around (``Matrix``, ``Batch``, ``Step``), the two interfaces
(``Core``: the maths; ``Placement``: where matrices are stepped and what they communicate)
and ``Local``, the placement that communicates nothing. What each method must do, and the
order the driver calls them in: ``dobb.optim.base``'s docstring.
"""

from typing import Any, NamedTuple

import torch
from torch import Tensor

from dobb._dtensor import local
from dobb.optim.batching import group_by

COUNTERS = ("step", "stats_steps")  # CPU scalars (read for free), device ones if capturable
Group = dict[str, Any]


def state_dtype(param: Tensor) -> torch.dtype:
    """fp32, or the parameter's dtype where that is wider (fp64 params keep fp64 state)."""
    return torch.promote_types(param.dtype, torch.float32)


class Matrix(NamedTuple):
    """A matrix with a gradient in a step: what the placements claim and step."""

    param: Tensor
    """As the model holds it (a DTensor under FSDP or TP)."""
    state: dict[str, Any]
    """Its state (DTensors where the parameter is one)."""
    config: Any
    """This step's options of its group (the optimizer's ``Config``)."""
    name: str
    """The parameter's name, equal on every rank (errors, seeds)."""


class Batch(NamedTuple):
    """Matrices of one set of math options as plain local tensors: what a core updates."""

    params: list[Tensor]
    grads: list[Tensor]
    states: list[dict[str, Tensor]]


class Step(NamedTuple):
    """What a placement needs of the step besides its matrices and the core."""

    configs: dict[Tensor, Any]
    """This step's config of every matrix parameter, with a gradient or not."""
    live: Tensor | None
    """Capturable: 1.0 (on the device) if this step's inputs are finite, else 0.0; None
    otherwise."""


def local_state(state: dict[str, Any]) -> dict[str, Any]:
    """A state dict with the rank-local tensor of each DTensor."""
    return {key: local(value) for key, value in state.items()}


def local_batch(matrices: list[Matrix]) -> Batch:
    """The rank-local pieces of the params, gradients and states of ``matrices``."""
    return Batch(
        [local(m.param) for m in matrices],
        [local(m.param.grad) for m in matrices],
        [local_state(m.state) for m in matrices],
    )


def partition(matrices: list[Matrix], mine: list[bool]) -> tuple[list[Matrix], list[Matrix]]:
    """A placement's claim: the matrices flagged ``mine``, and the rest, each in order."""
    return [m for m, f in zip(matrices, mine) if f], [m for m, f in zip(matrices, mine) if not f]


class Core:
    """An algorithm's maths (the module docstring): ``init_state`` and ``updates``."""

    def init_state(self, param: Tensor, config, name: str) -> dict[str, Any]:
        """A matrix's state, placed as ``param`` (a DTensor's is a DTensor)."""
        raise NotImplementedError

    def updates(self, batch: Batch, config) -> None:
        """The whole update, in place, of ``batch``: matrices no other rank shares, of one
        set of math options (``config``'s), stacked by shape where ``config.batched``."""
        raise NotImplementedError


class Placement:
    """Where matrices are stepped and what they communicate (the module docstring): this
    base claims every matrix and keeps no state of its own."""

    def init_state(self, param: Tensor, config, name: str) -> dict[str, Any]:
        """State beside the core's (none here)."""
        return {}

    def claim(self, matrices: list[Matrix]) -> tuple[list[Matrix], list[Matrix]]:
        """``matrices`` split into the ones this placement steps and the rest."""
        return matrices, []

    def step(self, matrices: list[Matrix], core: Core, step: Step) -> None:
        """One step of the claimed ``matrices`` (with their gradients)."""
        raise NotImplementedError


class Local(Placement):
    """The placement of matrices no other rank shares, and the last of most optimizers':
    it claims what the others left and runs ``core.updates`` once per set of math options
    and device (``config.math_key()``); no communication."""

    def step(self, matrices: list[Matrix], core: Core, step: Step) -> None:
        by_options = group_by(matrices, lambda m: (m.config.math_key(), local(m.param).device))
        for indices in by_options.values():
            mine = [matrices[i] for i in indices]
            core.updates(local_batch(mine), mine[0].config)
