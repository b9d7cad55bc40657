"""Timing of the eigenbasis solvers: ``python -m bench.results.eigensolve``.

Every ``refresh_bases`` method (``BASIS_METHODS``, and the first-refresh ``COLD_METHODS``) on
a refresh as Dobb meets it (``refresh_problem``): median seconds, aten ops and host reads
per call (``OpCounter``: the profiler's reads, nested ones included), worst eigen-residual
and orthogonality error.
"""

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import UTC, datetime

import torch
from torch import Tensor

from bench.tools.opcount import OpCounter
from dobb.eigensolve import BASIS_METHODS, COLD_METHODS, orthogonality_error, refresh_bases

COMMAND = "python -m bench.results.eigensolve "


def refresh_problem(n: int, s: int, device: str | torch.device, seed: int = 0):
    """A refresh as Dobb meets it: ``(C, Q_prev, C_prev)``, ``(n, s, s)`` float32 each.

    ``C_prev`` has eigenvalues log-spaced over 3 decades and random eigenvectors, ``Q_prev`` is
    its eigenbasis, and ``C = 0.6 C_prev + 0.4 S`` with ``S`` a sample second moment of
    ``4 s`` tokens drawn from ``C_prev`` (the EMA weight of new statistics over 10 steps of
    ``beta2 = 0.95``).
    """
    gen = torch.Generator().manual_seed(seed)
    vectors = torch.linalg.qr(torch.randn(n, s, s, generator=gen, dtype=torch.float64)).Q
    values = torch.logspace(0, -3, s, dtype=torch.float64)
    c_prev = (vectors * values) @ vectors.mT
    x = torch.randn(n, 4 * s, s, generator=gen, dtype=torch.float64) * values.sqrt()
    x = x @ vectors.mT
    cov = 0.6 * c_prev + 0.4 * x.mT @ x / (4 * s)
    basis = vectors.flip(-1)
    return tuple(t.float().to(device) for t in (cov, basis, c_prev))


def eigen_residual(cov: Tensor, q: Tensor) -> Tensor:
    """``||C Q - Q diag(Qᵀ C Q)||_F / ||C||_F`` of each block, in float64 (``(n,)``)."""
    cov, q = cov.double(), q.double()
    rayleigh = (q.mT @ cov @ q).diagonal(0, 1, 2)
    return (cov @ q - q * rayleigh[:, None, :]).norm(dim=(1, 2)) / cov.norm(dim=(1, 2))


def benchmark(
    sizes, device: str, methods=BASIS_METHODS + COLD_METHODS, repeats: int = 5, on_row=None
) -> list[dict]:
    """Time ``refresh_bases`` per method on ``refresh_problem(n, s)`` for ``(s, n)`` in ``sizes``.

    Per row: median and all seconds of ``repeats`` timed calls after one warm-up call (CUDA
    synchronised around each), the aten ops and host reads one call dispatches, and the
    worst block's eigen-residual and orthogonality error. A method that cannot run here
    (``cupy`` without CuPy or CUDA) gets its error instead. ``on_row(rows)`` is called after
    every row (``main`` rewrites its JSON there, so a timeout keeps the rows done).
    """
    rows = []
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else lambda: None
    for s, n in sizes:
        cov, basis, _ = refresh_problem(n, s, device)
        for method in methods:
            row = {"method": method, "s": s, "n": n, "device": device}
            try:
                refresh_bases([cov], [basis], method)
            except Exception as err:  # reported in its row, so that the other methods still run
                rows.append({**row, "error": f"{type(err).__name__}: {err}"})
                if on_row:
                    on_row(rows)
                continue
            times = []
            for _ in range(repeats):
                sync()
                start = time.perf_counter()
                (q,) = refresh_bases([cov], [basis], method)
                sync()
                times.append(time.perf_counter() - start)
            with OpCounter() as counter:
                refresh_bases([cov], [basis], method)
            rows.append(
                {
                    **row,
                    "seconds": statistics.median(times),
                    "all_seconds": times,
                    "ops": counter.total,
                    "host_reads": counter.host_reads,
                    "residual": eigen_residual(cov, q).max().item(),
                    "orthogonality": orthogonality_error(q.double()).max().item(),
                }
            )
            print(json.dumps(rows[-1]), file=sys.stderr)
            if on_row:
                on_row(rows)
    return rows


def main(argv=None) -> None:
    """``python -m bench.results.eigensolve --device cuda --sizes 100:144,400:16 --out F.json``"""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sizes", default="64:16,128:16", help="s:n pairs, comma-separated")
    parser.add_argument("--methods", default=",".join(BASIS_METHODS + COLD_METHODS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None, help="JSON file (default: stdout)")
    args = parser.parse_args(argv)
    sizes = [tuple(int(v) for v in pair.split(":")) for pair in args.sizes.split(",")]
    device = torch.device(args.device)
    result = {
        "command": COMMAND + " ".join(sys.argv[1:] if argv is None else argv),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": platform.platform(),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "rows": [],
    }

    def write(rows):
        if args.out:
            result["rows"] = rows
            with open(args.out, "w") as f:
                f.write(json.dumps(result, indent=1) + "\n")

    rows = benchmark(sizes, args.device, args.methods.split(","), args.repeats, on_row=write)
    if not args.out:
        print(json.dumps({**result, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
