"""NorDion2's cost model (``dobb.optim.nordion2``): Dion2's call plus NorMuon's row
normalization on the selected rows (registry entry ``nordion2``)."""

import math

from bench.model.costs import dion2
from bench.model.costs.kernels import FP32, Kernel, Work, elementwise, no_launch
from bench.model.costs.normuon import state_bytes, state_formula  # noqa: F401  NorMuon's state
from bench.model.hardware import Collective
from bench.model.workload import ONE_DEVICE, Layout, Matrix
from dobb.optim.nordion2 import NorDion2

ENTRIES = ("nordion2",)  # the registry entries it prices (``cost_model``)

COMM_FORMULA = "as Dion2 + 2 fp64 per matrix all-reduced (DDP: as Dion2)"


def work(
    matrices: list[Matrix],
    *,
    layout: Layout = ONE_DEVICE,
    row_fraction: float = NorDion2.Config.row_fraction,
    launches: str = "per_shape",
    **exchange,
) -> Work:
    """NorDion2's call: Dion2's (``dion2.work``: selection, feedback, Newton-Schulz on the
    ``k x n`` selected rows, the owner exchange, the row update) plus, on the selected
    rows, the gather and scatter of ``v``, ``v_S <- beta2 v_S + (1 - beta2) mean(O²)``,
    ``Ô = O / (sqrt(v_S) + eps)``, the two norms ``||O||_F``, ``||Ô||_F`` and the rescale
    (one all-reduce of two floats per matrix when rows are split)."""
    work = dion2.work(
        matrices, layout=layout, row_fraction=row_fraction, launches=launches, **exchange
    )
    shapes: set[tuple[int, int]] = set()
    for m in matrices:
        rows, n = layout.local(m)
        k = math.ceil(row_fraction * rows)
        ek = k * n
        first = launches != "per_shape" or layout.splits(m)[0] > 1 or (rows, n) not in shapes
        shapes.add((rows, n))
        ops = [
            elementwise(k, 2, count=2, new=True),  # v[S] gathered, scattered back
            elementwise(ek, 2, new=True),  # O²
            Kernel("reduction", bytes=ek * FP32),  # row means
            elementwise(k, 3, count=3, new=True),  # v.lerp_, sqrt, + eps
            elementwise(ek, 3, new=True),  # O / (sqrt(v) + eps)
            Kernel("reduction", bytes=2 * ek * FP32, count=2),  # ||O||_F², ||Ô||_F²
            elementwise(ek, 2),  # Ô *= ||O|| / ||Ô||
        ]
        work.step += ops if first else [no_launch(op) for op in ops]
    rows_split = [m for m in matrices if layout.splits(m)[0] > 1]
    if rows_split:
        ranks = max(layout.splits(m)[0] for m in rows_split)
        work.step_comm.append(Collective("all_reduce", len(rows_split) * 2 * FP32, ranks))
    return work


def comm_bytes(opt, matrices, layout: str, world: int, step: int) -> int:
    """This rank's bytes in ``opt.step()``: Dion2's, plus on sharded layouts two fp64
    (``||O||_F²``, ``||Ô||_F²``) of every matrix."""
    norms = 16 * len(matrices) if layout != "ddp" else 0
    return norms + dion2.comm_bytes(opt, matrices, layout, world, step)
