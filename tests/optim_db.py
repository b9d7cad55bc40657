"""Test inputs for every registry optimizer, in the spirit of torch's ``optim_db``.

``SMALL_INPUTS[name]``: valid constructor overrides, small enough for CPU tests;
``ERROR_INPUTS[name]``: invalid overrides and the error each must raise (with a message
regex); ``FOREACH``: the two paths every entry has, which a test chooses per case
(``over_foreach``). Tests run over ``dobb.registry.OPTIMIZERS`` and look their inputs
up here; ``test_every_entry_has_inputs`` keeps the two in step.
"""

from dataclasses import dataclass
from typing import Any

import pytest
import torch


@dataclass(frozen=True)
class ErrorInput:
    """Constructor overrides that must fail with ``error`` whose message matches ``regex``."""

    overrides: dict[str, Any]
    error: type[Exception]
    regex: str


FOREACH = {False: "per-matrix", True: "batched"}
"""``foreach`` of every entry (torch's own for ``"adamw"``), with its test id: ``False``
updates matrix by matrix (the default on the CPU, and the readable reference), ``True``
stacks same-shape matrices into shared kernels (the default off the CPU). Both run on the
CPU; a test passes one explicitly, never the device's default: a cheap test runs both, an
expensive one names the path it runs, and ``test_small_inputs_train`` holds the two equal."""


def over_foreach(cases: list, paths: tuple[bool, ...] = tuple(FOREACH)) -> list:
    """Each of ``cases`` (``pytest.param``) once per ``foreach`` in ``paths``: the flag as
    its last value, ``-per-matrix`` or ``-batched`` at the end of its id."""
    return [
        pytest.param(*case.values, foreach, id=f"{case.id}-{FOREACH[foreach]}")
        for case in cases
        for foreach in paths
    ]


# Errors every MatrixOptimizer raises (from dobb.optim.base).
MATRIX_ERRORS = (
    ErrorInput({"lr": -1.0}, ValueError, "invalid learning rate"),
    ErrorInput({"weight_decay": -0.1}, ValueError, "invalid weight_decay"),
    ErrorInput({"nonfinite": "ignore"}, ValueError, "nonfinite must be one of"),
)

SMALL_INPUTS: dict[str, tuple[dict[str, Any], ...]] = {
    "dobb": (
        {},
        {"num_blocks": 4, "basis_interval": 2},
        {"basis_method": "power_qr", "basis_interval": 1, "nesterov": False},
        {"basis_method": "jacobi", "basis_interval": 2},
        {"update_scale": "muon", "weight_decay": 0.1},
        {"projection_dtype": "bfloat16"},
    ),
    "dobb_paper": (
        {},
        {"num_blocks": 3, "basis_interval": 2, "stats_sync": "step"},
        {"block_size": 4, "num_blocks": None, "update_scale": 1.0},
    ),
    "dobb_sign": (
        {},
        {"row_blocks": 2, "block_size": 4, "basis_interval": 2},
        {"coefficients": "adam", "update_scale": 1.0, "row_stats": "outputs"},
        {"coefficients": "adam", "row_blocks": 2, "projection_dtype": "bfloat16"},
    ),
    "dion": (
        {},
        {"rank": 4, "momentum": 1.0},
        {"orthogonalize": "cholesky_qr", "rank_fraction": 0.5, "weight_decay": 0.0},
    ),
    "muon": (
        {},
        {"ns_dtype": torch.float32, "nesterov": False},
        {"update_scale": "adamw", "weight_decay": 0.1},
        {"ns_coefficients": "polar_express", "ns_steps": 7},
    ),
    "muonbp": (
        {},
        {"row_blocks": 2, "period": 2, "block_lr_ratio": 0.5},
        {"col_blocks": (2, 2), "period": None, "ns_dtype": torch.float32},
        {"update_scale": "spectral", "row_blocks": 4, "period": 1, "weight_decay": 0.1},
        {"ns_coefficients": "polar_express", "row_blocks": 2, "period": 2},
    ),
    "blockmuon": ({}, {"row_blocks": 2, "col_blocks": 2}),
    "normuon": (
        {},
        {"ns_dtype": torch.float32, "nesterov": True},
        {"beta2": 0.0, "eps": 1e-10, "weight_decay": 0.1},
        {"ns_coefficients": "polar_express"},
    ),
    "dion2": (
        {},
        {"row_fraction": 1.0, "ef_decay": 0.0, "ns_dtype": torch.float32},
        {"row_fraction": 0.1, "row_blocks": (2, 2), "weight_decay": 0.0},
        {"ns_coefficients": "polar_express"},
    ),
    "nordion2": (
        {},
        {"row_fraction": 1.0, "ef_decay": 0.0, "ns_dtype": torch.float32, "beta2": 0.0},
        {"row_fraction": 0.1, "row_blocks": (2, 2), "eps": 1e-10, "ns_coefficients": "quintic"},
    ),
    "adamw": ({}, {"weight_decay": 0.1}),
}

