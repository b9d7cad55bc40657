"""Dobb's state keys name a side and a stack index (``dobb.optim.dobb_core``), and a
checkpoint written in the keys before them (``cov``, ``cov_tail``, ``row_basis``, ...:
``tests/data/dobb_legacy_checkpoint.pt``, by that commit's code) loads and continues as
that state continues when the test places it under today's keys itself.

The committed file is read for its format (the old keys, the shapes) and for its starting
state (model, optimizer state, the next two batches). It also holds the parameters the run
that wrote it reached two steps later, on the machine that wrote it; those are not
compared: matrix products round differently on another CPU kind (AVX2 and AVX-512
kernels), and Dobb's sign turns a last-bit difference in a near-zero rotated coefficient
into a flipped sign, which moves weights by up to ``2 lr alpha |Q_jk|``. The reference is
computed in the test, on the machine running it: the saved tensors put into a fresh
optimizer's ``state`` under today's keys by ``RENAMED`` (a table written here, not the
library's ``LEGACY_KEYS``), with none of the library's loading code, then two steps. Each
loading path (``load_state_dict`` of the old keys; DCP with ``LegacyKeysLoadPlanner``;
``convert_legacy_checkpoint``) must end on it bit for bit: one process, the same tensors,
the same ops in the same order.
"""

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

SPEC = importlib.util.spec_from_file_location(
    "dobb_legacy_checkpoint", Path(__file__).parent / "data" / "dobb_legacy_checkpoint.py"
)
legacy = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(legacy)

# each old key and today's key for it, written out here so that a wrong entry of the
# library's LEGACY_KEYS (or OLD_NAMES) cannot also be in the reference
RENAMED = {
    "cov": "input_cov_0",
    "basis": "input_basis_0",
    "cov_tail": "input_cov_1",
    "basis_tail": "input_basis_1",
    "row_cov": "row_cov_0",
    "row_basis": "row_basis_0",
    "row_cov_tail": "row_cov_1",
    "row_basis_tail": "row_basis_1",
}
OLD = {new: old for old, new in RENAMED.items()}
# each option the file's param groups spell as before, and today's name (its value is kept)
OPTIONS_RENAMED = {"coefficient_beta": "beta2"}
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


@pytest.fixture
def reference(saved):
    """The parameters after each of the two steps that follow the saved state placed by
    ``place`` (``RENAMED``, no loading code of the library), on this machine."""
    model, opt = legacy.build()
    place(model, opt, saved)
    return continuation(model, opt, saved)


def place(model, opt, saved, renamed=RENAMED) -> None:
    """The saved model weights and optimizer state (copies) put into a fresh ``legacy.build()``
    as they are, the old keys renamed by ``renamed``: ``opt.state[p]`` assigned, as
    ``Optimizer.load_state_dict`` ends up doing, but with no renaming of the library's. The
    saved param groups are the ones ``build`` makes, so only the state has to be placed."""
    model.load_state_dict(saved["model"])
    groups = [
        {OPTIONS_RENAMED.get(k, k): v for k, v in g.items()}
        for g in saved["optimizer"]["param_groups"]
    ]
    # (the options the file predates, such as row_block_size, are the build's own)
    assert [{k: v for k, v in g.items() if k != "params"} for g in groups] == [
        {k: v for k, v in g.items() if k != "params" and k in saved_group}
        for g, saved_group in zip(opt.state_dict()["param_groups"], groups)
    ]
    params = [p for group in opt.param_groups for p in group["params"]]
    for i, entry in saved["optimizer"]["state"].items():
        opt.state[params[i]] = {renamed.get(k, k): v.clone() for k, v in entry.items()}


def continuation(model, opt, saved) -> list[dict[str, torch.Tensor]]:
    """The parameters after each of the saved next batches (a steady step, then a basis
    refresh), one step each."""
    after = []
    for batch in saved["batches"]:
        legacy.train(model, opt, [batch])
        after.append({name: value.clone() for name, value in model.state_dict().items()})
    return after


def continues_as_the_reference(model, opt, saved, reference) -> None:
    """Two more steps end on ``reference``'s parameters, bit for bit (same machine, same
    ops); the state is then saved in today's keys."""
    for got, expected in zip(continuation(model, opt, saved), reference, strict=True):
        for name, value in expected.items():
            torch.testing.assert_close(
                got[name], value, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}"
            )
    assert [set(opt.state_dict()["state"][i]) for i in range(3)] == KEYS


