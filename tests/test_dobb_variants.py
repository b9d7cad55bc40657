"""Dobb's variants on one device: two-sided bases, Adam coefficients and block_size, each
against a literal float64 transcription of its formula."""

import pytest
import torch
from layers import TransposedLinear
from torch import nn

import dobb
from dobb.optim.dobb_core import _rotated_update, dobb_update, dobb_update_batched
from dobb.stats import block_stacks

D_IN, D_OUT, TOKENS = 12, 10, 24
HYPER = dict(lr=0.05, momentum=0.9, weight_decay=0.1, update_scale=0.2, stats_beta=0.8)


def blocks(n: int, count: int) -> list[slice]:
    """Near-equal contiguous blocks, the first ``n % count`` one longer (``block_stacks``)."""
    size, big = divmod(n, count)
    bounds = [0]
    for i in range(count):
        bounds.append(bounds[-1] + size + (i < big))
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


def eigvecs(c: torch.Tensor) -> torch.Tensor:
    return torch.linalg.eigh(c).eigenvectors


def reference(weights, batches, *, num_blocks, row_blocks, row_stats, coefficients, interval):
    """The variant update, written out tile by tile in float64 for lone Linear layers
    ``y = x Wᵀ`` with loss ``sum_i mean((y_i - t_i)²)``; returns the final weights."""
    weights = [w.clone() for w in weights]
    cols, rows = blocks(D_IN, num_blocks), blocks(D_OUT, row_blocks)
    state = [dict(m=torch.zeros_like(w), v=torch.zeros_like(w)) for w in weights]
    lr, mu, wd, alpha, beta2 = (HYPER[k] for k in ("lr", "momentum", "weight_decay",
                                                   "update_scale", "stats_beta"))  # fmt: skip
    for t, batch in enumerate(batches, start=1):
        for w, s, (x, target) in zip(weights, state, batch):
            delta = 2 * (x @ w.T - target) / target.numel()  # dL/dy
            g = delta.T @ x
            in_moments = [x[:, b].T @ x[:, b] / len(x) for b in cols]
            if row_stats == "gradients":
                row_moments = [g[r] @ g[r].T / D_IN for r in rows]
            else:
                row_moments = [delta[:, r].T @ delta[:, r] / len(x) for r in rows]
            if t == 1:
                s["C"], s["R"] = in_moments, row_moments
            else:
                s["C"] = [beta2 * c + (1 - beta2) * n for c, n in zip(s["C"], in_moments)]
                s["R"] = [beta2 * c + (1 - beta2) * n for c, n in zip(s["R"], row_moments)]
            if (t - 1) % interval == 0:
                s["Q"], s["P"] = [eigvecs(c) for c in s["C"]], [eigvecs(c) for c in s["R"]]
            s["m"] = mu * s["m"] + (1 - mu) * g
            n = (1 - mu) * g + mu * s["m"]  # Nesterov
            u = torch.zeros_like(w)
            for r, p in zip(rows, s["P"]):
                for b, q in zip(cols, s["Q"]):
                    c = p.T @ n[r, b] @ q
                    if coefficients == "sign":
                        d = torch.sign(c)
                    else:
                        v = s["v"][r, b]
                        v.mul_(0.95).add_(0.05 * (p.T @ g[r, b] @ q) ** 2)
                        d = c / ((v / (1 - 0.95**t)).sqrt() + 1e-8)
                    u[r, b] = p @ d @ q.T
            w.mul_(1 - lr * wd).sub_(lr * alpha * u)
    return weights


