"""Shard-local Dobb under DDP, FSDP2, HSDP, TP and FSDP x TP equals the single-device run.

Equal up to rounding and to whole sign flips: the sharded run sums gradients and statistics
in another order, and a coefficient of ``C = P_rᵀ N Q_b`` within that rounding of zero may
take the other sign there, which moves its tile of the weights by ``2 lr alpha`` in
Frobenius norm (``sign_steps``). Which coefficients those are depends on the CPU (these
tests' smallest coefficient is 5e-6 of its matrix's largest, at step 4 of the FSDP and HSDP
runs), so after each step the single-device run takes the sharded run's sign wherever the
two differ (``follow_signs``), at most ``MAX_FLIPS`` coefficients of a matrix a step and
only where its own coefficient was within ``FLIP_ZONE`` of zero; everything else is then
held to rounding. The sharded coefficients differ from the single-device ones by the
rounding of the gradient's and the momentum's sums over the batch's 24 rows (at most
``2 x 24 x 2^-24 = 2.9e-6`` of the largest; Higham, *Accuracy and Stability of Numerical
Algorithms*, section 4.2) and, on refresh steps, by the bases' rounding over their
eigenvalue gaps (relative gaps at least 7.9e-3 in these statistics: at most 3.7e-4 of the
largest), so ``FLIP_ZONE`` is 1e-3; a wrong shard, state or basis moves coefficients of any
size and fails it.
"""

import pytest
import torch
from dobb_configs import PaperDobb
from dobb_runs import HYPER, STEPS, compare_layout, dobb_step, follow_signs
from layouts import MLP, full, parallelize
from multirank import run_ranks
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dobb


@pytest.mark.parametrize(
    "layout, world",
    [("ddp", 2), ("fsdp", 2), ("fsdp", 4), ("hsdp", 4), ("tp", 2), ("tp", 4), ("fsdp_tp", 4)],
)
def test_sharded_update_equals_single_device(layout, world):
    results = run_ranks(compare_layout, world, layout, "refresh", timeout=120)
    for result in results:
        assert max(result["errors"]) <= 1e-6, result["errors"]
    # only on basis-refresh steps (1 and 3): the statistics average over each data axis, and
    # one all-gather of the bases per block size (fc1: 4 or 8; fc2: 5 or 9), 1/P per rank
    axes = {"ddp": 1, "fsdp": 1, "hsdp": 2, "tp": 0, "fsdp_tp": 1}[layout]
    refresh = ["all_reduce"] * axes + ["all_gather"] * 2 * (axes > 0)
    assert results[0]["comms"] == [refresh, [], refresh, []]
    assert results[0]["save"] == axes
    for other in results[1:]:  # every replica holds bit-identical bases
        for a, b in zip(results[0]["bases"], other["bases"]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_batched_solver_sharded_equals_single_device(layout):
    """The batched Jacobi refresh (CUDA's default) keeps the sharded == single-device result,
    with the refresh split over ranks (FSDP) and on local column blocks (TP)."""
    results = run_ranks(compare_layout, 2, layout, "refresh", True, "jacobi", timeout=120)
    for result in results:
        assert max(result["errors"]) <= 1e-5, result["errors"]
    for a, b in zip(results[0]["bases"], results[1]["bases"]):
        assert torch.equal(a, b)  # every rank holds the same (gathered) bases


def test_sync_every_step_equals_sync_on_refresh():
    every_step = run_ranks(compare_layout, 2, "fsdp", "step", False, timeout=120)
    for result in every_step:
        assert max(result["errors"]) <= 1e-6
        assert result["comms"] == [["all_reduce"]] * STEPS  # unsharded refresh: no gather
        assert result["save"] == 0  # already averaged: saving on one rank cannot hang


def misaligned_blocks(rank, world):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tensor",))
    model = parallelize_module(
        MLP(32, 16), mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    )
    PaperDobb(dobb.param_groups(model, exclude="^$"), lr=0.1, num_blocks=3)


def test_misaligned_row_parallel_blocks_raise_at_construction():
    with pytest.raises(ValueError, match=r"fc2.weight of shape \(16, 32\).*2 ranks.*num_blocks=3"):
        run_ranks(misaligned_blocks, 2, timeout=60)


def checkpoint_run(rank, world, path, phase):
    """phase "save": 2 steps, DCP save, 2 more; "load": DCP load, the last 2 steps, beside a
    single-device twin that DCP loads from the same checkpoint (``follow_signs``). Returns
    the final parameters (``"twin"``'s too, after a load)."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    model, data, dp_rank, dp_size = parallelize(MLP(18, 3), "fsdp", world)
    hyper = {**HYPER, "num_blocks": 4}
    opt = PaperDobb(dobb.param_groups(model, exclude="^$"), **hyper, stats_group=data)
    opt.track(model)
    if phase == "save":
        for step in range(2):
            dobb_step(model, opt, step, dp_rank, dp_size, 3)
        dcp.save(
            {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)},
            checkpoint_id=path,
        )
        for step in range(2, 4):
            dobb_step(model, opt, step, dp_rank, dp_size, 3)
        return {"params": [full(p.detach()) for p in model.parameters()]}
    twin = MLP(18, 3)
    twin_opt = PaperDobb(dobb.param_groups(twin, exclude="^$"), **hyper)
    twin_opt.track(twin)
    for m, o in ((model, opt), (twin, twin_opt)):
        state = {"model": m.state_dict(), "optim": get_optimizer_state_dict(m, o)}
        dcp.load(state, checkpoint_id=path)
        m.load_state_dict(state["model"])
        set_optimizer_state_dict(m, o, state["optim"])
    for step in range(2, 4):
        before = [p.detach().clone() for p in twin.parameters()]
        before_sharded = [full(p.detach()).clone() for p in model.parameters()]
        dobb_step(twin, twin_opt, step, 0, 1, 3)
        dobb_step(model, opt, step, dp_rank, dp_size, 3)
        follow_signs(twin, twin_opt, model, before, before_sharded)
    params = [full(p.detach()) for p in model.parameters()]
    return {"params": params, "twin": [p.detach() for p in twin.parameters()]}


@pytest.mark.parametrize("load_world", [4, 2])
def test_dcp_resume_equals_uninterrupted(tmp_path, load_world):
    """On the world size it was saved on, the resumed run is the uninterrupted one bit for
    bit (the same ops and sums in the same order). On another, the sums run in another order
    (module docstring): it is held, step by step, to a single-device twin that DCP loads
    from the same checkpoint, up to rounding and the signs ``follow_signs`` allows."""
    uninterrupted = run_ranks(checkpoint_run, 4, str(tmp_path), "save", timeout=120)[0]
    resumed = run_ranks(checkpoint_run, load_world, str(tmp_path), "load", timeout=120)[0]
    if load_world == 4:
        for a, b in zip(uninterrupted["params"], resumed["params"], strict=True):
            assert torch.equal(a, b)
    for a, b in zip(resumed["twin"], resumed["params"], strict=True):
        assert ((b - a).norm() / a.norm()).item() <= 1e-6
