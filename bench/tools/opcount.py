"""Counting what a step dispatches: aten ops (a dispatch mode) and host reads (the profiler).

A dispatch mode sees the ops a Python call dispatches, one level deep: a library kernel that
reads the device inside (``torch.linalg.eigh`` and ``cholesky`` check their error flag with
``_linalg_check_errors``, which calls ``.item()`` in C++) dispatches its read below the mode.
The profiler records every ``aten::_local_scalar_dense`` event, nested or not, so
``host_reads`` comes from it.
"""

from collections import Counter

from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

HOST_READ = "aten::_local_scalar_dense"  # .item(), bool(t), int(t), and _linalg_check_errors
# An op the dispatch mode sees is recorded twice: as called, and again as the mode runs it.
REDISPATCH = "PythonDispatchMode"


class _DispatchCounter(TorchDispatchMode):
    def __init__(self, ops: Counter):
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace != "profiler":  # the profiler's own record_function ops
            self.ops[func.name()] += 1
        return func(*args, **(kwargs or {}))


class OpCounter:
    """Counts inside the ``with`` block: ``ops`` the aten ops dispatched from Python (about
    one kernel each on a GPU), ``host_reads`` every device-to-host scalar read, including
    those nested inside library kernels (``_linalg_check_errors``).

    Reading a CPU tensor with ``tolist()`` dispatches nothing and is no read: on a GPU that
    tensor would live on the host too. ``nested_reads`` is how many of ``host_reads`` the
    dispatch mode alone would have missed.
    """

    def __init__(self):
        self.ops: Counter = Counter()
        self.host_reads = 0
        self._mode = _DispatchCounter(self.ops)
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
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def nested_reads(self) -> int:
        return self.host_reads - self.ops[HOST_READ]
