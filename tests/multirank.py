"""Run a test function on N gloo ranks in spawned processes.

``run_ranks(fn, world_size, *args)`` calls ``fn(rank, world_size, *args)`` on every
rank after ``init_process_group``, so ``fn`` may build meshes directly, e.g.
``init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_shard", "tensor"))``.
``fn`` must be defined at module level (spawn pickles it by name) and return
something picklable.

The ranks of each world size are a ``bench.tools.launch.RankPool``, spawned once for the
session and kept while calls succeed: each call runs as on fresh ranks (the pool resets
the RNG, the default dtype and the process groups), without importing torch and dobb
again on every rank (about 4 s of CPU per rank and call on this machine).
"""

import atexit

from bench.tools.launch import COLLECTIVE_TIMEOUT, RankPool

__all__ = ["COLLECTIVE_TIMEOUT", "run_ranks"]

_POOLS: dict[int, RankPool] = {}


def run_ranks(fn, world_size, *args, timeout=120.0):
    """``[fn(rank, world_size, *args) for each rank]`` on the session's pool of
    ``world_size`` ranks (``bench.tools.launch.run_ranks``' contract)."""
    if world_size not in _POOLS:
        _POOLS[world_size] = RankPool(world_size)
    return _POOLS[world_size].run(fn, *args, timeout=timeout)


@atexit.register
def _close_pools():
    for pool in _POOLS.values():
        pool.close()
