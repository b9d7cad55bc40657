"""Dobb's cost model (``dobb.optim.dobb``): its state, one call's work, its statistics
hooks, and the bytes its ``step()`` sends (registry entries ``dobb``, ``dobb_paper`` and
``dobb_sign``)."""

import math
from collections import Counter

import torch
import torch.distributed as dist

from bench.model.costs.kernels import (
    BF16,
    FP32,
    Kernel,
    Work,
    elementwise,
    finite_check,
    matmul,
    no_launch,
)
from bench.model.costs.traced import solver_kernels
from bench.model.hardware import Collective
from bench.model.workload import ONE_DEVICE, Layout, Matrix
from dobb._dtensor import DTensor
from dobb.eigensolve import JACOBI_SWEEPS, JACOBI_WIDTH, resolve_method
from dobb.optim.dobb import BLOCK_WIDTH, Dobb
from dobb.optim.dobb_core import refresh_due
from dobb.optim.dobb_steps import local_block_stacks
from dobb.stats import block_stacks

ENTRIES = ("dobb", "dobb_paper", "dobb_sign")  # the registry entries it prices (``cost_model``)

DEFAULTS = Dobb.Config()  # the options' defaults: the library's (each entry's on top of them)
# the refresh Dobb's default basis_method runs on the CPU, and its default refresh layout
CPU_SOLVER = resolve_method(DEFAULTS.basis_method, torch.device("cpu"))
REFRESH = "sharded" if DEFAULTS.shard_refresh else "replicated"

COMM_FORMULA = "refresh: Σ d_in²/B fp32 per data axis + bases all-gather Σ_s P⌈n_s/P⌉ s²; else 0"


def state_formula(
    two_sided: bool = DEFAULTS.two_sided, coefficients: str = DEFAULTS.coefficients
) -> str:
    """``state_bytes`` per parameter of an ``(m, n)`` matrix, in words (``s``: block size;
    two-sided: ``m`` the row-block size)."""
    moments = " + 4 (V, Adam coefficients)" if coefficients == "adam" else ""
    if two_sided:
        return (
            f"4 (momentum){moments} + 8 s / d_out (C_b, Q_b) + 8 m / d_in (P_r and its "
            "moments) + 8 / (m n)"
        )
    return f"4 (momentum){moments} + 8 s / d_out (C_b, Q_b) + 8 / (m n) (step counters)"


def state_bytes(
    matrix: Matrix,
    *,
    num_blocks: int | None = DEFAULTS.num_blocks,
    two_sided: bool = DEFAULTS.two_sided,
    row_blocks: int | None = DEFAULTS.row_blocks,
    coefficients: str = DEFAULTS.coefficients,
) -> float:
    """Bytes of state for one fp32 matrix: momentum, per block ``C_b`` and ``Q_b``
    (``s x s`` each), ``step`` and ``stats_steps``; the statistics accumulators (another
    ``s x s`` per block) live outside the state and are not counted. Two-sided (sign
    coefficients) adds, per row block (``row_blocks`` near-equal blocks of the whole
    matrix's ``d_out`` rows; two-sided Dobb's call-time runs take ``XL_WORLD``, one block
    per rank's rows under FSDP over the paper's ranks), the moments ``row_cov`` and the basis
    ``P_r`` (``m x m`` each); its row moments come from the gradient in the step
    (``row_stats="gradients"``), so no further accumulators. ``coefficients="adam"`` adds
    the ``variance`` ``V``, the size of the matrix. A count of None is the defaults' blocks
    of at most ``BLOCK_WIDTH`` (``widest_blocks``) of the whole matrix's columns or rows
    (one process)."""
    blocks = sum(s.count * s.size**2 for s in widest_blocks(matrix.d_in, num_blocks))
    if two_sided:  # P_r and its moments, per row block
        blocks += sum(s.count * s.size**2 for s in widest_blocks(matrix.d_out, row_blocks))
    moments = 2 if coefficients == "adam" else 1  # the momentum, and V
    return moments * matrix.numel * FP32 + 2 * blocks * FP32 + 2 * FP32


