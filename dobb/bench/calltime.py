"""Optimizer-call time on the hidden matrices of a GPT: Dobb, Dion, Muon, MuonBP, AdamW.

    python -m dobb.bench.calltime --config gpt2-xl --layers 2 --repeats 5 --out calltime.json
    python -m dobb.bench.calltime calibrate --device cuda --out calibration.json
    python -m dobb.bench.calltime eigh --device cuda --out eigh.json

Single process, one device (``--device cuda`` works; every timed region is bracketed by
``torch.cuda.synchronize``). The workload is a ``LinearStack``: every hidden matrix of the
first ``--layers`` blocks of a GPT config (q, k, v, attention and MLP projections) as an
``nn.Linear`` fed a fixed token batch (``--tokens`` rows with correlated features).

What is measured:

- **Call time**, amortized over one period of the optimizer's periodic work. Dobb's period
  is ``--basis-interval`` (k) calls, exactly one of which refreshes the bases (batched
  ``eigh``), so the refresh is included; MuonBP's is its ``--period`` (P) calls, one full
  Newton-Schulz step and P - 1 block steps (on one device its blocks are
  ``--row-blocks`` row tiles, emulating FSDP over that many ranks); Dion, Muon and AdamW
  do the same work every call, so their period is ``--calls`` calls. Each repeat gives one
  number per optimizer (the mean call time over its period); we report the median and the
  spread (min, quartiles, max) over repeats. The optimizers run interleaved, in a rotated
  order each repeat, after one warm-up period each (lazy state, the first ``eigh``).
  Gradients come from one real backward pass of the stack (``G = Cᵀ X`` with a fixed
  random output cotangent ``C``) and stay fixed. Before every Dobb call a real forward
  pass of every layer on the token batch feeds Dobb's statistics hooks; that forward is
  timed apart, not as part of the call.
- **Statistics hooks' share** of forward+backward: the stack's forward+backward with and
  without hooks (alternated), and the hooks alone (``BlockStatistics.add`` on each input).
- **Optimizer-state bytes per parameter** of the hidden matrices.
- ``calibrate``: the cost model's ``Hardware`` profile of this machine (matmul, bmm, eigh,
  QR rates, memory bandwidth, per-op and per-matrix overheads); ``eigh``: eigh backends.

All optimizers share one set of parameters (their updates do not change the work), so
memory is parameters + gradients + the optimizers' states. Sharded timing (FSDP2, HSDP,
TP over gloo ranks) is ``dobb.bench.calltime_sharded``, which runs ``time_optimizers`` on
every rank.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import torch
from torch import Tensor, nn

from dobb.bench.costmodel import (
    FP32,
    OPTIMIZERS,
    Hardware,
    Matrix,
    dion_rank,
    hidden_matrices,
    predict,
    predict_hooks,
)
from dobb.blocks import block_stacks
from dobb.optim.registry import build_optimizer, get_entry
from dobb.stats import BlockStatistics, statistics_hook

Progress = Callable[[str], None]


class LinearStack(nn.Module):
    """Every matrix as a bias-free ``nn.Linear`` fed a fixed input of its width.

    ``forward()`` returns ``sum_l <layer_l(X), C>``: ``X`` is the token batch of the
    layer's input width (shared by layers of equal width, as q, k and v share theirs) and
    ``C`` a fixed cotangent of its output width, so ``W.grad = Cᵀ X``. The inputs require
    grad, so the backward pass also computes input gradients, as a real network's does.
    """

    def __init__(self, matrices: list[Matrix], tokens: int, *, device=None, seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.matrices = matrices
        # "blocks.0.attn.q" -> "blocks_0_attn_q": ModuleDict keys may not contain dots
        self.layers = nn.ModuleDict(
            {
                m.name.replace(".", "_"): nn.Linear(m.d_in, m.d_out, bias=False, device=device)
                for m in matrices
            }
        )
        widths = sorted({m.d_in for m in matrices})
        self.inputs = {d: correlated_tokens(tokens, d, gen).to(device) for d in widths}
        for x in self.inputs.values():
            x.requires_grad_(True)
        outs = sorted({m.d_out for m in matrices})
        self.cotangents = {d: torch.randn(tokens, d, generator=gen).to(device) for d in outs}

    def forward(self) -> Tensor:
        loss = 0.0
        for layer in self.layers.values():
            y = layer(self.inputs[layer.in_features])  # (N, d_out)
            loss = loss + (y * self.cotangents[layer.out_features]).sum()
        return loss

    def clear_input_grads(self) -> None:
        for x in self.inputs.values():
            x.grad = None


def correlated_tokens(tokens: int, width: int, gen: torch.Generator) -> Tensor:
    """``(tokens, width)`` activations with unequal feature scales and a shared low-rank
    part, so that the second moment has a spread spectrum (as real activations do)."""
    scales = torch.randn(width, generator=gen).mul_(0.5).exp_()
    shared = torch.randn(tokens, 16, generator=gen) @ torch.randn(16, width, generator=gen)
    return torch.randn(tokens, width, generator=gen) * scales + 0.5 * shared


# --------------------------------------------------------------------------- timing
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of ``fn()``, with the device synchronized before and after."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def spread(values: list[float]) -> dict[str, float]:
    """Median, quartiles, min and max of ``values``."""
    if len(values) >= 2:
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    else:
        q1 = q3 = values[0]
    return {
        "median": statistics.median(values),
        "q1": q1,
        "q3": q3,
        "min": min(values),
        "max": max(values),
    }


def autocast_context(device: torch.device, autocast: bool):
    return torch.autocast(device.type, dtype=torch.bfloat16) if autocast else nullcontext()


def forward_backward(stack: LinearStack, autocast: bool) -> None:
    stack.zero_grad(set_to_none=True)
    stack.clear_input_grads()
    device = next(stack.parameters()).device
    with torch.enable_grad(), autocast_context(device, autocast):
        loss = stack()
    loss.backward()


def hook_overhead(
    stack: LinearStack,
    *,
    num_blocks: int,
    repeats: int,
    autocast: bool = False,
    progress: Progress = lambda _: None,
) -> dict:
    """Forward+backward of ``stack`` with and without statistics hooks, alternated, and
    the hooks alone. Leaves the gradients of the last pass in ``.grad``."""
    device = next(stack.parameters()).device
    stats = {
        layer: BlockStatistics(block_stacks(layer.in_features, num_blocks), torch.float32, device)
        for layer in stack.layers.values()
    }

    def with_hooks():
        handles = [m.register_forward_pre_hook(statistics_hook(s)) for m, s in stats.items()]
        try:
            forward_backward(stack, autocast)
        finally:
            for h in handles:
                h.remove()
            for s in stats.values():
                s.reset()

    def hooks_alone():
        for layer, s in stats.items():
            s.add(stack.inputs[layer.in_features])
        for s in stats.values():
            s.reset()

    plain, hooked, alone = [], [], []
    stack.train()
    for i in range(repeats + 1):  # the first round warms up
        t_plain = timed(lambda: forward_backward(stack, autocast), device)
        t_hooked = timed(with_hooks, device)
        t_alone = timed(hooks_alone, device)
        if i:
            plain.append(t_plain)
            hooked.append(t_hooked)
            alone.append(t_alone)
            progress(
                f"hooks {i}/{repeats}: fwd+bwd {t_plain * 1e3:.1f} ms, with hooks "
                f"{t_hooked * 1e3:.1f} ms, hooks alone {t_alone * 1e3:.1f} ms"
            )
    forward_backward(stack, autocast)  # gradients for the optimizers
    plain_s, hooked_s, alone_s = spread(plain), spread(hooked), spread(alone)
    return {
        "forward_backward_s": plain_s,
        "forward_backward_hooks_s": hooked_s,
        "hooks_alone_s": alone_s,
        "share_difference": (hooked_s["median"] - plain_s["median"]) / hooked_s["median"],
        "share_hooks_alone": alone_s["median"] / (plain_s["median"] + alone_s["median"]),
    }


def optimizer_overrides(
    name: str,
    num_blocks: int,
    basis_interval: int,
    rank_fraction: float,
    period: int = 5,
    row_blocks: int = 1,
) -> dict:
    """Constructor arguments of the comparison (everything else: registry defaults).

    The arguments are named as ``costmodel.predict``'s, so one dict feeds both."""
    return {
        "dobb": {"num_blocks": num_blocks, "basis_interval": basis_interval},
        "dion": {"rank_fraction": rank_fraction},
        "muonbp": {"period": period, "row_blocks": row_blocks},
    }.get(name, {})


