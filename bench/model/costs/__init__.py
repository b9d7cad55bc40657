"""Cost models of the optimizers, one module per optimizer family.

The lab's table names each optimizer's module (``bench.optimizers.LabEntry.cost_model``).
Each module defines

- ``state_bytes(matrix, **options)``: bytes of optimizer state for one fp32 ``Matrix``,
  and ``state_formula(**options)``: the same per parameter, in words;
- ``work(matrices, *, layout, **options)``: the kernels and collectives of one call
  (``kernels.Work``), priced by ``bench.model.costmodel``;
- ``comm_bytes(opt, matrices, layout, world, step)`` and ``COMM_FORMULA`` (optimizers that
  communicate inside ``step()``): the analytic bytes ``bench.results.comm`` checks against
  what it measures.

Options are named as the constructor's (``num_blocks``, ``rank_fraction``, ``period``) or
as the model's (``launches``, ``solver``, ``layout``); ``with_options`` hands each
function those it takes, so one dict of a benchmark's settings serves every optimizer.
"""

import inspect
from typing import Any

from dobb.registry import get_entry


def with_options(function, *args, **options: Any):
    """``function(*args, **options)`` with only the options ``function`` has parameters
    for (a benchmark's settings for other optimizers are not this one's)."""
    accepted = inspect.signature(function).parameters
    return function(*args, **{k: v for k, v in options.items() if k in accepted})


def entry_options(name: str, **options: Any) -> dict[str, Any]:
    """The entry's constructor hyperparameters (e.g. BlockMuon's ``period=None``, two-sided
    Dobb's ``two_sided=True``) under ``options``."""
    return {**get_entry(name).hyperparameters, **options}
