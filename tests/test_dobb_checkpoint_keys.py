"""Dobb's state keys name a side and a stack index (``dobb.optim.dobb_core``), and a
checkpoint written in the keys before them (``cov``, ``cov_tail``, ``row_basis``, ...:
``tests/data/dobb_legacy_checkpoint.pt``, by that commit's code) loads and continues as
the run that wrote it did."""

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from dobb.optim.dobb import LegacyKeysLoadPlanner, convert_legacy_checkpoint
from dobb.optim.dobb_core import LEGACY_KEYS, OLD_NAMES

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


@pytest.fixture
def saved():
    """The committed checkpoint, read afresh for each test (a loaded optimizer's state may
    share the tensors it was loaded from, which its steps then change)."""
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


def continues_as_it_did(model, opt, saved):
    """Two more steps (a steady one, then a basis refresh) end on the committed parameters,
    bit for bit; the state is then saved in the new keys."""
    for batch, expected in zip(saved["batches"], saved["expected"], strict=True):
        legacy.train(model, opt, [batch])
        for name, value in model.state_dict().items():
            torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=name)
    assert [set(opt.state_dict()["state"][i]) for i in range(3)] == KEYS


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
    continues_as_it_did(model, opt, saved)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_an_old_dcp_checkpoint_loads_through_the_legacy_planner(saved, tmp_path):
    """A DCP checkpoint in the old keys (the committed state saved by DCP, as
    ``dobb.train`` saves) does not load by today's keys; with ``LegacyKeysLoadPlanner``
    it loads and continues as the run that wrote it."""
    save_old_dcp(saved, tmp_path)
    model, opt = legacy.build()
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    with pytest.raises(CheckpointException, match="Missing key in checkpoint state_dict: optim"):
        dcp.load(state, checkpoint_id=tmp_path, no_dist=True)
    dcp.load(state, checkpoint_id=tmp_path, planner=LegacyKeysLoadPlanner(), no_dist=True)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    continues_as_it_did(model, opt, saved)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_converted_old_dcp_checkpoint_loads_without_a_planner(saved, tmp_path):
    """``convert_legacy_checkpoint`` (for loaders that take no planner, as torchtitan's)
    writes a copy in today's keys, which plain ``dcp.load`` reads and continues from."""
    save_old_dcp(saved, tmp_path / "old")
    old_keys = sum(k in LEGACY_KEYS for e in saved["optimizer"]["state"].values() for k in e)
    assert convert_legacy_checkpoint(tmp_path / "old", tmp_path / "new") == old_keys == 20
    model, opt = legacy.build()
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=tmp_path / "new", no_dist=True)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    continues_as_it_did(model, opt, saved)


def save_old_dcp(saved, path) -> None:
    """The committed old state saved by DCP in the old keys (as ``dobb.train`` saved)."""
    model, opt = legacy.build()
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    optim = get_optimizer_state_dict(model, opt)
    optim["state"] = {
        fqn: {OLD_NAMES.get(k, k): v for k, v in entry.items()}
        for fqn, entry in optim["state"].items()
    }
    state = {"model": get_model_state_dict(model), "optim": optim}
    dcp.save(state, checkpoint_id=path, no_dist=True)
    assert (
        "optim.state.0.weight.cov_tail"
        in dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    )
