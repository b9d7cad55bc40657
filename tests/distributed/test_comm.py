"""CommRecorder counts exactly the collectives issued inside it; the tests' rank pools
(``tests/multirank.py``) fail loudly and start each call as on fresh ranks."""

import os
import signal
import time

import multirank
import pytest
import torch
import torch.distributed as dist
from multirank import run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from bench.tools import launch
from bench.tools.comm_recorder import CommRecorder


def _all_reduce(mesh):
    t = torch.arange(10, dtype=torch.float64) + dist.get_rank()
    dist.all_reduce(t)
    return t


def _all_gather_into_tensor(mesh):
    out = torch.empty(6)
    dist.all_gather_into_tensor(out, torch.arange(3.0) + dist.get_rank())
    return out


def _all_gather_list(mesh):
    out = [torch.empty(3), torch.empty(3)]
    dist.all_gather(out, torch.arange(3.0) + dist.get_rank())
    return torch.cat(out)


def _reduce_scatter_tensor(mesh):
    out = torch.empty(4)
    dist.reduce_scatter_tensor(out, torch.arange(8.0) * (dist.get_rank() + 1))
    return out


def _all_to_all_single(mesh):
    out = torch.empty(4, dtype=torch.int64)
    dist.all_to_all_single(out, torch.arange(4) + 10 * dist.get_rank())
    return out


def _broadcast(mesh):
    t = torch.arange(5, dtype=torch.bfloat16) + dist.get_rank()
    dist.broadcast(t, src=0)
    return t


def _full_tensor(mesh):
    local = torch.arange(8.0).reshape(2, 4) + dist.get_rank()
    return DTensor.from_local(local, mesh, [Shard(0)]).full_tensor()


# name -> (issue it on 2 ranks, expected (kind, group size, numel, bytes))
CASES = {
    "all_reduce": (_all_reduce, ("all_reduce", 2, 10, 80)),
    "all_gather_into_tensor": (_all_gather_into_tensor, ("all_gather", 2, 6, 24)),
    "all_gather_list": (_all_gather_list, ("all_gather", 2, 6, 24)),
    "reduce_scatter_tensor": (_reduce_scatter_tensor, ("reduce_scatter", 2, 8, 32)),
    "all_to_all_single": (_all_to_all_single, ("all_to_all", 2, 4, 32)),
    "broadcast": (_broadcast, ("broadcast", 2, 5, 10)),
    "dtensor_full_tensor": (_full_tensor, ("all_gather", 2, 16, 64)),
}


def _record_each_case(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size,))
    events = {}
    for name, (issue, _) in CASES.items():
        expected = issue(mesh)
        with CommRecorder() as rec:
            out = issue(mesh)
        assert torch.equal(out, expected), f"{name} changed its result under the recorder"
        events[name] = rec.events
    with CommRecorder() as rec:
        torch.ones(3).add_(1)
    for issue, _ in CASES.values():
        issue(mesh)
    events["outside"] = rec.events
    return events


@pytest.fixture(scope="module")
def two_rank_events():
    return run_ranks(_record_each_case, 2)


@pytest.mark.parametrize("name", CASES)
def test_records_one_collective_with_its_bytes(two_rank_events, name):
    for events in two_rank_events:
        assert [(e.kind, e.group_size, e.numel, e.nbytes) for e in events[name]] == [CASES[name][1]]


def test_records_nothing_outside_the_block(two_rank_events):
    assert all(events["outside"] == [] for events in two_rank_events)


def test_summary_and_count(two_rank_events):
    rec = CommRecorder()
    rec.events = [e for events in two_rank_events[0].values() for e in events]
    assert rec.count() == len(CASES)
    assert rec.count("all_gather") == 3
    assert rec.total_bytes == sum(expected[3] for _, expected in CASES.values())
    assert f"{rec.total_bytes}" in rec.summary().splitlines()[-1]


def _record_on_2d_mesh(rank, world_size):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_shard", "tensor"))
    shard = DTensor.from_local(torch.ones(3, 5), mesh["tensor"], [Shard(0)])
    with CommRecorder() as rec:
        shard.full_tensor()
        dist.all_reduce(torch.ones(7))
    return rec.events, mesh["tensor"].get_group().group_name


def test_group_size_comes_from_the_op_on_4_ranks():
    for events, tensor_group in run_ranks(_record_on_2d_mesh, 4):
        gather, reduce = events
        assert (gather.kind, gather.group_size, gather.numel) == ("all_gather", 2, 30)
        assert gather.group_name == tensor_group
        assert (reduce.kind, reduce.group_size, reduce.nbytes) == ("all_reduce", 4, 28)