ERROR_INPUTS: dict[str, tuple[ErrorInput, ...]] = {
    "dobb": MATRIX_ERRORS
    + (
        ErrorInput({"momentum": 1.0}, ValueError, "invalid momentum"),
        ErrorInput({"num_blocks": 0}, ValueError, "invalid num_blocks"),
        ErrorInput({"update_scale": "huge"}, ValueError, "invalid update_scale"),
        ErrorInput({"basis_method": "svd"}, ValueError, "invalid basis_method"),
        ErrorInput({"projection_dtype": "int8"}, ValueError, "invalid projection_dtype"),
        ErrorInput({"num_blocks": 4, "block_size": 4}, ValueError, "not both"),
        ErrorInput({"row_block_size": 0}, ValueError, "invalid row_block_size"),
    ),
    "dobb_paper": MATRIX_ERRORS
    + (
        ErrorInput({"row_blocks": 2}, ValueError, "options of two-sided Dobb"),
        ErrorInput({"stats_sync": "never"}, ValueError, "invalid stats_sync"),
    ),
    "dobb_sign": MATRIX_ERRORS
    + (
        ErrorInput({"row_blocks": 0}, ValueError, "invalid row_blocks"),
        ErrorInput({"row_stats": "weights"}, ValueError, "invalid row_stats"),
        ErrorInput({"coefficients": "lion"}, ValueError, "invalid coefficients"),
    ),
    "dion": MATRIX_ERRORS
    + (
        ErrorInput({"momentum": 1.5}, ValueError, "invalid momentum"),
        ErrorInput({"rank_fraction": 0.0}, ValueError, "invalid rank_fraction"),
        ErrorInput({"rank": 0}, ValueError, "invalid rank"),
        ErrorInput({"orthogonalize": "svd"}, ValueError, "invalid orthogonalize"),
    ),
    "muon": MATRIX_ERRORS
    + (
        ErrorInput({"momentum": 1.0}, ValueError, "invalid momentum"),
        ErrorInput({"ns_steps": 0}, ValueError, "invalid ns_steps"),
        ErrorInput({"ns_dtype": torch.int32}, ValueError, "invalid ns_dtype"),
        ErrorInput({"update_scale": "sqrt"}, ValueError, "invalid update_scale"),
        ErrorInput({"ns_coefficients": "Polar Express"}, ValueError, "invalid ns_coefficients"),
    ),
    "muonbp": MATRIX_ERRORS
    + (
        ErrorInput({"momentum": 1.0}, ValueError, "invalid momentum"),
        ErrorInput({"period": 0}, ValueError, "invalid period"),
        ErrorInput({"block_lr_ratio": -1.0}, ValueError, "invalid block_lr_ratio"),
        ErrorInput({"row_blocks": 0}, ValueError, "invalid row_blocks"),
        ErrorInput({"col_blocks": (2, 0)}, ValueError, "invalid col_blocks"),
    ),
    "blockmuon": MATRIX_ERRORS + (ErrorInput({"row_blocks": 0}, ValueError, "invalid row_blocks"),),
    "normuon": MATRIX_ERRORS
    + (
        ErrorInput({"momentum": 1.0}, ValueError, "invalid momentum"),
        ErrorInput({"beta2": -0.1}, ValueError, "invalid beta2"),
        ErrorInput({"eps": 0.0}, ValueError, "invalid eps"),
        ErrorInput({"ns_steps": 0}, ValueError, "invalid ns_steps"),
        ErrorInput({"ns_dtype": torch.int32}, ValueError, "invalid ns_dtype"),
    ),
    "dion2": MATRIX_ERRORS
    + (
        ErrorInput({"row_fraction": 0.0}, ValueError, "invalid row_fraction"),
        ErrorInput({"ef_decay": 1.5}, ValueError, "invalid ef_decay"),
        ErrorInput({"row_blocks": 0}, ValueError, "invalid row_blocks"),
        ErrorInput({"ns_steps": 0}, ValueError, "invalid ns_steps"),
        ErrorInput({"ns_coefficients": "cubic"}, ValueError, "invalid ns_coefficients"),
    ),
    "nordion2": MATRIX_ERRORS
    + (
        ErrorInput({"row_fraction": 1.5}, ValueError, "invalid row_fraction"),
        ErrorInput({"ef_decay": -0.5}, ValueError, "invalid ef_decay"),
        ErrorInput({"beta2": 1.0}, ValueError, "invalid beta2"),
        ErrorInput({"eps": 0.0}, ValueError, "invalid eps"),
        ErrorInput({"row_blocks": (2, 0)}, ValueError, "invalid row_blocks"),
        ErrorInput({"ns_coefficients": "cubic"}, ValueError, "invalid ns_coefficients"),
    ),
    "adamw": (
        ErrorInput({"lr": -1.0}, ValueError, "Invalid learning rate"),
        ErrorInput({"betas": (1.0, 0.95)}, ValueError, "Invalid beta parameter at index 0"),
    ),
}
