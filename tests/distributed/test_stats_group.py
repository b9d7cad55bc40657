"""Dobb's ``stats_group`` must be data-parallel ranks: an axis that splits a matrix's input
columns (row-parallel TP) or, with ``row_stats="outputs"``, its rows (column-parallel TP)
raises at construction, or at ``track()`` for a ``(d_in, d_out)`` weight; the data axes
are accepted. Groups are compared by their ranks: a second mesh or a ProcessGroup over the
TP ranks is refused like the TP mesh itself."""

import pytest
import torch
import torch.distributed as dist
from layouts import MLP, parallelize
from multirank import run_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dobb


class TransposedLinear(nn.Module):
    """Stores its weight as ``(d_in, d_out)`` and computes ``x @ W``, like GPT-2's Conv1D."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_in, d_out))

    def forward(self, x):
        return x @ self.weight


def _outcome(build):
    """``"ok"`` if ``build()`` returns, else the exception's type name and message."""
    try:
        build()
    except (ValueError, NotImplementedError) as error:
        return f"{type(error).__name__}: {error}"
    return "ok"


def _tp_cases(world):
    """Row-parallel fc2 (its input columns split over TP) and column-parallel fc1 (rows)."""
    model, _, _, _ = parallelize(MLP(20, 16), "tp", world)
    tp_mesh = model.fc2.weight.device_mesh
    new_group = dist.new_group(list(range(world)))  # the TP ranks, another group name
    groups = dobb.param_groups(model, exclude="^$")
    fc1 = [("fc1.weight", model.fc1.weight)]
    return {
        "tp mesh": lambda: dobb.Dobb(groups, lr=0.1, stats_group=tp_mesh),
        "world group": lambda: dobb.Dobb(groups, lr=0.1, stats_group=dist.group.WORLD),
        "new group": lambda: dobb.Dobb(groups, lr=0.1, stats_group=new_group),
        "tp, none": lambda: dobb.Dobb(groups, lr=0.1),
        # column-parallel fc1 alone: one-sided, its inputs are the same on every TP rank
        "fc1 one-sided": lambda: dobb.Dobb(fc1, lr=0.1, stats_group=dist.group.WORLD),
        "fc1 outputs": lambda: dobb.Dobb(
            fc1, lr=0.1, two_sided=True, row_stats="outputs", stats_group=new_group
        ),
        "fc1 gradients": lambda: dobb.Dobb(
            fc1, lr=0.1, two_sided=True, row_stats="gradients", stats_group=dist.group.WORLD
        ),
    }


