"""Cost model of one optimizer call: FLOPs, memory traffic, launches, factorizations, comm.

    python -m bench.model.costmodel --config gpt2-xl --world 32 [--hardware calib.json]

Each optimizer call is written out as the kernels our implementation launches (one entry
per op of ``dobb_update``, ``dion_update``, ``muon_update``, PyTorch's AdamW and the
shared finite-gradient check), each with its FLOPs and the bytes it reads plus writes, and
the collectives its distributed form issues: in ``bench.model.costs``, one module per
optimizer family, each naming the registry entries it prices. This module prices them. A
kernel costs

    launch + max(FLOPs / rate[kind], bytes / memory_bandwidth)          (a roofline per op)

(factorizations: launch + latency + FLOPs / rate; ``eigh``: a + b s³ per block), a
collective costs the α–β time of its algorithm (``Network``), and periodic work (Dobb's
basis refresh and statistics all-reduce, MuonBP's full step) is priced on the share of the
calls the library's schedule marks, counted over one period (``kernels.Work``). Rates
come from a ``Hardware`` profile: ``bench.results.calibrate`` measures one on the machine it
runs on (CPU or GPU); ``H100`` and ``H200`` hold datasheet values times stated efficiency
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
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.model.costs import MODELS, cost_model, entry_options, with_options
from bench.model.costs.dobb import CPU_SOLVER, hook_work
from bench.model.costs.kernels import FP32, Kernel, Work, matmul
from bench.model.hardware import H100, Hardware, Network
from bench.model.workload import ONE_DEVICE, Layout, Matrix, hidden_matrices, layout_of
from bench.tools.markdown import markdown_table
from dobb.eigensolve import AUTO_CUDA
from dobb.registry import OPTIMIZERS, PAPER_DOBB, get_entry

CATEGORIES = ("matmul", "memory", "factorization", "overhead", "comm_latency", "comm_bandwidth")

# The refresh Dobb's basis_method="auto" runs on CUDA when CuPy is not installed (the library's
# one constant, read here rather than restated)
CUDA_SOLVER = AUTO_CUDA

# Paper's reference points (arXiv 2610.39412, abstract): GPT-2 XL, FSDP on 32 H100,
# amortized optimizer-call time.
PAPER_XL_32_H100_MS = {"dobb_paper": 9.2, "dion": 124.1}


def state_bytes(name: str, matrix: Matrix, **options: Any) -> float:
    """Bytes of optimizer state our implementation keeps for one fp32 matrix
    (``bench.model.costs.<family>.state_bytes``; ``options`` it does not take are ignored)."""
    return with_options(cost_model(name).state_bytes, matrix, **entry_options(name, **options))


def rank_state_bytes(
    name: str, matrices: list[Matrix], layout: Layout = ONE_DEVICE, **options: Any
) -> float:
    """Bytes optimizer ``name`` keeps alive on the rank holding the largest piece of each
    matrix under ``layout``: its cost module's ``rank_state_bytes`` (state replicated
    across the ranks, e.g. Dobb's input bases, counted whole) or, for state that follows
    the parameter's rows and columns, ``state_bytes`` of the local piece."""
    model, options = cost_model(name), entry_options(name, **options)
    total = 0.0
    for m in matrices:
        rows, columns = layout.local(m)
        if hasattr(model, "rank_state_bytes"):
            total += with_options(model.rank_state_bytes, m, rows, columns, **options)
        else:
            piece = Matrix(m.name, rows, columns, m.source)
            total += with_options(model.state_bytes, piece, **options)
    return total


def state_formula(name: str, **options: Any) -> str:
    """``state_bytes`` of optimizer ``name`` per parameter, in words."""
    return with_options(cost_model(name).state_formula, **entry_options(name, **options))


