"""Sharded NorDion2 equals NorDion2 on one device whose selection blocks are the shards.

Dion2's exchange of the selected rows (one all_to_all to each matrix's owner, none under
DDP; one back), then each rank normalizes its own selected rows and one all_reduce of two
floats per matrix sums ``||O||_F²`` and ``||Ô||_F²`` over the pieces (none under DDP,
where every rank holds whole matrices). Tolerance as Muon's (``ns_dtype=torch.float32``,
Polar Express, the default): relative error 1e-5.
"""

import pytest
from multirank import run_ranks
from row_runs import OPTIONS, TOLERANCE, compare

NORDION2 = {**OPTIONS, "row_fraction": 0.3, "ef_decay": 0.9, "beta2": 0.9}
# layout, world -> the row shards of fc1 (18 rows) and fc2 (3 rows): the reference's row_blocks
CASES = [("ddp", 2, 1), ("fsdp", 2, 2), ("hsdp", 4, 2)]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("layout, world, blocks", CASES)
def test_sharded_nordion2_equals_single_device_with_shard_blocks(layout, world, blocks):
    results = run_ranks(compare, world, layout, "nordion2", NORDION2, blocks, timeout=140)
    for result in results:
        assert max(result["errors"]) <= TOLERANCE, result["errors"]
    if layout == "ddp":
        expected = [("all_to_all", world)]
    else:
        expected = [("all_to_all", world), ("all_to_all", world), ("all_reduce", world)]
    for result in results:
        for step in result["comms"]:
            assert [(kind, size) for kind, size, _ in step] == expected
            if layout != "ddp":
                assert step[-1][2] == 4  # two floats per matrix (fc1, fc2)
    if layout != "ddp":  # v is sharded like the rows of W
        assert all(p is not None for p in results[0]["placements"])
