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

import copy

import pytest
import torch
from dobb_configs import PaperDobb
from layouts import LAYOUTS, MLP, full, parallelize, train_step
from multirank import run_ranks
from sign_steps import rotate, sign_steps, stacks
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dobb
from bench.tools.comm_recorder import CommRecorder
from dobb.optim.dobb_core import update_alpha, update_scale_of

STEPS = 4
MAX_FLIPS = 2  # sign coefficients of a matrix a step that may differ (module docstring)
FLIP_ZONE = 1e-3  # ... and only where |C| was within this of the matrix's largest |C|
HYPER = dict(lr=0.02, basis_interval=2, weight_decay=0.1)
# Blocks must tile TP column shards: hidden 18 splits 9/9 over TP 2 (2 blocks of 9), hidden
# 20 over TP 2 or 4 into 10s or 5s (4 blocks of 5); elsewhere 4 ragged blocks of 5,5,4,4.
NUM_BLOCKS = {"ddp": 4, "fsdp": 4, "hsdp": 4, "tp": 4, "fsdp_tp": 2}


def dobb_step(model, opt, step, dp_rank, dp_size, out):
    """A training step; the kinds of the collectives inside ``opt.step()``."""
    return [kind for kind, _, _ in train_step(model, opt, step, dp_rank, dp_size, out)]


def compare_layout(
    rank,
    world,
    layout,
    stats_sync,
    shard_refresh=True,
    basis_method="auto",
    options=None,
    reference_options=None,
):
    """Train the layout and the single-device model side by side (``options`` for both,
    ``reference_options`` on top for the single-device one)."""
    torch.manual_seed(0)
    _, _, hidden, out = LAYOUTS[layout]
    hyper = {**HYPER, "num_blocks": NUM_BLOCKS[layout], "basis_method": basis_method}
    hyper |= options or {}
    if hyper.get("block_size") is not None:  # a block width instead of the layout's count
        hyper["num_blocks"] = None
    reference = MLP(hidden, out)
    model = copy.deepcopy(reference)
    ref_opt = PaperDobb(
        dobb.param_groups(reference, exclude="^$"), **hyper | (reference_options or {})
    )
    ref_opt.track(reference)
    model, data, dp_rank, dp_size = parallelize(model, layout, world)
    opt = PaperDobb(
        dobb.param_groups(model, exclude="^$"),
        **hyper,
        stats_group=data,
        stats_sync=stats_sync,
        shard_refresh=shard_refresh,
    )
    opt.track(model)
    comms, flips = [], []
    for step in range(STEPS):
        before = [p.detach().clone() for p in reference.parameters()]
        before_sharded = [full(p.detach()).clone() for p in model.parameters()]
        dobb_step(reference, ref_opt, step, 0, 1, out)
        comms.append(dobb_step(model, opt, step, dp_rank, dp_size, out))
        flips.append(follow_signs(reference, ref_opt, model, before, before_sharded))
    errors = [
        ((full(p.detach()) - q).norm() / q.norm()).item()
        for p, q in zip(model.parameters(), reference.parameters())
    ]
    keys = ("input_basis_0", "input_basis_1")
    bases = [full(s[k]) for s in opt.state.values() for k in keys if k in s]
    with CommRecorder() as rec:  # after a non-refresh step: averages unless synced every step
        opt.state_dict()
    return {
        "errors": errors,
        "comms": comms,
        "bases": bases,
        "save": rec.count(),
        "flips": flips,
    }


@torch.no_grad()
def follow_signs(reference, ref_opt, model, before, before_sharded) -> int:
    """After a step of both runs: each sign-coefficient matrix's step, in the single-device
    run's bases (the sharded run's equal them up to rounding over their eigenvalue gaps; a
    row basis of uneven row shards is not gathered), is ``±1`` in units of ``lr alpha``
    within 0.1 in both runs; where the sharded run took the other sign
    (at most ``MAX_FLIPS`` coefficients, each within ``FLIP_ZONE`` of zero in the
    single-device run), the single-device weights take its sign (``W -= lr alpha P_r (S_sharded
    - S) Q_bᵀ``), so the next step starts from weights equal up to rounding. Returns the
    number of signs taken."""
    taken = 0
    pairs = zip(reference.parameters(), model.parameters(), before, before_sharded, strict=True)
    for p, q, w0, v0 in pairs:
        group = next(g for g in ref_opt.param_groups if any(x is p for x in g["params"]))
        if group["algorithm"] != "dobb" or group["coefficients"] != "sign":
            continue
        state = ref_opt.state[p]
        mine = stacks(state, "input"), stacks(state, "row")
        hyper = dict(lr=group["lr"], weight_decay=group["weight_decay"])
        scale = update_scale_of(group["update_scale"], group["coefficients"])
        hyper["alpha"] = update_alpha(scale, p.shape[1])
        signs = [
            sign_steps(w0, p, *mine, **hyper),
            sign_steps(v0, full(q.detach()), *mine, **hyper),
        ]
        for s in signs:
            assert float((s.abs() - 1).abs().max()) < 0.1, "not a sign step of lr alpha"
        ours, other = (s.sign() for s in signs)
        differ = ours != other
        if not differ.any():
            continue
        mu = group["momentum"]
        direction = (
            (1 - mu) * p.grad + mu * state["momentum"] if group["nesterov"] else state["momentum"]
        )
        coefficients = rotate(direction, *mine).abs()
        zone = FLIP_ZONE * float(coefficients.max())
        assert int(differ.sum()) <= MAX_FLIPS, f"{int(differ.sum())} signs differ"
        assert float(coefficients[differ].max()) <= zone, "a sign differs away from zero"
        p.sub_(
            rotate(other - ours, *mine, into=False).to(p.dtype), alpha=hyper["lr"] * hyper["alpha"]
        )
        taken += int(differ.sum())
    return taken


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