def build_work(
    name: str, matrices: list[Matrix], *, layout: Layout = ONE_DEVICE, **options: Any
) -> Work:
    """The ``Work`` of optimizer ``name`` on ``matrices`` split as ``layout`` says: its cost
    model's ``work`` (``bench.model.costs``) with the entry's hyperparameters and those of
    ``options`` it takes, e.g. ``num_blocks``, ``basis_interval``, ``solver`` and
    ``refresh`` (Dobb), ``rank_fraction``, ``orthogonalize`` and ``collectives`` (Dion),
    ``period`` and ``row_blocks`` (MuonBP), ``launches`` (``"per_shape"``: batched, ours;
    ``"per_matrix"``: the implementation before batching), ``foreach`` (AdamW)."""
    options = entry_options(name, layout=layout, **options)
    return with_options(cost_model(name).work, matrices, **options)


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


def predict(
    name: str,
    matrices: list[Matrix],
    hardware: Hardware,
    *,
    world: int = 1,
    layout: Layout | None = None,
    network: Network | None = None,
    calls: str = "amortized",
    **options,
) -> dict[str, float]:
    """Predicted amortized seconds per call by category, plus ``"total"``.

    ``layout`` (default: FSDP ``Shard(0)`` over ``world`` ranks; see ``layout_of``) on
    ``network`` (default: ``Network()``). ``calls``: ``"periodic"`` or ``"other"`` predicts
    one call of that kind instead (Dobb's refresh or steady call, MuonBP's full or block
    call; ``Work``). ``options`` go to ``build_work``.
    """
    layout = layout or Layout(shard=world)
    if layout.world > 1 and network is None:
        network = Network()
    # Dobb's basis_method="auto": eigh on CPU, CUDA_SOLVER on CUDA (foreach: a GPU profile)
    options.setdefault("solver", CUDA_SOLVER if hardware.foreach else CPU_SOLVER)
    work = build_work(name, matrices, layout=layout, foreach=hardware.foreach, **options)
    terms = work_time(replace(work, calls=calls), hardware, network)
    # Python work per matrix (state lookups, building the batches), calibrated per matrix;
    # an entry the profile has not timed takes a timed entry's of its class (Dobb's first)
    per_matrix = hardware.matrix_s.get(name)
    if per_matrix is None:
        cls = get_entry(name).cls
        timed = [n for n in hardware.matrix_s if n in OPTIMIZERS and get_entry(n).cls is cls]
        per_matrix = hardware.matrix_s[timed[0]] if timed else 0.0
    terms["overhead"] += per_matrix * len(matrices)
    terms["total"] = sum(terms[c] for c in CATEGORIES)
    return terms


def predict_hooks(
    matrices,
    tokens: int,
    hardware: Hardware,
    *,
    num_blocks: int = PAPER_DOBB["num_blocks"],
    forward_kind=None,
    low_precision: bool = False,
    share_inputs: bool = True,
):
    """Predicted seconds of the statistics hooks of one forward, and of forward+backward
    (``low_precision``: 16-bit Gram products, as under autocast on a GPU)."""

    def seconds(kernels):
        return sum(sum(kernel_time(k, hardware).values()) for k in kernels)

    work = hook_work(
        matrices,
        tokens,
        num_blocks=num_blocks,
        low_precision=low_precision,
        share_inputs=share_inputs,
    )
    hooks = seconds(work)
    hooks += hardware.matrix_s.get("hook", 0.0) * len(matrices)
    fb = forward_backward_work(matrices, tokens, forward_kind or "gemm_fp32")
    return {"hooks_s": hooks, "forward_backward_s": seconds(fb)}


# --------------------------------------------------------------------------- tables
def format_terms(rows: dict[str, dict[str, float]], unit: float = 1e-3) -> str:
    """A Markdown table of per-category times (ms by default), one row per entry."""
    columns = (*CATEGORIES, "total")
    cells = [[label, *(f"{t[c] / unit:.2f}" for c in columns)] for label, t in rows.items()]
    return markdown_table(["", *columns], cells, align="l" + "r" * len(columns), pad=False)


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
    rows = {name: predict(name, matrices, hw, layout=layout, network=network) for name in MODELS}
    print(f"{args.config}, {layout} on {hw.name}, {args.algorithm} collectives (ms)")
    print(format_terms(rows))


if __name__ == "__main__":
    main(sys.argv[1:])
