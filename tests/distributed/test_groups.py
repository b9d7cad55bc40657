"""The optimizers' process-group arguments: one name per meaning.

``stats_group`` (Dobb), ``replica_group`` (Muon's family) and ``sync_group`` (Dion); the
old spelling ``data_parallel=`` is gone.
"""

import pytest
import torch
from torch import nn

import dobb
from dobb.registry import OPTIMIZERS, build_optimizer

# each matrix optimizer's group argument (the meanings: dobb.distributed.groups)
NEW_NAME = {
    "dobb": "stats_group",
    "dobb_sign": "stats_group",
    "dobb_paper": "stats_group",
    "muon": "replica_group",
    "muonbp": "replica_group",
    "blockmuon": "replica_group",
    "normuon": "replica_group",
    "dion2": "replica_group",
    "nordion2": "replica_group",
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


@pytest.mark.parametrize("name", sorted(NEW_NAME))
def test_the_old_spelling_is_refused(name):
    with pytest.raises(TypeError, match="data_parallel"):
        build_optimizer(name, _model(), data_parallel=None)


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
