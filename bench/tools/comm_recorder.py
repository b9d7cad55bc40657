"""Communication accounting: record every collective issued inside a block.

    with CommRecorder() as rec:
        opt.step()
    print(rec.summary())

``CommRecorder`` is a ``TorchDispatchMode``. It sees the ``torch.ops.c10d`` ops behind the
plain ``torch.distributed`` calls and the ``torch.ops._c10d_functional`` ops that DTensor
(``full_tensor``, ``redistribute``, sharding propagation) issues. It lets every op run
unchanged, so results are bit-identical. Every op dispatched inside the block pays a
Python call (~8 us on the 2-core CPU machine), so keep the recorder out of timed runs.

Byte convention (that of nccl-tests' "size"): the bytes of the full, unsharded buffer.

- all_reduce, broadcast, reduce: the tensor.
- all_gather: the gathered output (``group_size`` x input).
- reduce_scatter: the input that is reduced and scattered (``group_size`` x output).
- all_to_all: the input (equal to the output).
- gather: ``group_size`` x input; scatter: ``group_size`` x output.
- barrier: nothing.

Coalesced ops count as one event holding all their tensors. Point-to-point ops
(send/recv) are not recorded, nor are ops issued on other threads.
"""

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dobb._dtensor import DTensor

__all__ = ["CommEvent", "CommRecorder"]


@dataclass(frozen=True)
class CommEvent:
    """One collective: what it was, over how many ranks, and its payload."""

    kind: str
    """``"all_reduce"``, ``"all_gather"``, ``"reduce_scatter"``, ``"all_to_all"``, ..."""
    op: str
    """The dispatched op, e.g. ``"c10d._allgather_base_.default"``."""
    group_size: int
    group_name: str
    numel: int
    """Elements of the payload buffer (see the module docstring)."""
    nbytes: int


# op name -> (kind, payload argument, payload is one rank's share so scale by group size)
_C10D = {
    "allreduce_": ("all_reduce", "tensors", False),
    "allreduce_coalesced_": ("all_reduce", "tensors", False),
    "_allgather_base_": ("all_gather", "output_tensor", False),
    "allgather_": ("all_gather", "output_tensors", False),
    "allgather_coalesced_": ("all_gather", "output_lists", False),
    "allgather_into_tensor_coalesced_": ("all_gather", "outputs", False),
    "_reduce_scatter_base_": ("reduce_scatter", "input_tensor", False),
    "reduce_scatter_": ("reduce_scatter", "input_tensors", False),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "inputs", False),
    "alltoall_base_": ("all_to_all", "input", False),
    "alltoall_": ("all_to_all", "input_tensors", False),
    "broadcast_": ("broadcast", "tensors", False),
    "reduce_": ("reduce", "tensors", False),
    "gather_": ("gather", "input_tensors", True),
    "scatter_": ("scatter", "output_tensors", True),
    "barrier": ("barrier", None, False),
    "monitored_barrier_": ("barrier", None, False),
}
_FUNCTIONAL = {
    "all_reduce": ("all_reduce", "input", False),
    "all_reduce_": ("all_reduce", "input", False),
    "all_reduce_coalesced": ("all_reduce", "inputs", False),
    "all_reduce_coalesced_": ("all_reduce", "inputs", False),
    "all_gather_into_tensor": ("all_gather", "input", True),
    "all_gather_into_tensor_out": ("all_gather", "input", True),
    "all_gather_into_tensor_coalesced": ("all_gather", "inputs", True),
    "reduce_scatter_tensor": ("reduce_scatter", "input", False),
    "reduce_scatter_tensor_out": ("reduce_scatter", "input", False),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", "inputs", False),
    "all_to_all_single": ("all_to_all", "input", False),
    "broadcast": ("broadcast", "input", False),
    "broadcast_": ("broadcast", "input", False),
}


@dataclass(frozen=True)
class _OpSpec:
    kind: str
    payload: int | None  # argument index of the payload tensor(s)
    group: int  # argument index of the process group (object or name)
    scaled: bool

    def event(self, func, args, kwargs):
        schema = func._schema.arguments
        group = _process_group(_arg(schema, args, kwargs, self.group))
        numel = nbytes = 0
        if self.payload is not None:
            for t in tree_leaves(_arg(schema, args, kwargs, self.payload)):
                numel += t.numel()
                nbytes += t.numel() * t.element_size()
        scale = group.size() if self.scaled else 1
        return CommEvent(
            self.kind, str(func), group.size(), group.group_name, numel * scale, nbytes * scale
        )


def _arg(schema, args, kwargs, index):
    return args[index] if index < len(args) else kwargs[schema[index].name]


def _process_group(arg):
    if isinstance(arg, str):
        return _resolve_process_group(arg)
    if isinstance(arg, torch.ScriptObject):
        return dist.ProcessGroup.unbox(arg)
    return arg


def _specs():
    """Map each collective overload that exists in this torch build to its ``_OpSpec``."""
    specs = {}
    tables = {"c10d": _C10D, "_c10d_functional": _FUNCTIONAL}
    tables["_c10d_functional_autograd"] = _FUNCTIONAL
    for namespace, table in tables.items():
        ops = getattr(torch.ops, namespace)
        for name, (kind, payload, scaled) in table.items():
            if not hasattr(ops, name):
                continue
            packet = getattr(ops, name)
            for overload in packet.overloads():
                func = getattr(packet, overload)
                names = [a.name for a in func._schema.arguments]
                group = names.index("process_group" if namespace == "c10d" else "group_name")
                index = None if payload is None else names.index(payload)
                specs[func] = _OpSpec(kind, index, group, scaled)
    return specs


_SPECS = _specs()


class CommRecorder(TorchDispatchMode):
    """Context manager recording the collectives issued on this thread as ``CommEvent``\\ s."""

    def __init__(self):
        super().__init__()
        self.events: list[CommEvent] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor lower itself to the collectives we record
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        spec = _SPECS.get(func)
        if spec is not None:
            self.events.append(spec.event(func, args, kwargs))
        return out

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.events)

    def count(self, kind: str | None = None) -> int:
        """Number of collectives recorded, of one ``kind`` or of all."""
        return sum(1 for e in self.events if kind is None or e.kind == kind)

    def summary(self) -> str:
        """A table of calls, elements and bytes per (kind, group size)."""
        rows = defaultdict(lambda: [0, 0, 0])
        for e in self.events:
            row = rows[e.kind, e.group_size]
            row[0] += 1
            row[1] += e.numel
            row[2] += e.nbytes
        lines = [f"{'kind':<16}{'group':>6}{'calls':>8}{'numel':>14}{'bytes':>14}"]
        for (kind, size), (calls, numel, nbytes) in sorted(rows.items()):
            lines.append(f"{kind:<16}{size:>6}{calls:>8}{numel:>14}{nbytes:>14}")
        lines.append(f"{'total':<16}{'':>6}{self.count():>8}{'':>14}{self.total_bytes:>14}")
        return "\n".join(lines)