def rank_state_bytes(
    matrix: Matrix,
    rows: int,
    columns: int,
    *,
    num_blocks: int | None = DEFAULTS.num_blocks,
    two_sided: bool = DEFAULTS.two_sided,
    row_blocks: int | None = DEFAULTS.row_blocks,
    coefficients: str = DEFAULTS.coefficients,
) -> float:
    """Bytes Dobb keeps alive for ``matrix`` on a rank holding ``rows x columns`` of it,
    everything counted: the momentum (and ``V``) of the local piece; per input block of the
    rank's columns ``C_b``, ``Q_b`` and the hooks' sum of ``X_bᵀ X_b`` (``s x s`` each, the
    same on every data rank); two-sided, per row block of the rank's rows ``P_r`` and its
    moments; two step counters (``bench.results.memory`` measures the same figure)."""
    inputs = sum(s.count * s.size**2 for s in input_stacks(matrix, columns, num_blocks))
    if two_sided and row_blocks is None:
        rows_blocks = sum(s.count * s.size**2 for s in widest_blocks(rows, None))
    elif two_sided:  # row_blocks blocks of all d_out rows, the rank's among them
        whole = block_stacks(matrix.d_out, row_blocks)
        local = local_block_stacks(whole, 0, rows, matrix.name)
        rows_blocks = sum(s.count * s.size**2 for s in local)
    else:
        rows_blocks = 0
    moments = 2 if coefficients == "adam" else 1
    return (moments * rows * columns + 3 * inputs + 2 * rows_blocks + 2) * FP32