def _fsdp_cases(world):
    """FSDP shards dim 0: an nn.Linear's rows (fine), a (d_in, d_out) weight's inputs."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("data_shard",))
    model = MLP(18, 3)
    for module in (model.fc1, model.fc2, model):
        fully_shard(module, mesh=mesh)
    dobb.stats.register_layer(TransposedLinear, input_dim=0)
    transposed = TransposedLinear(16, 6)
    fully_shard(transposed, mesh=mesh)

    def track_transposed():
        opt = dobb.Dobb(dobb.param_groups(transposed), lr=0.1, num_blocks=4, stats_group=mesh)
        opt.track(transposed)

    def train_linear():
        opt = dobb.Dobb(dobb.param_groups(model, exclude="^$"), lr=0.1, stats_group=mesh)
        opt.track(model)
        model(torch.randn(4, 16)).square().mean().backward()
        opt.step()

    return {"fsdp data axis": train_linear, "fsdp transposed": track_transposed}


def outcomes(rank, world):
    return {
        name: _outcome(build) for name, build in {**_tp_cases(world), **_fsdp_cases(world)}.items()
    }


@pytest.fixture(scope="module")
def results():
    per_rank = run_ranks(outcomes, 2, timeout=120)
    assert per_rank[0] == per_rank[1]  # every rank decides alike
    return per_rank[0]


@pytest.mark.parametrize("case", ["tp mesh", "world group", "new group"])
def test_a_group_splitting_input_columns_raises(results, case):
    message = results[case]
    assert message.startswith("ValueError: fc2.weight: stats_group"), message
    assert "ranks [0, 1]" in message and "mesh axis 'tensor'" in message, message
    assert "pass only the data-parallel axes" in message, message
    assert "stats_group=None" in message, message


def test_a_transposed_weight_split_along_its_inputs_raises_at_track(results):
    message = results["fsdp transposed"]
    assert message.startswith("ValueError: weight: stats_group"), message
    assert "input dim 0" in message and "mesh axis 'data_shard'" in message, message


def test_a_tp_axis_averaging_split_rows_of_output_moments_raises(results):
    message = results["fc1 outputs"]
    assert message.startswith("NotImplementedError: fc1.weight: row_stats='outputs'"), message
    assert "pass only the data-parallel axes" in message, message


@pytest.mark.parametrize("case", ["tp, none", "fc1 one-sided", "fc1 gradients", "fsdp data axis"])
def test_data_axes_and_unsplit_inputs_are_accepted(results, case):
    assert results[case] == "ok"


def fsdp_without_stats_group(rank, world):
    """Dobb with ``stats_group`` left unset on a model FSDP shards over all ranks, and on
    one it shards over this rank alone (a pipeline stage: the ranks hold different
    layers, no data parallelism): ``track``'s outcomes."""
    outcomes = []
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("pp", "data_shard"))
    for data_mesh in (mesh["pp"], mesh["data_shard"]):
        model = MLP(18, 4)
        for module in (model.fc1, model.fc2, model):
            fully_shard(module, mesh=data_mesh)
        opt = dobb.Dobb(dobb.param_groups(model, exclude="^$"))
        outcomes.append(_outcome(lambda opt=opt, model=model: opt.track(model)))
    return outcomes


def test_an_fsdp_model_without_stats_group_is_refused_at_track():
    """FSDP's ranks see different tokens: without ``stats_group`` each rank would
    precondition with its own statistics (replicated DDP parameters are checked at the
    first step: tests/distributed/test_nanogpt_loop.py). FSDP over one rank of several
    (torchtitan's pipeline stages without data parallelism) needs none."""
    for sharded, stage in run_ranks(fsdp_without_stats_group, 2, timeout=120):
        assert sharded.startswith("ValueError") and "over 2 ranks" in sharded, sharded
        assert stage == "ok", stage


def a_rank_without_tokens(rank, world):
    """A replicated ``nn.Linear`` (DDP's layout, ``stats_group`` over the world) whose
    first step gives rank 1 no token and rank 0 some, then a step with tokens on both:
    each rank's ``C`` and ``stats_steps`` afterwards (gradients averaged by hand, as DDP
    would)."""
    torch.manual_seed(0)
    layer = nn.Linear(8, 6, bias=False, dtype=torch.float64)
    opt = dobb.Dobb([layer.weight], lr=0.01, stats_group=dist.group.WORLD)
    opt.track(layer)
    for step, rows in enumerate([(4, 0), (4, 3)]):
        generator = torch.Generator().manual_seed(10 * step + rank)
        x = torch.randn(rows[rank], 8, generator=generator, dtype=torch.float64)
        opt.zero_grad()
        layer(x).square().sum().backward()
        dist.all_reduce(layer.weight.grad)
        opt.step()
    state = opt.state[layer.weight]
    return {k: v.clone() for k, v in state.items() if "_cov" in k or k == "stats_steps"}


def test_a_rank_without_tokens_folds_zero_statistics_and_keeps_its_ranks_in_step():
    """The idle expert's rule (``C`` and ``stats_steps`` kept on no token) is for a layer
    whose ``C`` no group averages: a replicated layer's ranks fold alike, one of them zero
    statistics, so that their ``stats_steps`` and collectives stay the same (a rank that
    skipped its first fold would skip the average the others call, and hang them)."""
    first, second = run_ranks(a_rank_without_tokens, 2, timeout=60)
    assert float(first["stats_steps"]) == float(second["stats_steps"]) == 2
    for key in first:
        assert torch.equal(first[key], second[key]), key
