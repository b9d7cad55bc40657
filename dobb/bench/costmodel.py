"""Cost model of one optimizer call: FLOPs, memory traffic, launches, factorizations, comm.

    python -m dobb.bench.costmodel --config gpt2-xl --world 32 [--hardware calib.json]

Each optimizer call is written out as the kernels our implementation launches (one entry
per op of ``dobb_update``, ``dion_update``, ``muon_update``, PyTorch's AdamW and the
shared finite-gradient check), each with its FLOPs and the bytes it reads plus writes, and
the collectives its distributed form issues. A kernel costs

    launch + max(FLOPs / rate[kind], bytes / memory_bandwidth)          (a roofline per op)

(factorizations: launch + latency + FLOPs / rate; ``eigh``: a + b s³ per block), a
collective costs the α–β time of its algorithm (``Network``), and periodic work (Dobb's
basis refresh and statistics all-reduce) is divided by its period. Rates come from a
``Hardware`` profile: ``dobb.bench.calibrate`` measures one on the machine it runs
on (CPU or GPU); ``H100`` and ``H200`` hold datasheet values times stated efficiency
assumptions.

FLOPs per ``(m, n)`` matrix (``m`` local rows, ``n = d_in``) and step:

- Dobb (blocks of size ``s``): two ``bmm`` per block stack, ``4 m n s``; refresh every
  ``k`` steps: ``eigh`` of every ``s x s`` block (``a + b s³`` seconds each); statistics
  hook (in the forward pass, not the call): ``2 N n s`` for ``N`` tokens.
- Dion (rank ``r``): ``B Q``, ``Bᵀ P``, error feedback ``P Rᵀ`` and update ``P Qᵀ``:
  ``8 m n r``; Householder QR of ``P`` (``m x r``): ``4 m r² - 4/3 r³`` (geqrf + orgqr);
  randomized Cholesky QR (distributed form): sketch ``2 k m r``, ``QR(k x r)``, Gram
  ``2 m r²``, two triangular solves ``2 m r²``, Cholesky ``r³ / 3``.
- Muon: Newton-Schulz, 5 x (``X Xᵀ``: ``2 a² b``; ``b A + c A²``: ``2 a³``; ``B X``:
  ``2 a² b``) with ``a = min(m, n)``, ``b = max(m, n)``, in bf16.
- MuonBP (period ``P``): Muon's call on 1 of every ``P`` calls; on the others Newton-Schulz
  of each block (the rank's row shard, cut into ``row_blocks`` tiles), no communication.
- AdamW: elementwise only, 80 bytes per parameter (fp32).

Layouts (``Layout``, ``layout_of``): one device, DDP, FSDP2 (``Shard(0)``: every rank
holds ``ceil(m / p)`` rows of every matrix), HSDP (FSDP inside a replica of ``shard``
ranks) and Megatron TP (rows of q, k, v and the MLP's up projection, columns of the two
output projections); the slowest rank sets the time. Dobb's update is local; on refresh
steps its statistics are all-reduced over the data-parallel ranks, each rank of the
innermost data axis eigh's its share of the blocks and an all-gather shares the bases
(``shard_refresh``). Dion all-reduces over the ranks splitting a matrix's rows the
sketch product (``k x r``), the Gram matrix (``r x r``) and ``Bᵀ P`` (``n x r``), and
over those splitting its columns ``B Q`` (``m x r``) and the column norms, every step (one
buffer per round for all matrices, or one collective per matrix). Muon sends every
matrix to an owner rank (all-to-all, fp32), runs Newton-Schulz there, and sends the
result back (all-to-all, bf16); MuonBP does so on its full steps only.
"""

import argparse
import json
import math
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from dobb.bench.hardware import H100, Collective, Hardware, Network
from dobb.bench.workload import (
    ONE_DEVICE,
    Layout,
    Matrix,
    dion_rank,
    hidden_matrices,
    layout_of,
    sketch_rows,
)
from dobb.blocks import block_stacks
from dobb.distributed.sharding import local_block_stacks
from dobb.eigensolve import JACOBI_SWEEPS, JACOBI_WIDTH
from dobb.optim.muon import NS_STEPS
from dobb.optim.muonbp import chunk_sizes

FP32, BF16 = 4, 2  # bytes per element
CATEGORIES = ("matmul", "memory", "factorization", "overhead", "comm_latency", "comm_bandwidth")
OPTIMIZERS = ("dobb", "dion", "muon", "muonbp", "normuon", "dion2", "adamw")

