"""The cost-model sections of ``benchmarks/RESULTS.md``: predictions only, nothing measured.

GPT-2 XL under FSDP on ``XL_WORLD`` H100 beside the paper (``paper_section``, read by
``discussion``), the world-size and width sweeps (``sweep_tables``, read by ``scaling``),
the layouts (``layout_table``) and the constants the model assumes (``constants_section``).
Every number in the prose is computed from the model or read from its constants.
"""

import math

from bench.model import hardware
from bench.model.costmodel import (
    CUDA_SOLVER,
    PAPER_XL_32_H100_MS,
    build_work,
    format_terms,
    predict,
)
from bench.model.costs.traced import passes, solver_kernels
from bench.model.hardware import H100, H200, Hardware, Network, captured
from bench.model.workload import (
    WIDTHS,
    XL_WORLD,
    Layout,
    hidden_matrices,
    transformer_matrices,
)
from bench.optimizers import CALL_SETTINGS, in_table, lab_entry
from bench.tools.markdown import markdown_table
from dobb.eigensolve import JACOBI_SWEEPS, JACOBI_WIDTH
from dobb.stats import block_stacks

WORLDS = (8, 16, 32, 64, 128, 256, 512, 1024)
SETTINGS = CALL_SETTINGS  # the hyperparameters of every prediction here
OPTIMIZERS = in_table("calltime")  # the optimizers predicted: the call-time table's
# sensitivity rows: another option of ours, or our implementation before batching
VARIANTS = {
    "Dobb, refresh replicated (shard_refresh=False)": ("dobb_paper", dict(refresh="replicated")),
    "Dobb, eigh refresh (torch.linalg.eigh per block)": ("dobb_paper", dict(solver="eigh")),
    "Dobb, Jacobi refresh (the CUDA default before #32)": ("dobb_paper", dict(solver="jacobi")),
    "Dobb before batching (per-matrix ops, eigh)": (
        "dobb_paper",
        dict(launches="per_matrix", solver="eigh"),
    ),
    "Muon before batching (per-matrix ops)": ("muon", dict(launches="per_matrix")),
    "MuonBP before batching (per-matrix ops)": ("muonbp", dict(launches="per_matrix")),
    "BlockMuon (period None)": ("muonbp", dict(period=None)),
}
UNBATCHED = {"dobb_paper": "Dobb before batching (per-matrix ops, eigh)"}  # dashed in the plots
CAPTURED = ("dobb_paper", "muon")  # also priced as a replayed CUDA graph (hardware.captured)
# Published figures the assumed constants of ``bench.model.hardware`` rest on (its comments
# give the same sources); quoted beside the constants, never used by the model.
NVLINK4_BYTES_S = 450e9  # per direction per GPU (NVLink 4 datasheet)
IB_NDR_BYTES_S = 50e9  # InfiniBand NDR, one ConnectX-7 per GPU (datasheet)
NCCL_TESTS_BUSBW = (350e9, 480e9)  # nccl-tests bus bandwidth on one node of H100, typical
H200_HBM_BYTES_S = 4.8e12  # NVIDIA H200 datasheet
H200_GEMM_SEEN = (8192, 790e12)  # bf16 square product on an H200 of this workplace: size, FLOP/s
# pytorch/pytorch#174674: seconds per block of size s (torch.linalg.eigh on CUDA, CuPy's
# syevjBatched)
ISSUE_174674 = {"s": 100, "eigh": 1.8e-3, "syevj": 17e-6}


def ms(seconds: float) -> str:
    """Milliseconds as the reports print them (two decimals below 100 ms, else one)."""
    return f"{seconds * 1e3:.2f}" if seconds < 0.1 else f"{seconds * 1e3:.1f}"


def xl_predict(name: str, matrices, hw: Hardware, **options) -> dict[str, float]:
    """``predict`` of ``name`` with the ``SETTINGS`` its lab entry takes in the call-time
    runs (``calltime_settings``; the recommended Dobb keeps its own blocks), ``options``
    over them."""
    taken = {k: v for k, v in SETTINGS.items() if k in lab_entry(name).calltime_settings}
    return predict(name, matrices, hw, **{**taken, **options})


