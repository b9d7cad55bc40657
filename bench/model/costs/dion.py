"""Dion's cost model (``dobb.optim.dion``): its state, one call's work and the bytes its
``step()`` sends (registry entry ``dion``)."""

from bench.model.costs.kernels import (
    FP32,
    Kernel,
    Work,
    elementwise,
    finite_check,
    matmul,
    no_launch,
    tensor_isfinite,
)
from bench.model.hardware import Collective
from bench.model.workload import ONE_DEVICE, Layout, Matrix, dion_rank
from dobb.distributed.placement import matrix_placement
from dobb.optim.dion import Dion
from dobb.optim.dion_core import rank_of, sketch_rows

ENTRIES = ("dion",)  # the registry entries it prices (``cost_model``)

DEFAULTS = Dion.Config  # the options' defaults: the library's
COMM_FORMULA = "per row axis (k r + 1 + r² + n r), per col axis (m r + 1 + r) fp32"


def state_formula() -> str:
    """``state_bytes`` per parameter of an ``(m, n)`` matrix, in words."""
    return "4 (momentum) + 4 r / d_out (Q) + 4 / (m n) (step)"


def state_bytes(matrix: Matrix, *, rank_fraction: float = DEFAULTS.rank_fraction) -> float:
    """Bytes of state for one fp32 matrix: momentum, ``Q`` (``d_in x r``) and ``step``."""
    return (matrix.numel + matrix.d_in * dion_rank(matrix, rank_fraction) + 1) * FP32


def rank_state_bytes(
    matrix: Matrix, rows: int, columns: int, *, rank_fraction: float = DEFAULTS.rank_fraction
) -> float:
    """Bytes Dion keeps for ``matrix`` on a rank holding ``rows x columns`` of it: the
    momentum of the local piece, ``Q`` (``columns x r``, ``r`` of the whole matrix: the
    same on every rank splitting the rows) and ``step``."""
    return (rows * columns + columns * dion_rank(matrix, rank_fraction) + 1) * FP32