# Paper's reference points (arXiv 2610.39412, abstract): GPT-2 XL, FSDP on 32 H100,
# amortized optimizer-call time.
PAPER_XL_32_H100_MS = {"dobb": 9.2, "dion": 124.1}


# --------------------------------------------------------------------------- memory
def state_bytes(
    name: str,
    matrix: Matrix,
    *,
    num_blocks: int = 16,
    rank_fraction=1 / 16,
    row_blocks: int = 32,
):
    """Bytes of optimizer state our implementation keeps for one fp32 matrix.

    AdamW: ``exp_avg``, ``exp_avg_sq`` and a scalar ``step`` tensor. Muon: momentum. Dion:
    momentum, ``Q`` (``d_in x r``) and ``step``. Dobb: momentum, per block ``C_b`` and
    ``Q_b`` (``s x s`` each), ``step`` and ``stats_steps``; its statistics accumulators
    (another ``s x s`` per block) live outside the state and are not counted here.
    Two-sided Dobb (``"dobb2s"``, sign coefficients): Dobb's state plus, per row block of
    ``m`` rows (``row_blocks`` near-equal blocks of the whole matrix's ``d_out`` rows),
    the moments ``row_cov`` and the basis ``P_r`` (``m x m`` each); with
    ``row_stats="gradients"`` its row moments come from the gradient in the step, so it
    keeps no further accumulators. (``coefficients="adam"`` would add a ``variance`` the
    size of the matrix; not modelled.)
    """
    mn, scalar = matrix.numel * FP32, FP32
    if name == "adamw":
        return 2 * mn + scalar
    if name in ("muon", "muonbp"):
        return mn + (scalar if name == "muonbp" else 0)  # MuonBP also counts its steps
    if name == "normuon":
        return mn + matrix.d_out * FP32  # momentum, one second moment per row
    if name == "dion2":
        return mn  # the error-feedback momentum
    if name == "dion":
        return mn + matrix.d_in * dion_rank(matrix, rank_fraction) * FP32 + scalar
    if name in ("dobb", "dobb2s"):
        blocks = sum(s.count * s.size**2 for s in block_stacks(matrix.d_in, num_blocks))
        if name == "dobb2s":  # P_r and its moments, per row block
            blocks += sum(s.count * s.size**2 for s in block_stacks(matrix.d_out, row_blocks))
        return mn + 2 * blocks * FP32 + 2 * scalar
    known = (*OPTIMIZERS, "dobb2s")
    raise ValueError(f"unknown optimizer {name!r}; choose one of {known}")


# --------------------------------------------------------------------------- work
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


@dataclass
class Work:
    """What one optimizer call does: ``step*`` on a ``step_share`` of the calls (1: every
    call), ``refresh*`` once every ``period`` calls."""

    step: list[Kernel] = field(default_factory=list)
    step_comm: list[Collective] = field(default_factory=list)
    refresh: list[Kernel] = field(default_factory=list)
    refresh_comm: list[Collective] = field(default_factory=list)
    period: int = 1
    step_share: float = 1.0

    def parts(self):
        """``(kernels, collectives, share of the calls)`` of the step and of the refresh."""
        yield self.step, self.step_comm, self.step_share
        yield self.refresh, self.refresh_comm, 1.0 / self.period

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


