"""The optimizers' process-group arguments: one name per meaning, the old spelling deprecated.

``stats_group`` (Dobb), ``replica_group`` (Muon's family) and ``sync_group`` (Dion) replaced
``data_parallel=``, which still works for one release with a ``DeprecationWarning`` that
names the new argument and gives the same optimizer.
"""

import warnings

import pytest
import torch
import torch.distributed as dist
from multirank import run_ranks
from torch import nn

import dobb
from dobb.optim.registry import OPTIMIZERS, build_optimizer

# each matrix optimizer's group argument (the meanings: dobb.distributed.groups)
NEW_NAME = {
    "dobb": "stats_group",
    "dobb2s": "stats_group",
    "muon": "replica_group",
    "muonbp": "replica_group",
    "blockmuon": "replica_group",
    "normuon": "replica_group",
    "dion2": "replica_group",
    "dion": "sync_group",
}


def test_every_matrix_optimizer_has_a_group_argument():
    assert set(NEW_NAME) == {name for name, entry in OPTIMIZERS.items() if entry.is_matrix}


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 8))


def _steps(opt, model):
    """Two steps on the same batches on every rank; the parameters after them."""
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def both_spellings(rank, world):
    """Per optimizer: the warnings of the old spelling, and both spellings' parameters."""
    results = {}
    for name, new in NEW_NAME.items():
        model = _model()
        new_params = _steps(build_optimizer(name, model, **{new: dist.group.WORLD}), model)
        model = _model()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt = build_optimizer(name, model, data_parallel=dist.group.WORLD)
        old_params = _steps(opt, model)
        messages = [str(w.message) for w in caught if w.category is DeprecationWarning]
        results[name] = (messages, all(map(torch.equal, new_params, old_params)))
    return results


@pytest.mark.timeout(120)
def test_data_parallel_still_works_and_warns_with_the_new_name():
    for results in run_ranks(both_spellings, 2, timeout=110):
        for name, (messages, same) in results.items():
            assert len(messages) == 1, (name, messages)
            assert f"pass {NEW_NAME[name]}=" in messages[0], (name, messages)
            assert same, f"{name}: data_parallel= and {NEW_NAME[name]}= train differently"


@pytest.mark.parametrize("name", sorted(NEW_NAME))
def test_both_spellings_at_once_is_an_error(name):
    with pytest.raises(ValueError, match=f"pass {NEW_NAME[name]} only"):
        build_optimizer(name, _model(), **{NEW_NAME[name]: object(), "data_parallel": object()})


@pytest.mark.parametrize("name", sorted(NEW_NAME))
def test_a_group_argument_of_the_wrong_kind_names_the_argument(name):
    with pytest.raises(TypeError, match=f"{NEW_NAME[name]} must be a DeviceMesh, a ProcessGroup"):
        build_optimizer(name, _model(), **{NEW_NAME[name]: "world"})


def test_an_argument_of_another_optimizer_is_refused():
    """Each name means one thing: Muon has no statistics to average, Dobb no replicas'
    work to share out."""
    with pytest.raises(TypeError, match="stats_group"):
        dobb.Muon(_model().parameters(), stats_group=None)
    with pytest.raises(TypeError, match="replica_group"):
        dobb.Dobb(_model().parameters(), lr=1e-3, replica_group=None)
