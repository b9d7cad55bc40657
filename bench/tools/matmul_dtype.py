"""The dtype a machine multiplies fastest in, for the Muon family's Newton-Schulz iteration.

Keller Jordan's Muon runs Newton-Schulz in bf16 because a GPU multiplies bf16 natively. A
CPU without AVX-512 BF16 or AMX emulates bf16 matmuls, several times slower than fp32 ones,
so the call-time benchmarks time the Muon family in the dtype that is fastest on the
machine that times them, measured here, and say which one. fp32 is the iteration's exact
form; bf16 its fast one.
"""

import statistics
import time
from pathlib import Path

import torch

BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of native bf16 matmuls
CANDIDATES = ("bfloat16", "float32")


def cpu_flags() -> set[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def bf16_native(device: torch.device) -> bool:
    """Whether ``device`` multiplies bf16 in hardware: a CUDA GPU of compute capability 8 or
    more, or a CPU with one of ``BF16_CPU_FLAGS``."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device)[0] >= 8
    return bool(cpu_flags() & set(BF16_CPU_FLAGS))


def matmul_ms(dtype: torch.dtype, device: torch.device, rows: int = 512, repeats: int = 5):
    """Median ms of one Newton-Schulz Gram product ``X Xᵀ`` of a ``rows x 4 rows`` matrix."""
    x = torch.randn(rows, 4 * rows, device=device).to(dtype)
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        x @ x.mT
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times[1:])


def fastest_ns_dtype(device: torch.device, choice: str = "fastest") -> dict:
    """The Newton-Schulz dtype for ``device``: ``choice`` itself, or with ``"fastest"`` the
    faster of ``CANDIDATES`` as measured; with the timings and whether bf16 is native."""
    timings = {name: matmul_ms(getattr(torch, name), device) for name in CANDIDATES}
    chosen = min(timings, key=timings.get) if choice == "fastest" else choice
    if chosen not in CANDIDATES:
        raise ValueError(f"ns_dtype must be 'fastest' or one of {CANDIDATES}, got {choice!r}")
    return {
        "ns_dtype": chosen,
        "chosen_by": "measured" if choice == "fastest" else "given",
        "matmul_ms": timings,
        "bf16_native": bf16_native(device),
    }
