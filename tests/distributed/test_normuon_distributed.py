"""Distributed NorMuon equals the single-device run under DDP, FSDP2 and HSDP.

Muon's owner exchange (one all_to_all to the owners, none under DDP; one back), then each
rank normalizes its own rows and one all_reduce of one float per matrix sums ``||Ô||_F²``
(none under DDP, where every rank holds whole matrices). The worker: ``row_runs``.

Tolerance as Muon's: with ``ns_dtype=torch.float32`` the owner runs the same Newton-Schulz
as one device, so the parameters agree to float rounding (relative error 1e-5).
"""

import pytest
from layouts import MLP, parallelize
from multirank import run_ranks
from row_runs import OPTIONS, TOLERANCE, build, compare


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout, world", [("ddp", 2), ("fsdp", 2), ("fsdp", 4), ("hsdp", 4)])
def test_sharded_normuon_equals_single_device(layout, world):
    results = run_ranks(compare, world, layout, "normuon", OPTIONS, timeout=110)
    for result in results:
        assert max(result["errors"]) <= TOLERANCE, result["errors"]
    # Muon's exchange, then the sum of ||Ô||_F² over the mesh (DDP: neither the gather
    # nor the sum: every rank holds N and O whole)
    if layout == "ddp":
        expected = [("all_to_all", world)]
    else:
        expected = [("all_to_all", world), ("all_to_all", world), ("all_reduce", world)]
    for result in results:
        for step in result["comms"]:
            assert [(kind, size) for kind, size, _ in step] == expected
            if layout != "ddp":
                assert step[-1][2] == 2  # one float per matrix (fc1, fc2)
    if layout != "ddp":  # v is sharded like the rows of W
        assert all(p is not None for p in results[0]["placements"])


def construct_on_tp(rank, world):
    model, _, _, _ = parallelize(MLP(20, 16), "tp", world)
    for name in ("normuon", "dion2", "nordion2"):
        with pytest.raises(NotImplementedError, match="split along its columns"):
            build(name, model, OPTIONS)
    return True


@pytest.mark.timeout(60)
def test_column_split_weights_are_rejected():
    # TP's row-parallel fc2 is Shard(1): rows are split over ranks, so neither the row
    # normalization (NorMuon) nor the row selection (Dion2) can run on a rank's piece
    assert all(run_ranks(construct_on_tp, 2, timeout=50))
