"""Distributed Muon equals the single-device run under DDP, FSDP2, HSDP, TP and FSDP x TP.

Each matrix is gathered to one owner rank, orthogonalized there and sent back (one
all_to_all each way per step). The workers: ``muon_runs``.

Tolerance: with ``ns_dtype=torch.float32`` the owner runs the same Newton-Schulz on the
same matrix as one device, so parameters agree to float rounding; we allow a relative
error of 1e-5 (measured: ~1e-7).
"""

import pytest
import torch
from multirank import run_ranks
from muon_runs import MUON, STEPS, checkpoint_run, compare_layout

TOLERANCE = 1e-5


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "layout, world",
    [("ddp", 2), ("fsdp", 2), ("fsdp", 4), ("hsdp", 4), ("tp", 2), ("fsdp_tp", 4)],
)
def test_sharded_muon_equals_single_device(layout, world):
    # under DDP the replicas share the work (Keller's distributed Muon): replica_group set
    results = run_ranks(compare_layout, world, layout, "muon", MUON, layout == "ddp", timeout=110)
    for result in results:
        assert max(result["errors"]) <= TOLERANCE, result["errors"]
    # one all_to_all to the owners (none under DDP: every rank holds N whole), one back,
    # over every rank of the mesh (or the DDP group)
    expected = [("all_to_all", world)] * (1 if layout == "ddp" else 2)
    for result in results:
        for step in result["comms"]:
            assert [(kind, size) for kind, size, _ in step] == expected
    # elements, all ranks together: the owner receives each piece it lacks once (a piece
    # held by several replicas is sent by one), and sends every other rank its piece
    plan = results[0]["plan"]
    replicas = 2 if layout in ("ddp", "hsdp") else 1
    lacking = sum(sum(sizes) // replicas - sizes[owner] for owner, sizes in plan)
    returned = sum(sum(sizes) - sizes[owner] for owner, sizes in plan)
    for step in range(STEPS):
        moved = [sum(r["comms"][step][i][2] for r in results) for i in range(len(expected))]
        assert moved == ([returned] if layout == "ddp" else [lacking, returned])


@pytest.mark.timeout(120)
def test_dcp_resume_on_another_mesh_equals_uninterrupted(tmp_path):
    """Save under FSDP x TP on 4 ranks, resume under FSDP on 2."""
    uninterrupted, states = run_ranks(
        checkpoint_run, 4, str(tmp_path), "save", "fsdp_tp", timeout=110
    )[0]
    momenta = [placements for key, placements, _ in states if key == "momentum"]
    assert len(momenta) == 2 and None not in momenta  # momentum sharded like the weights
    resumed, _ = run_ranks(checkpoint_run, 2, str(tmp_path), "load", "fsdp", timeout=110)[0]
    for a, b in zip(uninterrupted, resumed):
        torch.testing.assert_close(a, b, rtol=TOLERANCE, atol=1e-7)
