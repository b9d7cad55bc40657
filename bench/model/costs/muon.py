"""Muon's cost model (``dobb.optim.muon``): its state, one call's work and the bytes of its
owner exchange (registry entry ``muon``; MuonBP, NorMuon and Dion2 build on it)."""

from bench.model.costs.kernels import (
    BF16,
    FP32,
    Kernel,
    Work,
    elementwise,
    finite_check,
    local_elements,
    matmul,
    no_launch,
)
from bench.model.hardware import Collective
from bench.model.workload import ONE_DEVICE, Layout, Matrix
from dobb.distributed.placement import matrix_placement
from dobb.optim.muon import NS_STEPS

ENTRIES = ("muon",)  # the registry entries it prices (``cost_model``)

COMM_FORMULA = "m n (W-1)/W fp32 to owner + m n (W-1)/W bf16 back (DDP: m n (W-1) bf16)"


def state_formula() -> str:
    """``state_bytes`` per parameter of an ``(m, n)`` matrix, in words."""
    return "4 (momentum)"


def state_bytes(matrix: Matrix) -> float:
    """Bytes of state for one fp32 matrix: the momentum."""
    return matrix.numel * FP32


def newton_schulz_flops(m: int, n: int, steps: int = NS_STEPS) -> float:
    """FLOPs of ``newton_schulz`` on an ``(m, n)`` matrix: ``steps (4 a² b + 2 a³)``."""
    a, b = min(m, n), max(m, n)
    return steps * (4.0 * a * a * b + 2.0 * a**3)


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


def work(
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
        work.step += ops if first else [no_launch(k) for k in ops]
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


def owner_exchange_bytes(m: int, n: int, layout: str, world: int, split: bool) -> int:
    """This rank's bytes (averaged over the ``world`` ranks) of the owner exchange of one
    ``(m, n)`` matrix: under DDP the owner sends its result to the ``W - 1`` others in bf16;
    a ``split`` matrix travels to its owner in fp32 and back in bf16; else nothing."""
    if layout == "ddp":
        return BF16 * m * n * (world - 1) // world
    if split:
        return (FP32 + BF16) * m * n * (world - 1) // world**2
    return 0


def comm_bytes(opt, matrices, layout: str, world: int, step: int) -> int:
    """This rank's bytes in ``opt.step()`` (``matrices``: ``(param, group)`` pairs), every
    step: each matrix's owner exchange."""
    total = 0
    for p, _ in matrices:
        placement = matrix_placement(p)
        split = bool(placement.row_groups or placement.col_groups)
        total += owner_exchange_bytes(*p.shape, layout, world, split)
    return total
