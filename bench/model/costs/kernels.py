"""The vocabulary of the cost models: kernels (``Kernel``), one call's work (``Work``) and
the helpers that write common ops; ``bench.model.costmodel`` prices them on a ``Hardware``."""

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from bench.model.hardware import Collective
from bench.model.workload import Layout, Matrix

FP32, BF16 = 4, 2  # bytes per element


@dataclass(frozen=True)
class Kernel:
    """One launched op (or ``count`` identical ones).

    ``kind`` picks the rate: ``gemm_fp32``, ``gemm_skinny`` (fp32 products with a rank-r
    side), ``gemm_update`` (in-place rank-r updates ``W -= P Qᵀ``), ``gemm_bf16``,
    ``bmm_fp32`` (rate by ``block``), ``elementwise`` and ``reduction`` (memory only),
    ``qr`` / ``small`` (factorizations: latency + FLOPs),
    ``eigh`` (``count`` blocks of size ``block``, one launch). ``bytes``: device memory
    read plus written; ``alloc``: bytes of the freshly allocated output (first-touch
    cost on CPU; free under CUDA's caching allocator).
    """

    kind: str
    flops: float = 0.0
    bytes: float = 0.0
    block: int = 0
    count: int = 1
    alloc: float = 0.0


CALLS = ("amortized", "periodic", "other")  # what a Work prices (``Work.calls``)


@dataclass
class Work:
    """What one optimizer call does: ``step*`` on every call (``replaces_step``: on the
    calls without periodic work only, as MuonBP's block step), ``refresh*`` (the periodic
    work: Dobb's refresh, MuonBP's full step) on the calls the library's schedule marks:
    ``due(step)`` for a matrix's call ``step`` (from 1; ``dobb.optim.dobb_core.refresh_due``,
    ``dobb.optim.muonbp.full_step_due``), a schedule that repeats every ``period`` calls.

    ``calls``: ``"amortized"`` (default) prices the mean call, each part on its share of the
    calls, counted from ``due`` over one period (``shares``); ``"periodic"`` and ``"other"``
    price one call of that kind alone."""

    step: list[Kernel] = field(default_factory=list)
    step_comm: list[Collective] = field(default_factory=list)
    refresh: list[Kernel] = field(default_factory=list)
    refresh_comm: list[Collective] = field(default_factory=list)
    due: Callable[[int], bool] | None = None
    """None: no periodic work."""
    period: int = 1
    replaces_step: bool = False
    calls: str = "amortized"

    def shares(self) -> tuple[float, float]:
        """``(share of the step, share of the periodic work)`` of the calls priced: counted
        over one period of the schedule, or of one call of one kind."""
        if self.calls not in CALLS:
            raise ValueError(f"calls must be one of {CALLS}, got {self.calls!r}")
        if self.due is None or self.calls == "other":
            calls, periodic = 1, 0
        elif self.calls == "periodic":
            calls, periodic = 1, 1
        else:  # one period of the schedule: the calls that do the periodic work
            calls = self.period
            periodic = sum(bool(self.due(step)) for step in range(1, calls + 1))
        step = calls - periodic if self.replaces_step else calls
        return step / calls, periodic / calls

    def parts(self):
        """``(kernels, collectives, share of the calls)`` of the step and of the refresh."""
        step, refresh = self.shares()
        yield self.step, self.step_comm, step
        yield self.refresh, self.refresh_comm, refresh

    def flops(self) -> float:
        """FLOPs per call, amortized (``eigh`` excluded: its cost is fitted, not counted)."""
        return sum(
            share * sum(k.flops * k.count for k in kernels if k.kind != "eigh")
            for kernels, _, share in self.parts()
        )

    def bytes(self) -> float:
        """Device-memory bytes read plus written per call, amortized."""
        return sum(share * sum(k.bytes * k.count for k in ks) for ks, _, share in self.parts())

    def comm_bytes(self) -> float:
        """Collective payload bytes per call, amortized (full-buffer convention)."""
        return sum(share * sum(c.bytes * c.count for c in cs) for _, cs, share in self.parts())


def elementwise(elements: float, accesses: int, count: int = 1, new: bool = False) -> Kernel:
    """An fp32 elementwise op touching ``accesses`` tensors of ``elements`` (reads + writes);
    ``new``: its output is a fresh tensor."""
    return Kernel(
        "elementwise",
        bytes=elements * accesses * FP32,
        count=count,
        alloc=elements * FP32 if new else 0.0,
    )


def matmul(
    kind: str, flops: float, read: float, written: float, *, new: bool = True, block: int = 0
) -> Kernel:
    """A product reading ``read`` and writing ``written`` bytes (a fresh output if ``new``)."""
    alloc = written if new else 0.0
    return Kernel(kind, flops=flops, bytes=read + written, block=block, alloc=alloc)


def finite_check(elements: float) -> list[Kernel]:
    """MatrixOptimizer's non-finite check over all gradients (and statistics) of a call:
    one fused ``torch._foreach_norm`` pass reading everything, then ``stack``,
    ``isfinite``, ``all`` and a host sync on the small result."""
    return [Kernel("reduction", bytes=elements * FP32), Kernel("elementwise", count=4)]


def tensor_isfinite(elements: float) -> list[Kernel]:
    """``torch.isfinite(t).all()`` on one fp32 tensor: composite in ATen,
    ``(t == t) * (t.abs() != inf)``, four passes with fresh outputs, then ``all``."""
    return [
        Kernel("elementwise", bytes=elements * 2 * FP32, alloc=elements * FP32),  # abs
        Kernel("elementwise", bytes=elements * (FP32 + 1), alloc=elements),  # != inf
        Kernel("elementwise", bytes=elements * (FP32 + 1), alloc=elements),  # t == t
        Kernel("elementwise", bytes=elements * 3, alloc=elements),  # *
        Kernel("reduction", bytes=elements),  # all
    ]


def no_launch(kernel: Kernel) -> Kernel:
    """The kernel's FLOPs and bytes as part of another launch (``kind`` suffix ``+``)."""
    return replace(kernel, kind=kernel.kind + "+")


def local_elements(matrices: list[Matrix], layout: Layout) -> int:
    """Elements of the largest local pieces of ``matrices``, summed."""
    return sum(math.prod(layout.local(m)) for m in matrices)
