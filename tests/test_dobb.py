"""Dobb on one device: the invariants of docs/algorithm.md, the torch.optim contract, bad input."""

import copy
import math

import pytest
import torch
from dobb_configs import PaperDobb
from layers import TransposedLinear
from torch import nn

import dobb
import dobb.optim.dobb_steps as dobb_steps
from dobb.eigensolve import eigenbasis, power_qr_basis
from dobb.optim.dobb_core import dobb_update, dobb_update_batched
from dobb.optim.dobb_steps import DobbSteps
from dobb.stats import block_stacks


def mlp(dtype=torch.float32, d_in=12, hidden=20, d_out=6, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, d_out)).to(dtype)


def make_opt(model, **kwargs):
    """Dobb on every Linear weight, AdamW on biases; tracked."""
    groups = dobb.param_groups(model, exclude="^$")
    opt = PaperDobb(groups, **{"lr": 0.01, "num_blocks": 4, **kwargs})
    opt.track(model)
    return opt


def train(model, opt, steps, seed=1, batch=16):
    """``steps`` steps regressing onto a fixed random linear teacher; returns the losses."""
    gen = torch.Generator().manual_seed(seed)
    dtype, d_in = model[0].weight.dtype, model[0].in_features
    teacher = torch.randn(d_in, model[-1].out_features, generator=gen, dtype=dtype)
    losses = []
    for _ in range(steps):
        x = torch.randn(batch, d_in, generator=gen, dtype=dtype)
        y = x @ teacher
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def one_step_update(weight, x, grad, **kwargs):
    """Dobb's first-step update -(W' - W)/lr of a lone Linear with input ``x``."""
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False).to(weight.dtype)
    layer.weight.data.copy_(weight)
    opt = PaperDobb([layer.weight], **{"lr": 1.0, "update_scale": 1.0, **kwargs})
    opt.track(layer)
    layer(x)
    layer.weight.grad = grad.clone()
    opt.step()
    return weight - layer.weight.detach()


# ------------------------------------------------------------------ invariants
def test_block_stacks_near_equal_and_contiguous():
    assert [(s.start, s.size, s.count) for s in block_stacks(10, 4)] == [(0, 3, 2), (6, 2, 2)]
    assert [(s.size, s.count) for s in block_stacks(64, 16)] == [(4, 16)]
    assert [(s.size, s.count) for s in block_stacks(5, 9)] == [(1, 5)]  # B > d_in: size 1


def test_block_size_one_is_signum():
    torch.manual_seed(0)
    w, x, g = torch.randn(5, 7), torch.randn(9, 7), torch.randn(5, 7)
    update = one_step_update(w, x, g, num_blocks=7)
    mu = 0.95
    nesterov = (1 - mu) * g + mu * ((1 - mu) * g)
    torch.testing.assert_close(update, nesterov.sign())


def test_identity_basis_is_signum():
    torch.manual_seed(0)
    layer = nn.Linear(8, 4, bias=False)
    w = layer.weight.detach().clone()
    opt = PaperDobb([layer.weight], lr=0.1, update_scale=1.0, missing_stats="identity")
    layer.weight.grad = torch.randn(4, 8)
    opt.step()  # no statistics were ever seen: Q_b = I
    torch.testing.assert_close(w - layer.weight.detach(), 0.1 * layer.weight.grad.sign())


def test_diagonal_second_moment_is_signum():
    torch.manual_seed(0)
    w, g = torch.randn(3, 8), torch.randn(3, 8)
    x = torch.diag(torch.arange(1.0, 9.0))  # C = diag(1..64)/8: distinct eigenvalues
    update = one_step_update(w, x, g, num_blocks=2, nesterov=False)
    torch.testing.assert_close(update, g.sign())


def random_orthogonal(n, generator, dtype=torch.float64):
    return torch.linalg.qr(torch.randn(n, n, generator=generator, dtype=dtype)).Q


