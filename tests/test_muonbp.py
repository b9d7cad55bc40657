"""MuonBP on one device: its limits (Muon, BlockMuon), the block step, the schedule, the lr rule."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dobb.optim.muon as muon_module
import dobb.optim.muonbp as muonbp_module
from dobb.optim.muon import Muon, lr_scale, nesterov_direction, newton_schulz
from dobb.optim.muonbp import MuonBP, block_tiles, chunk_sizes, full_step_due
from dobb.registry import build_optimizer

SHAPES = [(12, 8), (8, 12)]  # tall and wide
HP = dict(lr=0.05, momentum=0.9, weight_decay=0.1)


def run(make, shape, steps=4, seed=0):
    """The parameter after ``steps`` random-gradient steps of ``make([param])``."""
    g = torch.Generator().manual_seed(seed)
    p = nn.Parameter(torch.randn(shape, generator=g))
    opt = make([p])
    for _ in range(steps):
        p.grad = torch.randn(shape, generator=g)
        opt.step()
    return p.detach(), opt


def test_chunk_sizes_are_torch_chunk_padded_with_empty_parts():
    assert chunk_sizes(18, (4,)) == [5, 5, 5, 3]  # FSDP2 over 4 ranks
    assert chunk_sizes(3, (4,)) == [1, 1, 1, 0]  # one rank holds an empty shard
    assert chunk_sizes(18, (2, 2)) == [5, 4, 5, 4]  # TP 2, then FSDP 2 (_StridedShard)
    for n in range(12):
        for parts in range(1, 6):
            chunks = [len(c) for c in torch.arange(n).chunk(parts)]
            assert chunk_sizes(n, (parts,)) == chunks + [0] * (parts - len(chunks))


@pytest.mark.parametrize("update_scale", ["adamw", "spectral"])
@pytest.mark.parametrize("shape", SHAPES)
def test_period_one_is_muon(shape, update_scale):
    hp = dict(HP, update_scale=update_scale)
    ours, _ = run(lambda p: MuonBP(p, period=1, row_blocks=3, **hp), shape)
    theirs, _ = run(lambda p: Muon(p, **hp), shape)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("shape", SHAPES)
def test_blockmuon_with_one_block_is_muon(shape, nesterov):
    hp = dict(HP, nesterov=nesterov, update_scale="adamw")
    ours, opt = run(lambda p: MuonBP(p, period=None, block_lr_ratio=1.0, **hp), shape)
    theirs, _ = run(lambda p: Muon(p, **hp), shape)
    assert torch.equal(ours, theirs)
    assert set(next(iter(opt.state.values()))) == {"momentum", "step"}


@pytest.mark.parametrize(
    "shape, row_blocks, col_blocks",
    [
        ((10, 7), 4, 2),  # rows 3/3/3/1, columns 4/3: batched equal tiles and lone ones
        ((3, 5), 4, 1),  # an empty tile
        ((18, 6), (2, 2), 3),  # nested rows 5/4/5/4
    ],
)
def test_block_step_orthogonalizes_each_tile_on_its_own(shape, row_blocks, col_blocks):
    lr, ratio, mu, wd = 0.1, 0.5, 0.9, 0.1
    g = torch.Generator().manual_seed(1)
    w0, grad = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    p = nn.Parameter(w0.clone())
    p.grad = grad.clone()
    opt = MuonBP(
        [p],
        lr=lr,
        momentum=mu,
        weight_decay=wd,
        period=None,
        block_lr_ratio=ratio,
        row_blocks=row_blocks,
        col_blocks=col_blocks,
        ns_dtype=torch.float32,
    )
    opt.step()
    N = nesterov_direction(grad, torch.zeros(shape), beta=mu, nesterov=True)
    expected = w0.clone()
    for tile in block_tiles(shape, row_blocks, col_blocks):
        if N[tile].numel():
            ortho = newton_schulz(N[tile], dtype=torch.float32)  # this tile alone
            scale = lr_scale(tuple(ortho.shape), "adamw")
            expected[tile] = w0[tile] * (1 - lr * ratio * wd) - lr * ratio * scale * ortho
    torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-6)


def record_newton_schulz(monkeypatch, replacement=None):
    """Record the input shape of every Newton-Schulz call, Muon's and the block step's."""
    shapes = []

    def spy(G, steps=5, dtype=torch.bfloat16, coefficients="quintic"):
        shapes.append(tuple(G.shape))
        return (replacement or newton_schulz)(G, steps, dtype, coefficients)

    monkeypatch.setattr(muon_module, "newton_schulz", spy)
    monkeypatch.setattr(muonbp_module, "newton_schulz", spy)
    return shapes


def test_a_full_step_every_period_starting_with_the_first(monkeypatch):
    shapes = record_newton_schulz(monkeypatch)
    _, opt = run(lambda p: MuonBP(p, period=3, row_blocks=2, foreach=True), (8, 6), steps=7)
    full, block = (8, 6), (2, 4, 6)  # the whole matrix; two 4 x 6 tiles in one batch
    assert shapes == [full, block, block, full, block, block, full]
    assert int(next(iter(opt.state.values()))["step"]) == 7


def test_the_schedule_the_steps_follow_is_full_step_due(monkeypatch):
    """The steps ``full_step_due`` marks are the full ones the optimizer takes (the first,
    then every ``period``; none for BlockMuon): the schedule the cost model reads."""
    assert [full_step_due(s, 3) for s in range(1, 8)] == [1, 0, 0, 1, 0, 0, 1]
    assert [full_step_due(s, 1) for s in range(1, 4)] == [1, 1, 1]
    assert not any(full_step_due(s, None) for s in range(1, 8))
    for period in (2, 3, None):
        shapes = record_newton_schulz(monkeypatch)  # one call a step: the tiles batched
        run(lambda p, k=period: MuonBP(p, period=k, row_blocks=2, foreach=True), (8, 6), 7)
        full = [shape == (8, 6) for shape in shapes]
        assert full == [full_step_due(s, period) for s in range(1, 8)], period


def exact_polar(G, steps, dtype, coefficients):
    """U Vᵀ exactly (every singular value 1), in place of NS5's approximation."""
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    return (U @ Vh).to(dtype)


