"""``Dobb(capturable=True)``: the same training as the default step, no host read in a
steady step, a non-finite batch a device-side no-op, and a steady step that
``torch.compile(fullgraph=True)`` traces (no graph break)."""

import copy

import pytest
import torch
from opcount import count_step, tiny_gpt

from dobb.optim.registry import build_optimizer

TOKENS = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
# (options, exact, steps): with Lion on the scalars the bits agree; bias corrections from
# device counters (capturable AdamW, as torch's, and Adam coefficients) round differently,
# and a refresh (step 11) can turn rounding into a different basis: those stop at step 10
VARIANTS = {
    "one-sided": ({}, False, 13),
    "one-sided, lion": ({"scalar_algorithm": "lion"}, True, 13),
    "two-sided, lion": ({"two_sided": True, "scalar_algorithm": "lion"}, True, 13),
    "two-sided, adam coefficients, lion": (
        {"two_sided": True, "coefficients": "adam", "scalar_algorithm": "lion"},
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
        opt = build_optimizer("dobb", model, foreach=True, basis_interval=10, **options, **extra)
        train(opt, model, steps)
        runs.append(model)
    for a, b in zip(runs[0].parameters(), runs[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0 if exact else 1e-5, atol=0 if exact else 1e-6)


def test_a_non_finite_batch_changes_nothing_and_is_counted_on_the_device():
    model = tiny_gpt(2)
    opt = build_optimizer("dobb", model, capturable=True, nonfinite="skip", foreach=True)
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
        build_optimizer("dobb", tiny_gpt(1), capturable=True)


def test_a_capturable_steady_step_reads_nothing():
    """The default step reads the device once (its non-finite check); capturable: never."""
    assert count_step("dobb", 4, foreach=True).host_reads == 1
    counter = count_step("dobb", 4, foreach=True, capturable=True, nonfinite="skip")
    assert counter.host_reads == 0
    lr = torch.tensor(1e-3)  # a tensor lr (a schedule fills it between replays)
    tensor_lr = count_step("dobb", 4, lr=lr, foreach=True, capturable=True, nonfinite="skip")
    assert tensor_lr.host_reads == 0


def test_counters_return_to_the_cpu_after_load_unless_capturable():
    """torch's load_state_dict moves non-"step" tensors onto the parameter's device;
    Dobb's ``stats_steps`` must stay where it was made (a CPU counter costs no sync)."""
    model = tiny_gpt(1)
    opt = build_optimizer("dobb", model)
    train(opt, model, 1)
    opt.load_state_dict(opt.state_dict())
    for state in opt.state.values():
        for key in ("step", "stats_steps"):
            if key in state:
                assert state[key].device.type == "cpu"


def test_refresh_schedule_on_the_host():
    model = tiny_gpt(1)
    opt = build_optimizer("dobb", model, capturable=True, nonfinite="skip", basis_interval=3)
    assert opt.refresh_due()  # the first step
    train(opt, model, 1)
    assert not opt.refresh_due()
    opt.count_replay()
    assert not opt.refresh_due()
    opt.count_replay()
    assert opt.refresh_due()  # step 4 = 1 + 3


def test_compiled_steady_step_has_no_graph_break():
    """``torch.compile(fullgraph=True)`` raises at the first graph break; the compiled
    steady step computes what the eager one does."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    models, opts = [], []
    for _ in range(2):
        model = tiny_gpt(1)
        opt = build_optimizer("dobb", model, capturable=True, nonfinite="skip", foreach=True)
        train(opt, model, 1)  # the first step refreshes: eager
        models.append(model)
        opts.append(opt)
    compiled = torch.compile(opts[1].step, fullgraph=True, backend="eager")
    for _ in range(4):
        assert not opts[1].refresh_due()
        for model in models:
            model.zero_grad(set_to_none=True)
            backward(model)
        opts[0].step()
        compiled()
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b)
    # the host counters are guarded once and then traced as dynamic: 2 graphs, not 4
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2