def test_the_committed_checkpoint_holds_the_old_keys(saved):
    old = [set(saved["optimizer"]["state"][i]) for i in range(3)]
    assert old[1] >= set(RENAMED) and not old[1] & set(RENAMED.values())
    assert [{RENAMED.get(k, k) for k in keys} for keys in old] == KEYS


def test_a_fresh_run_writes_one_key_per_side_and_stack():
    model, opt = legacy.build()
    legacy.train(model, opt, legacy.batches(1))
    state = opt.state_dict()["state"]
    assert [set(state[i]) for i in range(3)] == KEYS


def test_the_reference_depends_on_the_keys_and_the_momentum(saved, reference):
    """The comparison can fail: the saved state placed with two same-shape entries swapped
    (``cov`` and ``basis``; ``row_cov_tail`` and ``row_basis_tail``), or with its momentum
    zeroed (as if not saved), continues elsewhere."""
    swaps = [("cov", "basis"), ("row_cov_tail", "row_basis_tail")]
    for a, b in swaps:
        model, opt = legacy.build()
        place(model, opt, saved, renamed={**RENAMED, a: RENAMED[b], b: RENAMED[a]})
        assert differs(continuation(model, opt, saved)[-1], reference[-1]), (a, b)
    model, opt = legacy.build()
    place(model, opt, saved)
    for state in opt.state.values():
        if "momentum" in state:
            state["momentum"].zero_()  # as a fresh momentum starts
    assert differs(continuation(model, opt, saved)[-1], reference[-1])


def differs(a: dict, b: dict) -> bool:
    return any(not torch.equal(a[name], value) for name, value in b.items())


def test_an_old_checkpoint_loads_into_the_new_keys_and_continues_as_the_reference(saved, reference):
    model, opt = legacy.build()
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    for group, old in zip(opt.param_groups, saved["optimizer"]["param_groups"], strict=True):
        for old_name, name in (
            OPTIONS_RENAMED.items() if old["algorithm"] == "dobb" else ()
        ):  # the old spelling's value, renamed
            assert old_name in old and old_name not in group and group[name] == old[old_name]
    params = [p for g in opt.param_groups for p in g["params"]]
    for i, entry in saved["optimizer"]["state"].items():
        state = opt.state[params[i]]
        assert set(state) == {RENAMED.get(k, k) for k in entry}
        for key, value in entry.items():
            assert torch.equal(state[RENAMED.get(key, key)], value), key
    continues_as_the_reference(model, opt, saved, reference)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_an_old_dcp_checkpoint_loads_through_the_legacy_planner(saved, reference, tmp_path):
    """A DCP checkpoint in the old keys (the committed state saved by DCP, as
    ``dobb.train`` saves) does not load by today's keys; with ``LegacyKeysLoadPlanner``
    it loads and continues as the reference."""
    save_old_dcp(saved, tmp_path)
    model, opt = legacy.build()
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    with pytest.raises(CheckpointException, match="Missing key in checkpoint state_dict: optim"):
        dcp.load(state, checkpoint_id=tmp_path, no_dist=True)
    dcp.load(state, checkpoint_id=tmp_path, planner=LegacyKeysLoadPlanner(), no_dist=True)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    continues_as_the_reference(model, opt, saved, reference)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_converted_old_dcp_checkpoint_loads_without_a_planner(saved, reference, tmp_path):
    """``convert_legacy_checkpoint`` (for loaders that take no planner, as torchtitan's)
    writes a copy in today's keys, which plain ``dcp.load`` reads and continues from as
    the reference."""
    save_old_dcp(saved, tmp_path / "old")
    old_keys = sum(k in RENAMED for e in saved["optimizer"]["state"].values() for k in e)
    assert convert_legacy_checkpoint(tmp_path / "old", tmp_path / "new") == old_keys == 20
    model, opt = legacy.build()
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=tmp_path / "new", no_dist=True)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    continues_as_the_reference(model, opt, saved, reference)


def save_old_dcp(saved, path) -> None:
    """The committed old state saved by DCP in the old keys (as ``dobb.train`` saved):
    placed in today's keys by ``RENAMED``, read out by DCP's ``get_optimizer_state_dict``
    (keyed by parameter name) and written back in the old keys by ``OLD``."""
    model, opt = legacy.build()
    place(model, opt, saved)
    optim = get_optimizer_state_dict(model, opt)
    optim["state"] = {
        fqn: {OLD.get(k, k): v for k, v in entry.items()} for fqn, entry in optim["state"].items()
    }
    state = {"model": get_model_state_dict(model), "optim": optim}
    dcp.save(state, checkpoint_id=path, no_dist=True)
    assert (
        "optim.state.0.weight.cov_tail"
        in dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    )
