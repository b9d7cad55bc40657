"""One config per optimizer (``dobb.optim.config``): one default per option, class and
registry alike; a batching key that holds every option marked as changing the update. (The
docs' option tables, rendered from the configs: ``tests/repo/test_docs_tables.py``.)"""

import inspect
from dataclasses import fields

import pytest
import torch
from torch import nn

from dobb.registry import OPTIMIZERS, build_optimizer, recommended_lr

CLASSES = sorted({e.cls for e in OPTIMIZERS.values() if hasattr(e.cls, "Config")}, key=str)


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(11, 8), nn.Linear(8, 8), nn.Linear(8, 11))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_class_defaults_are_the_registrys(name):
    entry, net = OPTIMIZERS[name], model()
    built = build_optimizer(name, net)
    bare = {k: v for k, v in built.param_groups[0].items() if k in ("params", "algorithm")}
    plain = entry.cls([bare], **entry.hyperparameters)
    group, default = (
        {k: v for k, v in opt.param_groups[0].items() if k not in ("params", "param_names", "lr")}
        for opt in (built, plain)
    )
    assert group == default and plain.param_groups[0]["lr"] == entry.lr
    # the registry's lr is the table's at the model's width (8: the nearest tuned is 128)
    assert built.param_groups[0]["lr"] == recommended_lr(name, 8)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_the_constructor_takes_every_option_with_the_configs_default(cls):
    signature = inspect.signature(cls).parameters
    options = {f.name: f.default for f in fields(cls.Config)}
    assert set(signature) - {"params"} == set(options)
    assert {name: signature[name].default for name in options} == options


# a value other than the default of every option marked ``math`` (a callable: of the
# default), and what it needs besides
OTHER = {
    "lr": 0.05,
    "weight_decay": 0.2,
    "momentum": 0.5,
    "nesterov": lambda d: not d,
    "ns_steps": 3,
    "ns_dtype": lambda d: torch.float64 if d == torch.float32 else torch.float32,
    "ns_coefficients": lambda d: "quintic" if d == "polar_express" else "polar_express",
    "adjust_lr": lambda d: "spectral" if d == "match_rms_adamw" else "match_rms_adamw",
    "period": 1,
    "block_lr_ratio": 0.5,
    "row_blocks": 2,
    "col_blocks": 2,
    "beta2": 0.5,
    "eps": 1e-2,
    "fraction": 0.5,
    "ef_decay": 0.5,
    "mu": 0.5,
    "rank_fraction": 0.5,
    "rank": 2,
    "orthogonalize": lambda d: "qr" if d == "cholesky_qr" else "cholesky_qr",
    "num_blocks": 4,
    "stats_beta": 0.5,
    "basis_interval": 2,
    "update_scale": 0.5,
    "block_size": 2,
    "row_block_size": 2,
    "two_sided": lambda d: not d,
    "row_stats": "outputs",
    "coefficients": lambda d: "sign" if d == "adam" else "adam",
    "coefficient_beta": 0.5,
    "projection_dtype": "bfloat16",
    "basis_method": "power_qr",
    "basis_source": "gradients",
}
# Dobb: blocks of 4 columns, refreshed every step; Newton-Schulz in fp32 (bf16 is slow on CPU)
BASE = {"Dobb": {"num_blocks": 2, "basis_interval": 1}}
BASE |= {n: {"ns_dtype": torch.float32} for n in ("Muon", "MuonBP", "NorMuon", "Dion2", "NorDion2")}
NEEDS = {
    ("MuonBP", "period"): {"row_blocks": 2},  # else a block step is the full step
    ("Dobb", "row_blocks"): {"two_sided": True},
    ("Dobb", "block_size"): {"num_blocks": None},
    ("Dobb", "row_stats"): {"two_sided": True},
    ("Dobb", "coefficient_beta"): {"coefficients": "adam"},
}
MATH = [
    pytest.param(cls, name, id=f"{cls.__name__}-{name}")
    for cls in CLASSES
    for name in cls.Config.math_options()
]


def train(make, groups, steps=3):
    """Weights of two same-shape layers after ``steps`` steps of the optimizers ``make``
    builds from ``groups`` (one per layer, ``(name, param)`` lists)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False))
    named = [[(f"{i}.weight", layer.weight)] for i, layer in enumerate(net)]
    optimizers = make([{**g, "params": p} for g, p in zip(groups, named)])
    for opt in optimizers:
        sources = [g.get("basis_source") for g in opt.param_groups]
        if hasattr(opt, "track") and "activations" in sources:
            opt.track(net)
    data = torch.Generator().manual_seed(1)
    for _ in range(steps):
        net(torch.randn(16, 8, generator=data)).square().mean().backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    return [layer.weight.detach() for layer in net]


@pytest.mark.parametrize("cls, name", MATH)
def test_groups_that_differ_in_a_math_option_never_share_a_batch(cls, name):
    """Two groups differing only in ``name`` in one optimizer (batched, same shapes) update
    as two optimizers do: the batching key holds the option."""
    assert name in OTHER, f"add a value of {name} to OTHER"
    options = {**BASE.get(cls.__name__, {}), **NEEDS.get((cls.__name__, name), {})}
    default = options.get(name, cls.Config.__dataclass_fields__[name].default)
    other = OTHER[name](default) if callable(OTHER[name]) else OTHER[name]
    assert other != default
    options["foreach"] = True
    groups = [{}, {name: other}]
    together = train(lambda gs: [cls(gs, **options)], groups)
    apart = train(lambda gs: [cls([g], **options) for g in gs], groups)
    for a, b in zip(together, apart):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    alike = train(lambda gs: [cls(gs, **options)], [{}, {}])
    assert not torch.equal(together[1], alike[1])  # the option changed the update
