"""MuonBP's cost model (``dobb.optim.muonbp``): block steps on local shards, Muon's full
step every ``period`` calls (registry entries ``muonbp`` and ``blockmuon``)."""

from bench.model.costs import muon
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
from bench.model.costs.muon import newton_schulz_kernels
from bench.model.workload import ONE_DEVICE, Layout, Matrix
from dobb.optim.muonbp import MuonBP, chunk_sizes, full_step_due

ENTRIES = ("muonbp", "blockmuon")  # the registry entries it prices (``cost_model``)

COMM_FORMULA = "full step (step 1, then every period): as Muon; block step: 0"


def state_formula() -> str:
    """``state_bytes`` per parameter of an ``(m, n)`` matrix, in words."""
    return "4 (momentum) + 4 / (m n) (step)"


def state_bytes(matrix: Matrix) -> float:
    """Bytes of state for one fp32 matrix: the momentum and the step count."""
    return (matrix.numel + 1) * FP32


def work(
    matrices: list[Matrix],
    *,
    layout: Layout = ONE_DEVICE,
    period: int | None = MuonBP.Config.period,
    row_blocks: int | None = MuonBP.Config.row_blocks,
    launches: str = "per_shape",
    send_bytes: int = FP32,
    return_bytes: int = BF16,
) -> Work:
    """MuonBP's call: a block step on the calls ``full_step_due`` leaves (``(P - 1) / P`` of
    them), Muon's (``muon.work``, with its all-to-alls on split matrices) on the others
    (``1 / P``); ``period=None``: block steps only (BlockMuon).

    Block step (``block_muon_update``): momentum and direction per matrix; the rank's piece
    cut into ``row_blocks`` row tiles, equal tiles in one batched Newton-Schulz; weight decay
    and the update per tile. No communication. Same-shape tiles of all matrices share one
    launch per op (``launches="per_matrix"``: the unbatched implementation).
    """
    block: list[Kernel] = []
    shapes: set[tuple[int, int]] = set()
    for m in matrices:
        rows, n = layout.local(m)
        tiles = [t for t in chunk_sizes(rows, row_blocks) if t]
        e = rows * n
        ops = [elementwise(e, 3), elementwise(e, 3, new=True)]  # M.lerp_(G), N
        for size in sorted(set(tiles)):
            count = tiles.count(size)
            if count > 1:
                ops.append(elementwise(count * size * n, 2, new=True))  # torch.stack
            ops += newton_schulz_kernels(size, n, batch=count)
        for size in tiles:
            ops += [  # W_b.mul_(1 - lr wd), W_b.add_(O_b) with O_b in bf16
                elementwise(size * n, 2),
                Kernel("elementwise", bytes=size * n * (BF16 + 2 * FP32)),
            ]
        ops.append(Kernel("elementwise"))  # step += 1
        first = launches == "per_matrix" or (m.d_out, m.d_in) not in shapes
        shapes.add((m.d_out, m.d_in))
        block += ops if first else [no_launch(k) for k in ops]
    block += finite_check(local_elements(matrices, layout))
    if period is None:
        return Work(step=block)
    exchange = dict(send_bytes=send_bytes, return_bytes=return_bytes)
    full = muon.work(matrices, layout=layout, launches=launches, **exchange)
    return Work(
        step=block,
        refresh=full.step,
        refresh_comm=full.step_comm,
        due=lambda step: full_step_due(step, period),
        period=period,
        replaces_step=True,  # a full step is Muon's call, not a block step and more
    )


def comm_bytes(opt, matrices, layout: str, world: int, step: int) -> int:
    """This rank's bytes in ``opt.step()``: Muon's on a full step (the first, then every
    ``period``), nothing on a block step."""
    if not all(full_step_due(step, g["period"]) for _, g in matrices):
        return 0
    return muon.comm_bytes(opt, matrices, layout, world, step)