def work(
    matrices: list[Matrix],
    *,
    layout: Layout = ONE_DEVICE,
    num_blocks: int | None = DEFAULTS.num_blocks,
    basis_interval: int = DEFAULTS.basis_interval,
    refresh: str = REFRESH,
    launches: str = "per_shape",
    solver: str = CPU_SOLVER,
    two_sided: bool = DEFAULTS.two_sided,
    row_blocks: int | None = DEFAULTS.row_blocks,
    coefficients: str = DEFAULTS.coefficients,
    stats_sync: str = DEFAULTS.stats_sync,
) -> Work:
    """Dobb's call: the statistics fold, ``dobb_update_batched`` per batch of same-shape
    matrices, and a refresh on the calls ``refresh_due`` marks (one in ``k``).

    Each rank updates its piece (its rows; under TP row-parallel, the blocks of its
    columns). The fold is a few ``torch._foreach_*`` launches for all matrices; the update
    launches once per shape (``launches="per_matrix"``: the unbatched implementation, one
    launch per op and matrix). Batching stacks the direction and copies it into block order,
    two passes more than the per-matrix ops. The statistics are all-reduced over the data
    ranks at a refresh (on every step with ``stats_sync="step"``, or ``"auto"`` where the
    parameters are plain tensors, as under DDP). ``refresh="sharded"`` is our default
    (``shard_refresh=True``): each of the ``p`` ranks of the innermost data axis refreshes
    ``1/p`` of the blocks of each size, then one all-gather per block size shares the
    bases; ``"replicated"``
    (``shard_refresh=False``): every rank refreshes every block it holds. ``solver``:
    ``"eigh"`` (``torch.linalg.eigh``: one fitted cost per block), ``"jacobi"``
    (``dobb.eigensolve.jacobi_basis``: batched kernels, ``jacobi_kernels``) or another
    batched ``basis_method`` such as ``"cholqr"`` (``traced.solver_kernels``).
    Two-sided Dobb (``two_sided=True``, ``row_blocks``: None for one block of each rank's
    rows) runs ``two_sided_ops`` instead of the one-sided rotations; its row bases are
    refreshed where they live (never shared out), and under row-parallel TP its row
    moments are all-reduced over the ranks splitting the columns at a refresh.
    ``coefficients="adam"`` rotates the gradient into the bases too and updates ``V`` in
    place of the sign (``adam_ops``).
    """
    work = Work(due=lambda step: refresh_due(step, basis_interval), period=basis_interval)
    eigh_blocks: dict[int, int] = {}  # input blocks: shared out over the data ranks
    row_eigh_blocks: dict[int, int] = {}  # row blocks: refreshed where they live
    cov_bytes = checked = 0
    shapes: set[tuple[int, int]] = set()
    batched, adam = launches == "per_shape", coefficients == "adam"
    for i, m in enumerate(matrices):
        rows, n = layout.local(m)
        e = rows * n
        stacks = input_stacks(m, n, num_blocks)
        first = not batched or (rows, n) not in shapes
        shapes.add((rows, n))
        cov = sum(s.count * s.size**2 for s in stacks)
        checked += e + cov  # gradients and the statistics sums
        cov_bytes += cov * FP32
        for s in stacks:
            eigh_blocks[s.size] = eigh_blocks.get(s.size, 0) + s.count
        fold = [  # foreach over every matrix: launched with the first one
            elementwise(cov, 2, new=True),  # S_b = A_b / n
            elementwise(cov, 1),  # A_b.zero_()
            elementwise(cov, 3),  # C_b.lerp_(S_b)
        ]
        ops: list[Kernel] = [
            elementwise(e, 3),  # M.lerp_(G)
            elementwise(e, 3, new=True),  # N = G.lerp(M)
        ]
        if two_sided:
            rstacks = row_stacks(m, rows, row_blocks)
            ops += two_sided_ops(rows, n, stacks, rstacks, adam)
            for r in rstacks:
                row_eigh_blocks[r.size] = row_eigh_blocks.get(r.size, 0) + r.count
            row_cov = sum(r.count * r.size**2 for r in rstacks)
            fold.append(elementwise(row_cov, 3))  # P_r's moments .lerp_
            if layout.splits(m)[1] > 1:  # row-parallel TP: partial row moments
                ranks = layout.splits(m)[1]
                work.refresh_comm.append(Collective("all_reduce", row_cov * FP32, ranks))
        else:
            ops += one_sided_ops(rows, n, stacks, batched, adam)
        ops.append(elementwise(e, 3))  # W.add_(U)
        work.step += fold if i == 0 or not batched else [no_launch(k) for k in fold]
        # batched per shape: the same FLOPs and bytes, launched with the first of its shape
        work.step += ops if first else [no_launch(k) for k in ops]
        if not batched:
            work.step += [Kernel("elementwise", count=2)]  # step += 1, stats_steps += 1
    if batched:
        work.step += [Kernel("elementwise", count=4)]  # step counters: add, stack (twice)
    work.step += finite_check(checked)
    group = layout.refresh_split if refresh == "sharded" else 1
    if layout.data > 1:  # every step for plain parameters (DDP) under "auto", as comm_bytes
        plain = layout.shard == 1 and layout.tensor == 1
        every = stats_sync == "step" or (stats_sync == "auto" and plain)
        comm = work.step_comm if every else work.refresh_comm
        comm.append(Collective("all_reduce", cov_bytes, layout.data))
    for size, count in sorted(eigh_blocks.items()):
        blocks = math.ceil(count / group)
        work.refresh += refresh_kernels(size, count, blocks, solver)
        if group > 1:  # this rank's padded chunk, then the all-gather of all chunks
            work.refresh.append(elementwise(blocks * size * size, 2, new=True))
            gathered = blocks * group * size * size * FP32
            work.refresh_comm.append(Collective("all_gather", gathered, group))
    for size, count in sorted(row_eigh_blocks.items()):
        work.refresh += refresh_kernels(size, count, count, solver)
    return work


def refresh_kernels(size: int, count: int, blocks: int, solver: str) -> list[Kernel]:
    """Refreshing ``blocks`` of the ``count`` bases of one ``size`` that a rank holds: cat
    the stacks, solve (``eigh``: jitter, one fitted call, flip; ``jacobi_kernels``; any other
    batched ``basis_method``, e.g. ``cholqr``: ``traced.solver_kernels``, its ops counted
    from the code), copy all ``count`` into the state."""
    elements = blocks * size * size
    if solver == "jacobi":
        solve = jacobi_kernels(size, blocks)
    elif solver != "eigh":  # a batched solver: its kernels counted from the code
        solve = solver_kernels(solver, size, blocks)
    else:
        solve = [
            elementwise(elements, 3, new=True),  # C + jitter I
            Kernel("eigh", block=size, count=blocks),
            elementwise(elements, 2, new=True),  # flip
        ]
    cat = elementwise(count * size * size, 2, new=True)
    return [cat, *solve, elementwise(count * size * size, 2)]