def test_block_orthogonal_equivariance():
    """x' = x R, W' = W R with block-diagonal orthogonal R  =>  U' = U R."""
    gen = torch.Generator().manual_seed(0)
    d_in, blocks = 12, 3
    r = torch.block_diag(*[random_orthogonal(d_in // blocks, gen) for _ in range(blocks)])
    w = torch.randn(5, d_in, generator=gen, dtype=torch.float64)
    x = torch.randn(40, d_in, generator=gen, dtype=torch.float64) * torch.linspace(0.5, 3, d_in)
    g = torch.randn(5, d_in, generator=gen, dtype=torch.float64)
    update = one_step_update(w, x, g, num_blocks=blocks)
    rotated = one_step_update(w @ r, x @ r, g @ r, num_blocks=blocks)
    torch.testing.assert_close(rotated, update @ r, rtol=1e-10, atol=1e-10)
    assert not torch.allclose(update, torch.sign(g))  # the basis really rotated the update


@pytest.mark.parametrize("num_blocks", [1, 3, 5])
def test_update_rms_is_one_before_scaling(num_blocks):
    torch.manual_seed(0)
    param, grad = torch.zeros(6, 13), torch.randn(6, 13)
    stacks = block_stacks(13, num_blocks)
    bases = [
        eigenbasis(torch.randn(s.count, s.size, s.size).mT @ torch.randn(s.size, s.size))
        for s in stacks
    ]
    bases = [eigenbasis(b @ b.mT) for b in bases]
    dobb_update(param, grad, torch.zeros_like(param), bases, stacks, lr=1.0, beta=0.9,
                nesterov=True, weight_decay=0.0, scale=1.0)  # fmt: skip
    assert math.isclose(param.pow(2).mean().sqrt().item(), 1.0, rel_tol=1e-6)


def test_matches_per_block_reference_with_ragged_blocks():
    """Three steps against a loop written straight from the formula of docs/algorithm.md
    (fp64, explicit blocks)."""
    gen = torch.Generator().manual_seed(3)
    d_out, d_in, num_blocks, lr, mu, beta2 = 4, 10, 4, 0.05, 0.9, 0.8
    layer = nn.Linear(d_in, d_out, bias=False).double()
    w = layer.weight.detach().clone()
    opt = PaperDobb([layer.weight], lr=lr, momentum=mu, num_blocks=num_blocks,
                    stats_beta=beta2, basis_interval=2, weight_decay=0.1)  # fmt: skip
    opt.track(layer)
    sizes = [3, 3, 2, 2]
    m, covs, bases = torch.zeros_like(w), [None] * 4, [None] * 4
    for t in range(1, 4):
        x = torch.randn(7, d_in, generator=gen, dtype=torch.float64)
        g = torch.randn(d_out, d_in, generator=gen, dtype=torch.float64)
        layer(x)
        layer.weight.grad = g.clone()
        opt.step()
        m = mu * m + (1 - mu) * g
        n = (1 - mu) * g + mu * m
        u = torch.empty_like(w)
        for b, start in enumerate([0, 3, 6, 8]):
            cols = slice(start, start + sizes[b])
            s_b = x[:, cols].T @ x[:, cols] / x.shape[0]
            covs[b] = s_b if t == 1 else beta2 * covs[b] + (1 - beta2) * s_b
            if (t - 1) % 2 == 0:
                bases[b] = torch.linalg.eigh(covs[b])[1]
            u[:, cols] = torch.sign(n[:, cols] @ bases[b]) @ bases[b].T
        w = w * (1 - lr * 0.1) - lr * 0.2 * u
    torch.testing.assert_close(layer.weight.detach(), w, rtol=1e-9, atol=1e-9)


# ---------------------------------------------------------------- statistics
def test_statistics_ema_and_refresh_schedule():
    layer = nn.Linear(4, 3, bias=False)
    opt = PaperDobb([layer.weight], lr=0.01, num_blocks=2, stats_beta=0.5, basis_interval=3)
    opt.track(layer)
    gen = torch.Generator().manual_seed(0)
    expected, bases = None, []
    for t in range(1, 6):
        x = torch.randn(5, 4, generator=gen) * torch.tensor([1.0, 2.0, 3.0, 4.0])
        layer(x[:2]), layer(x[2:])  # two micro-batches, token-averaged together
        layer.weight.grad = torch.randn(3, 4, generator=gen)
        opt.step()
        s = torch.stack([x[:, :2].T @ x[:, :2], x[:, 2:].T @ x[:, 2:]]) / 5
        expected = s if t == 1 else 0.5 * expected + 0.5 * s
        state = opt.state[layer.weight]
        torch.testing.assert_close(state["input_cov_0"], expected)
        bases.append(state["input_basis_0"].clone())
    assert torch.equal(bases[0], bases[1]) and torch.equal(bases[1], bases[2])
    assert not torch.equal(bases[2], bases[3])  # refreshed at t = 4 = 1 + 3
    assert torch.equal(bases[3], bases[4])


def test_hooks_ignore_eval_mode_and_no_grad():
    layer = nn.Linear(4, 3)
    opt = PaperDobb([layer.weight], lr=0.1, num_blocks=2)
    opt.track(layer)
    with torch.no_grad():
        layer(torch.randn(2, 4))
    layer.eval()
    layer(torch.randn(2, 4))
    layer.weight.grad = torch.randn(3, 4)
    with pytest.raises(RuntimeError, match="no activation statistics"):
        opt.step()


def test_gradient_accumulation_counts_every_micro_batch():
    full, micro = mlp(), mlp()
    opt_full, opt_micro = make_opt(full), make_opt(micro)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        x, y = torch.randn(8, 12, generator=gen), torch.randn(8, 6, generator=gen)
        opt_full.zero_grad()
        nn.functional.mse_loss(full(x), y).backward()
        opt_full.step()
        opt_micro.zero_grad()
        for xs, ys in [(x[:3], y[:3]), (x[3:], y[3:])]:
            (nn.functional.mse_loss(micro(xs), ys) * len(xs) / 8).backward()
        opt_micro.step()
    for a, b in zip(full.parameters(), micro.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_power_qr_converges_to_eigenbasis():
    gen = torch.Generator().manual_seed(0)
    q = random_orthogonal(6, gen, torch.float32)
    cov = (q * torch.tensor([9.0, 5, 3, 2, 1, 0.5])) @ q.T
    basis = torch.eye(6)[None]
    for _ in range(200):
        basis = power_qr_basis(cov[None], basis)
    overlap = (basis[0].T @ eigenbasis(cov[None])[0]).abs()
    torch.testing.assert_close(overlap, torch.eye(6), atol=1e-3, rtol=0)


def test_power_qr_method_trains():
    model = mlp()
    losses = train(model, make_opt(model, lr=0.1, basis_method="power_qr", basis_interval=2), 30)
    assert losses[-1] < 0.9 * losses[0]


def test_eigenbasis_of_singular_blocks_is_orthonormal():
    cov = torch.zeros(3, 5, 5)
    cov[1] = torch.ones(5, 5)
    basis = eigenbasis(cov)
    torch.testing.assert_close(basis.mT @ basis, torch.eye(5).expand(3, 5, 5), atol=1e-5, rtol=0)


# ------------------------------------------------------------ torch.optim contract
def test_trains_a_tiny_model():
    model = mlp()
    losses = train(model, make_opt(model, lr=0.1), 40)
    assert losses[-1] < 0.8 * losses[0]


def test_closure_returns_loss():
    model = mlp()
    opt = make_opt(model)
    x, y = torch.randn(4, 12), torch.randn(4, 6)

    def closure():
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    assert opt.step(closure) is not None
    assert opt.state[model[0].weight]["step"] == 1


def test_lr_scheduler_drives_the_step():
    model = mlp()
    opt = make_opt(model, lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.0 if step >= 1 else 1.0)
    train(model, opt, 1)
    sched.step()
    before = copy.deepcopy(model.state_dict())
    train(model, opt, 1)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)


def test_resume_equals_uninterrupted():
    reference = mlp()
    train(reference, make_opt(reference, basis_interval=3), 8, seed=5)

    model = mlp()
    opt = make_opt(model, basis_interval=3)
    train(model, opt, 4, seed=5)
    checkpoint = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    resumed = mlp(seed=99)
    resumed.load_state_dict(checkpoint["model"])
    opt2 = make_opt(resumed, basis_interval=3)
    opt2.load_state_dict(checkpoint["opt"])
    # continue with the same data stream: replay the generator past the first 4 batches
    gen = torch.Generator().manual_seed(5)
    teacher = torch.randn(12, 6, generator=gen)
    for _ in range(4):
        torch.randn(16, 12, generator=gen)
    for _ in range(4):
        x = torch.randn(16, 12, generator=gen)
        y = x @ teacher
        opt2.zero_grad()
        nn.functional.mse_loss(resumed(x), y).backward()
        opt2.step()
    for a, b in zip(reference.parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_zero_grad_zero_lr_step_is_a_no_op():
    """What DCP's state initialization does: zero grads, lr = 0, no forward pass."""
    model = mlp()
    opt = make_opt(model)
    before = copy.deepcopy(model.state_dict())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    for group in opt.param_groups:
        group["lr"] = 0.0
    opt.step(closure=None)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)
    for state in opt.state.values():
        assert all(torch.isfinite(v).all() for v in state.values())


@pytest.mark.parametrize(
    "dtype, state_dtype",
    [
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.float32),
        (torch.float64, torch.float64),
    ],
)
def test_state_precision_and_dtype_survives_load(dtype, state_dtype):
    model = mlp(dtype)
    opt = make_opt(model)
    train(model, opt, 2)
    state = opt.state[model[0].weight]
    assert state["momentum"].dtype == state["input_basis_0"].dtype == state_dtype
    opt2 = make_opt(copy.deepcopy(model))
    opt2.load_state_dict(opt.state_dict())
    assert opt2.state[opt2.param_groups[0]["params"][0]]["input_cov_0"].dtype == state_dtype


def test_adamw_group_matches_torch_adamw():
    model, reference = mlp(), mlp()
    group = {"params": model.parameters(), "algorithm": "adamw", "weight_decay": 0.1, "lr": 3e-3}
    opt = PaperDobb([group])
    ref = torch.optim.AdamW(reference.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    train(model, opt, 5)
    train(reference, ref, 5)
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b)


def test_lion_group_follows_its_rule():
    p = nn.Parameter(torch.randn(5))
    opt = PaperDobb([{"params": [p], "algorithm": "lion", "weight_decay": 0.5, "lr": 0.1}])
    w, m = p.detach().clone(), torch.zeros(5)
    for _ in range(3):
        g = torch.randn(5)
        p.grad = g.clone()
        opt.step()
        w = w * (1 - 0.1 * 0.5) - 0.1 * torch.sign(0.9 * m + 0.1 * g)
        m = 0.99 * m + 0.01 * g
        torch.testing.assert_close(p.detach(), w)


def test_param_groups_route_heads_embeddings_and_tied_weights():
    class TinyLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(11, 8)
            self.fc = nn.Linear(8, 8)
            self.ln = nn.LayerNorm(8)
            self.lm_head = nn.Linear(8, 11, bias=False)
            self.lm_head.weight = self.wte.weight  # tied

    matrix, scalar = dobb.param_groups(TinyLM())
    assert "algorithm" not in matrix  # the optimizer's own
    assert [n for n, _ in matrix["params"]] == ["fc.weight"]
    assert scalar["algorithm"] == "adamw"
    assert sorted(n for n, _ in scalar["params"]) == [
        "fc.bias",
        "ln.bias",
        "ln.weight",
        "wte.weight",
    ]
    # any matrix optimizer takes them; the AdamW group keeps its own lr, not the matrix one
    opt = dobb.Muon(dobb.param_groups(TinyLM()))
    assert [g["lr"] for g in opt.param_groups] == [0.02, 1e-3]


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"lr": -1.0}, "invalid learning rate"),
        ({"num_blocks": 0}, "num_blocks"),
        ({"momentum": 1.0}, "momentum"),
        ({"basis_interval": 0}, "basis_interval"),
        ({"update_scale": "huge"}, "update_scale"),
        ({"basis_method": "svd"}, "basis_method"),
        ({"nonfinite": "ignore"}, "nonfinite"),
        ({"missing_stats": "zeros"}, "missing_stats"),
    ],
)
def test_bad_hyperparameters_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PaperDobb([nn.Parameter(torch.zeros(2, 2))], **{"lr": 0.1, **kwargs})