def _raise_on_rank_1(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


def test_run_ranks_reraises_a_rank_exception():
    with pytest.raises(ValueError, match="boom on rank 1") as info:
        run_ranks(_raise_on_rank_1, 2)
    assert "raised on rank 1" in info.value.__notes__[0]
    assert "_raise_on_rank_1" in info.value.__notes__[0]


def _hang_rank_0_at_a_barrier(rank, world_size):
    if rank == 0:
        dist.barrier()
    else:
        time.sleep(600)


def test_run_ranks_times_out_on_a_hung_rank(monkeypatch):
    """A call past its timeout raises having waited for results no longer than its timeout
    (every wait bounded by what is left of it) and having killed every rank, the hung one
    included: it returns at its timeout, not when the hung rank would end. Counted (the
    waits' bounds, the ranks killed), not timed."""
    waits, ended = [], []
    real_wait, real_close = multirank.wait, multirank.RankPool.close

    def counted_wait(objects, timeout=None):
        waits.append(timeout)
        return real_wait(objects, timeout)

    def counted_close(pool):
        ranks = list(pool._procs)
        real_close(pool)
        ended.extend(rank.exitcode for rank in ranks)

    monkeypatch.setattr(multirank, "wait", counted_wait)
    monkeypatch.setattr(multirank.RankPool, "close", counted_close)
    with pytest.raises(TimeoutError, match="did not finish within 10"):
        run_ranks(_hang_rank_0_at_a_barrier, 2, timeout=10)
    assert waits and all(t is not None and 0 <= t <= 10 for t in waits)
    assert ended == [-signal.SIGKILL] * 2  # both ranks killed, none left to finish


def _pid_draw_and_dtype(rank, world_size, dtype):
    """This rank's process, a draw from torch's generator, and the default dtype; sets the
    default dtype to ``dtype`` (a change the next call must not see)."""
    found = (os.getpid(), torch.randn(3).tolist(), torch.get_default_dtype())
    torch.set_default_dtype(dtype)
    torch.randn(7)  # moves the generator on
    return found


def test_pooled_ranks_are_kept_and_each_call_starts_as_on_fresh_ranks():
    """The pool's second call runs in the same processes, each rank's generator where it
    started (a fresh process seeds it at random) and the default dtype float32, as on fresh
    ranks; after a failed call, new ranks serve the next one."""
    first = run_ranks(_pid_draw_and_dtype, 2, torch.float64)
    second = run_ranks(_pid_draw_and_dtype, 2, torch.float64)
    assert [r[0] for r in first] == [r[0] for r in second]  # the same processes
    assert [r[1:] for r in first] == [r[1:] for r in second]
    assert {r[2] for r in first} == {torch.float32}
    fresh = launch.run_ranks(_pid_draw_and_dtype, 2, torch.float64)
    assert {r[2] for r in fresh} == {torch.float32}
    with pytest.raises(ValueError, match="boom on rank 1"):
        run_ranks(_raise_on_rank_1, 2)
    after = run_ranks(_pid_draw_and_dtype, 2, torch.float64)
    assert not {r[0] for r in after} & {r[0] for r in first}  # a new pool
    assert {r[2] for r in after} == {torch.float32}


def test_an_interrupted_call_ends_the_pool(monkeypatch):
    """A call that ends early for any reason (here the wait for results is interrupted)
    ends the pool: the next call is served by new ranks, never the old call's results."""
    pool = multirank.RankPool(2)
    try:
        first = {pid for pid, *_ in pool.run(_pid_draw_and_dtype, torch.float32)}

        def interrupted(*args, **kwargs):
            raise KeyboardInterrupt

        with monkeypatch.context() as patch:
            patch.setattr(multirank, "wait", interrupted)
            with pytest.raises(KeyboardInterrupt):
                pool.run(_pid_draw_and_dtype, torch.float32)
        after = pool.run(_pid_draw_and_dtype, torch.float32)
        assert not {pid for pid, *_ in after} & first
    finally:
        pool.close()


@pytest.mark.timeout(300)
def test_normuon_and_dion2_collectives_match_the_analytic_table():
    """Measured bytes inside ``opt.step()`` equal the formula of ``bench.results.comm`` on the
    tiny GPT over 2 ranks: Muon's exchange (on the selected rows for Dion2 and NorDion2),
    plus on sharded layouts NorMuon's all-reduce of one float per matrix, NorDion2's of two."""
    from bench.results.comm import measure

    results = run_ranks(
        measure, 2, "tiny", ("ddp", "fsdp"), ("normuon", "dion2", "nordion2"), timeout=280
    )
    expected = {
        ("ddp", "normuon"): [("all_to_all", 2)],
        ("ddp", "dion2"): [("all_to_all", 2)],
        ("fsdp", "normuon"): [("all_to_all", 2), ("all_to_all", 2), ("all_reduce", 2)],
        ("fsdp", "dion2"): [("all_to_all", 2), ("all_to_all", 2)],
        ("ddp", "nordion2"): [("all_to_all", 2)],
        ("fsdp", "nordion2"): [("all_to_all", 2), ("all_to_all", 2), ("all_reduce", 2)],
    }
    rows = results[0]
    assert sorted({(r["layout"], r["name"]) for r in rows}) == sorted(expected)
    for i, row in enumerate(rows):
        for result in results:
            kinds = [(kind, size) for kind, size, _ in result[i]["events"]]
            assert kinds == expected[row["layout"], row["name"]], row
        measured = sum(e[2] for r in results for e in r[i]["events"])
        assert measured == sum(r[i]["analytic"] for r in results) > 0, row


@pytest.mark.timeout(300)
def test_dobb_and_muon_collectives_match_the_analytic_table():
    """The paper's Dobb moves bytes only on its refresh step (step 1: the statistics average
    and the bases' all-gather), Muon every step; the recommended Dobb under DDP averages its
    statistics every step (``stats_sync="auto"``), under FSDP on refresh steps; all as
    ``bench.results.comm`` computes them."""
    from bench.results.comm import measure

    names = ("dobb_paper", "dobb", "muon")
    results = run_ranks(measure, 2, "tiny", ("ddp", "fsdp"), names, timeout=280)
    for i, row in enumerate(results[0]):
        measured = sum(e[2] for r in results for e in r[i]["events"])
        assert measured == sum(r[i]["analytic"] for r in results), row
        every_step = row["name"] == "muon" or (row["name"], row["layout"]) == ("dobb", "ddp")
        assert (measured > 0) == (every_step or row["step"] == 1), row
