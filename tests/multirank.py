"""Run a test function on N gloo ranks in spawned processes, kept for the session.

``run_ranks(fn, world_size, *args)`` calls ``fn(rank, world_size, *args)`` on every
rank after ``init_process_group``, so ``fn`` may build meshes directly, e.g.
``init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_shard", "tensor"))``.
``fn`` must be defined at module level (spawn pickles it by name) and return
something picklable: the contract of the lab's ``bench.tools.launch.run_ranks``, whose rank
set-up (``init_rank``: one thread, a ``file://`` rendezvous, the collective timeout) and
error reporting (``rank_exception``) the ranks here share.

The ranks of each world size are a ``RankPool``, spawned once for the session and kept
while calls succeed: each rank imports torch, dobb and the caller's module once, not per
call (about 4 s of CPU per rank and call on this machine, most of a small test's time).
Between calls each rank starts where a fresh one would, as far as a call can tell: torch's
generator reseeded with the seed the process started with (a fresh process's is random) and
the default dtype float32. The process groups a call made stay, a few sockets each (torch
resolves groups by name from caches a later call may reach: destroying them broke the next
mesh). A rank that raises, a rank that dies or a call past its ``timeout`` ends the whole
pool (the others may be waiting in a collective); the next call spawns a new one.
"""

import atexit
import os
import pickle
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import wait

import torch
import torch.multiprocessing as mp

from bench.tools.launch import init_rank, pickled_or_none, rank_exception

__all__ = ["RankPool", "run_ranks"]

_POOLS: dict[int, "RankPool"] = {}


def run_ranks(fn, world_size, *args, timeout=120.0):
    """``[fn(rank, world_size, *args) for each rank]`` on the session's pool of
    ``world_size`` ranks."""
    if world_size not in _POOLS:
        _POOLS[world_size] = RankPool(world_size)
    return _POOLS[world_size].run(fn, *args, timeout=timeout)


@atexit.register
def _close_pools():
    for pool in _POOLS.values():
        pool.close()


class RankPool:
    """``world_size`` gloo ranks, spawned on the first ``run`` and kept for the next ones
    (the module docstring); ``close`` ends them (so does the interpreter's exit)."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._procs, self._conns, self._tmp = [], [], None

    def run(self, fn, *args, timeout=120.0):
        """``[fn(rank, world_size, *args) for each rank]``, as ``bench.tools.launch.run_ranks``
        computes it. Whatever ends a call early (a rank's error, a timeout, an interrupt such as
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
                        raise rank_exception(rank, *data)
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
    init_rank(rank, world_size, tmp)
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
            conn.send(("error", pickled_or_none(e), traceback.format_exc()))
            continue
        conn.send(("result", result))
