"""One config per optimizer (``dobb.optim.config``): one default per option, class and
registry alike; a batching key that holds every option marked as changing the update. (The
docs' option tables, rendered from the configs: ``tests/repo/test_docs_tables.py``.)"""

import copy
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
    "update_scale": lambda d: {"spectral": "adamw", "adamw": "spectral"}.get(d, 0.5),  # Dobb's
    "period": 1,
    "block_lr_ratio": 0.5,
    "model_width": 64,
    "row_blocks": 2,
    "col_blocks": 2,
    "beta2": 0.5,
    "eps": 1e-2,
    "row_fraction": 0.5,
    "ef_decay": 0.5,
    "rank_fraction": 0.5,
    "rank": 2,
    "orthogonalize": lambda d: "qr" if d == "cholesky_qr" else "cholesky_qr",
    "num_blocks": 4,
    "stats_beta": 0.5,
    "basis_interval": 2,
    "block_size": 2,
    "row_block_size": 2,
    "two_sided": lambda d: not d,
    "row_stats": "outputs",
    "coefficients": lambda d: "sign" if d == "adam" else "adam",
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
    ("Dobb", "beta2"): {"coefficients": "adam"},
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


# every option renamed before the first release, with its class (``Config.renamed``)
RENAMES = [
    pytest.param(cls, old, new, id=f"{cls.__name__}-{old}")
    for cls in CLASSES
    for old, new in cls.Config.renamed.items()
]


def test_the_renamed_options_are_the_vocabulary_docs_baselines_lists():
    assert {(c.__name__, old, new) for c, old, new in (p.values for p in RENAMES)} == {
        ("Dion", "mu", "momentum"),
        ("Dobb", "coefficient_beta", "beta2"),
        ("Dion2", "fraction", "row_fraction"),
        ("NorDion2", "fraction", "row_fraction"),
        ("Muon", "adjust_lr", "update_scale"),
        ("MuonBP", "adjust_lr", "update_scale"),
    }


@pytest.mark.parametrize("cls, old, new", RENAMES)
def test_an_old_spelling_is_refused_with_the_new_one(cls, old, new):
    """In the constructor and in a parameter group, before anything changes."""
    default = cls.Config.__dataclass_fields__[new].default
    with pytest.raises(TypeError, match=f"'{old}' is now called '{new}'"):
        cls([nn.Parameter(torch.randn(4, 4))], **{old: default})
    opt = cls([nn.Parameter(torch.randn(4, 4))])
    with pytest.raises(TypeError, match=f"'{old}' is now called '{new}'"):
        opt.add_param_group({"params": [nn.Parameter(torch.randn(4, 4))], old: default})
    assert len(opt.param_groups) == 1


def test_an_old_value_is_refused_with_the_new_one():
    with pytest.raises(ValueError, match="update_scale='match_rms_adamw' is now update_scale="):
        build_optimizer("muon", model(), update_scale="match_rms_adamw")


def old_spellings(state_dict: dict, config) -> dict:
    """``state_dict`` as written before the renames: each group's renamed options under the
    old name and the old value (``Config.renamed``, ``renamed_values``), spelt out here."""
    new_to_old = {new: old for old, new in config.renamed.items()}
    old_values = {(name, new): old for (name, old), new in config.renamed_values.items()}
    groups = [
        {
            new_to_old.get(k, k): old_values.get((k, v), v) if isinstance(v, str) else v
            for k, v in g.items()
        }
        for g in state_dict["param_groups"]
    ]
    return {**state_dict, "param_groups": groups}


@pytest.mark.parametrize("cls, old, new", RENAMES)
def test_a_checkpoint_under_the_old_spelling_loads_and_continues_as_the_saved_run(cls, old, new):
    """A run saved (an option set away from its default) in the old spelling loads into a
    fresh optimizer under today's name with the saved value, leaves the given state dict as
    it was, and its next step equals the uninterrupted run's, bit for bit (same machine)."""
    default = cls.Config.__dataclass_fields__[new].default
    value = OTHER[new](default) if callable(OTHER[new]) else OTHER[new]
    options = {**BASE.get(cls.__name__, {}), new: value}
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(2))

    def built(net):
        opt = cls([net.weight], **options)
        if hasattr(opt, "track"):
            opt.track(net)
        return opt

    def step(net, opt):
        net(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    torch.manual_seed(0)
    net = nn.Linear(8, 8, bias=False)
    opt = built(net)
    for _ in range(2):
        step(net, opt)
    saved = old_spellings(copy.deepcopy(opt.state_dict()), cls.Config)  # as if from a file
    assert old in saved["param_groups"][0] and new not in saved["param_groups"][0]
    resumed = nn.Linear(8, 8, bias=False)
    resumed.load_state_dict(net.state_dict())
    again = built(resumed)
    again.load_state_dict(saved)
    assert old in saved["param_groups"][0]  # the caller's dict is left as given
    group = again.param_groups[0]
    assert old not in group and group[new] == value
    step(net, opt)
    step(resumed, again)
    torch.testing.assert_close(resumed.weight, net.weight, rtol=0, atol=0)