def test_bad_groups_raise():
    model = mlp()
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['betas'\]"):
        PaperDobb([{"params": [model[0].weight], "betas": (0.9, 0.9)}], lr=0.1)
    with pytest.raises(ValueError, match=r"unknown algorithm 'sgd'"):
        PaperDobb([{"params": [model[0].weight], "algorithm": "sgd"}], lr=0.1)
    with pytest.raises(ValueError, match=r"bias has 1 dimension.*algorithm='adamw'"):
        PaperDobb(list(model[0].named_parameters()), lr=0.1)


def test_missing_statistics_names_the_parameter():
    model = mlp()
    opt = PaperDobb([{"params": list(model.named_parameters())[:1]}], lr=0.1)
    model[0].weight.grad = torch.ones_like(model[0].weight)
    with pytest.raises(RuntimeError, match=r"0\.weight has no activation statistics.*track"):
        opt.step()
    assert not opt.state  # nothing was touched


def test_a_non_finite_step_without_statistics_is_skipped_not_refused():
    """The non-finite check comes first: with ``nonfinite="skip"`` a NaN step is skipped
    even when its statistics are missing, and leaves no state."""
    model = mlp()
    opt = PaperDobb([model[0].weight], lr=0.1, nonfinite="skip")
    model[0].weight.grad = torch.full_like(model[0].weight, float("nan"))
    opt.step()
    assert opt.skipped_steps == 1 and not opt.state


