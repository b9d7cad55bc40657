"""Dobb's per-expert statistics on 2 gloo ranks equal one process that sees every rank's
tokens (``dobb_experts_runs``: the layouts and what one process runs).

Expert parallelism: each rank folds its experts' routed tokens, whole, and steps them with
no communication: equal to one process (the same rows in the same order through the same
ops). FSDP2 (the stack split along ``E``, the forward on the gathered stack) and DDP (the
whole stack on each replica) see each expert's tokens on both ranks, and add its sums over
them before the fold, so the tokens weigh as in one process; so does FSDP2 over expert
parallelism on 2 x 2 ranks (torchtitan's layout: each grouped GEMM sees its expert-parallel
rank's experts, which FSDP splits over ``efsdp``: the sums are added over ``efsdp``); the
gradients and the sums are then added in another order than one process adds them: within
1e-12 relative (float64).
"""

import pytest
import torch
from dobb_experts_runs import layout_run
from multirank import run_ranks
from torch.distributed.tensor import Shard

TOLERANCE = 1e-12
RECOMMENDED, PAPER = {}, {"two_sided": False, "coefficients": "sign", "num_blocks": 2}


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / a.norm()).item()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("options", [RECOMMENDED, PAPER], ids=["dobb", "dobb_paper"])
def test_expert_parallel_equals_one_process(options):
    for alone, sharded, placements, _ in run_ranks(layout_run, 2, "ep", 4, options, timeout=110):
        for a, b in zip(alone, sharded):
            assert torch.equal(a, b)
        assert placements == (Shard(0),)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("experts", [4, 3])  # 3: 2 + 1 experts
@pytest.mark.parametrize("options", [RECOMMENDED, PAPER], ids=["dobb", "dobb_paper"])
def test_fsdp_adds_each_experts_statistics_over_the_ranks(options, experts):
    for alone, sharded, placements, _ in run_ranks(
        layout_run, 2, "fsdp", experts, options, timeout=110
    ):
        for a, b in zip(alone, sharded):
            assert relative(a, b) <= TOLERANCE
        assert placements == (Shard(0),)


@pytest.mark.timeout(120)
def test_ddp_adds_each_experts_statistics_over_the_replicas():
    for alone, replicated, placements, _ in run_ranks(
        layout_run, 2, "ddp", 4, RECOMMENDED, timeout=110
    ):
        for a, b in zip(alone, replicated):
            assert relative(a, b) <= TOLERANCE
        assert placements is None


@pytest.mark.timeout(180)
@pytest.mark.parametrize("options", [RECOMMENDED, PAPER], ids=["dobb", "dobb_paper"])
def test_fsdp_over_expert_parallel_adds_each_experts_statistics_over_efsdp(options):
    for alone, sharded, placements, _ in run_ranks(
        layout_run, 4, "ep_fsdp", 4, options, timeout=170
    ):
        for a, b in zip(alone, sharded):
            assert relative(a, b) <= TOLERANCE
        assert [type(p).__name__ for p in placements] == ["_StridedShard", "Shard"]
