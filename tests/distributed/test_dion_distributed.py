"""Distributed Dion equals the single-device run under DDP, FSDP2, HSDP, TP and FSDP x TP.

Where rows are split, ``S P``, ``P₁ᵀ P₁`` and ``R = Bᵀ P`` are summed over the row axes;
where columns are split, ``B Q`` and the column norms of ``R``; with compressed sync, ``P``
and ``R`` are averaged over the replicas. One batched all-reduce per axis and round.

Tolerance: the distributed sums add the same products in another order, and randomized
Cholesky QR and the power step pass that rounding on; we allow a relative error of 1e-5
on the parameters after three steps (measured: ~1e-7).
"""

import pytest
import torch
from multirank import run_ranks
from muon_runs import checkpoint_run, compare_layout

TOLERANCE = 1e-5
DION = {"lr": 0.05, "rank": 2, "momentum": 0.9, "orthogonalize": "cholesky_qr"}

# all-reduces per step, in order, as (group size, round) for each layout on its world size
# (fc1: 18 x 16, fc2: out x 18; see LAYOUTS). Rounds: "BQ" (columns split), "SP", "PtP",
# "R" (rows split), "norms" (columns split), and the compressed-sync means "P", "R mean".
EXPECTED = {
    # DDP, gradients averaged by DDP: the replicas compute alike, no communication
    ("ddp", False): [],
    # DDP, compressed: P and R averaged over the replicas (weights ignored by DDP)
    ("ddp", True): ["P", "R mean"],
    # FSDP: both matrices row-split over the FSDP axis
    ("fsdp", False): ["SP", "PtP", "R"],
    # HSDP 2 x 2, compressed: rows split over data_shard, P and R averaged over replicas
    ("hsdp", True): ["P", "SP", "PtP", "R", "R mean"],
    # TP: fc1 rows split (column-parallel), fc2 columns split (row-parallel)
    ("tp", False): ["BQ", "SP", "PtP", "R", "norms"],
    # FSDP x TP 2 x 2: fc1 rows over both axes; fc2 rows over data_shard, columns over TP
    ("fsdp_tp", False): ["BQ", "SP", "SP", "PtP", "PtP", "R", "R", "norms"],
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "layout, world, compressed",
    [
        ("ddp", 2, False),
        ("ddp", 2, True),
        ("fsdp", 2, False),
        ("fsdp", 4, False),
        ("hsdp", 4, True),
        ("tp", 4, False),
        ("fsdp_tp", 4, False),
    ],
)
def test_sharded_dion_equals_single_device(layout, world, compressed):
    results = run_ranks(
        compare_layout, world, layout, "dion", DION, compressed, compressed, timeout=110
    )
    for result in results:
        assert max(result["errors"]) <= TOLERANCE, result["errors"]
    if compressed:  # state_dict() left every replica the same (averaged) momentum
        for result in results[1:]:
            for a, b in zip(results[0]["momenta"], result["momenta"]):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
    rounds = EXPECTED[layout, compressed]
    size = 2 if layout in ("hsdp", "fsdp_tp") else world
    for result in results:
        for step in result["comms"]:
            assert [(kind, group) for kind, group, _ in step] == [("all_reduce", size)] * len(
                rounds
            ), step


@pytest.mark.timeout(120)
def test_householder_qr_gathers_row_split_P():
    """orthogonalize="qr" on row-split P: all-gather P's rows, Householder on every rank."""
    options = {**DION, "orthogonalize": "qr"}
    results = run_ranks(compare_layout, 4, "fsdp", "dion", options, timeout=110)
    for result in results:
        assert max(result["errors"]) <= TOLERANCE, result["errors"]
        for step in result["comms"]:  # the B != 0 flags, a gather of P per matrix, R
            kinds = ["all_reduce", "all_gather", "all_gather", "all_reduce"]
            assert [kind for kind, _, _ in step] == kinds, step


@pytest.mark.timeout(120)
def test_dcp_resume_on_another_mesh_equals_uninterrupted(tmp_path):
    """Save under FSDP x TP on 4 ranks (fc2's Q split over TP), resume under FSDP on 2."""
    args = (str(tmp_path), "save", "fsdp_tp", "dion", DION)
    uninterrupted, states = run_ranks(checkpoint_run, 4, *args)[0]
    Q = [(placements, q) for key, placements, q in states if key == "Q"]
    assert [str(placements) for placements, _ in Q] == [
        "(Replicate(), Replicate())",  # fc1: columns whole
        "(Replicate(), Shard(dim=0))",  # fc2: Q's rows split like fc2's columns (TP)
    ]
    args = (str(tmp_path), "load", "fsdp", "dion", DION)
    resumed, states = run_ranks(checkpoint_run, 2, *args)[0]
    Q_resumed = [q for key, _, q in states if key == "Q"]
    for a, b in zip(uninterrupted + [q for _, q in Q], resumed + Q_resumed):
        torch.testing.assert_close(a, b, rtol=TOLERANCE, atol=1e-7)
