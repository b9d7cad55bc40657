"""NorMuon's cost model (``dobb.optim.normuon``): Muon's plus a row second moment
(registry entry ``normuon``)."""

from bench.model.costs import muon
from bench.model.costs.kernels import BF16, FP32, Kernel, Work, elementwise, no_launch
from bench.model.hardware import Collective
from bench.model.workload import ONE_DEVICE, Layout, Matrix

ENTRIES = ("normuon",)  # the registry entries it prices (``cost_model``)

COMM_FORMULA = "as Muon + 1 fp64 per matrix all-reduced (DDP: as Muon)"


def state_formula() -> str:
    """``state_bytes`` per parameter of an ``(m, n)`` matrix, in words."""
    return "4 (momentum) + 4 / d_in (row second moment)"


def state_bytes(matrix: Matrix) -> float:
    """Bytes of state for one fp32 matrix: the momentum and one second moment per row."""
    return (matrix.numel + matrix.d_out) * FP32


def work(
    matrices: list[Matrix],
    *,
    layout: Layout = ONE_DEVICE,
    launches: str = "per_shape",
    send_bytes: int = FP32,
    return_bytes: int = BF16,
) -> Work:
    """NorMuon's call: Muon's (``muon.work``, owner exchange included; whole matrices
    batched per shape, as ``normuon_updates`` runs) plus, per matrix, the row second moment
    ``v <- beta2 v + (1 - beta2) mean(O²)``, ``Ô = O / (sqrt(v) + eps)`` and the rescale to
    RMS 0.2 (a norm, and one all-reduce of a float per matrix when rows are split)."""
    exchange = dict(send_bytes=send_bytes, return_bytes=return_bytes)
    work = muon.work(matrices, layout=layout, launches=launches, **exchange)
    shapes: set[tuple[int, int]] = set()
    for m in matrices:
        rows, n = layout.local(m)
        e = rows * n
        first = launches != "per_shape" or layout.splits(m)[0] > 1 or (rows, n) not in shapes
        shapes.add((rows, n))
        ops = [
            elementwise(e, 2, new=True),  # O²
            Kernel("reduction", bytes=e * FP32),  # row means
            elementwise(rows, 3, count=3, new=True),  # v.lerp_, sqrt, + eps
            elementwise(e, 3, new=True),  # O / (sqrt(v) + eps)
            Kernel("reduction", bytes=e * FP32),  # ||Ô||_F²
            elementwise(e, 2),  # Ô *= rms factor
        ]
        work.step += ops if first else [no_launch(k) for k in ops]
    rows_split = [m for m in matrices if layout.splits(m)[0] > 1]
    if rows_split:
        ranks = max(layout.splits(m)[0] for m in rows_split)
        work.step_comm.append(Collective("all_reduce", len(rows_split) * FP32, ranks))
    return work


def comm_bytes(opt, matrices, layout: str, world: int, step: int) -> int:
    """This rank's bytes in ``opt.step()``: Muon's, plus on sharded layouts one fp64
    ``||Ô||_F²`` of every matrix."""
    norms = 8 * len(matrices) if layout != "ddp" else 0
    return norms + muon.comm_bytes(opt, matrices, layout, world, step)