def one_sided_ops(rows: int, n: int, stacks, batched: bool, adam: bool = False) -> list[Kernel]:
    """``dobb_update`` (or, ``batched``, ``dobb_update_batched``) after the momentum, up to
    the final ``W.add_``: per block stack ``K_b = N_b Q_b``, ``sign_``, ``U_b = S_b Q_bᵀ``
    (``2 m n s`` FLOPs each); batching stacks the direction and the bases and copies each
    stack's columns into block order and back. ``adam``: ``G_b Q_b`` too (its copy into
    block order where batched), and ``adam_ops`` in place of the sign."""
    ops = [elementwise(rows * n, 2, new=True)] if batched else []  # stack the directions
    for s in stacks:
        x = rows * s.count * s.size * FP32  # bytes of this stack's columns
        bmm = 2.0 * rows * s.count * s.size * s.size  # (count, rows, s) @ (count, s, s)
        if batched:
            ops += [
                elementwise(x / FP32, 2, new=True),  # N_b in block order
                elementwise(s.count * s.size**2, 2, new=True),  # stack the bases
            ]
        ops += [
            matmul("bmm_fp32", bmm, x, x, block=s.size),  # K_b = N_b Q_b
            matmul("bmm_fp32", bmm, x, x, block=s.size),  # U_b = S_b Q_bᵀ
        ]
        if adam:  # G_b Q_b, the rotated gradient (in block order where batched)
            ops += [elementwise(x / FP32, 2, new=True)] if batched else []
            ops.append(matmul("bmm_fp32", bmm, x, x, block=s.size))
        else:
            ops.append(elementwise(x / FP32, 2))  # sign_
        if batched:
            ops.append(elementwise(x / FP32, 2))  # U_b into the update's columns
    if not batched:
        ops.append(elementwise(rows * n, 2))  # W.mul_(1 - lr wd), skipped when batched, wd 0
    return ops + (adam_ops(rows * n) if adam else [])


