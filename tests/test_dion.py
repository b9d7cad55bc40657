"""Dion: the power step, error feedback, orthonormalization, and Algorithm 1 itself."""

import math

import pytest
import torch

from dobb.optim.dion import Dion
from dobb.optim.dion_core import (
    dion_update,
    dion_updates,
    error_feedback,
    orthonormalize,
    power_step,
    randomized_cholesky_qr,
    rank_of,
)
from dobb.optim.dion_sharded import DionMatrix, dion_step

SHAPES = [(24, 16), (16, 24)]  # tall and wide


def with_singular_values(shape, values, seed=0, dtype=torch.float64):
    """``U diag(values) Vᵀ`` with random orthonormal ``U``, ``V``; returns (M, U, V)."""
    g = torch.Generator().manual_seed(seed)
    k = len(values)
    U = torch.linalg.qr(torch.randn(shape[0], k, generator=g, dtype=dtype)).Q
    V = torch.linalg.qr(torch.randn(shape[1], k, generator=g, dtype=dtype)).Q
    return U @ torch.diag(torch.tensor(values, dtype=dtype)) @ V.T, U, V


def directions(M, rank, steps, mu=1.0, **options):
    """Dion's update direction ``P Qᵀ`` at each step: ``M`` as the first gradient, then 0."""
    p = torch.nn.Parameter(torch.zeros_like(M))
    opt = Dion([p], lr=1.0, momentum=mu, weight_decay=0.0, rank=rank, **options)
    scale = math.sqrt(M.shape[0] / M.shape[1])
    out = []
    for t in range(steps):
        before = p.detach().clone()
        p.grad = M.clone() if t == 0 else torch.zeros_like(M)
        opt.step()
        out.append((before - p.detach()) / scale)  # W <- W - lr scale P Qᵀ
    return out, opt.state[p]


@pytest.mark.parametrize("shape", SHAPES)
def test_direction_converges_to_polar_factor_of_best_rank_r(shape):
    # mu = 1 keeps B fixed, so the warm-started power steps converge; r = 4 of 6 values
    M, U, V = with_singular_values(shape, [8.0, 6.0, 4.0, 2.0, 0.5, 0.25])
    polar_r = U[:, :4] @ V[:, :4].T
    steps, state = directions(M, rank=4, steps=40)
    errors = [(d - polar_r).norm().item() for d in steps]
    assert errors[-1] < 1e-8 and errors[-1] < errors[0]
    torch.testing.assert_close(state["momentum"], M)  # mu = 1: nothing removed


@pytest.mark.parametrize("rank", [3, 5])
@pytest.mark.parametrize("shape", SHAPES)
def test_rank_at_least_rank_of_M_recovers_its_polar_factor(shape, rank):
    M, U, V = with_singular_values(shape, [3.0, 2.0, 1.0])  # rank(M) = 3
    steps, _ = directions(M, rank=rank, steps=40)
    torch.testing.assert_close(steps[-1], U @ V.T, atol=1e-6, rtol=0)
    # and one step already captures all of M: with mu = 0 the buffer is emptied
    _, state = directions(M, rank=rank, steps=1, mu=0.0)
    assert state["momentum"].abs().max() < 1e-12


@pytest.mark.parametrize("mu", [0.0, 0.9, 1.0])
def test_error_feedback_removes_exactly_the_captured_component(mu):
    g = torch.Generator().manual_seed(4)
    B = torch.randn(32, 16, generator=g, dtype=torch.float64)
    Q = torch.randn(16, 4, generator=g, dtype=torch.float64)
    P, R = power_step(B, Q)
    torch.testing.assert_close(P.T @ P, torch.eye(4, dtype=torch.float64))
    torch.testing.assert_close(R, B.T @ P)
    M = B.clone()
    error_feedback(M, P, R, mu)
    torch.testing.assert_close(M, B - (1 - mu) * P @ R.T)
    # inside span(P) a (1 - mu) share is removed; outside it nothing changes
    torch.testing.assert_close(P.T @ M, mu * P.T @ B)
    outside = torch.eye(32, dtype=torch.float64) - P @ P.T
    torch.testing.assert_close(outside @ M, outside @ B)


