"""Dion2: agreement with a literal float64 transcription of its algorithm, and its rules."""

import math

import pytest
import torch
from references import BATCH_BLOCKS, BATCH_SHAPES, block_sizes, ns5_float64

from dobb.optim.dion2 import Dion2, dion2_update, dion2_updates, select_rows
from dobb.optim.dion_core import shape_scale
from dobb.optim.muon import Muon


def dion2_reference(W, grads, *, lr, fraction, ef_decay, weight_decay, blocks):
    """Dion2 step by step in float64: per block the top ceil(f m_b) rows by L1 norm."""
    W = W.double().clone()
    m, n = W.shape
    M = torch.zeros_like(W)
    for G in grads:
        M = M + G.double()
        S, start = [], 0
        for size in block_sizes(m, blocks):
            if size:
                k = max(1, math.ceil(fraction * size))
                norms = M[start : start + size].abs().sum(dim=1)
                S += sorted((start + norms.argsort(descending=True)[:k]).tolist())
            start += size
        U = ns5_float64(M[S])
        M[S] = ef_decay * M[S]
        W = (1 - lr * weight_decay) * W
        W[S] = W[S] - lr * math.sqrt(m / n) * U
    return W


def run(shape, grads, **options):
    w0 = torch.randn(shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    p = torch.nn.Parameter(w0.clone())
    opt = Dion2([p], **options)
    for G in grads:
        p.grad = G.clone()
        opt.step()
    return w0, p.detach(), opt.state[p]["momentum"]


def gradients(shape, steps=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(steps)]


@pytest.mark.parametrize("shape", [(18, 16), (16, 24)])
@pytest.mark.parametrize("blocks, fraction", [(1, 0.25), (4, 0.25), (3, 0.5)])
def test_matches_float64_transcription(shape, blocks, fraction):
    hp = dict(lr=0.02, ef_decay=0.9, weight_decay=0.1)
    grads = gradients(shape)
    options = dict(row_blocks=blocks, row_fraction=fraction, ns_dtype=torch.float64)
    w0, ours, _ = run(shape, grads, **options, **hp)
    ref = dion2_reference(w0, grads, blocks=blocks, fraction=fraction, **hp)
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12)


def test_only_selected_rows_move_and_the_rest_accumulate():
    shape = (16, 8)
    grads = gradients(shape, steps=1)
    w0, w1, momentum = run(shape, grads, lr=0.1, weight_decay=0.0, row_fraction=0.25)
    moved = (w1 != w0).any(dim=1)
    assert int(moved.sum()) == 4  # ceil(0.25 * 16)
    # the moved rows are the 4 of largest L1 norm; their momentum decayed, the rest kept G
    top = grads[0].abs().sum(dim=1).topk(4).indices
    assert set(moved.nonzero().flatten().tolist()) == set(top.tolist())
    torch.testing.assert_close(momentum[~moved], grads[0][~moved], rtol=0, atol=0)
    torch.testing.assert_close(momentum[moved], 0.95 * grads[0][moved], rtol=0, atol=0)


def test_all_rows_without_feedback_is_muon_without_momentum():
    shape = (24, 16)  # tall: Muon's sqrt(max(1, m/n)) equals Dion2's sqrt(m/n)
    grads = [g.float() for g in gradients(shape, steps=3)]
    a, b = (torch.nn.Parameter(torch.ones(shape)) for _ in range(2))
    dion2 = Dion2([a], lr=0.02, row_fraction=1.0, ef_decay=0.0, ns_dtype=torch.float32)
    muon = Muon([b], lr=0.02, momentum=0.0, weight_decay=0.01, ns_dtype=torch.float32)
    for G in grads:
        a.grad, b.grad = G.clone(), G.clone()
        dion2.step()
        muon.step()
    torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)


def test_select_rows_per_block():
    M = torch.tensor([[1.0, 1.0], [5.0, 0.0], [0.0, -3.0], [2.0, 2.0], [9.0, 0.0]])
    # blocks of 3 and 2 rows, fraction 0.5: 2 of the first block (rows 1, 2), 1 of the second
    assert select_rows(M, [3, 2], 0.5).tolist() == [1, 2, 4]
    assert select_rows(M, [5, 0], 0.1).tolist() == [4]  # at least one row per block


@pytest.mark.parametrize(
    "ns_dtype, param_dtype", [(torch.float64, torch.float64), (torch.bfloat16, torch.bfloat16)]
)
def test_dion2_updates_equal_dion2_update_per_matrix(ns_dtype, param_dtype):
    """The batched step (what the optimizer runs on unshared matrices) against the
    per-matrix reference: the same rows selected, decayed and updated in each matrix."""
    hp = dict(lr=0.05, row_fraction=0.25, ef_decay=0.9, weight_decay=0.1, ns_dtype=ns_dtype)
    state_dtype = torch.promote_types(param_dtype, torch.float32)
    g = torch.Generator().manual_seed(5)
    W = [torch.randn(s, generator=g, dtype=torch.float64).to(param_dtype) for s in BATCH_SHAPES]
    M = [torch.zeros(s, dtype=state_dtype) for s in BATCH_SHAPES]
    W2, M2 = [w.clone() for w in W], [m.clone() for m in M]
    scales = [shape_scale(s) for s in BATCH_SHAPES]
    for _ in range(3):
        G = [torch.randn(s, generator=g, dtype=torch.float64).to(param_dtype) for s in BATCH_SHAPES]
        for w, grad, m, blocks, scale in zip(W, G, M, BATCH_BLOCKS, scales):
            dion2_update(w, grad, m, blocks, scale=scale, **hp)
        dion2_updates(W2, G, M2, BATCH_BLOCKS, scales=scales, **hp)
    for a, b in zip(M, M2):  # the same rows selected and decayed: the same bits
        assert torch.equal(a, b)
    # fp64: batched and lone matmuls round alike to a few ulps; bf16: NS5 may differ by an
    # ulp of O (2^-8) times lr s, and W by one bf16 rounding
    tight = ns_dtype == torch.float64
    for a, b in zip(W, W2):
        rtol, atol = (1e-10, 1e-12) if tight else (2**-8, 0.05 * max(scales) * 2**-8)
        torch.testing.assert_close(b, a, rtol=rtol, atol=atol)
