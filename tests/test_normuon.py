"""NorMuon: agreement with a literal float64 transcription of the paper's Algorithm 1."""

import math

import pytest
import torch
from references import ns5_float64

from dobb.optim.normuon import NorMuon, normuon_update, normuon_updates

SHAPES = [(24, 16), (16, 24)]  # tall and wide


def normuon_reference(W, grads, *, lr, beta1, beta2, eps, weight_decay, nesterov):
    """Algorithm 1 of arXiv 2510.05491, step by step, in float64."""
    W = W.double().clone()
    m, n = W.shape
    M = torch.zeros_like(W)
    v = torch.zeros(m, 1, dtype=torch.float64)
    for G in grads:
        G = G.double()
        M = beta1 * M + (1 - beta1) * G
        N = (1 - beta1) * G + beta1 * M if nesterov else M
        U = ns5_float64(N)
        v = beta2 * v + (1 - beta2) * (U * U).mean(dim=1, keepdim=True)
        O_hat = U / (v.sqrt() + eps)
        eta_hat = 0.2 * lr * math.sqrt(m * n) / O_hat.norm()
        W = W - lr * weight_decay * W - eta_hat * O_hat
    return W


def run(shape, grads, **options):
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(shape, generator=g, dtype=torch.float64)
    p = torch.nn.Parameter(w0.clone())
    opt = NorMuon([p], ns_dtype=torch.float64, **options)
    for G in grads:
        p.grad = G.clone()
        opt.step()
    return w0, p.detach()


def gradients(shape, steps=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    # rows of very different scales, so the neuron-wise normalization matters
    scales = torch.logspace(-1, 1, shape[0], dtype=torch.float64)[:, None]
    return [torch.randn(shape, generator=g, dtype=torch.float64) * scales for _ in range(steps)]


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_float64_transcription_of_algorithm_1(shape, nesterov):
    hp = dict(lr=0.02, momentum=0.9, beta2=0.8, eps=1e-8, weight_decay=0.1, nesterov=nesterov)
    grads = gradients(shape)
    w0, ours = run(shape, grads, **hp)
    ref = normuon_reference(
        w0,
        grads,
        lr=hp["lr"],
        beta1=hp["momentum"],
        beta2=hp["beta2"],
        eps=hp["eps"],
        weight_decay=hp["weight_decay"],
        nesterov=nesterov,
    )
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(ours, w0)


@pytest.mark.parametrize("shape", SHAPES)
def test_update_rms_is_0_2_lr_and_first_step_balances_neurons(shape):
    lr = 0.01
    w0, w1 = run(shape, gradients(shape, steps=1), lr=lr)
    update = (w0 - w1) / lr
    torch.testing.assert_close(update.square().mean().sqrt().item(), 0.2, rtol=1e-9, atol=0)
    # step 1: v = (1 - β2) mean_cols(O²), so every row of Ô has the same RMS (up to ε)
    row_rms = update.square().mean(dim=1).sqrt()
    torch.testing.assert_close(row_rms, torch.full_like(row_rms, 0.2), rtol=1e-5, atol=0)


def test_row_second_moment_is_per_row_state_and_zero_gradient_is_harmless():
    p = torch.nn.Parameter(torch.ones(6, 4))
    p.grad = torch.zeros(6, 4)
    opt = NorMuon([p], lr=0.1, weight_decay=0.5)
    opt.step()
    assert opt.state[p]["row_second_moment"].shape == (6, 1)
    torch.testing.assert_close(p.detach(), torch.full((6, 4), 0.95))  # W (1 - lr wd), no NaN


# three of one shape (one with a zero gradient), two wide, a lone tall matrix
BATCH_SHAPES = [(12, 8)] * 3 + [(6, 10)] * 2 + [(16, 4)]


@pytest.mark.parametrize(
    "ns_dtype, param_dtype", [(torch.float64, torch.float64), (torch.bfloat16, torch.bfloat16)]
)
@pytest.mark.parametrize("nesterov", [False, True])
def test_normuon_updates_equal_normuon_update_per_matrix(nesterov, ns_dtype, param_dtype):
    """The batched step (what the optimizer runs on unshared matrices) against the
    per-matrix reference: one NS5 per stack, each matrix normalized by its own norms."""
    hp = dict(lr=0.02, beta=0.9, beta2=0.8, eps=1e-8, weight_decay=0.1, nesterov=nesterov)
    hp["ns_dtype"] = ns_dtype
    state_dtype = torch.promote_types(param_dtype, torch.float32)
    g = torch.Generator().manual_seed(4)
    W = [torch.randn(s, generator=g, dtype=torch.float64).to(param_dtype) for s in BATCH_SHAPES]
    M = [torch.zeros(s, dtype=state_dtype) for s in BATCH_SHAPES]
    V = [torch.zeros(s[0], 1, dtype=state_dtype) for s in BATCH_SHAPES]
    W2, M2, V2 = ([t.clone() for t in ts] for ts in (W, M, V))
    for _ in range(3):
        # rows and matrices of very different scales
        G = [
            (torch.randn(s, generator=g, dtype=torch.float64) * 10.0**i).to(param_dtype)
            for i, s in enumerate(BATCH_SHAPES)
        ]
        G[1].zero_()
        for w, grad, m, v in zip(W, G, M, V):
            normuon_update(w, grad, m, v, **hp)
        normuon_updates(W2, G, M2, V2, **hp)
    for a, b in zip(M, M2):  # the same foreach kernels
        assert torch.equal(a, b)
    # fp64: batched and lone matmuls round alike to a few ulps; bf16: NS5 may differ by an
    # ulp of O (2^-8), which v and the update carry, and W by a bf16 rounding
    tight = ns_dtype == torch.float64
    for a, b in zip(V, V2):
        torch.testing.assert_close(b, a, rtol=1e-10 if tight else 0.02, atol=1e-12 if tight else 0)
    for a, b in zip(W, W2):
        rtol, atol = (1e-10, 1e-12) if tight else (2**-7, 0.02 * 2**-7)
        torch.testing.assert_close(b, a, rtol=rtol, atol=atol)
