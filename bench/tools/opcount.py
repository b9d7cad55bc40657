"""Counting what a step dispatches: aten ops and host reads seen by a dispatch mode."""

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched inside the ``with`` block (about one kernel each on a
    GPU); ``host_reads`` are the ``_local_scalar_dense`` calls (``bool(t)``, ``t.item()``)."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.name()] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def host_reads(self) -> int:
        return self.ops["aten::_local_scalar_dense"]
