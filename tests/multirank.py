"""Run a test function on N gloo ranks in spawned processes.

``run_ranks(fn, world_size, *args)`` calls ``fn(rank, world_size, *args)`` on every
rank after ``init_process_group``, so ``fn`` may build meshes directly, e.g.
``init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_shard", "tensor"))``.
``fn`` must be defined at module level (spawn pickles it by name) and return
something picklable. The implementation is the library's ``bench.tools.launch``.
"""

from bench.tools.launch import COLLECTIVE_TIMEOUT, run_ranks

__all__ = ["COLLECTIVE_TIMEOUT", "run_ranks"]
