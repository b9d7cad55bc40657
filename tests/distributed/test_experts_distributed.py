"""Expert stacks on 2 gloo ranks equal one process, for every optimizer that steps experts
(``dobb.optim.experts``). Under DDP each replica steps every expert where it is, beside a
2-D matrix that the replicas share out (Muon's family: the owner exchange; Dion: its
compressed sync), and the experts take no part in that exchange. Under FSDP2 (the stack
split along ``E``, 2 + 2 or 2 + 1 experts) each rank steps its own experts; their state is
placed as the stack and resumes from DCP. Under expert parallelism as torchtitan lays it
out (``ep`` splits ``E``, FSDP2 shards each rank's experts over ``efsdp``: placements
``(_StridedShard(0), Shard(0))``, on 2 ranks and on 2 x 2) likewise, each local expert
named by its global index (Dion's ``Q_0`` is seeded by that name, so a wrong index
changes its result). The workers: ``experts_runs``.

Tolerance: the replicas hold the same gradients (DDP's average, here given alike), so each
expert's update is the one process's ops on the same numbers: equal. The 2-D matrix goes
through the exchange, which its own tests hold to one process within a relative 1e-5 with
Newton-Schulz in fp32 (Dion2's selected rows are orthogonalized as another stack there).
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist
from experts_runs import ep_run, fsdp_run
from multirank import run_ranks
from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import _StridedShard

from dobb.registry import get_entry

EXPERTS, D_OUT, D_IN, STEPS = 4, 12, 8, 4
TOLERANCE = 1e-5
OPTIMIZERS = ["muon", "normuon", "muonbp", "dion2", "nordion2", "dion"]


def _train(name: str, group) -> list[torch.Tensor]:
    """The stack and a 2-D matrix after ``STEPS`` steps of ``name``, with ``group`` (None:
    one process) as its data-parallel argument."""
    torch.manual_seed(0)
    stack = nn.Parameter(torch.randn(EXPERTS, D_OUT, D_IN, dtype=torch.float64))
    dense = nn.Parameter(torch.randn(D_OUT, D_IN, dtype=torch.float64))
    entry = get_entry(name)
    argument = entry.cls.data_parallel_option or "sync_group"  # Dion: its compressed sync
    options = {argument: group} if group is not None else {}
    if "ns_dtype" in {f.name for f in dataclasses.fields(entry.cls.Config)}:
        options["ns_dtype"] = torch.float32
    params = [{"params": [("experts.w1", stack), ("dense", dense)]}]
    opt = entry.cls(params, lr=0.02, **entry.hyperparameters, **options)
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)  # the same gradients on every replica
        stack.grad = torch.randn(EXPERTS, D_OUT, D_IN, generator=gen, dtype=torch.float64)
        dense.grad = torch.randn(D_OUT, D_IN, generator=gen, dtype=torch.float64)
        opt.step()
    return [stack.detach(), dense.detach()]


def _compare(rank: int, world: int, name: str) -> list[float]:
    """The largest difference of the stack and of the 2-D matrix from one process."""
    alone = _train(name, None)
    replicated = _train(name, dist.group.WORLD)
    return [((a - b).norm() / a.norm()).item() for a, b in zip(alone, replicated)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_experts_under_ddp_equal_one_process(name):
    for experts, dense in run_ranks(_compare, 2, name, timeout=110):
        assert experts == 0.0 and dense <= TOLERANCE


@pytest.mark.timeout(120)
@pytest.mark.parametrize("experts", [4, 3, 1])  # 3: 2 and 1 experts; 1: 1 and none
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_experts_under_fsdp_equal_one_process(name, experts):
    """FSDP2 splits the stack along ``E``: each rank steps its whole experts alone (no
    collective in the step), its state placed as the stack (``Shard(0)``)."""
    for alone, sharded, placements in run_ranks(fsdp_run, 2, name, experts, timeout=110):
        assert torch.equal(alone, sharded)
        assert set(placements.values()) == {(Shard(0),)}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["muon", "dion"])
def test_experts_resume_from_dcp_under_fsdp(tmp_path, name):
    run_ranks(fsdp_run, 2, name, 3, str(tmp_path), "save", timeout=110)
    for alone, resumed, _ in run_ranks(fsdp_run, 2, name, 3, str(tmp_path), "load", timeout=110):
        assert torch.equal(alone, resumed)


# (optimizer, ranks, experts): every optimizer on 2 x 2 ranks with 6 experts (2, 2, 1, 1 a
# rank); Dion, whose seeds show a misnamed expert, also on 2 ranks and with 3 (one rank none)
EXPERT_PARALLEL = [(name, 4, 6) for name in OPTIMIZERS] + [("dion", 2, 4), ("dion", 4, 3)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name, world, experts", EXPERT_PARALLEL)
def test_experts_under_expert_parallel_fsdp_equal_one_process(name, world, experts):
    """Each rank steps the whole experts it holds, named by their global indices (those
    its weights show it holds), its state placed as the stack."""
    strided = (_StridedShard(0, split_factor=2), Shard(0))
    for alone, sharded, placements, held, indices in run_ranks(
        ep_run, world, name, experts, timeout=110
    ):
        assert torch.equal(alone, sharded)
        assert indices == held
        assert set(placements.values()) == {strided}