def signs_aligned(A, B):
    """``B`` with each column's sign flipped to agree with ``A`` (QR is unique up to signs)."""
    return B * torch.sign(torch.sum(A * B, dim=0, keepdim=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("cond", [1.0, 1e4])
def test_householder_and_randomized_cholesky_qr_agree(cond, dtype):
    values = torch.logspace(0, -math.log10(cond), 8).tolist()
    P, _, _ = with_singular_values((300, 8), values, seed=5, dtype=dtype)
    householder = orthonormalize(P, "qr")
    cholesky = randomized_cholesky_qr(P, generator=torch.Generator().manual_seed(0))
    assert cholesky is not None  # the sketch keeps Cholesky QR stable at cond 1e4 in fp32
    eye = torch.eye(8, dtype=dtype)
    torch.testing.assert_close(cholesky.T @ cholesky, eye, atol=1e-5 if cond == 1 else 1e-4, rtol=0)
    # the last columns of any QR of P are only determined to about eps * cond(P)
    tol = max(10 * torch.finfo(dtype).eps * cond, 1e-10)
    torch.testing.assert_close(signs_aligned(householder, cholesky), householder, atol=tol, rtol=0)


def test_cholesky_qr_falls_back_to_householder_on_rank_deficiency():
    P = torch.randn(50, 4, generator=torch.Generator().manual_seed(6))
    P[:, 3] = 0.0  # rank 3: the sketch's R is singular, so the Cholesky step fails
    assert randomized_cholesky_qr(P) is None
    basis = orthonormalize(P, "cholesky_qr")
    torch.testing.assert_close(basis, torch.linalg.qr(P).Q)
    torch.testing.assert_close(basis.T @ basis, torch.eye(4), atol=1e-5, rtol=0)


def paper_dion(W, grads, Q, *, lr, mu, weight_decay):
    """Algorithm 1 of arXiv 2504.05295 by the library's reference ``dion_update`` (Householder
    QR, the box's ``Orthogonalize``), from ``M = 0``: the test oracle."""
    W, M, Q = W.clone(), torch.zeros_like(W), Q.clone()
    m, n = W.shape
    for G in grads:
        dion_update(W, G, M, Q, lr=lr, mu=mu, weight_decay=weight_decay, scale=math.sqrt(m / n))
    return W, M


@pytest.mark.parametrize("orthogonalize", ["qr", "cholesky_qr"])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_algorithm_1(shape, orthogonalize):
    g = torch.Generator().manual_seed(7)
    w0 = torch.randn(shape, generator=g, dtype=torch.float64)
    grads = [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(5)]
    p = torch.nn.Parameter(w0.clone())
    opt = Dion([p], lr=0.1, momentum=0.9, weight_decay=0.1, rank=3, orthogonalize=orthogonalize)
    p.grad = torch.zeros(shape, dtype=torch.float64)
    opt.step()  # a zero step: builds state, keeps Q_0, only decays W
    start, Q0 = p.detach().clone(), opt.state[p]["Q"].clone()
    assert Q0.shape == (shape[1], 3)
    for G in grads:
        p.grad = G.clone()
        opt.step()
    W, M = paper_dion(start, grads, Q0, lr=0.1, mu=0.9, weight_decay=0.1)
    # Householder vs Cholesky QR flip column signs of P, which cancel in P Rᵀ and P Qᵀ
    torch.testing.assert_close(p.detach(), W, atol=1e-10, rtol=0)
    torch.testing.assert_close(opt.state[p]["momentum"], M, atol=1e-10, rtol=0)
    Q = opt.state[p]["Q"]
    torch.testing.assert_close(Q.norm(dim=0), torch.ones(3, dtype=torch.float64))


@pytest.mark.parametrize("orthogonalize", ["qr", "cholesky_qr"])
def test_zero_momentum_gives_no_nan(orthogonalize):
    p = torch.nn.Parameter(torch.ones(12, 8))
    opt = Dion([p], lr=0.1, weight_decay=0.5, rank=2, orthogonalize=orthogonalize)
    for _ in range(2):
        p.grad = torch.zeros(12, 8)
        opt.step()
    state = opt.state[p]
    Q0 = state["Q"].clone()
    torch.testing.assert_close(p.detach(), torch.full((12, 8), 0.95**2))  # decay only
    assert not state["momentum"].any() and torch.isfinite(state["Q"]).all()
    p.grad = torch.randn(12, 8)
    opt.step()
    assert torch.isfinite(p).all() and not torch.equal(state["Q"], Q0)


@pytest.mark.parametrize(
    "shape, rank_fraction, rank, expected",
    [
        ((64, 48), 1 / 16, None, 3),  # ceil(48 / 16)
        ((30, 100), 0.1, None, 3),  # ceil(0.1 * 30)
        ((30, 100), 0.01, None, 1),  # ceil rounds 0.3 up
        ((100, 100), 0.07, None, 7),  # not 8, although 0.07 * 100 = 7.000000000000001
        ((30, 100), 1 / 16, 5, 5),  # an absolute rank overrides the fraction
        ((30, 100), 1 / 16, 64, 30),  # capped at min(d_out, d_in)
    ],
)
def test_rank_from_rank_fraction(shape, rank_fraction, rank, expected):
    assert rank_of(shape, rank_fraction, rank) == expected
    p = torch.nn.Parameter(torch.zeros(shape))
    opt = Dion([p], rank_fraction=rank_fraction, rank=rank)
    p.grad = torch.ones(shape)
    opt.step()
    assert opt.state[p]["Q"].shape == (shape[1], expected)


def test_initial_Q_is_the_same_on_every_replica_and_differs_per_matrix():
    def first_Q(name, seed=0):
        p = torch.nn.Parameter(torch.zeros(10, 6))
        opt = Dion([{"params": [(name, p)]}], rank=2, seed=seed)
        p.grad = torch.zeros(10, 6)
        opt.step()
        return opt.state[p]["Q"]

    assert torch.equal(first_Q("blocks.0.fc.weight"), first_Q("blocks.0.fc.weight"))
    assert not torch.equal(first_Q("blocks.0.fc.weight"), first_Q("blocks.1.fc.weight"))
    assert not torch.equal(first_Q("blocks.0.fc.weight"), first_Q("blocks.0.fc.weight", seed=1))


def test_defaults():
    # the registry's (lr 0.01: the tuned rate and the reference's; randomized Cholesky QR)
    p = torch.nn.Parameter(torch.zeros(8, 8))
    group = Dion([p]).param_groups[0]
    assert (group["lr"], group["momentum"], group["weight_decay"]) == (0.01, 0.95, 0.01)
    expected = (1 / 16, None, "cholesky_qr")
    assert (group["rank_fraction"], group["rank"], group["orthogonalize"]) == expected


def test_transposed_variant_is_dion_update_on_transposed_views():
    # microsoft/dion runs wide matrices transposed (Q of shape (d_out, r)); dion_update
    # computes that variant when given .mT views, as the distributed version may need
    g = torch.Generator().manual_seed(8)
    m, n, r = 12, 20, 3
    W = torch.randn(m, n, generator=g, dtype=torch.float64)
    Q = torch.randn(m, r, generator=g, dtype=torch.float64)
    M = torch.zeros(m, n, dtype=torch.float64)
    W_ref, M_ref, Q_ref = W.clone(), M.clone(), Q.clone()
    scale = math.sqrt(m / n)
    for _ in range(3):
        G = torch.randn(m, n, generator=g, dtype=torch.float64)
        dion_update(W.mT, G.mT, M.mT, Q, lr=0.1, mu=0.9, weight_decay=0.1, scale=scale)
        B = M_ref + G  # Algorithm 1 on Bᵀ: P = orth(Bᵀ Q), R = B P
        P = torch.linalg.qr(B.T @ Q_ref).Q
        R = B @ P
        M_ref = B - 0.1 * R @ P.T
        Q_ref = R / R.norm(dim=0, keepdim=True)
        W_ref = W_ref * (1 - 0.1 * 0.1) - 0.1 * scale * Q_ref @ P.T
    torch.testing.assert_close(W, W_ref)
    torch.testing.assert_close(M, M_ref)
    torch.testing.assert_close(Q, Q_ref)


def test_bf16_parameters_keep_fp32_state():
    p = torch.nn.Parameter(torch.randn(16, 8, dtype=torch.bfloat16))
    opt = Dion([p], rank=2)
    p.grad = torch.randn(16, 8, dtype=torch.bfloat16)
    opt.step()
    state = opt.state[p]
    assert state["momentum"].dtype == state["Q"].dtype == torch.float32
    assert p.dtype == torch.bfloat16 and torch.isfinite(p).all()


@pytest.mark.parametrize("orthogonalize", ["qr", "cholesky_qr"])
def test_dion_step_is_the_reference_on_whole_matrices(orthogonalize):
    """``dion_step`` (what the optimizer runs, batched over matrices and ready for split
    ones) computes exactly ``dion_update`` on each whole matrix: tall, wide, square, one
    tall enough for the sketch of Cholesky QR, and one whose buffer stays zero."""
    g = torch.Generator().manual_seed(9)
    shapes = [(24, 16), (16, 24), (12, 12), (300, 8), (10, 6)]
    scales = [math.sqrt(m / n) for m, n in shapes]
    hp = dict(lr=0.05, mu=0.9, weight_decay=0.1, orthogonalize=orthogonalize)
    W = [torch.randn(s, generator=g) for s in shapes]
    M = [torch.randn(s, generator=g) for s in shapes[:-1]] + [torch.zeros(shapes[-1])]
    Q = [torch.randn(n, 3, generator=g) for _, n in shapes]
    W2, M2, Q2 = ([t.clone() for t in ts] for ts in (W, M, Q))
    for step in range(3):
        grads = [torch.randn(s, generator=g) for s in shapes[:-1]] + [torch.zeros(shapes[-1])]
        seeds = [100 * step + i for i in range(len(shapes))]  # the sketches' generators
        for i in range(len(shapes)):
            generator = torch.Generator().manual_seed(seeds[i])
            dion_update(W[i], grads[i], M[i], Q[i], **hp, scale=scales[i], generator=generator)
        matrices = [
            DionMatrix(W2[i], grads[i], M2[i], Q2[i], scales[i], torch.Generator().manual_seed(s))
            for i, s in enumerate(seeds)
        ]
        dion_step(matrices, **hp)
    for reference, batched in zip(W + M + Q, W2 + M2 + Q2):
        assert torch.equal(reference, batched)
    assert not M[-1].any()  # B = 0 kept M (and Q) as they were


# stacks: three tall (one with a zero buffer), two wide, two very tall (sketched; the second
# starts with a zero column of Q, so its Cholesky QR fails and Householder QR takes over),
# and a lone square matrix
BATCH_SHAPES = [(24, 16)] * 3 + [(16, 24)] * 2 + [(300, 8)] * 2 + [(12, 12)]


def batch_inputs(dtype, param_dtype, seed=9):
    g = torch.Generator().manual_seed(seed)
    W = [torch.randn(s, generator=g, dtype=dtype).to(param_dtype) for s in BATCH_SHAPES]
    M = [torch.randn(s, generator=g, dtype=dtype) for s in BATCH_SHAPES]
    M[2].zero_()
    Q = [torch.randn(n, 3, generator=g, dtype=dtype) for _, n in BATCH_SHAPES]
    Q[6][:, 2] = 0.0
    grads = [
        [torch.randn(s, generator=g, dtype=dtype).to(param_dtype) for s in BATCH_SHAPES]
        for _ in range(3)
    ]
    for G in grads:
        G[2].zero_()  # B stays 0: M and Q kept
    return W, M, Q, grads


@pytest.mark.parametrize(
    "dtype, param_dtype, tol",
    [(torch.float64, torch.float64, 1e-10), (torch.float32, torch.bfloat16, None)],
)
@pytest.mark.parametrize("orthogonalize", ["qr", "cholesky_qr"])
def test_dion_updates_equal_dion_update_per_matrix(orthogonalize, dtype, param_dtype, tol):
    """The batched step (what the optimizer runs on whole matrices) against Algorithm 1 per
    matrix; same-shape matrices share a sketch seed, as the optimizer gives them."""
    hp = dict(lr=0.05, mu=0.9, weight_decay=0.1, orthogonalize=orthogonalize)
    scales = [math.sqrt(m / n) for m, n in BATCH_SHAPES]
    W, M, Q, grads = batch_inputs(dtype, param_dtype)
    W2, M2, Q2 = ([t.clone() for t in ts] for ts in (W, M, Q))
    BQ = M[6] @ Q[6]
    assert randomized_cholesky_qr(BQ, generator=torch.Generator().manual_seed(0)) is None
    for step, G in enumerate(grads):
        seeds = [1000 * step + hash(shape) % 997 for shape in BATCH_SHAPES]
        for i in range(len(BATCH_SHAPES)):
            generator = torch.Generator().manual_seed(seeds[i])
            dion_update(W[i], G[i], M[i], Q[i], **hp, scale=scales[i], generator=generator)
        dion_updates(W2, G, M2, Q2, **hp, scales=scales, sketch_seeds=seeds)
    assert not M[2].any() and not M2[2].any()
    assert torch.equal(Q2[2], Q[2])  # B = 0 kept Q
    # fp64: bmm and mm round alike up to a few ulps; bf16 weights: a rounding of W that
    # flips one way in one run and the other in the other may recur, up to 2 bf16 ulps
    for reference, batched in zip(M + Q, M2 + Q2):
        torch.testing.assert_close(batched, reference, rtol=tol or 1e-4, atol=tol or 1e-5)
    for reference, batched in zip(W, W2):
        rtol, atol = (tol, tol) if tol else (2**-6, 1e-3)
        torch.testing.assert_close(batched, reference, rtol=rtol, atol=atol)


def test_optimizer_batches_same_shape_matrices_and_shares_their_sketch():
    """The class runs ``dion_updates``: equal to ``dion_update`` per matrix with the
    class's sketch seeds (one per shape and step)."""
    g = torch.Generator().manual_seed(3)
    shapes = [(40, 12)] * 3 + [(12, 40)]
    params = [torch.nn.Parameter(torch.randn(s, generator=g, dtype=torch.float64)) for s in shapes]
    opt = Dion(params, rank=3, orthogonalize="cholesky_qr", lr=0.05, weight_decay=0.1, foreach=True)
    W = [p.detach().clone() for p in params]
    M = [torch.zeros_like(w) for w in W]
    Q = [opt.state[p]["Q"].clone() if opt.state[p] else None for p in params]
    for step in range(1, 4):
        grads = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
        for p, grad in zip(params, grads):
            p.grad = grad.clone()
        if step == 1:  # Q_0 as the optimizer draws it
            Q = [opt.core.init_state(p, opt.config, opt.name_of(p))["Q"] for p in params]
        opt.step()
        for i, s in enumerate(shapes):
            seed = opt.core.sketch_seed(s, 3, step)
            generator = torch.Generator().manual_seed(seed)
            hp = dict(lr=0.05, mu=0.95, weight_decay=0.1, orthogonalize="cholesky_qr")
            scale = math.sqrt(s[0] / s[1])
            dion_update(W[i], grads[i], M[i], Q[i], **hp, scale=scale, generator=generator)
    for p, w, q in zip(params, W, Q):
        torch.testing.assert_close(p.detach(), w, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(opt.state[p]["Q"], q, rtol=1e-10, atol=1e-10)
