"""``Dobb(capturable=True)``: the same training as the default step, no host read in a
steady or a warm refresh step, a non-finite batch a device-side no-op, and steady and
refresh steps that ``torch.compile(fullgraph=True)`` traces (no graph break)."""

import copy
import warnings

import pytest
import torch
from opcount import count_step, tiny_gpt

import dobb.eigensolve
from dobb.registry import build_optimizer

TOKENS = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
# (options, exact, steps): with Lion on the scalars the bits agree; bias corrections from
# device counters (capturable AdamW, as torch's, and Adam coefficients) round differently,
# and a refresh (step 11) can turn rounding into a different basis: those stop at step 10.
# Both runs use cholqr, what "auto" means with capturable=True (the default step: eigh on CPU)
VARIANTS = {
    "one-sided": ({}, False, 13),
    "one-sided, lion": ({"scalar_algorithm": "lion"}, True, 13),
    "two-sided, lion": ({"two_sided": True, "scalar_algorithm": "lion"}, True, 13),
    "two-sided, adam coefficients, lion": (
        {
            "two_sided": True,
            "coefficients": "adam",
            "update_scale": 0.2,
            "scalar_algorithm": "lion",
        },
        False,
        10,
    ),
}


def backward(model):
    _, loss = model(TOKENS[:, :-1], TOKENS[:, 1:])
    loss.backward()


def train(opt, model, steps, poison=()):
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        backward(model)
        if step in poison:
            model.blocks[0].mlp.fc.weight.grad[0, 0] = float("nan")
        opt.step()


