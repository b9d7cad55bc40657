"""Muon: the Newton-Schulz orthogonalizer, and agreement with torch.optim.Muon."""

import math

import pytest
import torch
from references import polar_express_float64

from dobb.optim import dion2 as dion2_module
from dobb.optim import muon as muon_module
from dobb.optim import muonbp as muonbp_module
from dobb.optim import nordion2 as nordion2_module
from dobb.optim import normuon as normuon_module
from dobb.optim.muon import Muon, lr_scale, newton_schulz
from dobb.registry import build_optimizer

SHAPES = [(64, 32), (32, 64)]  # tall (transposed inside NS) and wide


def with_condition_number(shape, cond, seed=0):
    """A random matrix whose singular values are log-spaced from 1 down to 1/cond."""
    g = torch.Generator().manual_seed(seed)
    k = min(shape)
    U = torch.linalg.qr(torch.randn(shape[0], k, generator=g)).Q
    V = torch.linalg.qr(torch.randn(shape[1], k, generator=g)).Q
    return U @ torch.diag(torch.logspace(0, -math.log10(cond), k)) @ V.T


# the documented bands (newton_schulz), with room for bf16 rounding: Keller's quintic about
# [0.7, 1.2], Polar Express about [0.85, 1.15]
BANDS = {"quintic": (0.65, 1.25), "polar_express": (0.8, 1.18)}