def dobb_work(
    matrices: list[Matrix],
    *,
    layout: Layout = ONE_DEVICE,
    num_blocks: int = 16,
    basis_interval: int = 10,
    refresh: str = "sharded",
    launches: str = "per_shape",
    solver: str = "eigh",
) -> Work:
    """Dobb's call: the statistics fold, ``dobb_update_batched`` per batch of same-shape
    matrices, and a refresh every ``k`` calls.

    Each rank updates its piece (its rows; under TP row-parallel, the blocks of its
    columns). The fold is a few ``torch._foreach_*`` launches for all matrices; the update
    launches once per shape (``launches="per_matrix"``: the unbatched implementation, one
    launch per op and matrix). Batching stacks the direction and copies it into block order,
    two passes more than the per-matrix ops. The statistics are all-reduced over the data
    ranks at a refresh. ``refresh="sharded"`` is our default (``shard_refresh=True``): each
    of the ``p`` ranks of the innermost data axis refreshes ``1/p`` of the blocks of each
    size, then one all-gather per block size shares the bases; ``"replicated"``
    (``shard_refresh=False``): every rank refreshes every block it holds. ``solver``:
    ``"eigh"`` (``torch.linalg.eigh``: one fitted cost per block) or ``"jacobi"``
    (``dobb.eigensolve.jacobi_basis``: batched kernels, ``jacobi_kernels``).
    """
    work = Work(period=basis_interval)
    eigh_blocks: dict[int, int] = {}
    cov_bytes = checked = 0
    shapes: set[tuple[int, int]] = set()
    for i, m in enumerate(matrices):
        rows, n = layout.local(m)
        e = rows * n
        stacks = local_block_stacks(block_stacks(m.d_in, num_blocks), 0, n, m.name)
        batched = launches == "per_shape"
        first = not batched or (rows, n) not in shapes
        shapes.add((rows, n))
        cov = sum(s.count * s.size**2 for s in stacks)
        checked += e + cov  # gradients and the statistics sums
        fold = [  # foreach over every matrix: launched with the first one
            elementwise(cov, 2, new=True),  # S_b = A_b / n
            elementwise(cov, 1),  # A_b.zero_()
            elementwise(cov, 3),  # C_b.lerp_(S_b)
        ]
        ops: list[Kernel] = [
            elementwise(e, 3),  # M.lerp_(G)
            elementwise(e, 3, new=True),  # N = G.lerp(M)
        ]
        if batched:
            ops.append(elementwise(e, 2, new=True))  # stack the directions
        for s in stacks:
            x = rows * s.count * s.size * FP32  # bytes of this stack's columns
            bmm = 2.0 * rows * s.count * s.size * s.size  # (count, rows, s) @ (count, s, s)
            blocks = s.count * s.size**2
            if batched:
                ops += [
                    elementwise(x / FP32, 2, new=True),  # N_b in block order
                    elementwise(blocks, 2, new=True),  # stack the bases
                ]
            ops += [
                matmul("bmm_fp32", bmm, x, x, block=s.size),  # K_b = N_b Q_b
                elementwise(x / FP32, 2),  # sign_
                matmul("bmm_fp32", bmm, x, x, block=s.size),  # U_b = S_b Q_bᵀ
            ]
            if batched:
                ops.append(elementwise(x / FP32, 2))  # U_b into the update's columns
            eigh_blocks[s.size] = eigh_blocks.get(s.size, 0) + s.count
            cov_bytes += blocks * FP32
        if not batched:
            ops.append(elementwise(e, 2))  # W.mul_(1 - lr wd), skipped when batched and wd = 0
        ops.append(elementwise(e, 3))  # W.add_(U)
        work.step += fold if i == 0 or not batched else [_no_launch(k) for k in fold]
        # batched per shape: the same FLOPs and bytes, launched with the first of its shape
        work.step += ops if first else [_no_launch(k) for k in ops]
        if not batched:
            work.step += [Kernel("elementwise", count=2)]  # step += 1, stats_steps += 1
    if launches == "per_shape":
        work.step += [Kernel("elementwise", count=4)]  # step counters: add, stack (twice)
    work.step += finite_check(checked)
    group = layout.refresh_split if refresh == "sharded" else 1
    if layout.data > 1:
        work.refresh_comm.append(Collective("all_reduce", cov_bytes, layout.data))
    for size, count in sorted(eigh_blocks.items()):
        blocks = math.ceil(count / group)
        elements = blocks * size * size
        work.refresh += [elementwise(count * size * size, 2, new=True)]  # cat of the stacks
        if solver == "jacobi":
            work.refresh += jacobi_kernels(size, blocks)
        else:
            work.refresh += [
                elementwise(elements, 3, new=True),  # C + jitter I
                Kernel("eigh", block=size, count=blocks),
                elementwise(elements, 2, new=True),  # flip
            ]
        work.refresh.append(elementwise(count * size * size, 2))  # copy into the state
        if group > 1:  # this rank's padded chunk, then the all-gather of all chunks
            work.refresh.append(elementwise(elements, 2, new=True))
            gathered = blocks * group * size * size * FP32
            work.refresh_comm.append(Collective("all_gather", gathered, group))
    return work


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


def _no_launch(kernel: Kernel) -> Kernel:
    """The kernel's FLOPs and bytes as part of another launch (``kind`` suffix ``+``)."""
    return replace(kernel, kind=kernel.kind + "+")


