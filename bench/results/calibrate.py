"""A cost-model profile of this machine, measured: ``Hardware`` for ``bench.model.costmodel``.

    python -m bench.results.calibrate calibrate --device cuda --out calibration.json
    python -m bench.results.calibrate eigh --device cuda --out eigh.json

``calibrate`` times
the kernels the optimizers launch, at the shapes of a GPT config: fp32 and bf16 GEMMs, the
rank-r products and updates of Dion, batched block products and ``eigh`` per block size
(fitted as ``a + b s³``), Householder QR and Cholesky, streaming and reduction bandwidth,
first-touch cost of fresh outputs, the fixed cost of each op kind, and what each
optimizer's call costs per matrix beyond its ops (``framework_overhead``). ``eigh``
compares eigh backends (``torch.linalg.eigh`` here and on the CPU, CuPy's batched Jacobi
solver on CUDA).
"""

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from bench.model.costmodel import predict, predict_hooks
from bench.model.costs.kernels import FP32
from bench.model.hardware import Hardware
from bench.model.workload import Matrix, dion_rank, hidden_matrices
from bench.optimizers import CALL_SETTINGS
from bench.results.calltime import OPTIMIZERS, device_name, optimizer_overrides, write_json
from bench.results.linear_stack import LinearStack, Progress, forward_backward
from bench.tools.records import stamped
from bench.tools.timing import timed
from dobb.optim.config import batched_by_default
from dobb.registry import build_optimizer, get_entry
from dobb.stats import BlockStatistics, block_stacks, statistics_hook

# The lab's choice for ``framework_overhead``: square matrices this small, where the ops
# cost almost nothing; Dobb in 4 blocks with no refresh after its first call (an interval
# no run reaches), Dion at rank fraction 1/4, MuonBP with block steps only
OVERHEAD_SIZE = 16
OVERHEAD_SETTINGS = dict(num_blocks=4, basis_interval=10**9, rank_fraction=1 / 4, period=None)


def _seconds(fn: Callable[[], object], device: torch.device, min_total: float = 0.2, min_reps=3):
    """Median seconds of ``fn`` after one warm-up, repeated until ``min_total`` has passed."""

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    sync()
    times: list[float] = []
    while len(times) < min_reps or sum(times) < min_total:
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
        if len(times) >= 200:
            break
    return statistics.median(times)


