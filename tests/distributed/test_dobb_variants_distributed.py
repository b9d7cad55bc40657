"""Dobb's variants (two-sided, Adam coefficients) sharded equal their single-device run,
with no collective inside ``step()`` besides the statistics average on refresh steps."""

import pytest
from dobb_configs import PaperDobb
from dobb_runs import compare_layout
from layouts import MLP
from multirank import run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dobb

# Row blocks that tile every row shard: FSDP over 2 splits fc1's 18 rows 9/9 and fc2's 3
# rows 2/1 (6 blocks: 3s, and 1s for fc2); TP over 2 splits fc1's 20 rows 10/10 and keeps
# fc2's 16 rows whole (2 blocks: 10s and 8s).
CASES = [
    ("fsdp", {"two_sided": True, "row_blocks": 6}, None),
    ("fsdp", {"two_sided": True, "row_blocks": 6, "row_stats": "gradients"}, None),
    ("fsdp", {"two_sided": True}, {"row_blocks": 2}),  # one block per rank's rows
    ("fsdp", {"coefficients": "adam", "two_sided": True, "row_blocks": 6}, None),
    ("hsdp", {"two_sided": True, "row_blocks": 6}, None),
    ("ddp", {"two_sided": True, "row_blocks": 4, "block_size": 5}, None),
    ("tp", {"two_sided": True, "row_blocks": 2}, None),
    ("tp", {"coefficients": "adam", "two_sided": True, "row_blocks": 2}, None),
    ("tp", {"two_sided": True, "row_blocks": 2, "row_stats": "outputs"}, None),
    ("ddp", {"two_sided": True, "row_blocks": 4, "row_stats": "outputs"}, None),
]


@pytest.mark.parametrize("layout, options, reference_options", CASES)
def test_variant_sharded_equals_single_device(layout, options, reference_options):
    world = 4 if layout == "hsdp" else 2
    results = run_ranks(
        compare_layout, world, layout, "refresh", True, "eigh", options, reference_options,
        timeout=120,
    )  # fmt: skip
    for result in results:
        # 1e-5: row moments come from gradients that FSDP sums in another order, and the
        # small row blocks' eigenvectors amplify that rounding a little
        assert max(result["errors"]) <= 1e-5, result["errors"]
        refresh = result["comms"][0]  # steps 0 and 2 refresh the bases, 1 and 3 do not
        assert result["comms"][1] == result["comms"][3] == [], result["comms"]
        # refresh steps: the statistics average over the data ranks and the bases'
        # all-gather; under TP, row moments from gradients (row_stats="gradients") are
        # averaged over the TP ranks that split fc2's columns; with "outputs", nothing
        expected = {"all_reduce", "all_gather"}
        if layout == "tp":
            expected = set() if options.get("row_stats") == "outputs" else {"all_reduce"}
        assert set(refresh) == expected, result["comms"]


def row_stats_outputs_under_fsdp(rank, world):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("data_shard",))
    model = MLP(18, 4)
    for module in (model.fc1, model.fc2, model):
        fully_shard(module, mesh=mesh)
    groups = dobb.param_groups(model, exclude="^$")
    PaperDobb(groups, lr=0.1, two_sided=True, row_stats="outputs", stats_group=mesh)


def test_row_stats_outputs_refuses_rows_split_over_data_ranks():
    with pytest.raises(NotImplementedError, match=r"fc1.weight: row_stats='outputs'.*FSDP"):
        run_ranks(row_stats_outputs_under_fsdp, 2, timeout=60)


def misaligned_row_blocks(rank, world):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("data_shard",))
    model = MLP(18, 3)
    for module in (model.fc1, model.fc2, model):
        fully_shard(module, mesh=mesh)
    PaperDobb(dobb.param_groups(model, exclude="^$"), lr=0.1, two_sided=True, row_blocks=4)


def test_misaligned_row_blocks_raise_at_construction():
    with pytest.raises(ValueError, match=r"fc1.weight.*output dim 0.*row_blocks=4.*row blocks"):
        run_ranks(misaligned_row_blocks, 2, timeout=60)
