"""Counting what a step dispatches: aten ops and bytes (a dispatch mode) and host reads (the
profiler).

A dispatch mode sees the ops a Python call dispatches, one level deep: a library kernel that
reads the device inside (``torch.linalg.eigh`` and ``cholesky`` check their error flag with
``_linalg_check_errors``, which calls ``.item()`` in C++) dispatches its read below the mode.
The profiler records every ``aten::_local_scalar_dense`` event, nested or not, so
``host_reads`` comes from it.
"""

from collections import Counter

from torch import Tensor
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

HOST_READ = "aten::_local_scalar_dense"  # .item(), bool(t), int(t), and _linalg_check_errors
# An op the dispatch mode sees is recorded twice: as called, and again as the mode runs it.
REDISPATCH = "PythonDispatchMode"
# ops that move no data: allocations, and a view the schema does not mark as one
NO_TRAFFIC = {"empty", "empty_like", "new_empty", "empty_strided", "_unsafe_view"}


def _nbytes(tree) -> int:
    """Bytes of the tensors in a (nested) op argument or result; views of no storage count."""
    from torch.utils._pytree import tree_leaves

    return sum(t.numel() * t.element_size() for t in tree_leaves(tree) if isinstance(t, Tensor))


class _DispatchCounter(TorchDispatchMode):
    def __init__(self, ops: Counter, moved: list[int]):
        super().__init__()
        self.ops, self.moved = ops, moved

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace != "profiler":  # the profiler's own record_function ops
            self.ops[func.name()] += 1
            if not func.is_view and func.__name__.split(".")[0] not in NO_TRAFFIC:
                self.moved[0] += _nbytes((args, kwargs)) + _nbytes(out)
        return out


class OpCounter:
    """Counts inside the ``with`` block: ``ops`` the aten ops dispatched from Python (about
    one kernel each on a GPU), ``host_reads`` every device-to-host scalar read, including
    those nested inside library kernels (``_linalg_check_errors``).

    Reading a CPU tensor with ``tolist()`` dispatches nothing and is no read: on a GPU that
    tensor would live on the host too. ``nested_reads`` is how many of ``host_reads`` the
    dispatch mode alone would have missed. ``bytes`` is the memory traffic the ops imply:
    every tensor an op reads plus every tensor it writes (views and allocations move
    nothing), an upper bound of what its kernels move.
    """

    def __init__(self):
        self.ops: Counter = Counter()
        self.host_reads = 0
        self._moved = [0]
        self._mode = _DispatchCounter(self.ops, self._moved)
        self._profile = profile(activities=[ProfilerActivity.CPU])

    def __enter__(self) -> "OpCounter":
        self._profile.__enter__()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        self._profile.__exit__(*exc)
        self.host_reads = sum(
            event.name == HOST_READ
            and not (event.cpu_parent and event.cpu_parent.name == REDISPATCH)
            for event in self._profile.events()
        )

    @property
    def bytes(self) -> int:
        return self._moved[0]

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def nested_reads(self) -> int:
        return self.host_reads - self.ops[HOST_READ]