def _fit_latency_rate(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``t = L + F / rate`` over ``(flops, seconds)``; ``L >= 0``."""
    if len(points) == 1 or len({f for f, _ in points}) == 1:
        f, t = points[0]
        return 0.0, f / t
    n = len(points)
    mf = sum(f for f, _ in points) / n
    mt = sum(t for _, t in points) / n
    slope = sum((f - mf) * (t - mt) for f, t in points) / sum((f - mf) ** 2 for f, _ in points)
    latency = mt - slope * mf
    if slope <= 0 or latency < 0:  # noisy: fall back to rate through the largest point
        f, t = max(points)
        return 0.0, f / t
    return latency, 1.0 / slope


def _fit_eigh(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares ``t = a + b s³`` (``a, b >= 0``) over ``(s, seconds per block)``."""
    latency, rate = _fit_latency_rate([(float(s) ** 3, t) for s, t in points])
    return latency, 1.0 / rate


def calibrate(
    device: torch.device | str = "cpu",
    matrices: list[Matrix] | None = None,
    *,
    num_blocks: int = CALL_SETTINGS["num_blocks"],
    rank_fraction: float = CALL_SETTINGS["rank_fraction"],
    quick: bool = False,
    progress: Callable[[str], None] = lambda _: None,
) -> Hardware:
    """Measure a ``Hardware`` profile here: matmul rates, bmm rates and eigh time at the
    block sizes of ``matrices``, QR at Dion's shapes, memory bandwidth and per-op cost.

    ``quick``: small sizes and short timings (for tests; the numbers are rough)."""
    device = torch.device(device)
    matrices = matrices or hidden_matrices("gpt2", 1)
    gpu = device.type == "cuda"
    g = torch.Generator(device="cpu").manual_seed(0)
    min_total = 0.02 if quick else 0.2

    def seconds(fn):
        return _seconds(fn, device, min_total)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    meas: dict = {}
    size = 256 if quick else 4096 if gpu else 1024
    a, b = randn(size, size), randn(size, size)
    meas["gemm_fp32"] = 2.0 * size**3 / seconds(lambda: a @ b)
    # the products our optimizers run, at the shapes of ``matrices``: Newton-Schulz's
    # X Xᵀ in bf16, Dion's rank-r products B Q in fp32 and its in-place rank-r updates
    # W -= P Qᵀ (flop-weighted over the shapes)
    ns_flops = ns_time = skinny_flops = skinny_time = update_time = 0.0
    for rows, cols in sorted({(min(m.d_out, m.d_in), max(m.d_out, m.d_in)) for m in matrices}):
        x = randn(rows, cols, dtype=torch.bfloat16)
        ns_flops += 2.0 * rows * rows * cols
        ns_time += seconds(lambda x=x: x @ x.mT)
    for m in {(m.d_out, m.d_in, dion_rank(m, rank_fraction)): m for m in matrices}.values():
        r = dion_rank(m, rank_fraction)
        w, q, p = randn(m.d_out, m.d_in), randn(m.d_in, r), randn(m.d_out, r)
        skinny_flops += 2.0 * m.numel * r
        skinny_time += seconds(lambda w=w, q=q: w @ q)
        update_time += seconds(lambda w=w, q=q, p=p: w.addmm_(p, q.mT, alpha=-1e-6))
    meas["gemm_bf16"], meas["gemm_skinny"] = ns_flops / ns_time, skinny_flops / skinny_time
    meas["gemm_update"] = skinny_flops / update_time
    for kind in ("gemm_fp32", "gemm_bf16", "gemm_skinny", "gemm_update"):
        progress(f"{kind}: {meas[kind] / 1e9:.1f} GFLOP/s")
    blocks = sorted({s.size for m in matrices for s in block_stacks(m.d_in, num_blocks)})
    bmm, eigh = {}, {}
    rows = 256 if quick else 4096 if gpu else 1024
    for s in sorted(set(blocks) | {32, 64}):  # two small sizes anchor the fit of a + b s³
        x, q = randn(16, rows, s), randn(16, s, s)
        bmm[s] = 2.0 * 16 * rows * s * s / seconds(lambda x=x, q=q: torch.bmm(x, q))
        c = randn(16, s, s)
        c = c @ c.mT + s * torch.eye(s, device=device)
        eigh[s] = _seconds(lambda c=c: torch.linalg.eigh(c), device, 0.0, 2) / 16
        progress(f"s={s}: bmm {bmm[s] / 1e9:.1f} GFLOP/s, eigh {eigh[s] * 1e3:.3f} ms/block")
    qr_points = []
    for m_, r in sorted({(m.d_out, dion_rank(m, rank_fraction)) for m in matrices} | {(128, 64)}):
        p = randn(m_, r)
        flops = 4.0 * m_ * r * r - 4.0 / 3.0 * r**3
        qr_points.append((flops, seconds(lambda p=p: torch.linalg.qr(p))))
    qr_latency, qr_rate = _fit_latency_rate(qr_points)
    r = max(dion_rank(m, rank_fraction) for m in matrices)
    spd = randn(r, r)
    spd = spd @ spd.mT + r * torch.eye(r, device=device)
    small_latency = seconds(lambda: torch.linalg.cholesky(spd))
    progress(f"qr: latency {qr_latency * 1e6:.0f} us, {qr_rate / 1e9:.1f} GFLOP/s")
    # in-place streaming ops of the optimizers, on a tensor the size of the largest matrix
    # (CPU) or of 1 GiB (GPU: past its 50 MB L2); bytes = accesses x 4 n
    n = 1 << 20 if quick else 1 << 28 if gpu else max(1 << 20, max(m.numel for m in matrices))
    big, other, third = randn(n), randn(n), randn(n).abs_().add_(1)
    streams = {
        3: lambda: big.lerp_(other, 0.1),
        2: lambda: big.mul_(0.999),
        4: lambda: big.addcdiv_(other, third, value=1e-3),
    }
    times = {accesses: seconds(op) for accesses, op in streams.items()}
    in_place = times[3]
    fresh = seconds(lambda: big.lerp(other, 0.1))
    meas["memory_bandwidth"] = sum(a * n * FP32 for a in times) / sum(times.values())
    meas["alloc_s_per_byte"] = max(0.0, (fresh - in_place) / (n * FP32))
    # full reductions read at their own rate (on CPU slower than streaming ops)
    reductions = (lambda: torch.linalg.vector_norm(big), lambda: big.any())
    meas["reduction_bandwidth"] = 2 * n * FP32 / sum(seconds(op) for op in reductions)
    progress(
        f"memory: {meas['memory_bandwidth'] / 1e9:.1f} GB/s in place; a fresh output costs "
        f"{meas['alloc_s_per_byte'] * 1e9:.3f} s/GB more; reductions read "
        f"{meas['reduction_bandwidth'] / 1e9:.1f} GB/s"
    )
    # fixed cost per op kind: the op on tiny tensors (dispatch, allocation, launch)
    x, y, xb = randn(64, 64), randn(64, 64), randn(64, 64, dtype=torch.bfloat16)
    blocks = randn(2, 8, 8)
    tiny_ops = {
        "elementwise": lambda: x.lerp(y, 0.1),
        "reduction": lambda: torch.isfinite(x).all(),
        "gemm_fp32": lambda: torch.addmm(x, x, y, alpha=1e-3),
        "gemm_skinny": lambda: x @ y[:, :4],
        "gemm_update": lambda: y.addmm_(x[:, :4], x[:4, :], alpha=1e-6),
        "gemm_bf16": lambda: torch.addmm(xb, xb, xb, alpha=1e-3),
        "bmm_fp32": lambda: torch.bmm(blocks, blocks),
    }
    op_s = {}
    for kind, op in tiny_ops.items():

        def hundred(op=op):
            for _ in range(100):
                op()

        op_s[kind] = seconds(hundred) / 100
    progress("per-op cost (us): " + ", ".join(f"{k} {v * 1e6:.1f}" for k, v in op_s.items()))
    threads = f", {torch.get_num_threads()} threads" if not gpu else ""
    hardware = Hardware(
        name=f"{device_name(device)} ({device.type}{threads}, measured)",
        rates={
            "gemm_fp32": meas["gemm_fp32"],
            "gemm_skinny": meas["gemm_skinny"],
            "gemm_update": meas["gemm_update"],
            "gemm_bf16": meas["gemm_bf16"],
            "qr": qr_rate,
            "small": meas["gemm_fp32"],
        },
        bmm_rates=bmm,
        memory_bandwidth=meas["memory_bandwidth"],
        op_s=op_s,
        eigh_s=_fit_eigh(sorted(eigh.items())),
        latency_s={"qr": qr_latency, "small": small_latency},
        foreach=gpu,
        alloc_s_per_byte=0.0 if gpu else meas["alloc_s_per_byte"],
        reduction_bandwidth=meas["reduction_bandwidth"],
        source=f"calibrate() on {device}, torch {torch.__version__}",
        measurements={
            **meas,
            "eigh_s_per_block": eigh,
            "qr_points": qr_points,
            "cholesky_s": small_latency,
        },
    )
    matrix_s = framework_overhead(hardware, device, progress=progress)
    return replace(hardware, matrix_s=matrix_s)


def eigh_backends(
    device: torch.device | str = "cpu",
    stacks: tuple[tuple[int, int], ...] = ((80, 100), (16, 400)),
    progress: Callable[[str], None] = lambda _: None,
) -> dict:
    """Seconds per block of a batched eigh of ``count`` ``s x s`` blocks, by backend.

    Default stacks: one GPT-2 XL block's Dobb refresh (5 matrices x 16 blocks of 100, one
    x 16 of 400). Backends: ``torch.linalg.eigh`` on ``device`` and on the CPU, and CuPy's
    ``eigh`` on CUDA (batched Jacobi) when CuPy is importable.
    """
    device = torch.device(device)
    g = torch.Generator().manual_seed(0)
    out: dict = {"device": device_name(device), "threads": torch.get_num_threads(), "s": {}}
    for count, s in stacks:
        x = torch.randn(count, s, s, generator=g)
        cov = x @ x.mT + s * torch.eye(s)
        row = {}
        devices = {"torch_" + device.type: device, "torch_cpu": torch.device("cpu")}
        for label, dev in devices.items():
            c = cov.to(dev)
            row[label] = _seconds(lambda c=c: torch.linalg.eigh(c), dev, 0.0, 2) / count
        if device.type == "cuda":
            try:
                import cupy

                c = cupy.from_dlpack(cov.to(device))
                row["cupy_cuda"] = _seconds(lambda c=c: cupy.linalg.eigh(c), device, 0.0, 2) / count
            except Exception as error:  # CuPy missing or failing: record why
                row["cupy_cuda"] = f"{type(error).__name__}: {error}"
        out["s"][str(s)] = {"count": count, **row}
        progress(f"eigh of {count} blocks of {s}: {row}")
    return out


def framework_overhead(
    hardware, device, *, matrices: int = 8, calls: int = 10, progress: Progress = lambda _: None
) -> dict[str, float]:
    """Seconds per matrix (per layer for ``"hook"``) that a call costs beyond its ops.

    Times each optimizer on ``matrices`` tiny matrices (``OVERHEAD_SIZE`` square, with
    ``OVERHEAD_SETTINGS``), where the ops cost almost nothing, and subtracts the cost
    model's prediction of those calls (``hardware`` without this term; Dobb's steady call,
    MuonBP's block call): what remains is the Python loop, state lookups and the like,
    which the model then charges once per matrix.
    """
    device = torch.device(device)
    size, kw = OVERHEAD_SIZE, OVERHEAD_SETTINGS
    mats = [Matrix(f"m{i}", size, size) for i in range(matrices)]
    out = {}
    for name in OPTIMIZERS:
        stack = LinearStack(mats, size, device=device)
        forward_backward(stack, autocast=False)
        opt = build_optimizer(name, stack, **optimizer_overrides(name, **kw))
        times = []
        for i in range(calls + 2):  # two warm-up calls (lazy state, the first eigh)
            if get_entry(name).needs_statistics:
                with torch.enable_grad():
                    stack()
            if i >= 2:
                times.append(timed(opt.step, device))
            else:
                opt.step()
        launches = "per_shape" if batched_by_default(device) else "per_matrix"
        modeled = predict(name, mats, hardware, launches=launches, calls="other", **kw)["total"]
        out[name] = max(0.0, (statistics.median(times) - modeled) / matrices)
    stack = LinearStack(mats, size, device=device)
    blocks = block_stacks(size, kw["num_blocks"])
    stats = [BlockStatistics(blocks, torch.float32, device) for _ in mats]
    hooks = [statistics_hook(s) for s in stats]

    def run_hooks():
        for (key, layer), hook in zip(stack.layers.items(), hooks):
            hook(layer, (stack.inputs[stack.sources[key]],))

    run_hooks()
    with torch.enable_grad():
        measured = statistics.median(timed(run_hooks, device) for _ in range(calls))
    modeled = predict_hooks(mats, size, hardware, num_blocks=kw["num_blocks"])["hooks_s"]
    out["hook"] = max(0.0, (measured - modeled) / matrices)
    per_matrix = ", ".join(f"{k} {v * 1e6:.1f}" for k, v in out.items())
    progress(f"framework overhead (us per matrix): {per_matrix}")
    return out


def main(argv: list[str]) -> None:
    """``calibrate``: measure a ``Hardware`` profile; ``eigh``: time eigh backends."""
    if not argv or argv[0] not in ("calibrate", "eigh"):
        raise SystemExit("usage: python -m bench.results.calibrate {calibrate,eigh} [options]")
    parser = argparse.ArgumentParser(prog="python -m bench.results.calibrate " + argv[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--out", type=Path)
    if argv[0] == "calibrate":
        parser.add_argument("--config", default="gpt2-xl", help="shapes to calibrate at")
        parser.add_argument("--layers", type=int, default=1)
        parser.add_argument("--num-blocks", type=int, default=CALL_SETTINGS["num_blocks"])
        parser.add_argument("--rank-fraction", type=float, default=CALL_SETTINGS["rank_fraction"])
        parser.add_argument("--quick", action="store_true", help="small sizes, rough numbers")
    args = parser.parse_args(argv[1:])
    if args.threads:
        torch.set_num_threads(args.threads)
    log = lambda s: print(s, flush=True)  # noqa: E731
    if argv[0] == "calibrate":
        matrices = hidden_matrices(args.config, args.layers)
        kw = dict(num_blocks=args.num_blocks, rank_fraction=args.rank_fraction)
        hw = calibrate(args.device, matrices, quick=args.quick, progress=log, **kw)
        result = stamped(hw.to_json())  # its matrix_s is keyed by today's lab names
    else:
        result = {"eigh_backends": eigh_backends(args.device, progress=log)}
    if args.out:
        write_json(args.out, result)
    else:
        print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
