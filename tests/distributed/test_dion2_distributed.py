"""Sharded Dion2 equals Dion2 on one device whose selection blocks are the layout's shards.

Each rank selects among its own rows; only the selected rows travel to the owner of each
matrix (one all_to_all, none under DDP) and back (one all_to_all). A single-device run
with ``row_blocks`` equal to the row shards selects the same rows, so it takes the same
steps. Tolerance as Muon's (``ns_dtype=torch.float32``): relative error 1e-5.
"""

import math

import pytest
from multirank import run_ranks
from row_runs import OPTIONS, TOLERANCE, compare

DION2 = {**OPTIONS, "row_fraction": 0.3, "ef_decay": 0.9}
# layout, world -> the row shards of fc1 and fc2 (18 rows over 4: 5/5/5/3; fc2's 3: 1/1/1/0;
# HSDP 2 x 2 shards over its data_shard axis: 2)
CASES = [("ddp", 2, 1), ("fsdp", 2, 2), ("fsdp", 4, 4), ("hsdp", 4, 2)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout, world, blocks", CASES)
def test_sharded_dion2_equals_single_device_with_shard_blocks(layout, world, blocks):
    results = run_ranks(compare, world, layout, "dion2", DION2, blocks, timeout=110)
    for result in results:
        assert max(result["errors"]) <= TOLERANCE, result["errors"]
    expected = [("all_to_all", world)] * (1 if layout == "ddp" else 2)
    for result in results:
        for step in result["comms"]:
            assert [(kind, size) for kind, size, _ in step] == expected
    # elements moved, all ranks together: the selected rows the owner lacks (a replicated
    # piece is sent once), then every other rank's selected rows back
    (plan,) = results[0]["plans"]
    replicas = {"ddp": world, "hsdp": 2}.get(layout, 1)
    lacking = sum(sum(sizes) // replicas - sizes[owner] for owner, sizes in plan)
    returned = sum(sum(sizes) - sizes[owner] for owner, sizes in plan)
    for step in range(len(results[0]["comms"])):
        moved = [sum(r["comms"][step][i][2] for r in results) for i in range(len(expected))]
        assert moved == ([returned] if layout == "ddp" else [lacking, returned])
    # and the selected matrices are the fraction of the rows: per shard ceil(0.3 rows)
    shards = {"ddp": [18], "fsdp": [9, 9] if world == 2 else [5, 5, 5, 3], "hsdp": [9, 9]}
    selected_fc1 = sum(math.ceil(0.3 * rows) for rows in shards[layout])
    assert sum(plan[0][1]) // replicas == selected_fc1 * 16  # fc1: 18 x 16
