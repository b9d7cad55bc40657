"""Cost models of the optimizers, one module per optimizer family.

Each module names the registry entries it prices (``ENTRIES``; ``cost_model`` finds it by
name, and the lab's table shows it, ``bench.optimizers.LabEntry.cost_model``) and defines

- ``state_bytes(matrix, **options)``: bytes of optimizer state for one fp32 ``Matrix``,
  and ``state_formula(**options)``: the same per parameter, in words;
- ``work(matrices, *, layout, **options)``: the kernels and collectives of one call
  (``kernels.Work``), priced by ``bench.model.costmodel``;
- ``comm_bytes(opt, matrices, layout, world, step)`` and ``COMM_FORMULA`` (optimizers that
  communicate inside ``step()``): the analytic bytes ``bench.results.comm`` checks against
  what it measures.

Options are named as the constructor's (``num_blocks``, ``rank_fraction``, ``period``), with
its config's defaults, or as the model's (``launches``, ``solver``, ``layout``);
``with_options`` hands each function those it takes, so one dict of a benchmark's settings
serves every optimizer.
"""

import inspect
from types import ModuleType
from typing import Any

from bench.model.costs import adamw, dion, dion2, dobb, muon, muonbp, nordion2, normuon
from dobb.registry import OPTIMIZERS, get_entry

FAMILIES = (dobb, dion, muon, muonbp, normuon, dion2, nordion2, adamw)
MODELS: dict[str, ModuleType] = {
    name: family
    for name in OPTIMIZERS  # the registry's order
    for family in FAMILIES
    if name in family.ENTRIES
}
"""Each priced registry entry's cost module."""


def cost_model(name: str) -> ModuleType:
    """The cost module of registry entry ``name``; ``ValueError`` if it has none (or if
    ``name`` is no entry of the registry)."""
    if name not in MODELS:
        get_entry(name)  # ValueError listing the known names
        raise ValueError(f"{name!r} has no cost model; it is measured only")
    return MODELS[name]


def with_options(function, *args, **options: Any):
    """``function(*args, **options)`` with only the options ``function`` has parameters
    for (a benchmark's settings for other optimizers are not this one's)."""
    accepted = inspect.signature(function).parameters
    return function(*args, **{k: v for k, v in options.items() if k in accepted})


def entry_options(name: str, **options: Any) -> dict[str, Any]:
    """The entry's constructor hyperparameters (e.g. BlockMuon's ``period=None``, two-sided
    Dobb's ``two_sided=True``) under ``options``."""
    return {**get_entry(name).hyperparameters, **options}
