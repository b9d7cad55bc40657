"""The small language model the shared-behaviour tests train with every registry optimizer:
``TinyLM``, the cases (each optimizer, with each scalar algorithm where it has a scalar group),
and the helpers that build, train and compare runs (``test_shared_behaviour``,
``test_optimizer_errors``)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dobb.registry import OPTIMIZERS, build_optimizer

VOCAB = 16
MATRIX_NAMES = [name for name, entry in OPTIMIZERS.items() if entry.is_matrix]
# (optimizer, algorithm of its scalar group): both scalar routes of every matrix optimizer
CASES = [
    pytest.param(name, scalar, id=f"{name}+{scalar}")
    for name in MATRIX_NAMES
    for scalar in ("adamw", "lion")
] + [pytest.param(name, None, id=name) for name in OPTIMIZERS if name not in MATRIX_NAMES]
MATRIX_CASES = [case for case in CASES if case.values[0] in MATRIX_NAMES]


class TinyLM(nn.Module):
    """Embedding -> Linear 16x32 (tall) -> GELU -> Linear 32x16 (wide) -> norm -> head."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, 16)
        self.fc = nn.Linear(16, 32)
        self.proj = nn.Linear(32, 16)
        self.ln = nn.LayerNorm(16)
        self.head = nn.Linear(16, VOCAB, bias=False)

    def forward(self, idx):
        x = self.wte(idx)
        return self.head(self.ln(x + self.proj(F.gelu(self.fc(x)))))


def make(name, scalar, *, foreach, seed=0, **overrides):
    """TinyLM (seeded) and registry optimizer ``name`` on the path ``foreach`` (no default:
    each test chooses)."""
    torch.manual_seed(seed)
    model = TinyLM()
    if scalar is not None:
        overrides["scalar_algorithm"] = scalar
    return model, build_optimizer(name, model, foreach=foreach, **overrides)


def batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (4, 8), generator=g), torch.randint(
        0, VOCAB, (4, 8), generator=g
    )


def loss_of(model, step):
    x, y = batch(step)
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def train(model, opt, steps, first=0, fixed_batch=False):
    losses = []
    for t in range(first, first + steps):
        opt.zero_grad()
        loss = loss_of(model, 0 if fixed_batch else t)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_same_params(a, b, atol=0.0):
    assert a.keys() == b.keys()
    for n in a:
        torch.testing.assert_close(a[n], b[n], atol=atol, rtol=0, msg=lambda m, n=n: f"{n}: {m}")


def state_snapshot(opt):
    return copy.deepcopy(opt.state_dict()["state"])


def assert_same_state(a, b):
    assert a.keys() == b.keys()
    for index in a:
        assert a[index].keys() == b[index].keys()
        for key, value in a[index].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, b[index][key]), (index, key)
