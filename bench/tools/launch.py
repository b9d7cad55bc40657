"""Run a function on N gloo ranks in spawned processes, on one CPU machine.

``run_ranks(fn, world_size, *args)`` calls ``fn(rank, world_size, *args)`` on every
rank after ``init_process_group``, so ``fn`` may build meshes directly, e.g.
``init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_shard", "tensor"))``.
``fn`` must be defined at module level (spawn pickles it by name) and return
something picklable. The lab's measurements use it (``bench.results.comm``,
``bench.results.calltime_sharded``, ``bench.tools.trajectories``), each call on fresh ranks.

What makes it reliable on a small shared machine: ``spawn`` (``fork`` hangs
once the parent has used OpenMP threads), a ``file://`` rendezvous in a fresh temporary
directory (no ports to collide), one thread per rank, a 60 s collective timeout
(``init_rank``), and ending every rank with ``barrier; destroy_process_group; os._exit``
(a plain interpreter exit sometimes dies in gloo's teardown). A rank's exception comes
back with the rank's traceback as a note (``rank_exception``).

The tests run their ranks in pools kept for the session (``tests/multirank.py``), on the
same rank set-up and the same error reporting, imported from here.
"""

import os
import pickle
import tempfile
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT = timedelta(seconds=60)


def run_ranks(fn, world_size, *args, timeout=120.0):
    """Return ``[fn(rank, world_size, *args) for each rank]``, computed on ``world_size`` ranks.

    A rank's exception is re-raised here (its own type when it pickles, else
    ``RuntimeError``) with the rank's traceback attached as a note; ranks still running
    after ``timeout`` seconds are killed and ``TimeoutError`` is raised.
    """
    with tempfile.TemporaryDirectory(prefix="dobb-ranks-") as tmp:
        ctx = mp.start_processes(
            _rank_main,
            args=(fn, world_size, tmp, args),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        procs = ctx.processes
        pending = {p.sentinel: rank for rank, p in enumerate(procs)}
        failed = None
        deadline = time.monotonic() + timeout
        try:
            while pending and failed is None and time.monotonic() < deadline:
                for sentinel in wait(list(pending), timeout=deadline - time.monotonic()):
                    rank = pending.pop(sentinel)
                    procs[rank].join()
                    if procs[rank].exitcode != 0 and failed is None:
                        failed = rank
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join()
        if failed is not None:
            raise _rank_error(tmp, failed, procs[failed].exitcode)
        if pending:
            hung = sorted(pending.values())
            raise TimeoutError(
                f"{fn.__name__} on {world_size} ranks did not finish within {timeout} s; "
                f"ranks {hung} were still running and have been killed"
            )
        return [_read(tmp, rank, "result") for rank in range(world_size)]


def init_rank(rank, world_size, tmp):
    """One thread, and the gloo group of ``world_size`` ranks met at ``tmp``'s file store."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp}/store",
        rank=rank,
        world_size=world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )


def _rank_main(rank, fn, world_size, tmp, args):
    try:
        init_rank(rank, world_size, tmp)
        result = pickle.dumps(fn(rank, world_size, *args))
    except BaseException as e:
        _write(tmp, rank, "error", pickle.dumps((pickled_or_none(e), traceback.format_exc())))
        os._exit(1)  # skip the final barrier: the other ranks may be stuck in a collective
    _write(tmp, rank, "result", result)
    # A plain interpreter exit sometimes dies in gloo's teardown.
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def pickled_or_none(exc):
    """``exc`` pickled, or None if it does not pickle."""
    try:
        return pickle.dumps(exc)
    except Exception:
        return None


def _write(tmp, rank, kind, data):
    path = os.path.join(tmp, f"{kind}{rank}.pkl")
    with open(path + ".part", "wb") as f:
        f.write(data)
    os.replace(path + ".part", path)  # the parent never sees a half-written file


def _read(tmp, rank, kind):
    with open(os.path.join(tmp, f"{kind}{rank}.pkl"), "rb") as f:
        return pickle.load(f)


def _rank_error(tmp, rank, exitcode):
    try:
        exc_bytes, tb = _read(tmp, rank, "error")
    except FileNotFoundError:
        return RuntimeError(f"rank {rank} exited with code {exitcode} and left no traceback")
    return rank_exception(rank, exc_bytes, tb)


def rank_exception(rank, exc_bytes, tb):
    """The exception a rank raised (pickled), with its traceback ``tb`` as a note."""
    try:
        exc = pickle.loads(exc_bytes)
    except Exception:
        exc = RuntimeError(f"rank {rank} raised an exception that does not pickle")
    exc.add_note(f"--- raised on rank {rank} ---\n{tb}")
    return exc