@pytest.mark.parametrize("variant", VARIANTS)
def test_capturable_trains_as_the_default_step(variant):
    """Up to 13 steps (refreshes at steps 1 and 11), the batched path on both sides."""
    options, exact, steps = VARIANTS[variant]
    runs = []
    for capturable in (False, True):
        model = tiny_gpt(2)
        extra = {"capturable": True, "nonfinite": "skip"} if capturable else {}
        extra |= {"foreach": True, "basis_interval": 10, "basis_method": "cholqr"}
        opt = build_optimizer("dobb_paper", model, **options, **extra)
        train(opt, model, steps)
        runs.append(model)
    for a, b in zip(runs[0].parameters(), runs[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0 if exact else 1e-5, atol=0 if exact else 1e-6)


def test_a_non_finite_batch_changes_nothing_and_is_counted_on_the_device():
    model = tiny_gpt(2)
    opt = build_optimizer("dobb_paper", model, capturable=True, nonfinite="skip", foreach=True)
    train(opt, model, 3)
    params, state = copy.deepcopy(list(model.parameters())), copy.deepcopy(opt.state_dict())
    train(opt, model, 1, poison=(0,))
    assert opt.skipped_steps.device == params[0].device and int(opt.skipped_steps) == 1
    for a, b in zip(params, model.parameters()):
        assert torch.equal(a, b)
    after = opt.state_dict()["state"]
    for index, entry in state["state"].items():
        for key, value in entry.items():
            if key != "step" and key != "stats_steps":
                assert torch.equal(after[index][key], value), key
            else:  # the device counters do not move either
                assert torch.equal(after[index][key], value), key


def test_capturable_needs_the_device_side_skip():
    with pytest.raises(ValueError, match="nonfinite='skip'"):
        build_optimizer("dobb_paper", tiny_gpt(1), capturable=True)


def test_a_capturable_steady_step_reads_nothing():
    """The default step reads the device once (its non-finite check); capturable: never."""
    assert count_step("dobb_paper", 4, foreach=True).host_reads == 1
    counter = count_step("dobb_paper", 4, foreach=True, capturable=True, nonfinite="skip")
    assert counter.host_reads == 0
    lr = torch.tensor(1e-3)  # a tensor lr (a schedule fills it between replays)
    tensor_lr = count_step("dobb_paper", 4, lr=lr, foreach=True, capturable=True, nonfinite="skip")
    assert tensor_lr.host_reads == 0


def test_counters_return_to_the_cpu_after_load_unless_capturable():
    """torch's load_state_dict moves non-"step" tensors onto the parameter's device;
    Dobb's ``stats_steps`` must stay where it was made (a CPU counter costs no sync)."""
    model = tiny_gpt(1)
    opt = build_optimizer("dobb_paper", model)
    train(opt, model, 1)
    opt.load_state_dict(opt.state_dict())
    for state in opt.state.values():
        for key in ("step", "stats_steps"):
            if key in state:
                assert state[key].device.type == "cpu"


def test_refresh_schedule_on_the_host():
    model = tiny_gpt(1)
    opt = build_optimizer("dobb_paper", model, capturable=True, nonfinite="skip", basis_interval=3)
    assert opt.refresh_due()  # the first step
    train(opt, model, 1)
    assert not opt.refresh_due()
    opt.count_replay()
    assert not opt.refresh_due()
    opt.count_replay()
    assert opt.refresh_due()  # step 4 = 1 + 3


CAPTURABLE = {"capturable": True, "nonfinite": "skip", "foreach": True}


@pytest.mark.parametrize("method", ["eigh", "cupy", "power_qr"])
def test_solvers_that_cannot_be_captured_are_rejected_at_construction(method):
    with pytest.raises(ValueError, match=f"basis_method='{method}' cannot run in a captured"):
        build_optimizer("dobb_paper", tiny_gpt(1), basis_method=method, **CAPTURABLE)


def test_a_capturable_warm_refresh_step_reads_nothing():
    """Step 4 refreshes every basis from the last one ("auto" is cholqr here, on the CPU
    too); the default step reads the device once in a refresh step (the non-finite check)."""
    counter = count_step("dobb_paper", 4, warmup_steps=3, basis_interval=3, **CAPTURABLE)
    assert counter.ops["aten::linalg_cholesky_ex"] > 0  # the refresh ran
    assert counter.ops["aten::_linalg_eigh"] == 0 and counter.ops["aten::atan"] == 0
    assert counter.host_reads == 0


def test_refresh_failures_stay_on_the_device_until_refresh_due(monkeypatch):
    """A captured refresh cannot warn: every rejected block is counted on the device, and
    ``refresh_due`` (host-side, between steps) warns once the count reaches the host."""
    monkeypatch.setattr(dobb.eigensolve, "cholqr_basis", lambda cov, _: cov * float("nan"))
    model = tiny_gpt(1)
    opt = build_optimizer("dobb_paper", model, basis_interval=3, **CAPTURABLE)
    train(opt, model, 3)  # step 1: the cold refresh, Jacobi from the identity
    before = {k: v.clone() for k, v in opt.state[model.blocks[0].mlp.fc.weight].items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert opt.refresh_due()  # nothing failed yet
        train(opt, model, 3)  # step 4 refreshes (every block fails), steps 5, 6 do not
    blocks = opt.basis_failures.total
    dobb_matrices = [p for p, state in opt.state.items() if "input_basis_0" in state]
    assert blocks == sum(s.count for p in dobb_matrices for s in opt.local_blocks(p)) > 0
    after = opt.state[model.blocks[0].mlp.fc.weight]
    # kept (re-orthonormalised)
    torch.testing.assert_close(after["input_basis_0"], before["input_basis_0"])
    with pytest.warns(RuntimeWarning, match=rf"'cholqr' returned .* for {blocks} blocks on cpu"):
        assert opt.refresh_due()


def test_compiled_steady_and_refresh_steps_match_the_eager_ones():
    """After an eager first step (the cold refresh), ``torch.compile(opt.step,
    fullgraph=True)`` (which raises at a graph break) runs two refresh periods
    (``basis_interval=3``: refreshes at steps 4 and 7) as the eager capturable step does."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    models, opts = [], []
    for _ in range(2):
        model = tiny_gpt(1)
        opt = build_optimizer("dobb_paper", model, basis_interval=3, **CAPTURABLE)
        train(opt, model, 1)
        models.append(model)
        opts.append(opt)
    compiled = torch.compile(opts[1].step, fullgraph=True, backend="eager")
    due = []
    for _ in range(7):  # steps 2 to 8
        due.append(opts[1].refresh_due())
        for model in models:
            model.zero_grad(set_to_none=True)
            backward(model)
        opts[0].step()
        compiled()
        if len(due) == 1:  # step 2 stacked the bases for the steady step
            stacks = list(opts[1].steps._basis_stacks.values())
    assert due == [False, False, True, False, False, True, False]
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b)
    # the steady step's stacked bases were refilled in place (a CUDA graph reads them there)
    assert len(stacks) > 0 and list(opts[1].steps._basis_stacks.values()) == stacks
    for bases, stacked in stacks:
        assert torch.equal(stacked, torch.stack(bases))
    # steady and refresh, each traced with static host counts and then dynamic ones: a
    # graph per step would be 7
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 4
