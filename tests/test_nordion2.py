"""NorDion2: agreement with a literal float64 transcription of its formula, the batched
form against the per-matrix reference, and its rules."""

import math

import pytest
import torch
from references import (
    BATCH_BLOCKS,
    BATCH_SHAPES,
    block_sizes,
    ns5_float64,
    polar_express_float64,
)

from dobb.optim.dion_core import shape_scale
from dobb.optim.nordion2 import NorDion2, nordion2_update, nordion2_updates

ORTHOGONALIZE = {"quintic": ns5_float64, "polar_express": lambda G: polar_express_float64(G, 5)}


def nordion2_reference(W, grads, *, lr, fraction, ef_decay, beta2, eps, weight_decay, blocks, ns):
    """NorDion2 step by step in float64, as the authors' code computes it: Dion2's rows,
    NorMuon's row normalization of the selected rows, their Frobenius norm kept."""
    W = W.double().clone()
    m, n = W.shape
    M = torch.zeros_like(W)
    v = torch.zeros(m, 1, dtype=torch.float64)
    for G in grads:
        M = M + G.double()
        S, start = [], 0
        for size in block_sizes(m, blocks):
            if size:
                k = max(1, math.ceil(fraction * size))
                norms = M[start : start + size].abs().sum(dim=1)
                S += sorted((start + norms.argsort(descending=True)[:k]).tolist())
            start += size
        U = ORTHOGONALIZE[ns](M[S])
        M[S] = ef_decay * M[S]
        v[S] = beta2 * v[S] + (1 - beta2) * (U * U).mean(dim=1, keepdim=True)
        U_hat = U / (v[S].sqrt() + eps)
        U_hat = U_hat * U.norm() / U_hat.norm()
        W = (1 - lr * weight_decay) * W
        W[S] = W[S] - lr * math.sqrt(m / n) * U_hat
    return W


def gradients(shape, steps=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    # rows of very different scales, so the neuron-wise normalization matters
    scales = torch.logspace(-1, 1, shape[0], dtype=torch.float64)[:, None]
    return [torch.randn(shape, generator=g, dtype=torch.float64) * scales for _ in range(steps)]


def run(shape, grads, **options):
    w0 = torch.randn(shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    p = torch.nn.Parameter(w0.clone())
    opt = NorDion2([p], ns_dtype=torch.float64, **options)
    for G in grads:
        p.grad = G.clone()
        opt.step()
    return w0, p.detach(), opt.state[p]


@pytest.mark.parametrize("ns", ["polar_express", "quintic"])
@pytest.mark.parametrize("shape", [(18, 16), (16, 24)])
@pytest.mark.parametrize("blocks, fraction", [(1, 0.25), (4, 0.25), (3, 0.5)])
def test_matches_float64_transcription(shape, blocks, fraction, ns):
    hp = dict(lr=0.02, ef_decay=0.9, beta2=0.9, eps=1e-8, weight_decay=0.1)
    grads = gradients(shape)
    options = dict(row_blocks=blocks, row_fraction=fraction, ns_coefficients=ns)
    w0, ours, _ = run(shape, grads, **options, **hp)
    ref = nordion2_reference(w0, grads, blocks=blocks, fraction=fraction, ns=ns, **hp)
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12)


def test_only_the_selected_rows_move_and_keep_the_norm_of_o():
    shape = (16, 8)
    grads = gradients(shape, steps=1)
    w0, w1, state = run(shape, grads, lr=0.1, weight_decay=0.0, row_fraction=0.25)
    moved = (w1 != w0).any(dim=1)
    assert int(moved.sum()) == 4  # ceil(0.25 * 16)
    # v moved on those rows only; their momentum decayed, the rest kept G
    v = state["row_second_moment"].flatten()
    assert torch.equal(v != 0, moved)
    torch.testing.assert_close(state["momentum"][~moved], grads[0][~moved], rtol=0, atol=0)
    # the update has the Frobenius norm of the 4 x 8 orthogonalized rows (about 2)
    step = ((w1 - w0) / (0.1 * math.sqrt(16 / 8))).norm()
    selected = grads[0][moved]
    assert abs(step - polar_express_float64(selected, 5).norm()) < 1e-9


def test_defaults_follow_the_authors_code():
    # but lr: the registry's 0.02 (the authors' code: 0.01), one default per option
    opt = NorDion2([torch.nn.Parameter(torch.zeros(4, 4))])
    group = opt.param_groups[0]
    expected = dict(lr=0.02, row_fraction=0.25, ef_decay=0.95, beta2=0.95, eps=1e-8)
    assert {key: group[key] for key in expected} == expected
    assert group["weight_decay"] == 0.01 and group["ns_coefficients"] == "polar_express"
    assert group["ns_dtype"] == torch.bfloat16 and group["row_blocks"] is None


@pytest.mark.parametrize(
    "ns_dtype, param_dtype", [(torch.float64, torch.float64), (torch.bfloat16, torch.bfloat16)]
)
def test_nordion2_updates_equal_nordion2_update_per_matrix(ns_dtype, param_dtype):
    """The batched step (what the optimizer runs on unshared matrices) against the
    per-matrix reference: the same rows selected, normalized and updated in each matrix."""
    hp = dict(lr=0.05, row_fraction=0.25, ef_decay=0.9, beta2=0.9, eps=1e-8, weight_decay=0.1)
    hp["ns_dtype"] = ns_dtype
    state_dtype = torch.promote_types(param_dtype, torch.float32)
    g = torch.Generator().manual_seed(5)
    W = [torch.randn(s, generator=g, dtype=torch.float64).to(param_dtype) for s in BATCH_SHAPES]
    M = [torch.zeros(s, dtype=state_dtype) for s in BATCH_SHAPES]
    V = [torch.zeros(s[0], 1, dtype=state_dtype) for s in BATCH_SHAPES]
    W2, M2, V2 = [w.clone() for w in W], [m.clone() for m in M], [v.clone() for v in V]
    scales = [shape_scale(s) for s in BATCH_SHAPES]
    for _ in range(3):
        G = [torch.randn(s, generator=g, dtype=torch.float64).to(param_dtype) for s in BATCH_SHAPES]
        for w, grad, m, v, blocks, scale in zip(W, G, M, V, BATCH_BLOCKS, scales):
            nordion2_update(w, grad, m, v, blocks, scale=scale, **hp)
        nordion2_updates(W2, G, M2, V2, BATCH_BLOCKS, scales=scales, **hp)
    for a, b in zip(M, M2):  # the same rows selected and decayed: the same bits
        assert torch.equal(a, b)
    tight = ns_dtype == torch.float64
    for a, b in zip(V, V2):
        torch.testing.assert_close(b, a, rtol=1e-10 if tight else 2**-7, atol=1e-12)
    # fp64: batched and lone matmuls round alike to a few ulps; bf16: NS may differ by an
    # ulp of O (2^-8) times lr s, and W by one bf16 rounding
    for a, b in zip(W, W2):
        rtol, atol = (1e-10, 1e-12) if tight else (2**-8, 0.05 * max(scales) * 2**-6)
        torch.testing.assert_close(b, a, rtol=rtol, atol=atol)
