"""A batched refresh solver's kernels, counted from the code rather than typed by hand.

``solver_kernels(method, size, count)`` runs ``dobb.eigensolve.basis_solver(method)`` (the
guarded solver Dobb's refresh calls) on stacks of one and of two ``size x size`` blocks
(fake tensors: no arithmetic) under a dispatch mode that records every aten op: its FLOPs
(products and factorizations, from the shapes) and the bytes it reads plus writes (views
and allocations move nothing, as in ``bench.tools.opcount``). The solvers are batched, so
every op's FLOPs and bytes are affine in the number of blocks ``n``:
``f(n) = f(1) + (n - 1) (f(2) - f(1))``; both traces must dispatch the same op sequence
(one kernel each on a GPU), or the solver is not batched and this raises. ``passes`` is
the solver's traffic in units of one pass over the block stack (read or write of ``n s²``
fp32 values).
"""

import contextlib
import functools
from dataclasses import dataclass, replace

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from bench.model.costs.kernels import FP32, Kernel
from bench.tools.opcount import NO_TRAFFIC, _nbytes
from dobb.eigensolve import basis_solver

PRODUCTS = {"mm", "bmm", "addmm", "baddbmm"}  # 2 m k n FLOPs per (m, k) @ (k, n)
FACTORIZATIONS = {"linalg_cholesky_ex", "linalg_solve_triangular", "triangular_solve"}
REDUCTIONS = {
    "sum",
    "mean",
    "amax",
    "amin",
    "max",
    "min",
    "all",
    "any",
    "argmax",
    "argmin",
    "linalg_vector_norm",
    "norm",
    "sort",
    "argsort",
    "topk",
}


@dataclass(frozen=True)
class Op:
    """One recorded aten op: its name, FLOPs and bytes read plus written."""

    name: str
    flops: float
    bytes: float
    alloc: float


def op_flops(name: str, args, out) -> float:
    """FLOPs of a product (``2 m k n`` per batch entry) or a factorization on ``(b, s, s)``
    (Cholesky ``b s³ / 3``; a triangular solve ``s`` multiply-adds per right-hand-side
    element); 0 for anything else."""
    if name in PRODUCTS:  # the first factor is args[-2] (addmm, baddbmm: after the input)
        return 2.0 * out.numel() * args[-2].shape[-1]
    if name == "linalg_cholesky_ex":
        return args[0].numel() * args[0].shape[-1] / 3.0
    if name == "linalg_solve_triangular":  # (A, B)
        return args[1].numel() * args[0].shape[-1]
    if name == "triangular_solve":  # (B, A)
        return args[0].numel() * args[1].shape[-1]
    return 0.0


class _Recorder(TorchDispatchMode):
    """Appends an ``Op`` for every aten op that launches a kernel (views, allocations and
    the profiler's own ops excluded)."""

    def __init__(self):
        super().__init__()
        self.ops: list[Op] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if func.namespace == "aten" and not func.is_view and name not in NO_TRAFFIC:
            written = _nbytes(out)
            alloc = 0.0 if name.endswith("_") else float(written)  # in-place: no fresh output
            moved = _nbytes((args, kwargs)) + written
            self.ops.append(Op(name, op_flops(name, args, out), float(moved), alloc))
        return out


def trace(method: str, size: int, blocks: int, *, fake: bool = True) -> list[Op]:
    """The ops of one warm ``basis_solver(method)`` call on ``blocks`` blocks of ``size``.

    ``fake`` (the default): on ``FakeTensorMode`` tensors, which carry shapes and dtypes
    but compute nothing, so a trace at ``s = 2048`` costs no ``s³`` work; the batched
    solvers' ops do not depend on the values. Else on random PSD blocks and an orthonormal
    start (``tests/bench/test_costmodel.py`` holds the two traces equal). A first call on a
    real ``2 x 2`` block beforehand makes the solver's one-time state (``BlockFailures``'
    counters), which the fake call then updates as a warm one would.
    """
    solve = basis_solver(method, torch.device("cpu"))
    solve(torch.eye(2)[None], torch.eye(2)[None])
    with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext():
        gen = None if fake else torch.Generator().manual_seed(size)
        x = torch.randn(blocks, size, 2 * size, generator=gen)
        cov = x @ x.mT / (2 * size)
        basis = torch.linalg.qr(torch.randn(blocks, size, size, generator=gen)).Q
        with _Recorder() as recorder:
            solve(cov, basis)
    return recorder.ops


def kind_of(name: str) -> str:
    """The ``Kernel`` kind (rate and launch cost) of aten op ``name``."""
    if name in PRODUCTS:
        return "bmm_fp32"
    if name in FACTORIZATIONS:
        return "small"
    return "reduction" if name in REDUCTIONS else "elementwise"


@functools.cache
def _affine(method: str, size: int) -> tuple[tuple[Kernel, Kernel], ...]:
    """Per op, the ``Kernel`` of one block and the increment per further block."""
    one, two = trace(method, size, 1), trace(method, size, 2)
    if [op.name for op in one] != [op.name for op in two]:
        raise ValueError(
            f"basis method {method!r} dispatches different ops for 1 and 2 blocks: it is not "
            "batched, so solver_kernels cannot price it (model it by hand, as eigh)"
        )
    pairs = []
    for a, b in zip(one, two):
        kind = kind_of(a.name)
        block = size if kind == "bmm_fp32" else 0
        base = Kernel(kind, flops=a.flops, bytes=a.bytes, block=block, alloc=a.alloc)
        step = Kernel(
            kind, flops=b.flops - a.flops, bytes=b.bytes - a.bytes, alloc=b.alloc - a.alloc
        )
        pairs.append((base, step))
    return tuple(pairs)


def solver_kernels(method: str, size: int, count: int) -> list[Kernel]:
    """The kernels of ``basis_solver(method)`` on ``count`` blocks of ``size`` (see module)."""
    extra = count - 1
    return [
        replace(
            base,
            flops=base.flops + extra * step.flops,
            bytes=base.bytes + extra * step.bytes,
            alloc=base.alloc + extra * step.alloc,
        )
        for base, step in _affine(method, size)
    ]


def passes(method: str, size: int) -> float:
    """Bytes the solver moves per block, in passes over one fp32 ``size x size`` block."""
    return sum(step.bytes for _, step in _affine(method, size)) / (size * size * FP32)
