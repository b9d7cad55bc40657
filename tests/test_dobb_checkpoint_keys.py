"""Dobb's state keys name a side and a stack index (``dobb.optim.dobb_layout``), and a
checkpoint written in the keys before them (``cov``, ``cov_tail``, ``row_basis``, ...:
``tests/data/dobb_legacy_checkpoint.pt``, by that commit's code) loads and continues as
the run that wrote it did."""

import importlib.util
from pathlib import Path

import pytest
import torch

from dobb.optim.dobb_layout import LEGACY_KEYS

SPEC = importlib.util.spec_from_file_location(
    "dobb_legacy_checkpoint", Path(__file__).parent / "data" / "dobb_legacy_checkpoint.py"
)
legacy = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(legacy)

# the keys of every matrix's state, as written now (one-sided fc1; two-sided fc2 and fc3)
INPUT = ["input_cov_0", "input_basis_0", "input_cov_1", "input_basis_1"]
ROW = ["row_cov_0", "row_basis_0", "row_cov_1", "row_basis_1"]
KEYS = [
    {"step", "stats_steps", "momentum", *INPUT},
    {"step", "stats_steps", "momentum", *INPUT, *ROW, "variance"},
    {"step", "stats_steps", "momentum", *INPUT, *ROW},
]


@pytest.fixture(scope="module")
def saved():
    return torch.load(legacy.PATH)


def test_the_committed_checkpoint_holds_the_old_keys(saved):
    old = [set(saved["optimizer"]["state"][i]) for i in range(3)]
    assert old[1] >= set(LEGACY_KEYS) and not old[1] & set(LEGACY_KEYS.values())
    assert [{LEGACY_KEYS.get(k, k) for k in keys} for keys in old] == KEYS


def test_a_fresh_run_writes_one_key_per_side_and_stack():
    model, opt = legacy.build()
    legacy.train(model, opt, legacy.batches(1))
    state = opt.state_dict()["state"]
    assert [set(state[i]) for i in range(3)] == KEYS


def test_an_old_checkpoint_loads_into_the_new_keys_and_continues_as_it_did(saved):
    model, opt = legacy.build()
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    params = [p for g in opt.param_groups for p in g["params"]]
    for i, entry in saved["optimizer"]["state"].items():
        state = opt.state[params[i]]
        assert set(state) == {LEGACY_KEYS.get(k, k) for k in entry}
        for key, value in entry.items():
            assert torch.equal(state[LEGACY_KEYS.get(key, key)], value), key
    for batch, expected in zip(saved["batches"], saved["expected"], strict=True):
        legacy.train(model, opt, [batch])  # a steady step, then a basis refresh
        for name, value in model.state_dict().items():
            torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=name)
    assert [set(opt.state_dict()["state"][i]) for i in range(3)] == KEYS