def run_dobb(weights, batches, transposed=False, **options):
    make = (lambda w: TransposedLinear(w.T)) if transposed else None
    layers = []
    for w in weights:
        layer = make(w) if make else nn.Linear(D_IN, D_OUT, bias=False).double()
        if not make:
            layer.weight.data.copy_(w)
        layers.append(layer)
    params = [layer.weight for layer in layers]
    opt = dobb.Dobb(params, **HYPER, basis_method="eigh", two_sided=True, **options)
    for layer in layers:
        opt.track(layer)
    for batch in batches:
        opt.zero_grad()
        loss = sum(
            nn.functional.mse_loss(layer(x), target) for layer, (x, target) in zip(layers, batch)
        )
        loss.backward()
        opt.step()
    final = [layer.weight.detach() for layer in layers]
    return [w.T for w in final] if transposed else final, opt


def batches(steps=4, layers=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    scale = torch.linspace(0.3, 2.0, D_IN, dtype=torch.float64)

    def draw():
        x = torch.randn(TOKENS, D_IN, generator=gen, dtype=torch.float64) * scale
        return x, torch.randn(TOKENS, D_OUT, generator=gen, dtype=torch.float64)

    return [[draw() for _ in range(layers)] for _ in range(steps)]


@pytest.mark.parametrize(
    "row_blocks, row_stats, coefficients, transposed",
    [
        (3, "gradients", "sign", False),
        (3, "outputs", "sign", False),
        (1, "gradients", "adam", False),
        (2, "outputs", "adam", True),
    ],
)
def test_two_sided_matches_float64_transcription(row_blocks, row_stats, coefficients, transposed):
    if transposed:
        dobb.stats.register_layer(TransposedLinear, input_dim=0)
    torch.manual_seed(0)
    weights = [torch.randn(D_OUT, D_IN, dtype=torch.float64) for _ in range(2)]
    data = batches()
    options = dict(row_blocks=row_blocks, row_stats=row_stats, coefficients=coefficients)
    got, _ = run_dobb(weights, data, transposed, num_blocks=3, basis_interval=2, **options)
    expected = reference(weights, data, num_blocks=3, interval=2, **options)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_one_sided_adam_is_two_sided_with_identity_rows():
    """One-sided Adam coefficients = two-sided with one row block whose basis is fixed at I
    (here: the row moments are diagonal, as for a single row)."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(4, D_IN, 8, dtype=torch.float64, generator=gen)
    grads = torch.randn(4, D_IN, 8, dtype=torch.float64, generator=gen)
    q = torch.linalg.qr(torch.randn(4, 2, 4, 4, dtype=torch.float64, generator=gen)).Q
    stacks = dobb.stats.block_stacks(8, 2)
    eye = torch.eye(D_IN, dtype=torch.float64).expand(4, 1, D_IN, D_IN)
    rows = dobb.stats.block_stacks(D_IN, 1)
    results = []
    for row_bases, row_stacks in ((None, ()), ([eye], rows)):
        params, momenta, v = w.clone(), torch.zeros_like(w), torch.zeros_like(w)
        hyper = dict(lr=0.1, beta=0.9, nesterov=True, weight_decay=0.0, scale=1.0)
        dobb_update_batched(
            list(params), list(grads), list(momenta), [q], stacks, row_bases=row_bases,
            row_stacks=row_stacks, variances=list(v), steps=[1.0] * 4, **hyper,
        )  # fmt: skip
        results.append(params)
    torch.testing.assert_close(*results, rtol=0, atol=1e-12)


@pytest.mark.parametrize("transposed", [False, True])
def test_one_sided_sign_equals_the_paper_update(transposed):
    """The variants' tile path with sign coefficients and no row blocks is ``dobb_update``,
    matrix by matrix."""
    gen = torch.Generator().manual_seed(1)
    shape = (3, 10, D_OUT) if transposed else (3, D_OUT, 10)
    w, g = (torch.randn(shape, dtype=torch.float64, generator=gen) for _ in range(2))
    m = torch.randn(shape, dtype=torch.float64, generator=gen)
    stacks = dobb.stats.block_stacks(10, 3)  # 4, 3, 3: two stacks
    bases = [
        torch.linalg.qr(torch.randn(3, s.count, s.size, s.size, dtype=torch.float64,
                                    generator=gen)).Q
        for s in stacks
    ]  # fmt: skip
    hyper = dict(lr=0.1, beta=0.9, nesterov=True, weight_decay=0.1, scale=0.2)
    batched_w, batched_m = w.clone(), m.clone()
    _rotated_update(
        list(batched_w), list(g), list(batched_m), bases, stacks, transposed=transposed, **hyper
    )
    for i in range(3):
        orient = (lambda t: t.mT) if transposed else (lambda t: t)
        wi, mi = w[i].clone(), m[i].clone()
        dobb_update(orient(wi), orient(g[i]), orient(mi), [b[i] for b in bases], stacks, **hyper)
        torch.testing.assert_close(batched_w[i], wi, rtol=0, atol=1e-12)
        torch.testing.assert_close(batched_m[i], mi, rtol=0, atol=1e-12)


def test_block_size_sets_the_block_count_per_matrix():
    model = nn.Sequential(nn.Linear(12, 40), nn.Tanh(), nn.Linear(40, 5))
    opt = dobb.Dobb(dobb.param_groups(model, exclude="^$"), lr=0.01, block_size=8)
    opt.track(model)
    layouts = [[(s.size, s.count) for s in opt.local_blocks(m.weight)] for m in model[::2]]
    assert layouts == [[(6, 2)], [(8, 5)]]  # ceil(12 / 8) = 2 blocks; 40 / 8 = 5 blocks


def test_two_sided_state_and_memory():
    model = nn.Sequential(nn.Linear(12, 20), nn.Tanh(), nn.Linear(20, 6))
    groups = dobb.param_groups(model, exclude="^$")
    opt = dobb.Dobb(groups, lr=0.01, two_sided=True, row_blocks=2, coefficients="adam")
    opt.track(model)
    model(torch.randn(8, 12)).sum().backward()
    opt.step()
    state = opt.state[model[0].weight]
    assert state["row_basis_0"].shape == (2, 10, 10)  # two row blocks of 10 rows
    assert state["variance"].shape == model[0].weight.shape  # 4 more bytes per parameter


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"two_sided": False, "row_blocks": 2}, "options of two-sided Dobb"),
        ({"two_sided": True, "row_blocks": 0}, "invalid row_blocks"),
        ({"block_size": 0}, "invalid block_size"),
        ({"coefficients": "lion"}, "invalid coefficients"),
        ({"two_sided": True, "row_stats": "weights"}, "invalid row_stats"),
        ({"beta2": 1.0}, "invalid beta2"),
    ],
)
def test_bad_variant_options_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        dobb.Dobb([nn.Parameter(torch.zeros(4, 4))], lr=0.1, **kwargs)


def test_missing_output_statistics_name_the_parameter():
    layer = nn.Linear(4, 4)
    opt = dobb.Dobb([layer.weight], lr=0.1, two_sided=True, row_stats="outputs")
    opt.track(layer)
    layer(torch.randn(2, 4))  # input statistics, but no backward: no output gradient
    layer.weight.grad = torch.ones_like(layer.weight)
    before = {k: v.clone() for k, v in opt.state_dict()["state"].get(0, {}).items()}
    with pytest.raises(RuntimeError, match=r"\(4, 4\) has no output-gradient statistics"):
        opt.step()
    assert before == {} and not opt.state  # nothing was changed


@pytest.mark.parametrize("two_sided", [False, True])
def test_bf16_projections_stay_close_to_fp32(two_sided):
    """``projection_dtype=bfloat16`` rounds the rotations' operands (bases, direction,
    coefficients) to bf16: the update keeps its direction (cosine > 0.97 to fp32's) and the
    parameters, momentum and state stay fp32."""
    torch.manual_seed(0)
    stacks, rows = block_stacks(96, 4), block_stacks(64, 2) if two_sided else ()
    bases = [torch.linalg.qr(torch.randn(s.count, s.size, s.size)).Q for s in stacks]
    row_bases = [torch.linalg.qr(torch.randn(s.count, s.size, s.size)).Q for s in rows]
    weight, grad = torch.randn(64, 96), torch.randn(64, 96)
    updates = {}
    for low in (None, torch.bfloat16):
        param, momentum = weight.clone(), torch.zeros(64, 96)
        dobb_update(param, grad, momentum, bases, stacks, lr=1.0, beta=0.9, nesterov=True,
                    weight_decay=0.0, scale=1.0, row_bases=row_bases, row_stacks=rows,
                    projection_dtype=low)  # fmt: skip
        assert param.dtype == momentum.dtype == torch.float32
        updates[low] = (weight - param).flatten()
    cosine = torch.nn.functional.cosine_similarity(updates[None], updates[torch.bfloat16], 0)
    assert 0.97 < cosine < 1.0, cosine


VARIANTS = {  # (two-sided, Adam coefficients, projection dtype, transposed)
    "one-sided-sign": (False, False, None, False),
    "one-sided-sign-transposed": (False, False, None, True),
    "one-sided-adam": (False, True, None, False),
    "two-sided-sign": (True, False, None, False),
    "two-sided-adam-transposed": (True, True, None, True),
    "bf16-one-sided-sign": (False, False, torch.bfloat16, False),
    "bf16-two-sided-adam": (True, True, torch.bfloat16, False),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_batched_update_equals_the_per_matrix_reference(variant):
    """``dobb_update_batched`` on 3 matrices == ``dobb_update`` on each, over 3 steps (Adam's
    bias correction moves), with ragged input and row blocks: float64, or fp32 state with
    bf16 projections (both paths round the same operands)."""
    two_sided, adam, low, transposed = VARIANTS[variant]
    gen = torch.Generator().manual_seed(7)
    n, rows, d_in = 3, 10, 11
    dtype = torch.float32 if low else torch.float64
    stacks, row_stacks = block_stacks(d_in, 3), block_stacks(rows, 3) if two_sided else ()

    def draw(*shape):
        return torch.randn(*shape, dtype=dtype, generator=gen)

    def bases_of(layout):
        return [torch.linalg.qr(draw(n, s.count, s.size, s.size)).Q for s in layout]

    def orient(t):  # the reference takes (rows, d_in); Conv1D stores (d_in, rows)
        return t.mT if transposed else t

    bases, row_bases = bases_of(stacks), bases_of(row_stacks)
    shape = (n, d_in, rows) if transposed else (n, rows, d_in)
    start = {"w": draw(*shape), "m": torch.zeros(shape, dtype=dtype)}
    if adam:
        start["v"] = torch.zeros(shape, dtype=dtype)
    ref = {k: v.clone() for k, v in start.items()}
    got = {k: v.clone() for k, v in start.items()}
    hyper = dict(lr=0.1, beta=0.9, nesterov=True, weight_decay=0.1, scale=0.2, beta2=0.9)
    hyper |= dict(row_stacks=row_stacks, projection_dtype=low)
    for step in (1, 2, 3):
        grads = draw(*shape)
        for i in range(n):
            dobb_update(
                orient(ref["w"][i]),
                orient(grads[i]),
                orient(ref["m"][i]),
                [b[i] for b in bases],
                stacks,
                row_bases=[b[i] for b in row_bases],
                variance=orient(ref["v"][i]) if adam else None,
                step=step,
                **hyper,
            )
        dobb_update_batched(
            list(got["w"]),
            list(grads),
            list(got["m"]),
            bases,
            stacks,
            row_bases=row_bases or None,
            variances=list(got["v"]) if adam else None,
            steps=[float(step)] * n,
            transposed=transposed,
            **hyper,
        )
    atol = 1e-12 if dtype == torch.float64 else 1e-6  # bf16: bit-identical on this CPU
    for key, want in ref.items():
        torch.testing.assert_close(
            got[key], want, rtol=0, atol=atol, msg=lambda m, key=key: f"{key}: {m}"
        )
    assert not torch.equal(got["w"], start["w"])
