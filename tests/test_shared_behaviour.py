"""Behaviour every optimizer in the registry must share, run over the whole registry and,
where a test is cheap, over both paths (``optim_db.FOREACH``: matrix by matrix and batched);
an expensive test names the path it runs."""

import copy

import pytest
import torch
from optim_db import ERROR_INPUTS, FOREACH, SMALL_INPUTS, over_foreach
from tinylm import (
    CASES,
    MATRIX_CASES,
    MATRIX_NAMES,
    TinyLM,
    assert_same_params,
    assert_same_state,
    loss_of,
    make,
    params,
    state_snapshot,
    train,
)
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from dobb.groups import param_groups
from dobb.optim.base import NonFiniteGradientError
from dobb.optim.dobb import Dobb
from dobb.registry import OPTIMIZERS, build_optimizer

BOTH_PATHS = over_foreach(CASES)  # (optimizer, scalar algorithm, foreach)


@pytest.mark.parametrize("name, scalar, foreach", BOTH_PATHS)
def test_step_with_closure_returns_the_loss(name, scalar, foreach):
    model, opt = make(name, scalar, foreach=foreach)
    before, seen = params(model), []

    def closure():
        opt.zero_grad()
        loss = loss_of(model, 0)  # Dobb: this forward pass also feeds its statistics
        loss.backward()
        seen.append(loss)
        return loss

    assert opt.step(closure) is seen[0] and len(seen) == 1
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters())


@pytest.mark.parametrize("name, scalar, foreach", BOTH_PATHS)
def test_lr_scheduler_changes_the_lr_used(name, scalar, foreach):
    entry = OPTIMIZERS[name]
    model, opt = make(name, scalar, foreach=foreach)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
    for t in range(2):
        train(model, opt, 1, first=t)
        scheduler.step()
    halved = {"lr": opt.param_groups[0]["initial_lr"] * 0.5}  # the lr build_optimizer chose
    if entry.is_matrix:
        halved["scalar_lr"] = entry.scalar_lr * 0.5
    reference, reference_opt = make(name, scalar, foreach=foreach, **halved)
    train(reference, reference_opt, 2)
    assert_same_params(params(model), params(reference))
    full, full_opt = make(name, scalar, foreach=foreach)
    train(full, full_opt, 2)
    assert not torch.equal(params(full)["fc.weight"], params(model)["fc.weight"])


@pytest.mark.parametrize(
    "name, scalar, overrides, foreach",
    over_foreach(
        [pytest.param(*case.values, {}, id=case.id) for case in CASES]
        + [pytest.param("dion", "adamw", {"orthogonalize": "cholesky_qr"}, id="dion+cholesky_qr")]
    ),
)
def test_checkpoint_round_trip_continues_like_uninterrupted_training(
    name, scalar, overrides, foreach
):
    """Batched Dobb also keeps stacked copies of the bases between steps: a load drops them."""
    model, opt = make(name, scalar, foreach=foreach, **overrides)
    train(model, opt, 3)
    model_state, opt_state = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    train(model, opt, 3, first=3)
    resumed, resumed_opt = make(name, scalar, foreach=foreach, seed=1, **overrides)
    resumed.load_state_dict(model_state)
    resumed_opt.load_state_dict(opt_state)
    train(resumed, resumed_opt, 3, first=3)
    assert_same_params(params(resumed), params(model), atol=1e-6)


@pytest.mark.parametrize("name, scalar, foreach", BOTH_PATHS)
def test_zero_gradient_zero_lr_step_changes_nothing(name, scalar, foreach):
    # what DCP's get_state_dict does to an optimizer with empty state
    model, opt = make(name, scalar, foreach=foreach)
    before = params(model)
    for group in opt.param_groups:
        group["lr"] = 0.0
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step(closure=None)
    assert_same_params(params(model), before)
    for state in opt.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                assert torch.isfinite(value).all()


@pytest.mark.parametrize("name, scalar", CASES)
def test_dcp_state_init_before_the_first_step_leaves_the_trajectory_bit_identical(name, scalar):
    # get_optimizer_state_dict on empty state takes a zero-gradient, lr-0 step (DCP's
    # _init_optim_state); a run checkpointed before its first step must train the same.
    # 14 steps: the batched path (the state init is the same code on both)
    reference, reference_opt = make(name, scalar, foreach=True)
    train(reference, reference_opt, 7)
    model, opt = make(name, scalar, foreach=True)
    saved = get_optimizer_state_dict(model, opt)
    assert saved["state"], "DCP should have built the optimizer state"
    for state in saved["state"].values():
        for key in ("step", "stats_steps"):
            if key in state:
                assert float(state[key]) == 0.0, f"{key} moved to {float(state[key])}"
    assert all(p.grad is None for p in model.parameters())
    train(model, opt, 7)
    assert_same_params(params(model), params(reference))
    assert_same_state(state_snapshot(opt), state_snapshot(reference_opt))