def calls_per_period(name: str, options: dict, calls: int) -> int:
    """Calls over which ``name``'s periodic work repeats (``options``: its overrides)."""
    if name == "dobb":
        return options["basis_interval"]
    if name == "muonbp" and options["period"]:
        return options["period"]
    return calls


# the first call of a period is the periodic one: (its key, the other calls' key)
PERIODIC_CALLS = {
    "dobb": ("refresh_call_s", "steady_call_s"),
    "muonbp": ("full_call_s", "block_call_s"),
}


def state_bytes_measured(optimizer: torch.optim.Optimizer, params: list[Tensor]) -> int:
    """Bytes of every tensor in the optimizer state of ``params``."""
    total = 0
    for p in params:
        for value in optimizer.state[p].values():
            if isinstance(value, Tensor):
                total += value.numel() * value.element_size()
    return total


def time_optimizers(
    stack: LinearStack,
    names: tuple[str, ...] = OPTIMIZERS,
    *,
    repeats: int = 5,
    warmup: int = 1,
    calls: int = 1,
    num_blocks: int = 16,
    basis_interval: int = 10,
    rank_fraction: float = 1 / 16,
    period: int = 5,
    row_blocks: int = 1,
    autocast: bool = False,
    progress: Progress = lambda _: None,
    on_repeat: Callable[[dict], None] = lambda _: None,
    distributed: dict[str, dict] | None = None,
) -> dict:
    """Interleaved call times of ``names`` on ``stack`` (whose ``.grad`` must be set).

    ``period`` and ``row_blocks`` are MuonBP's. ``distributed``: further constructor
    arguments per optimizer (e.g. Dobb's ``data_parallel``) when ``stack`` is sharded.

    Returns ``{name: {...}}`` with per-repeat amortized call times and their spread,
    Dobb's refresh and MuonBP's full-step calls apart from their other calls, Dobb's
    forward-with-hooks time, and the state bytes. ``on_repeat`` gets the partial result
    after every repeat.
    """
    device = next(stack.parameters()).device
    params = list(stack.parameters())
    if any(p.grad is None for p in params):
        raise ValueError("every parameter needs a .grad (run forward_backward first)")
    stack.train()
    kw = dict(
        num_blocks=num_blocks,
        basis_interval=basis_interval,
        rank_fraction=rank_fraction,
        period=period,
        row_blocks=row_blocks,
    )
    overrides = {name: optimizer_overrides(name, **kw) for name in names}
    optimizers = {
        name: build_optimizer(name, stack, **overrides[name], **(distributed or {}).get(name, {}))
        for name in names
    }
    results = {name: {"period_calls": [], "amortized_s": [], "forward_s": []} for name in names}

    def forward_for_statistics():
        with torch.enable_grad(), autocast_context(device, autocast):
            stack()  # the hooks accumulate X_bᵀ X_b; the graph is dropped

    def period(name: str) -> tuple[list[float], list[float]]:
        optimizer = optimizers[name]
        stats = get_entry(name).needs_statistics
        calls_s, forward_s = [], []
        for _ in range(calls_per_period(name, kw, calls)):
            if stats:
                forward_s.append(timed(forward_for_statistics, device))
            calls_s.append(timed(optimizer.step, device))
        return calls_s, forward_s

    for name in names:
        for _ in range(warmup):
            calls_s, _ = period(name)
            progress(f"warm-up {name}: {sum(calls_s) / len(calls_s) * 1e3:.1f} ms/call")
    for r in range(repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            calls_s, forward_s = period(name)
            res = results[name]
            res["period_calls"].append(calls_s)
            res["amortized_s"].append(sum(calls_s) / len(calls_s))
            res["forward_s"] += forward_s
        progress(
            f"repeat {r + 1}/{repeats}: "
            + ", ".join(f"{n} {results[n]['amortized_s'][-1] * 1e3:.1f} ms" for n in names)
        )
        on_repeat(summarize(results, optimizers, params))
    return summarize(results, optimizers, params)


def summarize(results: dict, optimizers: dict, params: list[Tensor]) -> dict:
    """Spread of each optimizer's amortized call time, ratios to Dobb, state bytes."""
    numel = sum(p.numel() for p in params)
    out = {}
    for name, res in results.items():
        if not res["amortized_s"]:
            continue
        entry = {**res, "call_s": spread(res["amortized_s"])}
        if name in PERIODIC_CALLS:  # call 0 of every period: Dobb's refresh, MuonBP's full step
            first, others = PERIODIC_CALLS[name]
            entry[first] = spread([calls[0] for calls in res["period_calls"]])
            rest = [t for calls in res["period_calls"] for t in calls[1:]]
            if rest:
                entry[others] = spread(rest)
        if res["forward_s"]:
            entry["forward_with_hooks_s"] = spread(res["forward_s"])
        state = state_bytes_measured(optimizers[name], params)
        entry["state_bytes"] = state
        entry["state_bytes_per_param"] = state / numel
        out[name] = entry
    if "dobb" in out:
        base = out["dobb"]["call_s"]["median"]
        for entry in out.values():
            entry["ratio_vs_dobb"] = entry["call_s"]["median"] / base
    return out


# --------------------------------------------------------------------------- calibrate
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


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU model from ``/proc/cpuinfo``."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def calibrate(
    device: torch.device | str = "cpu",
    matrices: list[Matrix] | None = None,
    *,
    num_blocks: int = 16,
    rank_fraction: float = 1 / 16,
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

    Times each optimizer on ``matrices`` tiny (16 x 16) matrices, where the ops cost
    almost nothing, and subtracts the cost model's prediction (``hardware`` without this
    term): what remains is the Python loop, state lookups and the like, which the
    model then charges once per matrix. Dobb runs without refreshes here (``k`` huge),
    MuonBP with block steps only.
    """
    device = torch.device(device)
    mats = [Matrix(f"m{i}", 16, 16) for i in range(matrices)]
    kw = dict(num_blocks=4, basis_interval=10**9, rank_fraction=1 / 4, period=None)
    out = {}
    for name in OPTIMIZERS:
        stack = LinearStack(mats, 16, device=device)
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
        modeled = predict(name, mats, hardware, **kw)["total"]
        out[name] = max(0.0, (statistics.median(times) - modeled) / matrices)
    stack = LinearStack(mats, 16, device=device)
    stats = [BlockStatistics(block_stacks(16, 4), torch.float32, device) for _ in mats]
    hooks = [statistics_hook(s) for s in stats]

    def run_hooks():
        for layer, hook in zip(stack.layers.values(), hooks):
            hook(layer, (stack.inputs[16],))

    run_hooks()
    with torch.enable_grad():
        measured = statistics.median(timed(run_hooks, device) for _ in range(calls))
    modeled = predict_hooks(mats, 16, hardware, num_blocks=4)["hooks_s"]
    out["hook"] = max(0.0, (measured - modeled) / matrices)
    per_matrix = ", ".join(f"{k} {v * 1e6:.1f}" for k, v in out.items())
    progress(f"framework overhead (us per matrix): {per_matrix}")
    return out


# --------------------------------------------------------------------------- run
def run(
    config: str = "gpt2-xl",
    layers: int | None = 1,
    *,
    names: tuple[str, ...] = OPTIMIZERS,
    tokens: int = 512,
    repeats: int = 5,
    warmup: int = 1,
    calls: int = 1,
    num_blocks: int = 16,
    basis_interval: int = 10,
    rank_fraction: float = 1 / 16,
    period: int = 5,
    row_blocks: int = 4,
    device: str = "cpu",
    autocast: bool = False,
    seed: int = 0,
    out: Path | None = None,
    command: str | None = None,
    progress: Progress = lambda _: None,
) -> dict:
    """Build the stack, measure hooks and call times, return (and write) the JSON record."""
    started = time.perf_counter()
    device_ = torch.device(device)
    torch.manual_seed(seed)
    matrices = hidden_matrices(config, layers)
    stack = LinearStack(matrices, tokens, device=device_, seed=seed)
    record = {
        "meta": {
            "config": config,
            "layers": layers,
            "matrices": len(matrices),
            "params": sum(m.numel for m in matrices),
            "shapes": sorted({(m.d_out, m.d_in) for m in matrices}),
            "tokens": tokens,
            "repeats": repeats,
            "warmup_periods": warmup,
            "calls": calls,
            "num_blocks": num_blocks,
            "basis_interval": basis_interval,
            "rank_fraction": rank_fraction,
            "period": period,
            "row_blocks": row_blocks,
            "device": device,
            "device_name": device_name(device_),
            "autocast": "bf16" if autocast else "none",
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "cpus": os.cpu_count(),
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "command": command,
            "complete": False,
        }
    }

    def write(partial: dict | None = None) -> None:
        if partial is not None:
            record["optimizers"] = partial
        record["meta"]["wall_s"] = time.perf_counter() - started
        if out is not None:
            write_json(out, record)

    progress(f"{config}: {len(matrices)} matrices, {record['meta']['params'] / 1e6:.1f}M params")
    record["hooks"] = hook_overhead(
        stack, num_blocks=num_blocks, repeats=repeats, autocast=autocast, progress=progress
    )
    write()
    record["optimizers"] = time_optimizers(
        stack,
        names,
        repeats=repeats,
        warmup=warmup,
        calls=calls,
        num_blocks=num_blocks,
        basis_interval=basis_interval,
        rank_fraction=rank_fraction,
        period=period,
        row_blocks=row_blocks,
        autocast=autocast,
        progress=progress,
        on_repeat=write,
    )
    record["meta"]["complete"] = True
    write()
    return record


def write_json(path: Path, data: dict) -> None:
    """Write ``data`` to ``path`` through a temporary file (a reader never sees half)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def format_table(record: dict) -> str:
    """A Markdown table of the call times (ms), their spread, ratios and state bytes."""
    lines = [
        "| optimizer | calls / period | median ms | IQR ms | min–max ms | × Dobb | state B/param |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, e in record["optimizers"].items():
        c = {k: v * 1e3 for k, v in e["call_s"].items()}
        calls = len(e["period_calls"][0])
        lines.append(
            f"| {name} | {calls} | {c['median']:.1f} | {c['q1']:.1f}–{c['q3']:.1f} | "
            f"{c['min']:.1f}–{c['max']:.1f} | {e.get('ratio_vs_dobb', float('nan')):.2f} | "
            f"{e['state_bytes_per_param']:.3f} |"
        )
    lines.append("")  # notes below the table
    dobb = record["optimizers"].get("dobb")
    if dobb and "steady_call_s" in dobb:
        lines.append(
            f"Dobb: refresh call {dobb['refresh_call_s']['median'] * 1e3:.1f} ms, other calls "
            f"{dobb['steady_call_s']['median'] * 1e3:.1f} ms (medians); forward with hooks "
            f"before each call {dobb['forward_with_hooks_s']['median'] * 1e3:.1f} ms (not in "
            "the call time)."
        )
    muonbp = record["optimizers"].get("muonbp")
    if muonbp and "block_call_s" in muonbp:
        lines.append(
            f"MuonBP: full-step call {muonbp['full_call_s']['median'] * 1e3:.1f} ms, block-step "
            f"calls {muonbp['block_call_s']['median'] * 1e3:.1f} ms (medians)."
        )
    h = record.get("hooks")
    if h:
        lines.append(
            f"Statistics hooks: forward+backward {h['forward_backward_s']['median'] * 1e3:.1f} ms "
            f"without, {h['forward_backward_hooks_s']['median'] * 1e3:.1f} ms with hooks "
            f"(share {h['share_difference']:.1%}); hooks alone "
            f"{h['hooks_alone_s']['median'] * 1e3:.1f} ms (share {h['share_hooks_alone']:.1%})."
        )
    return "\n".join(lines).rstrip()


def calibrate_main(argv: list[str]) -> None:
    """``calibrate``: measure a ``Hardware`` profile; ``eigh``: time eigh backends."""
    parser = argparse.ArgumentParser(prog="python -m dobb.bench.calltime " + argv[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--out", type=Path)
    if argv[0] == "calibrate":
        parser.add_argument("--config", default="gpt2-xl", help="shapes to calibrate at")
        parser.add_argument("--layers", type=int, default=1)
        parser.add_argument("--num-blocks", type=int, default=16)
        parser.add_argument("--rank-fraction", type=float, default=1 / 16)
        parser.add_argument("--quick", action="store_true", help="small sizes, rough numbers")
    args = parser.parse_args(argv[1:])
    if args.threads:
        torch.set_num_threads(args.threads)
    log = lambda s: print(s, flush=True)  # noqa: E731
    if argv[0] == "calibrate":
        matrices = hidden_matrices(args.config, args.layers)
        kw = dict(num_blocks=args.num_blocks, rank_fraction=args.rank_fraction)
        result = calibrate(args.device, matrices, quick=args.quick, progress=log, **kw).to_json()
    else:
        result = {"eigh_backends": eigh_backends(args.device, progress=log)}
    if args.out:
        write_json(args.out, result)
    else:
        print(json.dumps(result, indent=1))


def main(argv: list[str]) -> None:
    if argv and argv[0] in ("calibrate", "eigh"):
        calibrate_main(argv)
        return
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Also: 'calibrate' (a cost-model profile of this machine) and 'eigh' "
        "(eigh backends), each with --device, --threads, --out.",
    )
    parser.add_argument("--config", default="gpt2-xl", help="GPT config (dobb.train.model)")
    parser.add_argument("--layers", type=int, default=1, help="transformer blocks to include")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="comma-separated")
    parser.add_argument("--tokens", type=int, default=512, help="rows of the token batch")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1, help="warm-up periods per optimizer")
    parser.add_argument("--calls", type=int, default=1, help="calls per period (not Dobb)")
    parser.add_argument("--num-blocks", type=int, default=16)
    parser.add_argument("--basis-interval", type=int, default=10, help="Dobb's k")
    parser.add_argument("--rank-fraction", type=float, default=1 / 16)
    parser.add_argument("--period", type=int, default=5, help="MuonBP's full-step period P")
    parser.add_argument(
        "--row-blocks",
        type=int,
        default=4,
        help="MuonBP's row tiles on one device (emulates FSDP over that many ranks)",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--autocast", choices=("none", "bf16"), default="none")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="JSON output (rewritten after every repeat)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    names = tuple(n.strip() for n in args.optimizers.split(",") if n.strip())
    for name in names:
        get_entry(name)  # ValueError for unknown names
    if args.repeats < 1 or args.calls < 1 or args.warmup < 0:
        raise ValueError("--repeats and --calls must be >= 1, --warmup >= 0")
    record = run(
        args.config,
        args.layers,
        names=names,
        tokens=args.tokens,
        repeats=args.repeats,
        warmup=args.warmup,
        calls=args.calls,
        num_blocks=args.num_blocks,
        basis_interval=args.basis_interval,
        rank_fraction=args.rank_fraction,
        period=args.period,
        row_blocks=args.row_blocks,
        device=args.device,
        autocast=args.autocast == "bf16",
        seed=args.seed,
        out=args.out,
        command="python -m dobb.bench.calltime " + " ".join(argv),
        progress=lambda s: print(s, flush=True),
    )
    m = record["meta"]
    print(
        f"\n{m['config']} x {m['layers']} layers ({m['params'] / 1e6:.1f}M params), "
        f"{m['device_name']}, torch {m['torch']}, {m['wall_s']:.0f} s"
    )
    print(format_table(record))


if __name__ == "__main__":
    main(sys.argv[1:])