def dion_work(
    matrices: list[Matrix],
    *,
    layout: Layout = ONE_DEVICE,
    rank_fraction: float = 1 / 16,
    orthogonalize: str = "cholesky_qr",
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
        work.step += ops if first else [_no_launch(k) for k in ops]
    work.step += finite_check(checked)
    work.step += [Kernel("elementwise", count=3)]  # which B != 0 (cat, nonzero, host sync)
    for (_, ranks), nbytes in rounds.items():  # one flat buffer: cat in, all-reduce, copy out
        flat = nbytes / FP32
        work.step += [elementwise(flat, 2, new=True), elementwise(flat, 2)]
        work.step_comm.append(Collective("all_reduce", nbytes, ranks))
    return work


def newton_schulz_flops(m: int, n: int, steps: int = NS_STEPS) -> float:
    """FLOPs of ``newton_schulz`` on an ``(m, n)`` matrix: ``steps (4 a² b + 2 a³)``."""
    a, b = min(m, n), max(m, n)
    return steps * (4.0 * a * a * b + 2.0 * a**3)


def muon_work(
    matrices: list[Matrix],
    *,
    layout: Layout = ONE_DEVICE,
    send_bytes: int = FP32,
    return_bytes: int = BF16,
    launches: str = "per_shape",
) -> Work:
    """Muon's call (``muon_updates``: same-shape matrices batched); on split matrices,
    whole-matrix Newton-Schulz on an owner rank, as ``dobb.optim.muon.Muon`` does with an
    ``OwnerExchange`` over the ``g`` ranks that split them (HSDP replicas repeat it).

    Owners: matrices go greedily, largest Newton-Schulz first, to the least loaded rank
    (LPT); the most loaded rank sets the time, and runs one batched Newton-Schulz per shape
    it owns. Communication: one all-to-all brings every piece of the direction ``N`` to its
    owner (``send_bytes`` per element: the fp32 state dtype), one sends every rank its piece
    of ``O`` (``return_bytes``: bf16). ``launches="per_matrix"``: the unbatched
    implementation (one launch per op and matrix, one Newton-Schulz per matrix).
    """
    work = Work()
    group = layout.shard * layout.tensor
    batched = launches == "per_shape"
    loads = [0.0] * group
    owned = [0.0] * group
    ns_batches: list[dict[tuple[int, int], int]] = [{} for _ in range(group)]
    shapes: set[tuple[int, int]] = set()
    for m in sorted(matrices, key=lambda m: -newton_schulz_flops(m.d_out, m.d_in)):
        rows, n = layout.local(m)
        e = rows * n
        ops = [
            elementwise(e, 3),  # M.lerp_(G)
            elementwise(e, 3, new=True),  # N = G.lerp(M)
            elementwise(e, 2),  # W.mul_(1 - lr wd)
            Kernel("elementwise", bytes=e * (BF16 + 2 * FP32)),  # W.add_(O), O in bf16
        ]
        first = not batched or (rows, n) not in shapes
        shapes.add((rows, n))
        work.step += ops if first else [_no_launch(k) for k in ops]
        owner = min(range(group), key=loads.__getitem__)
        loads[owner] += newton_schulz_flops(m.d_out, m.d_in)
        owned[owner] += m.numel
        shape = (m.d_out, m.d_in)
        ns_batches[owner][shape] = ns_batches[owner].get(shape, 0) + 1
    busiest = max(range(group), key=loads.__getitem__)
    for (d_out, d_in), count in ns_batches[busiest].items():
        if batched:
            work.step.append(elementwise(count * d_out * d_in, 2, new=True))  # torch.stack
            work.step += newton_schulz_kernels(d_out, d_in, batch=count)
        else:
            work.step += newton_schulz_kernels(d_out, d_in) * count
    work.step += finite_check(local_elements(matrices, layout))
    if group > 1:
        # the busiest rank receives (g - 1)/g of its own matrices, and every rank sends 1/g
        # of every matrix: the larger of the two sets the all-to-all's volume
        elements = max(max(owned), sum(m.numel for m in matrices) / group)
        work.step_comm += [
            Collective("all_to_all", elements * send_bytes, group),  # N to the owners
            Collective("all_to_all", elements * return_bytes, group),  # O back
        ]
    return work


def local_elements(matrices: list[Matrix], layout: Layout) -> int:
    """Elements of the largest local pieces of ``matrices``, summed."""
    return sum(math.prod(layout.local(m)) for m in matrices)


def newton_schulz_kernels(m: int, n: int, batch: int = 1) -> list[Kernel]:
    """``newton_schulz`` of ``batch`` ``(m, n)`` matrices in one batched call (bf16)."""
    a, b, full = min(m, n), max(m, n), batch * m * n
    ns = [
        Kernel("elementwise", bytes=full * (FP32 + BF16), alloc=full * BF16),  # to(bf16)
        Kernel("reduction", bytes=full * BF16),  # Frobenius norms
        Kernel("elementwise", bytes=full * 2 * BF16, alloc=full * BF16),  # X / norm
    ]
    aa, ab = batch * a * a, batch * a * b
    for _ in range(NS_STEPS):
        ns += [
            matmul("gemm_bf16", 2.0 * aa * b, ab * BF16, aa * BF16),  # A = X Xᵀ
            matmul("gemm_bf16", 2.0 * aa * a, 2 * aa * BF16, aa * BF16),  # b A + c A²
            matmul("gemm_bf16", 2.0 * aa * b, (aa + ab) * BF16, ab * BF16),  # B X
        ]
    return ns


def muonbp_work(
    matrices: list[Matrix],
    *,
    layout: Layout = ONE_DEVICE,
    period: int | None = 5,
    row_blocks: int = 1,
    launches: str = "per_shape",
    **muon_options,
) -> Work:
    """MuonBP's call: a block step on ``(P - 1) / P`` of the calls, Muon's (``muon_work``,
    with its all-to-alls on split matrices) on the other ``1 / P``; ``period=None``: block
    steps only (BlockMuon).

    Block step (``block_muon_update``): momentum and direction per matrix; the rank's piece
    cut into ``row_blocks`` row tiles, equal tiles in one batched Newton-Schulz; weight decay
    and the update per tile. No communication. Same-shape tiles of all matrices share one
    launch per op (``launches="per_matrix"``: the unbatched implementation).
    """
    block: list[Kernel] = []
    shapes: set[tuple[int, int]] = set()
    for m in matrices:
        rows, n = layout.local(m)
        tiles = [t for t in chunk_sizes(rows, (row_blocks,)) if t]
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
        block += ops if first else [_no_launch(k) for k in ops]
    block += finite_check(local_elements(matrices, layout))
    if period is None:
        return Work(step=block)
    full = muon_work(matrices, layout=layout, launches=launches, **muon_options)
    return Work(
        step=block,
        refresh=full.step,
        refresh_comm=full.step_comm,
        period=period,
        step_share=(period - 1) / period,
    )


def normuon_work(
    matrices: list[Matrix],
    *,
    layout: Layout = ONE_DEVICE,
    launches: str = "per_shape",
    **muon_options,
) -> Work:
    """NorMuon's call: Muon's (``muon_work``, owner exchange included; whole matrices
    batched per shape, as ``normuon_updates`` runs) plus, per matrix, the row second moment
    ``v <- beta2 v + (1 - beta2) mean(O²)``, ``Ô = O / (sqrt(v) + eps)`` and the rescale to
    RMS 0.2 (a norm, and one all-reduce of a float per matrix when rows are split)."""
    work = muon_work(matrices, layout=layout, launches=launches, **muon_options)
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
        work.step += ops if first else [_no_launch(k) for k in ops]
    rows_split = [m for m in matrices if layout.splits(m)[0] > 1]
    if rows_split:
        ranks = max(layout.splits(m)[0] for m in rows_split)
        work.step_comm.append(Collective("all_reduce", len(rows_split) * FP32, ranks))
    return work


def dion2_work(
    matrices: list[Matrix],
    *,
    layout: Layout = ONE_DEVICE,
    fraction: float = 0.25,
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
        e, k = rows * n, math.ceil(fraction * rows)
        ek = k * n
        selected_total += math.ceil(fraction * m.d_out) * m.d_in
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
        work.step += ops if first else [_no_launch(k) for k in ops]
        kernels = newton_schulz_kernels(math.ceil(fraction * m.d_out), m.d_in)
        ns += kernels if first else [_no_launch(k) for k in kernels]
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


def adamw_work(
    matrices: list[Matrix], *, layout: Layout = ONE_DEVICE, foreach: bool = False
) -> Work:
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
        work.step += ops if not (foreach and i) else [_no_launch(k) for k in ops]
    return work


def hook_work(
    matrices: list[Matrix],
    tokens: int,
    *,
    num_blocks: int = 16,
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
        for s in block_stacks(m.d_in, num_blocks):
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


def forward_backward_work(matrices: list[Matrix], tokens: int, kind="gemm_fp32") -> list[Kernel]:
    """A stack of Linear layers' forward (``2 N m n``) and backward (``4 N m n``) products:
    ``Y = X Wᵀ``, ``dX = dY W``, ``dW = dYᵀ X`` (fresh outputs)."""
    ops = []
    for m in matrices:
        x, y, w = tokens * m.d_in * FP32, tokens * m.d_out * FP32, m.numel * FP32
        flops = 2.0 * tokens * m.numel
        ops += [matmul(kind, flops, x + w, y), matmul(kind, flops, y + w, x)]
        ops += [matmul(kind, flops, x + y, w)]
    return ops


# --------------------------------------------------------------------------- predict
def kernel_time(k: Kernel, hw: Hardware) -> dict[str, float]:
    """Seconds of one kernel entry, by category."""
    fused = k.kind.endswith("+")  # accounted inside another launch
    kind = k.kind.rstrip("+")
    launch = 0.0 if fused else hw.launch(kind) * k.count
    if kind == "eigh":
        return {"overhead": launch, "factorization": k.count * hw.eigh_block_s(k.block)}
    if kind in ("qr", "small"):
        one = (0.0 if fused else hw.latency_s[kind]) + k.flops / hw.rates[kind]
        return {"overhead": launch, "factorization": k.count * one}
    rate = hw.bmm_rate(k.block) if kind == "bmm_fp32" else hw.rate(kind)
    compute = k.flops / rate if rate else 0.0
    bandwidth = hw.memory_bandwidth
    if kind == "reduction" and hw.reduction_bandwidth:
        bandwidth = hw.reduction_bandwidth
    memory = k.bytes / bandwidth + k.alloc * hw.alloc_s_per_byte
    category = "matmul" if compute >= memory and k.flops else "memory"
    return {"overhead": launch, category: k.count * max(compute, memory)}


def work_time(work: Work, hw: Hardware, network: Network | None = None) -> dict[str, float]:
    """Amortized seconds per call, by category (``CATEGORIES``)."""
    terms = dict.fromkeys(CATEGORIES, 0.0)
    for kernels, comms, scale in work.parts():
        for k in kernels:
            for key, value in kernel_time(k, hw).items():
                terms[key] += scale * value
        for c in comms:
            if network is None:
                raise ValueError("collectives need a Network (world > 1)")
            lat, bw = network.time(c)
            terms["comm_latency"] += scale * (lat + hw.launch("elementwise") * c.count)
            terms["comm_bandwidth"] += scale * bw
    return terms


def build_work(
    name: str,
    matrices: list[Matrix],
    *,
    layout: Layout = ONE_DEVICE,
    num_blocks: int = 16,
    basis_interval: int = 10,
    rank_fraction: float = 1 / 16,
    period: int | None = 5,
    row_blocks: int = 1,
    foreach: bool = False,
    launches: str = "per_shape",
    solver: str = "eigh",
    **options,
) -> Work:
    """The ``Work`` of optimizer ``name`` on ``matrices`` split as ``layout`` says.

    ``period`` and ``row_blocks`` are MuonBP's; ``solver`` is Dobb's refresh; ``launches``
    (Dobb, Muon, MuonBP): ``"per_shape"`` (batched, ours) or ``"per_matrix"`` (the
    implementation before batching); ``options``: ``refresh`` (Dobb), ``orthogonalize`` and
    ``collectives`` (Dion), ``send_bytes`` and ``return_bytes`` (Muon, MuonBP).
    """
    if name == "dobb":
        kw = dict(num_blocks=num_blocks, basis_interval=basis_interval, solver=solver)
        return dobb_work(matrices, layout=layout, launches=launches, **kw, **options)
    if name == "dion":
        kw = dict(rank_fraction=rank_fraction, launches=launches)
        return dion_work(matrices, layout=layout, **kw, **options)
    if name == "muon":
        return muon_work(matrices, layout=layout, launches=launches, **options)
    if name == "muonbp":
        kw = dict(period=period, row_blocks=row_blocks, launches=launches)
        return muonbp_work(matrices, layout=layout, **kw, **options)
    if name == "normuon":
        return normuon_work(matrices, layout=layout, launches=launches, **options)
    if name == "dion2":
        return dion2_work(matrices, layout=layout, launches=launches, **options)
    if name == "adamw":
        return adamw_work(matrices, layout=layout, foreach=foreach, **options)
    raise ValueError(f"unknown optimizer {name!r}; choose one of {OPTIMIZERS}")


def predict(
    name: str,
    matrices: list[Matrix],
    hardware: Hardware,
    *,
    world: int = 1,
    layout: Layout | None = None,
    network: Network | None = None,
    **options,
) -> dict[str, float]:
    """Predicted amortized seconds per call by category, plus ``"total"``.

    ``layout`` (default: FSDP ``Shard(0)`` over ``world`` ranks; see ``layout_of``) on
    ``network`` (default: ``Network()``). ``options`` go to ``build_work``.
    """
    layout = layout or Layout(shard=world)
    if layout.world > 1 and network is None:
        network = Network()
    # Dobb's basis_method="auto": eigh on CPU, batched Jacobi on CUDA (foreach: a GPU profile)
    options.setdefault("solver", "jacobi" if hardware.foreach else "eigh")
    work = build_work(name, matrices, layout=layout, foreach=hardware.foreach, **options)
    terms = work_time(work, hardware, network)
    # Python work per matrix (state lookups, building the batches), calibrated per matrix
    terms["overhead"] += hardware.matrix_s.get(name, 0.0) * len(matrices)
    terms["total"] = sum(terms[c] for c in CATEGORIES)
    return terms


def predict_hooks(
    matrices,
    tokens: int,
    hardware: Hardware,
    *,
    num_blocks=16,
    forward_kind=None,
    low_precision: bool = False,
    share_inputs: bool = True,
):
    """Predicted seconds of the statistics hooks of one forward, and of forward+backward
    (``low_precision``: 16-bit Gram products, as under autocast on a GPU)."""

    def seconds(kernels):
        return sum(sum(kernel_time(k, hardware).values()) for k in kernels)

    work = hook_work(
        matrices, tokens, num_blocks=num_blocks, low_precision=low_precision,
        share_inputs=share_inputs,
    )  # fmt: skip
    hooks = seconds(work)
    hooks += hardware.matrix_s.get("hook", 0.0) * len(matrices)
    fb = forward_backward_work(matrices, tokens, forward_kind or "gemm_fp32")
    return {"hooks_s": hooks, "forward_backward_s": seconds(fb)}


# --------------------------------------------------------------------------- tables
def format_terms(rows: dict[str, dict[str, float]], unit: float = 1e-3) -> str:
    """A Markdown table of per-category times (ms by default), one row per entry."""
    head = "| | " + " | ".join(CATEGORIES) + " | total |\n|---|" + "---:|" * (len(CATEGORIES) + 1)
    lines = [head]
    for label, t in rows.items():
        cells = " | ".join(f"{t[c] / unit:.2f}" for c in (*CATEGORIES, "total"))
        lines.append(f"| {label} | {cells} |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description="Predict per-call time under a layout.")
    parser.add_argument("--config", default="gpt2-xl")
    parser.add_argument("--world", type=int, default=32)
    parser.add_argument("--layout", choices=("fsdp", "hsdp", "tp", "ddp"), default="fsdp")
    parser.add_argument("--shard", type=int, default=8, help="hsdp: ranks per replica")
    parser.add_argument("--hardware", type=Path, help="a calibration JSON (default: H100)")
    parser.add_argument("--algorithm", choices=("hierarchical", "ring"), default="hierarchical")
    args = parser.parse_args(argv)
    hw = Hardware.from_json(json.loads(args.hardware.read_text())) if args.hardware else H100
    network = Network(algorithm=args.algorithm)
    matrices = hidden_matrices(args.config)
    layout = layout_of(args.layout, args.world, shard=args.shard)
    rows = {
        name: predict(name, matrices, hw, layout=layout, network=network) for name in OPTIMIZERS
    }
    print(f"{args.config}, {layout} on {hw.name}, {args.algorithm} collectives (ms)")
    print(format_terms(rows))


if __name__ == "__main__":
    main(sys.argv[1:])