def widest_blocks(size: int, count: int | None) -> tuple:
    """``count`` near-equal blocks of ``range(size)``; None: the fewest of at most
    ``BLOCK_WIDTH`` (``dobb.optim.dobb.side_stacks`` with no block width given)."""
    if count is None:
        return block_stacks(size, -(-size // BLOCK_WIDTH)) if size else ()
    return block_stacks(size, count)


def input_stacks(matrix: Matrix, n: int, num_blocks: int | None) -> tuple:
    """Dobb's input blocks of a rank holding ``n`` of ``matrix``'s columns: ``num_blocks``
    blocks of all ``d_in`` columns, which must tile the rank's columns (``Dobb``'s rule), or
    None: ``widest_blocks`` of the rank's columns."""
    if num_blocks is None:
        return widest_blocks(n, None)
    return local_block_stacks(block_stacks(matrix.d_in, num_blocks), 0, n, matrix.name)


def row_stacks(matrix: Matrix, rows: int, row_blocks: int | None) -> tuple:
    """Two-sided Dobb's row blocks of a rank holding ``rows`` rows of ``matrix``: the
    ``widest_blocks`` of them (``row_blocks=None``: one block at every shard the lab
    prices), or ``row_blocks`` blocks of all ``d_out`` rows, which must tile the rank's rows
    (``Dobb``'s rule)."""
    if row_blocks is None:
        return widest_blocks(rows, None)
    return local_block_stacks(block_stacks(matrix.d_out, row_blocks), 0, rows, matrix.name)


def two_sided_ops(rows: int, n: int, stacks, rstacks, adam: bool = False) -> list[Kernel]:
    """``dobb_update_batched``'s tile path with sign coefficients and the statistics' row
    moments on one ``(rows, n)`` piece (the momentum's two ops come before these).

    Row moments ``G_r G_rᵀ / n``: ``2 m n`` FLOPs per row. ``rotate`` on every tile of a
    row block (``m`` rows) and an input block (``s`` columns), into the bases and back:
    ``N_b Q_b`` (``2 m s²``) then ``P_rᵀ (.)`` (``2 m² s``) and a copy into place, each way;
    ``matmul`` first copies the strided tiles and each basis broadcast over the other
    side's blocks (``torch.matmul`` expands, then clones, its batch dimensions). ``adam``:
    the gradient rotated into the bases as well (a second ``"into"``), then ``adam_ops``
    in place of the sign.
    """
    e = rows * n
    ops = [
        elementwise(e, 2, new=True),  # stack the gradients (row moments)
        elementwise(e, 2, new=True),  # stack the direction
    ]
    for r in rstacks:
        moments = r.count * r.size**2
        read = r.count * r.size * n * FP32
        flops = 2.0 * r.count * r.size**2 * n
        ops += [
            matmul("bmm_fp32", flops, 2 * read, moments * FP32, block=r.size),  # G_r G_rᵀ
            elementwise(moments, 2, new=True),  # / d_in
            elementwise(moments, 2, new=True),  # stack P_r
        ]
    ops += [elementwise(s.count * s.size**2, 2, new=True) for s in stacks]  # stack Q_b
    for _way in ("into", "into", "back") if adam else ("into", "back"):
        ops.append(Kernel("elementwise", alloc=e * FP32))  # empty_like
        for r in rstacks:
            for s in stacks:
                tile = r.count * r.size * s.count * s.size  # elements of these tiles
                pairs = r.count * s.count  # matmul broadcasts each basis over the other side
                ops += [
                    elementwise(tile, 2, new=True),  # the strided tiles, made contiguous
                    elementwise(pairs * s.size**2, 2, new=True),  # Q_b for every row block
                    matmul(
                        "bmm_fp32", 2.0 * tile * s.size, 2 * tile * FP32, tile * FP32, block=s.size
                    ),  # N_b Q_b (or S Q_bᵀ)
                    elementwise(pairs * r.size**2, 2, new=True),  # P_r for every input block
                    matmul(
                        "bmm_fp32", 2.0 * tile * r.size, 2 * tile * FP32, tile * FP32, block=r.size
                    ),  # P_rᵀ (.) (or P_r (.))
                    elementwise(tile, 2),  # into place
                ]
    return ops + (adam_ops(e) if adam else [elementwise(e, 2)])  # D = sign(C) or Adam's


def adam_ops(e: int) -> list[Kernel]:
    """Adam coefficients on ``e`` rotated elements, after the rotations into the bases
    (``_rotated_update``): stack ``V``, square the rotated gradient, ``V.lerp_``, copy ``V``
    back, ``sqrt``, the bias correction, ``+ eps``, ``C / denominator``."""
    return [
        elementwise(e, 2, new=True),  # torch.stack(V)
        elementwise(e, 2),  # square_
        elementwise(e, 3),  # V.lerp_
        elementwise(e, 2),  # V copied back
        elementwise(e, 2, new=True),  # sqrt
        elementwise(e, 2),  # / sqrt(1 - beta2^t)
        elementwise(e, 2),  # + eps
        elementwise(e, 3),  # C / denominator
    ]


def jacobi_kernels(size: int, count: int) -> list[Kernel]:
    """``jacobi_basis`` on ``count`` blocks of ``size`` (``dobb.eigensolve``): ``A = Qᵀ C Q``,
    then ``JACOBI_SWEEPS`` sweeps of ``slots - 1`` rounds; each round solves every slot
    pair's ``(2w, 2w)`` block at once (one batched small ``eigh``, a factorization) and
    rotates ``A`` and ``Qᵀ`` with three ``bmm`` (``4 w m²`` FLOPs a block each) and three
    gathers; then sorting, one Cholesky-QR pass, the skip test and the guard's ``QᵀQ``."""
    slots = 2 * -(-size // (2 * JACOBI_WIDTH))
    w = -(-size // slots)
    m = slots * w
    rounds = (slots - 1) * (JACOBI_SWEEPS if slots > 2 else 1)
    pairs = count * slots // 2
    full, gram = count * m * m, 2.0 * count * size**3
    start = [
        matmul("bmm_fp32", gram, 2 * full * FP32, full * FP32, block=size),  # cholesky_qr Gram
        Kernel("small", flops=count * size**3 / 3.0),  # Cholesky
        Kernel("small", flops=count * size**3, alloc=full * FP32),  # triangular solve
        matmul("bmm_fp32", 2 * gram, 3 * full * FP32, full * FP32, block=size),  # Qᵀ C Q
        elementwise(full, 2, count=4, new=True),  # padding, layout gathers
    ]
    one_round = [
        Kernel("small", flops=pairs * 9.0 * (2 * w) ** 3),  # batched eigh of the pairs
        elementwise(pairs * 4 * w * w, 2, count=4, new=True),  # ranks, gather, transpose
        *[matmul("bmm_fp32", 4.0 * w * m * m * count, 2 * full * FP32, full * FP32, block=2 * w)]
        * 3,
        elementwise(full, 2, count=3, new=True),  # the next round's layout (index_select)
    ]
    finish = [
        elementwise(full, 2, count=3, new=True),  # sort and gather the columns
        matmul("bmm_fp32", gram, 2 * full * FP32, full * FP32, block=size),  # Cholesky-QR
        Kernel("small", flops=count * size**3 / 3.0),
        Kernel("small", flops=count * size**3, alloc=full * FP32),
        Kernel("reduction", bytes=full * FP32, count=2),  # skip test
        matmul("bmm_fp32", gram, 2 * full * FP32, full * FP32, block=size),  # guard: QᵀQ - I
        Kernel("elementwise", count=4),  # max, where, the guard's host read
    ]
    return start + one_round * rounds + finish


def hook_work(
    matrices: list[Matrix],
    tokens: int,
    *,
    num_blocks: int | None = DEFAULTS.num_blocks,
    low_precision: bool = False,
    share_inputs: bool = True,
) -> list[Kernel]:
    """Statistics hooks of one forward pass: ``A_b += X_bᵀ X_b``, ``2 N n s`` FLOPs a block
    stack, once per input tensor (``Matrix.input``: q, k and v share theirs through
    ``GramCache``), then one ``add`` into each layer's sums. ``low_precision``: under bf16
    autocast on a GPU the products take 16-bit inputs (one cast of each input) and
    accumulate in fp32. ``share_inputs=False``: every layer computes its own products (our
    hooks before ``GramCache``)."""
    ops, seen = [], set()
    for m in matrices:
        for s in widest_blocks(m.d_in, num_blocks):
            sums = s.count * s.size**2
            source = m.input if share_inputs else m.name
            if (source, s) not in seen:
                seen.add((source, s))
                x = tokens * s.count * s.size
                if low_precision:
                    ops.append(Kernel("elementwise", bytes=x * (FP32 + BF16), alloc=x * BF16))
                    io = x * BF16 + sums * FP32
                    kind = "gemm_bf16"
                else:
                    io, kind = x * FP32 + sums * FP32, "bmm_fp32"
                flops = 2.0 * tokens * sums
                ops.append(Kernel(kind, flops=flops, bytes=io, block=s.size, alloc=sums * FP32))
            ops.append(elementwise(sums, 3))  # A_b += the (shared) product
    return ops


def comm_bytes(opt, matrices, layout: str, world: int, step: int) -> int:
    """This rank's bytes in ``opt.step()`` (``matrices``: ``(param, group)`` pairs): the
    statistics of the blocks it holds, one all-reduce per data axis, on a refresh step, or
    on every step where they are averaged so (``stats_sync="step"``, or ``"auto"`` for a
    plain parameter, as under DDP: ``dobb_steps.averaged_every_step``); on a refresh step
    then one all-gather of the bases per block size, padded to a multiple of the group."""
    total, gathered = 0, Counter()  # blocks per size, all matrices
    sync = opt.config.stats_sync
    for p, group in matrices:
        refresh = refresh_due(step, group["basis_interval"])
        every = sync == "step" or (sync == "auto" and not isinstance(p, DTensor))
        blocks = sum(s.count * s.size**2 for s in opt.local_blocks(p))  # local C_b
        axes = len(opt.stats_groups) if refresh or every else 0
        total += FP32 * blocks * axes
        if refresh and axes:
            gathered.update({s.size: s.count for s in opt.local_blocks(p)})
    if gathered:
        ranks = dist.get_world_size(opt.stats_groups[-1])
        total += sum(
            FP32 * ranks * -(-count // ranks) * size**2 for size, count in gathered.items()
        )
    return total