def predict_variant(label, matrices, hw, **options):
    """``predict`` of the ``VARIANTS`` row ``label``."""
    name, variant = VARIANTS[label]
    return xl_predict(name, matrices, hw, **options, **variant)


def fsdp_cluster(world: int = XL_WORLD) -> str:
    """``"32 GPUs (4 nodes of 8)"``, from ``Network``'s node size."""
    node = Network().gpus_per_node
    return f"{world} GPUs ({math.ceil(world / node)} nodes of {node})"


def paper_section(hw: Hardware = H100) -> tuple[str, dict[str, dict[str, float]]]:
    """GPT-2 XL, FSDP over ``XL_WORLD`` GPUs on ``hw``, by category and beside the paper;
    and the rows (seconds by category) for ``discussion``."""
    matrices = hidden_matrices("gpt2-xl")
    world, rows = XL_WORLD, {}
    for algorithm in ("hierarchical", "ring"):
        net = Network(algorithm=algorithm)
        for name in OPTIMIZERS:
            rows[f"{name} ({algorithm})"] = xl_predict(name, matrices, hw, world=world, network=net)
    for label in VARIANTS:
        rows[label + " (hierarchical)"] = predict_variant(
            label, matrices, hw, world=world, network=Network()
        )
    for name in CAPTURED:
        rows[captured_label(name)] = xl_predict(
            name, matrices, captured(hw), world=world, network=Network()
        )
    for algorithm in ("hierarchical", "ring"):
        rows[f"Dion, {dion_all_reduces()} all-reduces per matrix ({algorithm})"] = xl_predict(
            "dion",
            matrices,
            hw,
            world=world,
            network=Network(algorithm=algorithm),
            collectives="per_matrix",
        )
    dobb, dion = rows["dobb_paper (hierarchical)"]["total"], rows["dion (hierarchical)"]["total"]
    before = rows[UNBATCHED["dobb_paper"] + " (hierarchical)"]["total"]
    replayed = rows[captured_label("dobb_paper")]["total"]
    paper = PAPER_XL_32_H100_MS

    def versus(label, model, reference):
        return [label, reference, ms(model), f"{model / 1e-3 / reference:.1f}x"]

    table = markdown_table(
        ["", "paper (ms)", "model, our implementation (ms)", "model / paper"],
        [
            versus("Dobb", dobb, paper["dobb_paper"]),
            versus("Dobb, captured (CUDA graph replay)", replayed, paper["dobb_paper"]),
            versus("Dion", dion, paper["dion"]),
            ["Dion / Dobb", f"{paper['dion'] / paper['dobb_paper']:.1f}", f"{dion / dobb:.2f}", ""],
            versus(UNBATCHED["dobb_paper"], before, paper["dobb_paper"]),
        ],
        "lrrr",
        pad=False,
    )
    head = (
        f"GPT-2 XL (all {WIDTHS['gpt2-xl'][1]} blocks, {len(matrices)} hidden matrices), FSDP "
        f"over {fsdp_cluster()}, profile `{hw.name}`, per-call ms by category:"
    )
    return "\n\n".join([head, format_terms(rows), table]), rows


def captured_label(name: str) -> str:
    """The row of ``name`` priced as a replayed CUDA graph in ``paper_section``."""
    return f"{name}, captured (CUDA graph replay) (hierarchical)"


def dion_all_reduces(collectives: str = "batched") -> int:
    """All-reduces of one Dion step on GPT-2 XL under FSDP over ``XL_WORLD`` ranks."""
    work = build_work(
        "dion",
        hidden_matrices("gpt2-xl"),
        layout=Layout(shard=XL_WORLD),
        collectives=collectives,
        **SETTINGS,
    )
    return sum(c.count for c in work.step_comm if c.kind == "all_reduce")