def work(
    matrices: list[Matrix],
    *,
    layout: Layout = ONE_DEVICE,
    rank_fraction: float = DEFAULTS.rank_fraction,
    orthogonalize: str = DEFAULTS.orthogonalize,
    collectives: str = "batched",
    launches: str = "per_shape",
) -> Work:
    """Dion's call (Algorithm 1, ``dion_step`` over all matrices).

    ``orthogonalize``: ``"cholesky_qr"`` (randomized Cholesky QR, the paper's distributed
    form and the registry's default) or ``"qr"`` (Householder). Each step all-reduces,
    over the ranks splitting a matrix's rows (FSDP, HSDP's shard axis, column-parallel
    TP), ``S P`` (``k x r``, with a nonzero flag), ``P₁ᵀ P₁`` (``r x r``) and ``R = Bᵀ P``
    (``n x r``); over the ranks splitting its columns (row-parallel TP), ``P = B Q``
    (``m x r``, with the flag) and the column norms of ``R`` (``r``); a piece with whole
    rows orthogonalizes ``P`` locally. ``collectives="batched"`` (ours,
    ``dobb.distributed.reduce.all_reduce_``) sends each round for all matrices in one
    buffer; ``"per_matrix"`` issues one all-reduce per matrix and round. Whole matrices
    (one device, DDP) run ``dion_updates``: same-shape matrices share each launch; split
    ones run ``dion_step``, one launch per op and matrix.
    """
    work = Work()
    rounds: dict[tuple[str, int], float] = {}  # (round, ranks) -> bytes
    checked = 0
    shapes: set[tuple[int, int]] = set()
    for m in matrices:
        (rows, n), r = layout.local(m), dion_rank(m, rank_fraction)
        row_split, col_split = layout.splits(m)
        first = launches != "per_shape" or row_split * col_split > 1 or (rows, n) not in shapes
        shapes.add((rows, n))
        e, mr, nr = rows * n * FP32, rows * r * FP32, n * r * FP32  # bytes
        checked += rows * n
        ops = [
            elementwise(rows * n, 3),  # B = M + G
            elementwise(rows * n, 2),  # W.mul_(1 - lr wd)
            matmul("gemm_skinny", 2.0 * rows * n * r, e + nr, mr),  # P = B Q
            Kernel("reduction", bytes=e),  # B.any()
        ]
        sends = {"P": (mr + FP32, col_split)}
        if orthogonalize == "qr":
            qr_flops = 4.0 * rows * r * r - 4.0 / 3.0 * r**3  # geqrf + orgqr
            ops += [Kernel("qr", flops=max(qr_flops, 0.0), bytes=2 * mr, alloc=mr)]
        else:
            k = sketch_rows(r)
            ops += [
                elementwise(k * m.d_out, 1, new=True),  # S ~ N(0, 1/k) (whole matrix's)
                elementwise(k * rows, 2, new=True),  # this rank's columns of S
                matmul("gemm_skinny", 2.0 * k * rows * r, k * rows * FP32 + mr, k * r * FP32),
                Kernel("qr", flops=2.0 * k * r * r - 2.0 / 3.0 * r**3),  # R of QR(S P)
                Kernel("small", flops=1.0 * rows * r * r, alloc=mr),  # P R1⁻¹
                matmul("gemm_skinny", 2.0 * rows * r * r, 2 * mr, r * r * FP32),  # Gram
                Kernel("small", flops=r**3 / 3.0),  # Cholesky
                Kernel("small", flops=1.0 * rows * r * r, alloc=mr),  # P1 R2⁻¹
                *tensor_isfinite(rows * r),  # of P2
            ]
            sends |= {"sketch": ((k * r + 1) * FP32, row_split), "gram": (r * r * FP32, row_split)}
        sends |= {"R": (nr, row_split), "norms": (r * FP32, col_split)}
        ops += [
            matmul("gemm_skinny", 2.0 * rows * n * r, e + mr, nr),  # R = Bᵀ P
            matmul("gemm_update", 2.0 * rows * n * r, 2 * e, 0.0, new=False),  # B -= P Rᵀ
            Kernel("reduction", bytes=nr),  # column norms
            elementwise(n * r, 2, count=2, new=True),  # clamp, divide
            elementwise(n * r, 2),  # Q.copy_
            matmul("gemm_update", 2.0 * rows * n * r, 2 * e, 0.0, new=False),  # W -= P Qᵀ
        ]
        for name, (nbytes, ranks) in sends.items():
            if ranks > 1 and collectives == "per_matrix":
                work.step_comm.append(Collective("all_reduce", nbytes, ranks))
            elif ranks > 1:
                rounds[name, ranks] = rounds.get((name, ranks), 0.0) + nbytes
        work.step += ops if first else [no_launch(k) for k in ops]
    work.step += finite_check(checked)
    work.step += [Kernel("elementwise", count=3)]  # which B != 0 (cat, nonzero, host sync)
    for (_, ranks), nbytes in rounds.items():  # one flat buffer: cat in, all-reduce, copy out
        flat = nbytes / FP32
        work.step += [elementwise(flat, 2, new=True), elementwise(flat, 2)]
        work.step_comm.append(Collective("all_reduce", nbytes, ranks))
    return work


def comm_bytes(opt, matrices, layout: str, world: int, step: int) -> int:
    """This rank's bytes in ``opt.step()`` (``matrices``: ``(param, group)`` pairs), every
    step: per axis splitting a matrix's rows ``S P`` with the ``B != 0`` flag, ``P₁ᵀ P₁``
    and ``Bᵀ P``; per axis splitting its columns ``B Q`` with the flag and the column norms."""
    total = 0
    for p, group in matrices:
        placement = matrix_placement(p)
        m_local, n_local = len(placement.rows), len(placement.cols)
        r = rank_of(p.shape, group["rank_fraction"], group["rank"])
        k = sketch_rows(r)
        floats = len(placement.row_groups) * ((k * r + 1) + r * r + n_local * r)
        floats += len(placement.col_groups) * ((m_local * r + 1) + r)
        total += FP32 * floats
    return total