@pytest.mark.parametrize("name", MATRIX_NAMES)
def test_unknown_group_keys_and_algorithms_are_rejected(name):
    cls = OPTIMIZERS[name].cls
    w = nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="unknown key"):
        cls([{"params": [w], "rank_fractoin": 0.5}], lr=0.01)
    with pytest.raises(ValueError, match="unknown key"):
        cls([{"params": [w], "algorithm": "adamw", "momentum": 0.9}], lr=0.01)
    with pytest.raises(ValueError, match="unknown algorithm"):
        cls([{"params": [w], "algorithm": "sgd"}], lr=0.01)
    with pytest.raises(ValueError, match="needs 2-D weight matrices"):
        cls([nn.Parameter(torch.zeros(4))], lr=0.01)


def nan_step(name, scalar, target, **overrides):
    """Train 2 steps, then step with a NaN in ``target``'s gradient; return the pieces."""
    model, opt = make(name, scalar, **overrides)
    train(model, opt, 2)
    before, state = params(model), state_snapshot(opt)
    opt.zero_grad()
    loss_of(model, 2).backward()
    model.get_parameter(target).grad.view(-1)[0] = float("nan")
    return model, opt, before, state


# The non-finite check runs in MatrixOptimizer.step before either path: the per-matrix one
# here (test_capturable skips on the batched path, on the device)
@pytest.mark.parametrize("target", ["fc.weight", "fc.bias"])  # a matrix and a scalar param
@pytest.mark.parametrize("name, scalar", MATRIX_CASES)
def test_nonfinite_gradient_raises_and_changes_nothing(name, scalar, target):
    model, opt, before, state = nan_step(name, scalar, target, foreach=False)
    with pytest.raises(NonFiniteGradientError, match="fc"):
        opt.step()
    assert_same_params(params(model), before)
    assert_same_state(state_snapshot(opt), state)


@pytest.mark.parametrize("target", ["fc.weight", "fc.bias"])
@pytest.mark.parametrize("name, scalar", MATRIX_CASES)
def test_nonfinite_skip_mode_skips_the_step(name, scalar, target):
    model, opt, before, state = nan_step(name, scalar, target, foreach=False, nonfinite="skip")
    opt.step()
    assert opt.skipped_steps == 1
    assert_same_params(params(model), before)
    assert_same_state(state_snapshot(opt), state)
    train(model, opt, 1, first=3)  # and training goes on
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("name, scalar", CASES)
def test_loss_decreases_on_a_tiny_model(name, scalar):
    # 40 steps: matrix by matrix (test_small_inputs_train holds the batched path to it)
    model, opt = make(name, scalar, foreach=False)
    losses = train(model, opt, 40, fixed_batch=True)
    assert losses[-1] < 0.9 * losses[0], (losses[0], losses[-1])


SMALL = [
    pytest.param(name, overrides, id=f"{name}-{i}")
    for name in OPTIMIZERS
    for i, overrides in enumerate(SMALL_INPUTS[name])
]
ERRORS = [
    pytest.param(name, error, id=f"{name}-{error.regex}")
    for name in OPTIMIZERS
    for error in ERROR_INPUTS[name]
]


def test_every_entry_has_inputs():
    assert SMALL_INPUTS.keys() == OPTIMIZERS.keys() == ERROR_INPUTS.keys()


@pytest.mark.parametrize("name, overrides", SMALL)
def test_small_inputs_train(name, overrides):
    """Every input trains on each path on its own, and the two paths (``FOREACH``) agree
    over 5 steps: the batched kernels compute the per-matrix update."""
    trained = {}
    for foreach in FOREACH:
        model, opt = make(name, None, foreach=foreach, **overrides)
        before = params(model)
        losses = train(model, opt, 5, fixed_batch=True)
        after = trained[foreach] = params(model)
        assert all(torch.isfinite(p).all() for p in after.values())
        assert not torch.equal(before["fc.weight"], after["fc.weight"])  # the matrices move
        assert not torch.equal(before["wte.weight"], after["wte.weight"])  # and the rest
        assert losses[-1] < losses[0], (FOREACH[foreach], losses)
    # bit-identical on this CPU but for Dion's QR (3e-8)
    for n, value in trained[True].items():
        torch.testing.assert_close(
            value, trained[False][n], rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}"
        )


