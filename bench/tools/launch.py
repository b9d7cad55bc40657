"""Run a function on N gloo ranks in spawned processes, on one CPU machine.

``run_ranks(fn, world_size, *args)`` calls ``fn(rank, world_size, *args)`` on every
rank after ``init_process_group``, so ``fn`` may build meshes directly, e.g.
``init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_shard", "tensor"))``.
``fn`` must be defined at module level (spawn pickles it by name) and return
something picklable. The tests and ``bench.results.comm`` use it.

What makes it reliable on a small shared machine: ``spawn`` (``fork`` hangs
once the parent has used OpenMP threads), a ``file://`` rendezvous in a fresh temporary
directory (no ports to collide), one thread per rank, a 60 s collective timeout, and
ending every rank with ``barrier; destroy_process_group; os._exit`` (a plain interpreter
exit sometimes dies in gloo's teardown).

``RankPool(world_size).run(fn, *args)`` is the same call on ranks spawned once and kept:
each rank imports torch, dobb and the caller's module once, not per call (about 4 s of
CPU per rank here, most of a small test's time). Between calls each rank starts where a
fresh one would, as far as a call can tell: torch's generator reseeded with the seed the
process started with (a fresh process's is random) and the default dtype float32. The
process groups a call made stay, a few sockets each (torch resolves groups by name from
caches a later call may reach: destroying them broke the next mesh). A rank that raises,
a rank that dies or a call past its ``timeout`` ends the whole pool (the others may be
waiting in a collective); the next call spawns a new one. The tests run their ranks in
pools (``tests/multirank.py``); the lab's measurements spawn fresh ranks.
"""

import os
import pickle
import sys
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


def _init_rank(rank, world_size, tmp):
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
        _init_rank(rank, world_size, tmp)
        result = pickle.dumps(fn(rank, world_size, *args))
    except BaseException as e:
        _write(tmp, rank, "error", pickle.dumps((_pickled_or_none(e), traceback.format_exc())))
        os._exit(1)  # skip the final barrier: the other ranks may be stuck in a collective
    _write(tmp, rank, "result", result)
    # A plain interpreter exit sometimes dies in gloo's teardown.
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def _pickled_or_none(exc):
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
    return _error(rank, exc_bytes, tb)


def _error(rank, exc_bytes, tb):
    """The exception a rank raised (pickled), with its traceback ``tb`` as a note."""
    try:
        exc = pickle.loads(exc_bytes)
    except Exception:
        exc = RuntimeError(f"rank {rank} raised an exception that does not pickle")
    exc.add_note(f"--- raised on rank {rank} ---\n{tb}")
    return exc


class RankPool:
    """``world_size`` gloo ranks, spawned on the first ``run`` and kept for the next ones
    (the module docstring); ``close`` ends them (so does the interpreter's exit)."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._procs, self._conns, self._tmp = [], [], None

    def run(self, fn, *args, timeout=120.0):
        """``[fn(rank, world_size, *args) for each rank]``, as ``run_ranks`` computes it.
        Whatever ends a call early (a rank's error, a timeout, an interrupt such as
        pytest-timeout's) ends the pool, so no later call can read this one's results."""
        if not self._procs:
            self._start()
        # the caller's sys.path, so that a rank finds a module imported after it started
        message = (list(sys.path), pickle.dumps((fn, args)))
        try:
            for conn in self._conns:
                conn.send(message)
            return self._results(fn.__name__, time.monotonic() + timeout, timeout)
        except BaseException:
            self.close()
            raise

    def _results(self, name, deadline, timeout):
        """Each rank's result, in rank order, or the first rank's error."""
        results, pending = [None] * self.world_size, dict(enumerate(self._conns))
        while pending:
            left = deadline - time.monotonic()
            ready = wait([*pending.values(), *(p.sentinel for p in self._procs)], max(left, 0))
            if not ready:
                raise TimeoutError(
                    f"{name} on {self.world_size} ranks did not finish within {timeout} s; "
                    f"ranks {sorted(pending)} were still running and have been killed"
                )
            for rank, conn in list(pending.items()):
                if conn in ready:
                    kind, *data = conn.recv()
                    if kind == "error":
                        raise _error(rank, *data)
                    results[rank] = pickle.loads(data[0])
                    del pending[rank]
            dead = [r for r, p in enumerate(self._procs) if r in pending and not p.is_alive()]
            if dead and not any(self._conns[r].poll() for r in dead):
                code = self._procs[dead[0]].exitcode
                raise RuntimeError(f"rank {dead[0]} exited with code {code} mid-call")
        return results

    def _start(self):
        context = mp.get_context("spawn")
        self._tmp = tempfile.TemporaryDirectory(prefix="dobb-pool-")
        for rank in range(self.world_size):
            parent, child = context.Pipe()
            args = (rank, self.world_size, self._tmp.name, child)
            proc = context.Process(target=_pool_rank_main, args=args)
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)

    def close(self):
        """Kill the ranks (a pool's ranks may be stuck in a collective: no teardown)."""
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
        for conn in self._conns:
            conn.close()
        if self._tmp is not None:
            self._tmp.cleanup()
        self._procs, self._conns, self._tmp = [], [], None


def _pool_rank_main(rank, world_size, tmp, conn):
    """A pool's rank: gloo once, then each call as a fresh rank would run it."""
    seed = torch.initial_seed()  # what a fresh process's generator starts from
    _init_rank(rank, world_size, tmp)
    while True:
        try:
            path, payload = conn.recv()
        except EOFError:  # the pool was closed
            os._exit(0)
        sys.path[:] = path
        torch.manual_seed(seed)
        torch.set_default_dtype(torch.float32)
        try:
            fn, args = pickle.loads(payload)
            result = pickle.dumps(fn(rank, world_size, *args))
        except BaseException as e:  # the pool ends: the other ranks may be in a collective
            conn.send(("error", _pickled_or_none(e), traceback.format_exc()))
            continue
        conn.send(("result", result))
