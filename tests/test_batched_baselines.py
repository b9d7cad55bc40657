"""Batched Muon, MuonBP and AdamW/Lion: equal to their per-matrix references, and a step
whose dispatched op count does not grow with depth.

The per-matrix functions (``muon_update``, ``block_muon_update``, ``adamw_update``,
``lion_update``) are the readable references; the optimizers run the batched forms
(``muon_updates``, ``block_muon_updates``, ``adamw_updates``, ``lion_updates``): foreach
kernels for the elementwise steps, one Newton-Schulz per stack of same-shape matrices.
"""

import pytest
import torch
from opcount import count_steps
from torch import nn

from dobb.optim.batching import foreach_mul_, group_by, stack_apply
from dobb.optim.muon import Muon, lr_scale, muon_update, muon_updates
from dobb.optim.muonbp import MuonBP, block_muon_update, block_muon_updates, block_tiles
from dobb.optim.scalar import adamw_update, adamw_updates, lion_update, lion_updates

# three of one shape, one of another (batched), a lone tall and a lone wide matrix
SHAPES = [(12, 8), (12, 8), (12, 8), (6, 10), (6, 10), (16, 4), (3, 9)]


def tensors(shapes, seed, scale=1.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [(scale * torch.randn(s, generator=g)).to(dtype) for s in shapes]


def clone(ts):
    return [t.clone() for t in ts]


@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_updates_equal_muon_update_per_matrix(ns_dtype, nesterov):
    hp = dict(lr=0.05, beta=0.9, nesterov=nesterov, weight_decay=0.1, ns_dtype=ns_dtype)
    W, M = tensors(SHAPES, 0), [torch.zeros(s) for s in SHAPES]
    W_ref, M_ref = clone(W), clone(M)
    for step in range(3):
        # gradients of very different sizes: NS5 must normalize each matrix by its own norm
        G = [g * 10.0**i for i, g in enumerate(tensors(SHAPES, 1 + step))]
        scales = [lr_scale(s, "spectral") for s in SHAPES]
        muon_updates(W, clone(G), M, scales=scales, **hp)
        for w, g, m, s in zip(W_ref, G, M_ref, scales):
            muon_update(w, g, m, scale=s, **hp)
    for a, b in zip(M, M_ref):  # the same foreach kernels: the same bits
        assert torch.equal(a, b)
    # batched and lone matmuls may round differently: in bf16 by one ulp of O (2^-8 at
    # |O| ~ 1), times lr s; in fp32 to float rounding
    atol = 0.05 * max(scales) * 2**-8 if ns_dtype == torch.bfloat16 else 1e-7
    for a, b in zip(W, W_ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=atol)


def test_muon_optimizer_equals_the_reference_loop_with_bf16_params():
    """The class (batched) against ``muon_update`` per matrix, bf16 weights, fp32 state."""
    W0 = tensors(SHAPES, 2, dtype=torch.bfloat16)
    params = [nn.Parameter(w.clone()) for w in W0]
    opt = Muon(params, lr=0.02, weight_decay=0.1, ns_dtype=torch.float32)
    W_ref, M_ref = clone(W0), [torch.zeros(s) for s in SHAPES]
    for step in range(3):
        G = tensors(SHAPES, 10 + step, dtype=torch.bfloat16)
        for p, g in zip(params, G):
            p.grad = g.clone()
        opt.step()
        for w, g, m in zip(W_ref, G, M_ref):
            hp = dict(lr=0.02, beta=0.95, nesterov=True, weight_decay=0.1)
            muon_update(w, g, m, scale=lr_scale(w.shape, "spectral"), ns_dtype=torch.float32, **hp)
    for p, w, m in zip(params, W_ref, M_ref):
        assert opt.state[p]["momentum"].dtype == torch.float32
        torch.testing.assert_close(opt.state[p]["momentum"], m, rtol=0, atol=0)
        # lone and batched NS5 may round apart in fp32: within one bf16 rounding of W
        torch.testing.assert_close(p.detach(), w, rtol=2**-8, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_foreach_mul_equals_mul_in_every_dtype(dtype):
    # 1 - lr wd = 0.998 is 0.99609375 in bf16: a multiply must not round the factor first
    ts = tensors([(50,), (7, 3)], 7, dtype=dtype)
    expected = [t * 0.998 for t in ts]
    foreach_mul_(ts, 0.998)
    for a, b in zip(ts, expected):
        assert torch.equal(a, b)


def test_stack_apply_stacks_equal_shapes_and_keys_once():
    ts = tensors([(2, 3), (2, 3), (3, 2), (2, 3)], 8)
    calls = []

    def fn(x, k):
        calls.append((tuple(x.shape), k))
        return x * k

    out = stack_apply(ts, fn, key=lambda i: 2.0 if i < 3 else 3.0)
    assert calls == [((2, 2, 3), 2.0), ((3, 2), 2.0), ((2, 3), 3.0)]
    for t, o, k in zip(ts, out, (2.0, 2.0, 2.0, 3.0)):
        assert torch.equal(o, t * k)
    assert group_by("abab", str.upper) == {"A": [0, 2], "B": [1, 3]}


@pytest.mark.parametrize("row_blocks, col_blocks", [(1, 1), (2, 1), (2, 3), ((2, 2), 1)])
def test_block_muon_updates_equal_block_muon_update_per_piece(row_blocks, col_blocks):
    shapes = SHAPES + [(2, 9)]  # with (2, 2) rows: empty tiles
    hp = dict(lr=0.05, beta=0.9, nesterov=True, weight_decay=0.1, update_scale="adamw")
    hp["ns_dtype"] = torch.float32
    W, M = tensors(shapes, 3), [torch.zeros(s) for s in shapes]
    W_ref, M_ref = clone(W), clone(M)
    tilings = [block_tiles(s, row_blocks, col_blocks) for s in shapes]
    for step in range(2):
        G = tensors(shapes, 20 + step)
        block_muon_updates(W, clone(G), M, tilings, **hp)
        for w, g, m, tiles in zip(W_ref, G, M_ref, tilings):
            block_muon_update(w, g, m, tiles, **hp)
    for a, b in zip(W + M, W_ref + M_ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_muonbp_optimizer_equals_the_reference_loop():
    """MuonBP (period 2: full, block, full) against the per-matrix references."""
    hp = dict(lr=0.05, momentum=0.9, weight_decay=0.1, ns_dtype=torch.float32)
    W0 = tensors(SHAPES, 9)
    params = [nn.Parameter(w.clone()) for w in W0]
    opt = MuonBP(params, period=2, block_lr_ratio=0.5, row_blocks=2, col_blocks=2, **hp)
    W_ref, M_ref = clone(W0), [torch.zeros(s) for s in SHAPES]
    ref = dict(beta=0.9, nesterov=True, weight_decay=0.1, ns_dtype=torch.float32)
    for step in range(3):
        G = tensors(SHAPES, 60 + step)
        for p, g in zip(params, G):
            p.grad = g.clone()
        opt.step()
        for w, g, m in zip(W_ref, G, M_ref):
            if step % 2 == 0:
                scale = lr_scale(w.shape, "adamw")
                muon_update(w, g, m, lr=0.05, scale=scale, **ref)
            else:
                tiles = block_tiles(w.shape, 2, 2)
                block_muon_update(w, g, m, tiles, lr=0.025, update_scale="adamw", **ref)
    for p, w, m in zip(params, W_ref, M_ref):
        assert torch.equal(opt.state[p]["momentum"], m)
        assert opt.state[p]["step"].item() == 3
        torch.testing.assert_close(p.detach(), w, rtol=1e-6, atol=1e-7)


SCALAR_SHAPES = [(7,), (5, 3), (7,), (4, 2, 3)]


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adamw_updates_equal_adamw_update_bit_for_bit(weight_decay):
    hp = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay)
    P = tensors(SCALAR_SHAPES, 4)
    m, v = [torch.zeros_like(p) for p in P], [torch.zeros_like(p) for p in P]
    P_ref, m_ref, v_ref = clone(P), clone(m), clone(v)
    for step in range(1, 5):
        G = tensors(SCALAR_SHAPES, 30 + step)
        adamw_updates(P, G, m, v, [float(step)] * len(P), **hp)
        for args in zip(P_ref, G, m_ref, v_ref):
            adamw_update(*args, step, **hp)
    for a, b in zip(P + m + v, P_ref + m_ref + v_ref):
        assert torch.equal(a, b)


def test_lion_updates_equal_lion_update_bit_for_bit():
    hp = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    P = tensors(SCALAR_SHAPES, 5)
    m = [torch.zeros_like(p) for p in P]
    P_ref, m_ref = clone(P), clone(m)
    for step in range(4):
        G = tensors(SCALAR_SHAPES, 40 + step)
        lion_updates(P, G, m, **hp)
        for args in zip(P_ref, G, m_ref):
            lion_update(*args, **hp)
    for a, b in zip(P + m, P_ref + m_ref):
        assert torch.equal(a, b)


@pytest.mark.parametrize("foreach", [None, True])
def test_adamw_group_of_muon_matches_torch_adamw_bit_for_bit(foreach):
    hp = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    P0 = tensors(SCALAR_SHAPES, 6)
    ours = [nn.Parameter(p.clone()) for p in P0]
    theirs = [nn.Parameter(p.clone()) for p in P0]
    opt = Muon([{"params": ours, "algorithm": "adamw", **hp}])
    ref = torch.optim.AdamW(theirs, foreach=foreach, **hp)
    for step in range(4):
        for a, b, g in zip(ours, theirs, tensors(SCALAR_SHAPES, 50 + step)):
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[a][key], ref.state[b][key]), key
        assert opt.state[a]["step"].device.type == "cpu"
        assert opt.state[a]["step"].dtype == ref.state[b]["step"].dtype


@pytest.mark.parametrize("scalar_algorithm", ["adamw", "lion"])
@pytest.mark.parametrize("name", ["muon", "muonbp", "blockmuon"])
def test_ops_per_step_do_not_grow_with_depth(name, scalar_algorithm):
    # 4 blocks: 24 matrices, 11 scalar tensors; 16 blocks: 96 and 35. Before batching a
    # steady Muon step dispatched 800 ops at 4 blocks and 3,080 at 16 (3.85x).
    # muonbp's 5 steps hold a full step (its period) and block steps.
    options = dict(steps=5, warmup_steps=1, scalar_algorithm=scalar_algorithm, foreach=True)
    shallow, deep = count_steps(name, 4, **options), count_steps(name, 16, **options)
    for a, b in zip(shallow, deep):
        assert b.total <= 1.15 * a.total, (a.total, b.total)
        # the only host read: the non-finite check (AdamW's per-tensor .item() is gone)
        assert a.host_reads == b.host_reads == 1