def layouts(world: int = XL_WORLD) -> dict[str, Layout]:
    """``world`` GPUs split four ways; every group of a node's GPUs lies inside a node."""
    node = Network().gpus_per_node
    return {
        f"FSDP {world}": Layout(shard=world),
        f"HSDP {world // node} x {node}": Layout(shard=node, replicate=world // node),
        f"DDP {world}": Layout(replicate=world),
        f"TP {node} (one node)": Layout(tensor=node),
    }


def layout_table(hw: Hardware = H100) -> str:
    """Predicted ms per call of GPT-2 XL under each of ``layouts()``."""
    xl, split = hidden_matrices("gpt2-xl"), layouts()
    rows = [
        [name, *(ms(xl_predict(name, xl, hw, layout=lay)["total"]) for lay in split.values())]
        for name in OPTIMIZERS
    ]
    return (
        "Predicted ms per call, GPT-2 XL, by layout (H100 model, two-level collectives; HSDP "
        "shards inside a node and replicates across nodes; TP: Megatron's plan):\n\n"
        + markdown_table(["optimizer", *split], rows, "l" + "r" * len(split), pad=False)
    )


def sweep_tables(hw: Hardware = H100) -> tuple[str, dict, dict]:
    """World-size and width sweeps (H100, hierarchical), as Markdown and raw series."""
    net = Network()
    models = {"xl": hidden_matrices("gpt2-xl")}
    models |= {d: transformer_matrices(d, layers) for d, layers in WIDTHS.values()}

    def series(mats, world):
        """Seconds per call of every optimizer, and of Dobb before batching, on ``mats``."""
        out = {n: xl_predict(n, mats, hw, world=world, network=net)["total"] for n in OPTIMIZERS}
        for label in UNBATCHED.values():
            out[label] = predict_variant(label, mats, hw, world=world, network=net)["total"]
        return out

    by_world = [series(models["xl"], p) for p in WORLDS]
    by_width = [series(models[d], XL_WORLD) for d, _ in WIDTHS.values()]
    worlds = {name: [point[name] for point in by_world] for name in by_world[0]}
    widths = {name: [point[name] for point in by_width] for name in by_width[0]}

    def table(columns, series):
        rows = [[n, *map(ms, ts)] for n, ts in series.items()]
        return markdown_table(["optimizer", *columns], rows, "l" + "r" * len(columns), pad=False)

    text = (
        "Predicted ms per call, GPT-2 XL under FSDP, by number of GPUs:\n\n"
        + table(WORLDS, worlds)
        + f"\n\nPredicted ms per call on {XL_WORLD} GPUs, by model (width d, layers L):\n\n"
        + table(WIDTHS, widths)
    )
    return text, worlds, widths


def scaling(worlds: dict[str, list[float]], widths: dict[str, list[float]]) -> str:
    """What drives each curve of the sweeps (``sweep_tables``' series), with their numbers."""
    first, last = WORLDS[0], WORLDS[-1]
    dobb, dion, muon = worlds["dobb_paper"], worlds["dion"], worlds["muon"]
    before = worlds[UNBATCHED["dobb_paper"]]
    turn = WORLDS[min(range(len(WORLDS)), key=muon.__getitem__)]
    models, nb, period = list(WIDTHS), SETTINGS["num_blocks"], SETTINGS["period"]
    return f"""\
What drives each curve in the model (H100 profile, two-level collectives; dashed: Dobb before
batching, per-matrix ops and a per-block eigh):

- Dobb (ours: same-shape matrices batched, `shard_refresh=True`, the batched `{CUDA_SOLVER}`
  refresh of `basis_method="auto"` on CUDA) goes from {ms(dobb[0])} ms at {first} GPUs to
  {ms(dobb[-1])} ms at {last}: its update is row-local, each rank refreshes 1/p of the
  blocks, and what remains is a fixed number of launches per shape and per refresh.
  Before batching the same model gives {ms(before[0])} ms and {ms(before[-1])} ms.
- Dion goes from {ms(dion[0])} to {ms(dion[-1])} ms: its small factorizations (QR of the
  k x r sketch, Cholesky, two triangular solves per matrix) are replicated on every rank,
  and the latency of its {dion_all_reduces()} all-reduce rounds grows with the number of nodes.
- Muon is lowest at {turn} GPUs ({ms(min(muon))} ms): the whole-matrix Newton-Schulz work
  divides among more owners, then its two all-to-alls pay (p - 1) latencies.
- MuonBP (P = {period}) runs Newton-Schulz on every rank's shard of every matrix on its block
  steps, batched per shape; its full steps' all-to-alls grow with p.
- AdamW falls as 1/p: elementwise on the local shard, no communication.
- With width ({XL_WORLD} GPUs, {models[0]} to {models[-1]}: Dobb {ms(widths["dobb_paper"][0])} to
  {ms(widths["dobb_paper"][-1])} ms), Dobb's block size grows (s = d/{nb} and 4d/{nb} with {nb}
  blocks) and its refresh with s³; a fixed block size would keep it linear in d. Muon's
  whole-matrix Newton-Schulz grows as d³ on the owner; MuonBP's block steps as d³/p.
- By layout (last table): HSDP shares Dobb's refresh only among the ranks of a replica (the
  innermost data axis), and pure TP has no data axis, so every TP rank refreshes all of its
  blocks, those of column-parallel matrices identical on every TP rank. Sharing the refresh
  over the TP ranks too (their statistics agree) is an improvement we have not made. DDP
  keeps whole matrices on every rank, so every update is whole-matrix."""


def discussion(rows: dict[str, dict[str, float]]) -> str:
    """How to read the GPT-2 XL prediction, with its numbers (``rows`` of ``paper_section``)."""
    dobb, dion = rows["dobb_paper (hierarchical)"], rows["dion (hierarchical)"]
    replicated = rows["Dobb, refresh replicated (shard_refresh=False) (hierarchical)"]
    eigh = rows["Dobb, eigh refresh (torch.linalg.eigh per block) (hierarchical)"]
    jacobi = rows["Dobb, Jacobi refresh (the CUDA default before #32) (hierarchical)"]
    replayed = rows[captured_label("dobb_paper")]
    before = rows[UNBATCHED["dobb_paper"] + " (hierarchical)"]
    muonbp, muon = rows["muonbp (hierarchical)"], rows["muon (hierarchical)"]
    paper = PAPER_XL_32_H100_MS

    def share(terms, *keys):
        return sum(terms[k] for k in keys) / terms["total"]

    xl = hidden_matrices("gpt2-xl")
    shapes = len({(m.d_out, m.d_in) for m in xl})
    refresh = build_work("dobb_paper", xl, layout=Layout(shard=XL_WORLD), **SETTINGS, solver="eigh")
    blocks_per_rank = sum(k.count for k in refresh.refresh if k.kind == "eigh")
    rounds, issued = dion_all_reduces(), dion_all_reduces("per_matrix")
    per_matrix = ms(rows[f"Dion, {rounds} all-reduces per matrix (hierarchical)"]["total"])
    per_matrix_ring = ms(rows[f"Dion, {rounds} all-reduces per matrix (ring)"]["total"])
    dion_fixed = share(dion, "comm_latency", "factorization", "overhead")
    return f"""\
How to read this (and where and why it disagrees with the paper):

- The model describes *our* implementation: matrices of one shape updated together (a few
  batched kernels per shape: {shapes} shapes in GPT-2 XL), some Python work per matrix, each
  op with a fixed cost; at a refresh each rank's 1/{XL_WORLD} of the blocks through the batched
  `{CUDA_SOLVER}` solver (`basis_method="auto"` on CUDA), then one all-gather per block
  size; Dion's {rounds} all-reduce rounds per step each sent for all matrices in one buffer
  (`dobb.distributed.reduce.all_reduce_`), its ops per matrix. The paper's implementation
  is not described in its abstract. All of it is a *prediction* from assumed H100 constants.
- **Dion**: {ms(dion["total"])} ms predicted against the paper's {paper["dion"]} ms
  ({dion["total"] * 1e3 / paper["dion"]:.1f}x). Latency-bound terms (small factorizations,
  per-op costs, collective latency) are {dion_fixed:.0%} of it; its communication is
  {ms(dion["comm_latency"] + dion["comm_bandwidth"])} ms. An implementation that issues the
  {rounds} all-reduces per matrix ({issued} for {len(xl)} matrices) would take {per_matrix} ms
  with NCCL-like two-level collectives and {per_matrix_ring} ms on one flat ring.
  The agreement with the paper rests on assumed latencies of small cuSOLVER calls and of
  PyTorch ops (the GPU section measures both on an H200).
- **Dobb**: {ms(dobb["total"])} ms predicted against the paper's {paper["dobb_paper"]} ms
  ({dobb["total"] * 1e3 / paper["dobb_paper"]:.1f}x; Muon {ms(muon["total"])} ms): matmul and memory
  {ms(dobb["matmul"] + dobb["memory"])} ms, per-op costs {ms(dobb["overhead"])} ms, the
  refresh's small factorizations {ms(dobb["factorization"])} ms and the statistics
  all-reduce and bases all-gather {ms(dobb["comm_latency"] + dobb["comm_bandwidth"])} ms
  (amortized). {refresh_words()}
  Replayed as CUDA graphs (steady and refresh step captured, {launch_us()} us a kernel) it
  is {ms(replayed["total"])} ms (per-op costs {ms(replayed["overhead"])} ms). With the
  closed-form Jacobi refresh (the CUDA default before #32) it is {ms(jacobi["total"])} ms;
  with `torch.linalg.eigh` ({blocks_per_rank} blocks per rank, one cuSOLVER call each)
  {ms(eigh["total"])} ms; before batching (per-matrix ops and eigh) {ms(before["total"])} ms;
  without sharding the refresh (`shard_refresh=False`) {ms(replicated["total"])} ms.
- **MuonBP**: {ms(muonbp["total"])} ms (Muon: {ms(muon["total"])} ms), of which
  {ms(muonbp["overhead"])} ms are per-op costs: shard-local Newton-Schulz on a rank's rows
  is cheap (a = d_out / p).
- So the predicted Dion/Dobb ratio ({dion["total"] / dobb["total"]:.1f} for our batched code,
  {dion["total"] / before["total"]:.2f} before batching, {paper["dion"] / paper["dobb_paper"]:.1f}
  in the paper) hinges on assumed constants: per-op and factorization latencies above all.
  Read the absolute numbers as order-of-magnitude and the breakdown as the useful part.
"""


def refresh_words() -> str:
    """The ``CUDA_SOLVER`` refresh's kernels and passes at GPT-2 XL's block sizes, in words
    (counted from the code: ``costs.traced``)."""
    sizes = sorted(
        {
            s.size
            for m in hidden_matrices("gpt2-xl")
            for s in block_stacks(m.d_in, SETTINGS["num_blocks"])
        }
    )
    counts = "; ".join(
        f"s = {s}: {len(solver_kernels(CUDA_SOLVER, s, 1))} kernels, "
        f"{passes(CUDA_SOLVER, s):.0f} passes over the stack"
        for s in sizes
    )
    return f"Its `{CUDA_SOLVER}` solve, counted from the code, launches ({counts})."


def launch_us() -> str:
    """The assumed per-kernel cost of a replayed CUDA graph, in us."""
    return f"{hardware.GRAPH_LAUNCH_S * 1e6:g}"


# the prose of ``constants_section``; every number is a slot filled from the constants
CONSTANTS_TEXT = """\
Cost-model constants (`bench/model/hardware.py`; values from datasheets are marked, every
other value is our assumption):

- H100 SXM5 compute (datasheet): dense bf16 {bf16} TFLOP/s, fp32 {fp32} TFLOP/s (PyTorch keeps TF32
  off for matmul by default, so fp32 products run on CUDA cores); efficiency assumed {gemm} for
  GEMMs (an {size}³ bf16 product ran at {seen} TFLOP/s on an H200 of this workplace) and
  {bmm} for the fp32 block products of Dobb.
- HBM3 {hbm} TB/s (datasheet) x {hbm_eff} (assumed; section 7 holds a measured profile's copy
  bandwidth when there is one). H200: {h200} TB/s (datasheet) x {h200_eff}.
- Per-op cost {launch} us (PyTorch eager dispatch + launch; assumed); {graph} us a kernel in
  a replayed CUDA graph (assumed; NVIDIA's "Getting Started with CUDA Graphs" blog measured
  under a microsecond between short kernels on a V100).
- eigh per s x s block on CUDA through `torch.linalg.eigh`: {a} ms + {b} s · s³ (PyTorch
  loops cuSOLVER syevd over the batch; pytorch/pytorch#174674 measured {eigh} ms a block at
  s={s}; the s³ term is assumed). The batched refreshes are modeled op by op: `cholqr` (the
  CUDA default) from its ops as dispatched (`bench.model.costs.traced`), the closed-form
  Jacobi (`dobb.eigensolve.jacobi_basis`) by hand: {sweeps} sweeps of rounds, each solving
  all slot pairs (up to {slot} x {slot}) at once (CuPy's syevjBatched, same issue: {syevj} us a
  block at s={s}).
- Small factorizations on GPU (QR, Cholesky, triangular solves): {qr} us (QR) / {small} us
  latency + FLOPs at {factor} TFLOP/s (assumed).
- Links: NVLink 4 {nvlink} GB/s per direction per GPU (datasheet), {intra} GB/s used
  (nccl-tests bus bandwidth on {node} H100 is typically {low}-{high} GB/s); InfiniBand NDR
  {ib_bits} Gb/s = {ib} GB/s per GPU (datasheet), {inter} GB/s used; α = {a_intra} us per ring
  step inside a node, {a_inter} us between nodes (assumed); {node} GPUs per node.
- Collectives: ring all-reduce 2(p-1)α + 2(p-1)/p · n/β; ring all-gather (p-1)α +
  (p-1)/p · n/β; hierarchical = reduce-scatter + all-gather inside the node on n, ring across
  nodes on n/{node}; all-to-all (p-1)α + max(intra-node bytes / β_intra, inter-node bytes /
  β_inter).
"""


def constants_section() -> str:
    """``CONSTANTS_TEXT`` with the constants of ``bench.model.hardware`` read from it and the
    published figures they rest on."""
    h, net = hardware, Network()
    numbers = {  # in the text's units
        "bf16": h.H100_BF16_PEAK / 1e12,
        "fp32": h.H100_FP32_PEAK / 1e12,
        "gemm": h.GEMM_EFFICIENCY,
        "size": H200_GEMM_SEEN[0],
        "seen": H200_GEMM_SEEN[1] / 1e12,
        "bmm": h.BMM_EFFICIENCY,
        "hbm": h.H100_HBM / 1e12,
        "hbm_eff": h.HBM_EFFICIENCY,
        "h200": H200_HBM_BYTES_S / 1e12,
        "h200_eff": H200.memory_bandwidth / H200_HBM_BYTES_S,
        "launch": h.GPU_LAUNCH_S * 1e6,
        "graph": h.GRAPH_LAUNCH_S * 1e6,
        "a": h.EIGH_TORCH_CUDA_S[0] * 1e3,
        "b": h.EIGH_TORCH_CUDA_S[1],
        "eigh": ISSUE_174674["eigh"] * 1e3,
        "s": ISSUE_174674["s"],
        "sweeps": JACOBI_SWEEPS,
        "slot": 2 * JACOBI_WIDTH,
        "syevj": ISSUE_174674["syevj"] * 1e6,
        "qr": h.GPU_FACTOR_LATENCY_S["qr"] * 1e6,
        "small": h.GPU_FACTOR_LATENCY_S["small"] * 1e6,
        "factor": h.GPU_FACTOR_RATE / 1e12,
        "nvlink": NVLINK4_BYTES_S / 1e9,
        "intra": net.beta_intra / 1e9,
        "node": net.gpus_per_node,
        "low": NCCL_TESTS_BUSBW[0] / 1e9,
        "high": NCCL_TESTS_BUSBW[1] / 1e9,
        "ib_bits": IB_NDR_BYTES_S * 8 / 1e9,
        "ib": IB_NDR_BYTES_S / 1e9,
        "inter": net.beta_inter / 1e9,
        "a_intra": net.alpha_intra * 1e6,
        "a_inter": net.alpha_inter * 1e6,
    }
    return CONSTANTS_TEXT.format(**{k: f"{x:g}" for k, x in numbers.items()})
