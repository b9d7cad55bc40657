"""AdamW's cost model (``torch.optim.AdamW``; registry entry ``adamw``)."""

import math

from bench.model.costs.kernels import FP32, Kernel, Work, elementwise, no_launch
from bench.model.workload import ONE_DEVICE, Layout, Matrix

ENTRIES = ("adamw",)  # the registry entries it prices (``cost_model``)


def state_formula() -> str:
    """``state_bytes`` per parameter of an ``(m, n)`` matrix, in words."""
    return "8 (two moments) + 4 / (m n) (step)"


def state_bytes(matrix: Matrix) -> float:
    """Bytes of state for one fp32 matrix: ``exp_avg``, ``exp_avg_sq`` and a ``step``."""
    return (2 * matrix.numel + 1) * FP32


def work(matrices: list[Matrix], *, layout: Layout = ONE_DEVICE, foreach: bool = False) -> Work:
    """PyTorch AdamW: 8 elementwise ops (20 fp32 accesses) per parameter and step; ``sqrt``
    and the division by the bias correction write fresh tensors (``denom``).

    Single-tensor path (PyTorch's choice on CPU): 8 launches per matrix, plus ``step``.
    ``foreach`` (its choice on CUDA): the same bytes in a handful of multi-tensor launches.
    """
    work = Work()
    # mul_ W, lerp_ m, mul_ v, addcmul_ v, sqrt, div, add_ eps, addcdiv_ W: (accesses, new)
    ops_of = ((2, 0), (3, 0), (2, 0), (3, 0), (2, 1), (2, 1), (2, 0), (4, 0))
    for i, m in enumerate(matrices):
        e = math.prod(layout.local(m))
        ops = [elementwise(e, a, new=bool(new)) for a, new in ops_of]
        ops.append(Kernel("elementwise", count=1))
        work.step += ops if not (foreach and i) else [no_launch(k) for k in ops]
    return work