def test_track_errors():
    model = mlp()
    opt = PaperDobb([model[0].weight], lr=0.1)
    opt.track(model)
    with pytest.raises(ValueError, match="already tracked"):
        opt.track(model)
    with pytest.raises(ValueError, match="no layer"):
        PaperDobb([model[0].weight], lr=0.1).track(nn.Sequential(nn.ReLU()))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_gradient_raises_and_keeps_state(bad):
    model = mlp()
    opt = make_opt(model)
    train(model, opt, 2)
    params = copy.deepcopy(list(model.parameters()))
    state = copy.deepcopy(opt.state_dict())
    model(torch.randn(3, 12)).sum().backward()
    model[2].weight.grad[0, 0] = bad
    with pytest.raises(dobb.NonFiniteGradientError, match=r"2\.weight"):
        opt.step()
    for a, b in zip(model.parameters(), params):
        assert torch.equal(a, b)
    torch.testing.assert_close(opt.state_dict()["state"], state["state"], rtol=0, atol=0)


def test_nonfinite_skip_mode_skips_the_step():
    model = mlp()
    opt = make_opt(model, nonfinite="skip")
    train(model, opt, 1)
    params = copy.deepcopy(list(model.parameters()))
    model(torch.full((3, 12), float("nan"))).sum().backward()  # NaN statistics and grads
    opt.step()
    assert opt.skipped_steps == 1
    for a, b in zip(model.parameters(), params):
        assert torch.equal(a, b)
    train(model, opt, 1)  # the dropped statistics do not poison the next step
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_transposed_layers_are_blocked_along_their_input_dim():
    dobb.stats.register_layer(TransposedLinear, input_dim=0)
    torch.manual_seed(0)
    linear = nn.Linear(10, 7, bias=False)
    transposed = TransposedLinear(linear.weight.detach().T)
    opts = []
    for layer in (linear, transposed):
        opt = PaperDobb(dobb.param_groups(layer), lr=0.1, num_blocks=3, update_scale="muon")
        opt.track(layer)
        opts.append(opt)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(6, 10, generator=gen)
        for layer, opt in zip((linear, transposed), opts):
            opt.zero_grad()
            layer(x).pow(2).sum().backward()
            opt.step()
    torch.testing.assert_close(transposed.weight.detach(), linear.weight.detach().T)
    assert opts[1].state[transposed.weight]["input_cov_0"].shape == (1, 4, 4)  # d_in = 10 = 4+3+3


