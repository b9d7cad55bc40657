"""The worker of Dobb's distributed tests: the layout and a single-device model trained side by
side, the single-device run following the sharded one's signs where rounding flipped one
(``test_dobb_distributed``, ``test_dobb_variants_distributed``)."""

import copy

import torch
from dobb_configs import PaperDobb
from layouts import LAYOUTS, MLP, full, parallelize, train_step
from sign_steps import rotate, sign_steps, stacks

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