@pytest.mark.parametrize("coefficients", list(BANDS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", ["gaussian", "condition 100"])
def test_newton_schulz_singular_values_in_band(kind, shape, dtype, coefficients):
    G = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    if kind != "gaussian":
        G = with_condition_number(shape, 100.0)
    out = newton_schulz(G, dtype=dtype, coefficients=coefficients)
    assert out.dtype == dtype and out.shape == G.shape
    s = torch.linalg.svdvals(out.float())
    low, high = BANDS[coefficients]
    assert low < s.min() and s.max() < high, (s.min(), s.max())
    # ... with the singular vectors of G: out ≈ U S' Vᵀ, so Uᵀ out V is diagonal
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    core = U.T @ out.float() @ Vh.T
    off = core - torch.diag(torch.diagonal(core))
    assert off.abs().max() < (0.05 if dtype == torch.bfloat16 else 1e-4)


def test_newton_schulz_batched_equals_one_by_one():
    G = torch.randn(3, 40, 24, generator=torch.Generator().manual_seed(2))
    batched = newton_schulz(G, dtype=torch.float32)
    for i in range(3):
        torch.testing.assert_close(batched[i], newton_schulz(G[i], dtype=torch.float32))


def test_newton_schulz_of_zero_is_zero():
    assert not newton_schulz(torch.zeros(8, 4)).any()


@pytest.mark.parametrize("steps", [3, 5, 7])
@pytest.mark.parametrize("shape", SHAPES)
def test_polar_express_matches_its_float64_transcription(shape, steps):
    G = with_condition_number(shape, 50.0).double()
    out = newton_schulz(G, steps, torch.float64, "polar_express")
    torch.testing.assert_close(out, polar_express_float64(G, steps), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["muon", "muonbp", "blockmuon", "normuon", "dion2", "nordion2"])
def test_ns_coefficients_reach_every_newton_schulz_call(name, monkeypatch):
    """Each Muon-family optimizer hands its group's ``ns_coefficients`` to every
    Newton-Schulz call; Muon's default is Keller's quintic, NorDion2's Polar Express."""
    seen = []

    def spy(G, steps=5, dtype=torch.bfloat16, coefficients="quintic"):
        seen.append(coefficients)
        return newton_schulz(G, steps, dtype, coefficients)

    for module in (muon_module, muonbp_module, normuon_module, dion2_module, nordion2_module):
        monkeypatch.setattr(module, "newton_schulz", spy)
    model = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.Tanh(), torch.nn.Linear(12, 8))
    default = "polar_express" if name == "nordion2" else "quintic"
    for coefficients in (None, "polar_express", "quintic"):
        seen.clear()
        options = {} if coefficients is None else {"ns_coefficients": coefficients}
        opt = build_optimizer(name, model, **options)
        for _ in range(2):
            model(torch.randn(4, 8)).square().sum().backward()
            opt.step()
            opt.zero_grad()
        assert seen and set(seen) == {coefficients or default}, seen


def run_pair(shape, ours, theirs, steps=5):
    """Params after ``steps`` identical random-gradient steps of two optimizers."""
    g = torch.Generator().manual_seed(3)
    w0 = torch.randn(shape, generator=g)
    a, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    opt_a, opt_b = ours([a]), theirs([b])
    for _ in range(steps):
        grad = torch.randn(shape, generator=g)
        a.grad, b.grad = grad.clone(), grad.clone()
        opt_a.step()
        opt_b.step()
    return a.detach(), b.detach()


TORCH_ADJUST = {"spectral": "original", "adamw": "match_rms_adamw"}


@pytest.mark.parametrize("update_scale", ["spectral", "adamw"])
@pytest.mark.parametrize("shape", SHAPES)
def test_bf16_matches_torch_muon(shape, update_scale):
    hp = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
    ours, theirs = run_pair(
        shape,
        lambda p: Muon(p, update_scale=update_scale, **hp),
        lambda p: torch.optim.Muon(p, adjust_lr_fn=TORCH_ADJUST[update_scale], **hp),
    )
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


@pytest.mark.parametrize("update_scale", ["spectral", "adamw"])
@pytest.mark.parametrize("shape", SHAPES)
def test_fp32_matches_torch_muon_in_fp32(shape, update_scale, monkeypatch):
    # torch.optim.Muon always casts to bf16 with `grad.bfloat16()`; make that an fp32 copy
    # so its whole pipeline (momentum, NS, lr adjustment, decay) runs in fp32.
    monkeypatch.setattr(torch.Tensor, "bfloat16", lambda self, *args, **kwargs: self.float())
    hp = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
    ours, theirs = run_pair(
        shape,
        lambda p: Muon(p, update_scale=update_scale, ns_dtype=torch.float32, **hp),
        lambda p: torch.optim.Muon(p, adjust_lr_fn=TORCH_ADJUST[update_scale], **hp),
    )
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", SHAPES)
def test_match_rms_adamw_scale(shape):
    assert lr_scale(shape, "spectral") == math.sqrt(max(1.0, shape[0] / shape[1]))
    assert lr_scale(shape, "adamw") == 0.2 * math.sqrt(max(shape))
    lr, w0 = 0.01, torch.zeros(shape)
    grad = with_condition_number(shape, 2.0)
    deltas = {}
    for mode in ("spectral", "adamw"):
        p = torch.nn.Parameter(w0.clone())
        p.grad = grad.clone()
        Muon([p], lr=lr, update_scale=mode, ns_dtype=torch.float32).step()
        deltas[mode] = p.detach() - w0
    ratio = lr_scale(shape, "adamw") / lr_scale(shape, "spectral")
    torch.testing.assert_close(deltas["adamw"], ratio * deltas["spectral"])
    # the point of the mode: update RMS ≈ 0.2 lr, AdamW's typical RMS
    rms = deltas["adamw"].pow(2).mean().sqrt() / lr
    assert 0.15 < rms < 0.25


def test_decoupled_weight_decay_and_zero_gradient():
    p = torch.nn.Parameter(torch.ones(4, 3))
    p.grad = torch.zeros(4, 3)
    Muon([p], lr=0.1, weight_decay=0.5).step()
    torch.testing.assert_close(p.detach(), torch.full((4, 3), 0.95))  # W (1 - lr wd), no NaN


def test_momentum_state_and_defaults():
    p = torch.nn.Parameter(torch.randn(6, 4, dtype=torch.bfloat16))
    opt = Muon([p])
    group = opt.param_groups[0]
    assert (group["lr"], group["momentum"], group["nesterov"], group["ns_steps"]) == (
        0.02,
        0.95,
        True,
        5,
    )
    assert (group["weight_decay"], group["ns_dtype"], group["update_scale"]) == (
        0.0,
        torch.bfloat16,
        "spectral",
    )
    p.grad = torch.randn(6, 4, dtype=torch.bfloat16)
    opt.step()
    assert set(opt.state[p]) == {"momentum"}
    assert opt.state[p]["momentum"].dtype == torch.float32  # fp32 state for bf16 params