def test_untrack_removes_the_hooks():
    model = mlp()
    opt = make_opt(model)
    opt.untrack()
    model(torch.randn(2, 12)).sum().backward()
    with pytest.raises(RuntimeError, match="no activation statistics"):
        opt.step()
    opt.track(model)  # may be tracked again
    train(model, opt, 1)


def test_parameters_replaced_after_construction_are_reported():
    model = mlp()
    opt = make_opt(model)
    opt.param_groups[0]["params"][0] = nn.Parameter(torch.zeros(20, 12))
    with pytest.raises(RuntimeError, match="after construction"):
        train(model, opt, 1)


@pytest.mark.parametrize("source", ["identity", "random", "gradients"])
def test_control_basis_sources(source):
    """Ablation controls need no statistics; their bases are what their names say."""
    torch.manual_seed(0)
    layer = nn.Linear(8, 5, bias=False)
    opt = PaperDobb([layer.weight], lr=0.1, num_blocks=2, basis_source=source, basis_interval=1)
    g = torch.randn(5, 8)
    w = layer.weight.detach().clone()
    layer.weight.grad = g.clone()
    opt.step()  # no track(), no forward pass
    basis = opt.state[layer.weight]["input_basis_0"]
    torch.testing.assert_close(basis.mT @ basis, torch.eye(4).expand(2, 4, 4), atol=1e-5, rtol=0)
    if source == "identity":
        torch.testing.assert_close(basis, torch.eye(4).expand(2, 4, 4))
    if source == "gradients":
        blocks = g.unflatten(1, (2, 4)).transpose(0, 1)
        torch.testing.assert_close(basis, eigenbasis(blocks.mT @ blocks / 5))
    n = 0.05 * g + 0.95 * (0.05 * g)
    expected = torch.cat([torch.sign(n[:, i : i + 4] @ q) @ q.T for i, q in zip((0, 4), basis)], 1)
    torch.testing.assert_close(w - layer.weight.detach(), 0.1 * 0.2 * expected)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_update_equals_per_matrix_reference(transposed, nesterov, dtype):
    """``dobb_update_batched`` on n matrices == ``dobb_update`` on each (ragged blocks;
    bf16 weights and gradients with fp32 momentum, as under mixed precision)."""
    gen = torch.Generator().manual_seed(5)
    n, rows, d_in, num_blocks = 3, 6, 11, 3
    stacks = block_stacks(d_in, num_blocks)
    shape = (d_in, rows) if transposed else (rows, d_in)
    params = [torch.randn(*shape, generator=gen).to(dtype) for _ in range(n)]
    grads = [torch.randn(*shape, generator=gen).to(dtype) for _ in range(n)]
    momenta = [torch.randn(*shape, generator=gen) for _ in range(n)]
    bases = [
        [eigenbasis((a := torch.randn(s.count, s.size, s.size, generator=gen)) @ a.mT)
         for s in stacks]
        for _ in range(n)
    ]  # fmt: skip
    hp = dict(lr=0.1, beta=0.9, nesterov=nesterov, weight_decay=0.05, scale=0.2)
    ref_params, ref_momenta = [p.clone() for p in params], [m.clone() for m in momenta]
    for p, g, m, b in zip(ref_params, grads, ref_momenta, bases):
        orient = (lambda t: t.mT) if transposed else (lambda t: t)
        dobb_update(orient(p), orient(g), orient(m), b, stacks, **hp)
    stacked = [torch.stack([b[i] for b in bases]) for i in range(len(stacks))]
    dobb_update_batched(params, grads, momenta, stacked, stacks, transposed=transposed, **hp)
    for got, want in zip(params + momenta, ref_params + ref_momenta):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert not torch.equal(params[0], ref_params[1])  # the matrices really differ


