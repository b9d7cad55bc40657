"""Dion2's cost model (``dobb.optim.dion2``): Muon's exchange on the selected rows only
(registry entry ``dion2``)."""

import math

from bench.model.costs.kernels import (
    BF16,
    FP32,
    Kernel,
    Work,
    elementwise,
    finite_check,
    local_elements,
    no_launch,
)
from bench.model.costs.muon import (
    newton_schulz_kernels,
    owner_exchange_bytes,
    state_bytes,  # noqa: F401  its state: one momentum (error feedback), as Muon's
    state_formula,  # noqa: F401
)
from bench.model.hardware import Collective
from bench.model.workload import ONE_DEVICE, Layout, Matrix
from dobb.distributed.placement import matrix_placement
from dobb.optim.dion2 import Dion2, selected_count, selection_blocks

ENTRIES = ("dion2",)  # the registry entries it prices (``cost_model``)

COMM_FORMULA = "as Muon on the K x n selected rows, K = Σ_shards ceil(f m_shard)"


def work(
    matrices: list[Matrix],
    *,
    layout: Layout = ONE_DEVICE,
    row_fraction: float = Dion2.Config.row_fraction,
    send_bytes: int = FP32,
    return_bytes: int = BF16,
    launches: str = "per_shape",
) -> Work:
    """Dion2's call (``dion2_update`` per matrix): ``M += G``, the ``ceil(f m)`` rows of
    largest L1 norm selected (a row reduction and ``topk``), gathered, decayed in place,
    Newton-Schulz on the ``k x n`` selected rows (on the matrix's owner rank: only the
    selected rows travel, one all-to-all each way), then ``W *= 1 - lr wd`` and an
    ``index_add_`` of the update into the selected rows. Whole matrices run
    ``dion2_updates``: same-shape matrices share each launch."""
    work = Work()
    group = layout.shard * layout.tensor
    selected_total = 0
    ns: list[Kernel] = []
    shapes: set[tuple[int, int]] = set()
    for m in matrices:
        rows, n = layout.local(m)
        e, k = rows * n, math.ceil(row_fraction * rows)
        ek = k * n
        selected_total += math.ceil(row_fraction * m.d_out) * m.d_in
        first = launches != "per_shape" or group > 1 or (rows, n) not in shapes
        shapes.add((rows, n))
        ops = [
            elementwise(e, 3),  # M.add_(G)
            Kernel("reduction", bytes=e * FP32),  # row L1 norms
            Kernel("elementwise", count=2),  # topk, sort of the picks
            elementwise(ek, 2, new=True),  # M[S]
            elementwise(ek, 3, new=True),  # M[S] * decay, index_copy_
            elementwise(e, 2),  # W.mul_(1 - lr wd)
            Kernel("elementwise", bytes=ek * (BF16 + 2 * FP32)),  # W.index_add_(O)
        ]
        work.step += ops if first else [no_launch(k) for k in ops]
        kernels = newton_schulz_kernels(math.ceil(row_fraction * m.d_out), m.d_in)
        ns += kernels if first else [no_launch(k) for k in kernels]
    # owners balance the work; the busiest holds about 1/g of it
    work.step += ns[: max(1, math.ceil(len(ns) / group))] if group > 1 else ns
    work.step += finite_check(local_elements(matrices, layout))
    if group > 1:
        elements = selected_total / group
        work.step_comm += [
            Collective("all_to_all", elements * send_bytes, group),  # selected rows to owners
            Collective("all_to_all", elements * return_bytes, group),  # O back
        ]
    return work


def comm_bytes(opt, matrices, layout: str, world: int, step: int) -> int:
    """This rank's bytes in ``opt.step()``: Muon's owner exchange of the ``K x n`` matrix of
    selected rows, ``K = W k_local`` (DDP: ``k_local``)."""
    total = 0
    for p, group in matrices:
        placement = matrix_placement(p)
        blocks = selection_blocks(len(placement.rows), group["row_blocks"])
        k_local = sum(selected_count(b, group["row_fraction"]) for b in blocks)
        k = k_local * (1 if layout == "ddp" else world)
        split = bool(placement.row_groups or placement.col_groups)
        total += owner_exchange_bytes(k, p.shape[1], layout, world, split)
    return total