@pytest.mark.parametrize("row_blocks, col_blocks", [(4, 1), (1, 4), (2, 3)])
def test_block_and_full_updates_have_the_rms_the_paper_matches(monkeypatch, row_blocks, col_blocks):
    # RMS matching: with exact orthogonalization each update has RMS 0.2 lr (its own lr),
    # whatever the shape of the matrix or block it orthogonalized
    record_newton_schulz(monkeypatch, exact_polar)
    lr, ratio, shape = 0.01, 0.3, (24, 12)
    g = torch.Generator().manual_seed(2)
    p = nn.Parameter(torch.zeros(shape))
    tiling = dict(row_blocks=row_blocks, col_blocks=col_blocks)
    opt = MuonBP([p], lr=lr, period=2, block_lr_ratio=ratio, ns_dtype=torch.float32, **tiling)
    rms = []
    for _ in range(2):  # a full step, then a block step
        before = p.detach().clone()
        p.grad = torch.randn(shape, generator=g)
        opt.step()
        rms.append((p.detach() - before).pow(2).mean().sqrt().item())
    torch.testing.assert_close(rms, [0.2 * lr, 0.2 * lr * ratio], rtol=1e-5, atol=0)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"period": 2.5}, "invalid period"),
        ({"period": True}, "invalid period"),
        ({"row_blocks": "4"}, "invalid row_blocks"),
        ({"col_blocks": ()}, "invalid col_blocks"),
        ({"block_lr_ratio": float("nan")}, "invalid block_lr_ratio"),
    ],
)
def test_invalid_block_arguments_are_rejected(overrides, message):
    with pytest.raises(ValueError, match=message):
        MuonBP([nn.Parameter(torch.zeros(4, 4))], **overrides)


def test_registry_entry_builds_and_trains_a_tiny_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
    model.head = nn.Linear(16, 4)  # "head": routed to AdamW by name
    opt = build_optimizer("muonbp", model, period=2, row_blocks=2, col_blocks=2)
    assert [g["algorithm"] for g in opt.param_groups] == ["muonbp", "adamw"]
    assert len(opt.param_groups[0]["params"]) == 2
    x = torch.randn(64, 8)
    y = torch.tanh(x @ torch.randn(8, 4))
    losses = []
    for _ in range(40):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], (losses[0], losses[-1])