def test_batches_split_by_shape_hyperparameters_and_size(monkeypatch):
    """Same-shape matrices share a batch; another lr, shape or the size cap splits them."""
    layers = [nn.Linear(8, 8, bias=False) for _ in range(3)] + [nn.Linear(8, 4, bias=False)]
    groups = [{"params": [layers[0].weight, layers[1].weight, layers[3].weight]},
              {"params": [layers[2].weight], "lr": 0.5}]  # fmt: skip
    opt = PaperDobb(groups, lr=0.1, num_blocks=2, missing_stats="identity", foreach=True)
    for layer in layers:
        layer.weight.grad = torch.ones_like(layer.weight)
    sizes, batches = [], DobbSteps._batches

    def recorded(steps, *args):  # a step's batches, of every set of math options
        return [sizes.append(len(b)) or b for b in batches(steps, *args)]

    monkeypatch.setattr(DobbSteps, "_batches", recorded)
    opt.step()
    assert sorted(sizes) == [1, 1, 2]
    sizes.clear()
    monkeypatch.setattr(dobb_steps, "BATCH_ELEMENTS", 64)  # one 8 x 8 matrix per batch
    opt.step()
    assert sorted(sizes) == [1, 1, 1, 1]


def test_public_accessors_name_blocks_and_groups():
    layer = nn.Linear(10, 3, bias=False)
    opt = PaperDobb([layer.weight], lr=0.1, num_blocks=4)
    assert [(s.size, s.count) for s in opt.local_blocks(layer.weight)] == [(3, 2), (2, 2)]
    assert opt.stats_groups == []  # one process: nothing to average over
    with pytest.raises(ValueError, match="not in a Dobb parameter group"):
        opt.local_blocks(nn.Parameter(torch.zeros(2, 2)))


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"block_size": 3, "num_blocks": None},
        {"two_sided": True},
        {"two_sided": True, "row_blocks": None},
    ],
)
def test_a_layout_reads_only_the_options_it_is_cached_by(options):
    """``Dobb.layouts`` caches a matrix's layout by the options marked ``layout``:
    ``matrix_layout`` must read no other option, or a group changing it would keep a stale
    layout."""
    from dobb.optim.dobb import matrix_layout

    read = set()

    class Recording:
        def __init__(self, config):
            self.config = config

        def __getattr__(self, name):
            read.add(name)
            return getattr(self.config, name)

    layer = nn.Linear(12, 10, bias=False)
    opt = PaperDobb(layer.parameters(), **{"lr": 0.1, "num_blocks": 2, **options})
    matrix_layout(layer.weight, 1, Recording(opt.config), (), "weight")
    layout_options = set(dobb.Dobb.Config.layout_options())
    assert read and read <= layout_options, read - layout_options