@pytest.mark.parametrize("name, overrides", SMALL)
def test_small_inputs_state_round_trips_and_deepcopies(name, overrides):
    """``state_dict`` -> a fresh optimizer's ``load_state_dict`` -> ``state_dict`` gives
    the same state and settings, and a deep copy of the state dict holds no shared tensor
    (the state is laid out alike on both paths: the per-matrix one here)."""
    model, opt = make(name, None, foreach=False, **overrides)
    train(model, opt, 2)
    saved = opt.state_dict()
    copied = copy.deepcopy(saved)
    assert_same_state(copied["state"], saved["state"])
    for key, value in copied["state"][next(iter(copied["state"]))].items():
        if isinstance(value, torch.Tensor) and value.numel():
            assert value.data_ptr() != saved["state"][next(iter(saved["state"]))][key].data_ptr()
    _, fresh = make(name, None, foreach=False, seed=1, **overrides)
    fresh.load_state_dict(copied)
    reloaded = fresh.state_dict()
    assert_same_state(reloaded["state"], saved["state"])
    strip = [{k: v for k, v in g.items() if k != "params"} for g in saved["param_groups"]]
    assert [
        {k: v for k, v in g.items() if k != "params"} for g in reloaded["param_groups"]
    ] == strip


@pytest.mark.parametrize("name, error", ERRORS)
def test_error_inputs_raise(name, error):
    with pytest.raises(error.error, match=error.regex):
        make(name, None, foreach=None, **error.overrides)


def test_unknown_optimizer_name_is_rejected():
    with pytest.raises(ValueError, match="unknown optimizer 'sgd'"):
        build_optimizer("sgd", TinyLM())


def test_huge_finite_gradients_are_not_mistaken_for_nonfinite():
    """The fast check overflows its norm on |g| ~ 1e30; the exact check must then pass it."""
    layer = nn.Linear(4, 3, bias=False)
    opt = Dobb([layer.weight], lr=0.0, missing_stats="identity")
    layer.weight.grad = torch.full((3, 4), 1e30)
    opt.step()
    assert opt.skipped_steps == 0


SCALAR_PARAMS = ("wte.weight", "fc.bias", "proj.bias", "ln.weight", "ln.bias", "head.weight")


@pytest.mark.parametrize("scalar_weight_decay", [None, 0.2])
@pytest.mark.parametrize("name, scalar, foreach", BOTH_PATHS)
def test_scalar_parameters_take_their_own_weight_decay(name, scalar, foreach, scalar_weight_decay):
    """Embeddings, norms, biases and the head decay by ``scalar_weight_decay`` (default 0)
    whatever the hidden matrices' ``weight_decay`` is (torch.optim's default filling once
    gave Dion's 0.01 to them). With zero gradients only the decay moves a parameter:
    ``W <- W (1 - lr wd)``."""
    extra = {} if scalar_weight_decay is None else {"scalar_weight_decay": scalar_weight_decay}
    model, opt = make(name, scalar, foreach=foreach, weight_decay=0.5, **extra)
    loss_of(model, 0).backward()  # Dobb's statistics
    before = params(model)
    for p in model.parameters():
        p.grad.zero_()
    opt.step()
    after = params(model)
    lr = {n: g["lr"] for g in opt.param_groups for n in g["param_names"]}
    for n in SCALAR_PARAMS:
        factor = 1 - lr[n] * (scalar_weight_decay or 0.0)
        torch.testing.assert_close(after[n], before[n] * factor, rtol=0, atol=0, msg=n)
    hidden = after["fc.weight"], before["fc.weight"] * (1 - lr["fc.weight"] * 0.5)
    torch.testing.assert_close(*hidden, rtol=1e-6, atol=0)


def test_negative_scalar_weight_decay_is_rejected():
    with pytest.raises(ValueError, match="scalar_weight_decay must be >= 0"):
        make("dion", "adamw", foreach=None, scalar_weight_decay=-0.1)


@pytest.mark.parametrize("scalar", ["adamw", "lion"])
@pytest.mark.parametrize("name", MATRIX_NAMES)
def test_a_scalar_group_does_not_inherit_the_matrix_weight_decay(name, scalar):
    """The classes themselves, built without the registry: a scalar group's weight decay is
    its own key (default 0), never filled in from the constructor's ``weight_decay``."""
    entry = OPTIMIZERS[name]
    groups = param_groups(TinyLM(), entry.cls.algorithm, scalar_algorithm=scalar)
    options = {**entry.hyperparameters, "lr": 0.01, "weight_decay": 0.5}
    opt = entry.cls(groups, **options)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.5, 0.0]
    explicit = param_groups(TinyLM(), entry.cls.algorithm, scalar_options={"weight_decay": 0.1})
    opt = entry.cls(explicit, **options)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.5, 0.1]