def _trained(model, steps=4, **options) -> list[torch.Tensor]:
    """``model``'s hidden weights after ``steps`` steps of the recommended Dobb with
    ``options``, on a fixed stream of inputs."""
    opt = dobb.Dobb(dobb.param_groups(model), **options)
    opt.track(model)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(16, 12, generator=gen)).pow(2).mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters() if p.dim() == 2], opt


def test_the_width_rule_scales_the_update_by_256_over_the_narrowest_input():
    """update_scale="width" (the default with Adam coefficients): alpha = 256/model_width,
    model_width the group's narrowest input (12 here: the hidden layer's 20 is wider). With
    no weight decay, lr x under the rule is lr x * 256/12 at alpha 1, step for step; an
    explicit model_width takes its place."""
    rule, opt = _trained(mlp(), lr=1e-3)
    assert [c.model_width for _, c in opt.configs()] == [12]
    fixed, _ = _trained(mlp(), lr=1e-3 * 256 / 12, update_scale=1.0)
    torch.testing.assert_close(rule, fixed, rtol=1e-6, atol=1e-7)  # lr * alpha's rounding
    wide, _ = _trained(mlp(), lr=1e-3, model_width=512)
    half, _ = _trained(mlp(), lr=0.5e-3, update_scale=1.0)
    torch.testing.assert_close(wide, half, rtol=1e-6, atol=1e-7)
    assert not torch.allclose(rule[0], wide[0])


def test_the_width_rule_reads_each_groups_own_width():
    """Two groups, two widths: the second holds only the 20-wide layer."""
    model = mlp()
    first, second = model[0].weight, model[2].weight
    opt = dobb.Dobb([{"params": [first]}, {"params": [second]}])
    assert [c.model_width for _, c in opt.configs()] == [12, 20]


def test_a_checkpoint_from_before_the_width_rule_keeps_its_scale_of_1():
    """A group saved without ``model_width``, when update_scale=None with Adam coefficients
    meant 1.0, resumes at 1.0 (not the rule, which would change its update mid-run)."""
    model = mlp()
    _, opt = _trained(model, steps=1)
    saved = opt.state_dict()
    for group in saved["param_groups"]:
        group.pop("model_width", None)  # the AdamW group has none
    resumed = dobb.Dobb(dobb.param_groups(model))
    resumed.load_state_dict(saved)
    matrices = [g for g in resumed.param_groups if g["algorithm"] == "dobb"]
    assert [g["update_scale"] for g in matrices] == [1.0]
    resumed.load_state_dict(opt.state_dict())  # a group of today's keeps the rule
    assert [g["update_scale"] for g in resumed.param_groups if g["algorithm"] == "dobb"] == [None]
