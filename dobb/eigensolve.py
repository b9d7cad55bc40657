"""Eigenbases of stacks of symmetric PSD blocks: the reference ``eigh`` and batched solvers.

Dobb refreshes an orthonormal eigenbasis ``Q_b`` of every block second moment ``C_b``
(``(n, s, s)`` stacks) every ``basis_interval`` steps. ``torch.linalg.eigh`` is the reference
and the fastest choice on CPU, but on CUDA it runs one solver call per matrix for
``32 < s <= 512`` (``torch.linalg.qr`` loops too). The solvers here use batched kernels only
(bmm, Cholesky, triangular solve, elementwise), so their kernel count per call depends on
``s`` and never on ``n``, and start from the previous basis:

- ``jacobi_basis``: cyclic Jacobi sweeps on ``A = Qᵀ C Q`` in round-robin order, each round
  rotating ``s/2`` disjoint index pairs of every block at once.
- ``cholqr_basis``: orthogonal iteration ``Q <- orth(C Q)`` (what ``power_qr`` does), with a
  shifted Cholesky-QR3 in place of Householder QR.
- ``cupy_eigenbasis``: CuPy's ``eigh`` on the whole stack through DLPack (optional, CUDA).

Both warm-started solvers keep the basis of blocks whose ``Qᵀ C Q`` is already nearly diagonal
(Distributed Shampoo's criterion), and ``guarded`` recomputes with float64 ``eigh`` any block
whose result is non-finite or not orthonormal. ``refresh_bases`` is the one dispatch point
(``python -m bench.results.eigensolve`` times every method).
"""

import contextlib
import functools
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

BASIS_METHODS = ("eigh", "power_qr", "jacobi", "cholqr", "cupy", "auto")
"""Accepted ``method`` names of ``refresh_bases`` (Dobb's ``basis_method``):

``"eigh"`` the reference ``eigenbasis``; ``"power_qr"`` one orthogonal-iteration step with
Householder QR (``power_qr_basis``); ``"jacobi"`` ``jacobi_basis``; ``"cholqr"``
``cholqr_basis``; ``"cupy"`` ``cupy_eigenbasis``; ``"auto"`` ``"eigh"`` on CPU tensors and
``AUTO_CUDA`` on CUDA tensors. The last three are wrapped in ``guarded``.
"""
AUTO_CUDA = "jacobi"  # batched kernels only; eigh and qr loop over matrices on CUDA

EIGH_JITTER = 1e-7  # relative diagonal jitter: C + JITTER * mean(diag C) * I
JACOBI_SWEEPS = 3  # per refresh: from a basis one refresh old, 3 reach eigh's fp32 residual
JACOBI_WIDTH = 16  # slot width: (32, 32) subproblems, the largest CUDA eigh batches
CHOLQR_ITERS = 1  # orthogonal-iteration steps per refresh, as power_qr (SOAP)
CHOLQR_SHIFT = 1e-3  # C + shift mean(diag C) I: positive definite, same eigenvectors
SKIP_TOL = 1e-5  # keep Q_b when ||offdiag(Qᵀ C Q)||_F <= SKIP_TOL ||Qᵀ C Q||_F
ORTHO_TOL = 1e-3  # guard: a basis with max |QᵀQ - I| above this is recomputed


def eigenbasis(cov: Tensor) -> Tensor:
    """Orthonormal eigenvectors of each ``(s, s)`` block in ``cov`` (``(n, s, s)``).

    Columns are sorted by decreasing eigenvalue. Computed in fp32 (or the input's wider
    dtype) with a tiny diagonal jitter; if that fails to converge, retried in fp64.
    """
    dtype = torch.promote_types(cov.dtype, torch.float32)
    scale = cov.diagonal(dim1=-2, dim2=-1).mean(-1).clamp_min(torch.finfo(dtype).tiny)
    eye = torch.eye(cov.shape[-1], dtype=dtype, device=cov.device)
    jittered = cov.to(dtype) + (EIGH_JITTER * scale)[:, None, None] * eye
    try:
        _, vectors = torch.linalg.eigh(jittered)
        if bool(torch.isfinite(vectors).all()):
            return vectors.flip(-1)
    except torch.linalg.LinAlgError:
        pass
    _, vectors = torch.linalg.eigh(jittered.double())
    return vectors.flip(-1).to(dtype)


def power_qr_basis(cov: Tensor, basis: Tensor) -> Tensor:
    """One warm-started orthogonal-iteration step toward the eigenbasis (as in SOAP).

    Sort the previous basis by its Rayleigh quotients ``diag(Qᵀ C Q)`` (decreasing), then
    ``Q <- qr(C Q).Q``. Cheaper than ``eigh``; converges over repeated refreshes.
    """
    rayleigh = torch.einsum("nij,nik,nkj->nj", basis, cov, basis)
    order = rayleigh.argsort(dim=-1, descending=True)
    basis = basis.gather(-1, order[:, None, :].expand_as(basis))
    return torch.linalg.qr(cov @ basis).Q


def cholesky_qr(x: Tensor, shift: bool = False) -> tuple[Tensor, Tensor]:
    """One (shifted) Cholesky-QR pass on ``(n, s, s)``: ``X R⁻¹`` with ``RᵀR = XᵀX + σI``.

    ``σ = 11 (2 s² + s) u ||X||_F²`` when ``shift`` (Fukaya et al. 2020), which keeps the
    Cholesky factorisation defined up to ``κ(X) ~ u⁻¹``. Also returns a per-block flag: the
    factorisation succeeded.
    """
    gram = x.mT @ x
    if shift:
        s = x.shape[-1]
        sigma = 11 * (2 * s * s + s) * torch.finfo(x.dtype).eps * gram.diagonal(0, 1, 2).sum(-1)
        gram = gram + sigma[:, None, None] * torch.eye(s, dtype=x.dtype, device=x.device)
    chol, info = torch.linalg.cholesky_ex(gram)
    return torch.linalg.solve_triangular(chol.mT, x, upper=True, left=False), info == 0


def orthonormalize(x: Tensor) -> Tensor:
    """Shifted Cholesky-QR3: the ``Q`` of ``X = Q R`` for each ``(s, s)`` block, batched.

    A shifted pass brings ``κ`` down to ``O(1)``-ish, two plain passes restore orthogonality
    to ``O(u)``. ``Q``'s first ``j`` columns span ``X``'s first ``j``, as with Householder QR.
    """
    for shift in (True, False, False):
        x, _ = cholesky_qr(x, shift)
    return x


def _orthonormal_start(basis: Tensor) -> Tensor:
    """The warm start: ``basis`` re-orthonormalised, or ``I`` for blocks where it is singular.

    Zero blocks reach here as the padding of ``split_over_ranks``; a stored basis in a narrow
    dtype is orthonormal only to its precision.
    """
    q, ok = cholesky_qr(basis)
    ok = ok & q.isfinite().all(-1).all(-1)
    eye = torch.eye(basis.shape[-1], dtype=basis.dtype, device=basis.device)
    return torch.where(ok[:, None, None], q, eye)


def off_diagonal_ratio(a: Tensor) -> Tensor:
    """``||offdiag(A)||_F / ||A||_F`` of each symmetric block (``(n,)``; NaN for ``A = 0``)."""
    off = 2 * a.triu(1).square().sum((-2, -1))
    return (off / a.square().sum((-2, -1))).sqrt()


def cholqr_basis(
    cov: Tensor, basis: Tensor, iters: int = CHOLQR_ITERS, skip_tol: float = SKIP_TOL
) -> Tensor:
    """``iters`` warm-started orthogonal-iteration steps, orthonormalised by Cholesky-QR3.

    ``Q`` sorted by decreasing Rayleigh quotient ``diag(Qᵀ C Q)``, then ``Q <- orth(C' Q)``
    ``iters`` times with ``C' = C + δ I``, ``δ = CHOLQR_SHIFT mean(diag C)`` (same eigenvectors;
    keeps ``κ(C' Q) <= 1 + s / CHOLQR_SHIFT`` in Cholesky-QR3's range when ``C`` is singular).
    Column ``j`` converges at rate ``(λ_{j+1} + δ) / (λ_j + δ)`` per step, so well-separated
    eigenvalues converge over a few refreshes and clustered ones only to their subspace.
    Blocks with ``off_diagonal_ratio(Qᵀ C Q) <= skip_tol`` keep their (warm) basis.
    """
    start = _orthonormal_start(basis)
    a = start.mT @ cov @ start
    order = a.diagonal(0, 1, 2).argsort(dim=-1, descending=True)
    q = start.gather(-1, order[:, None, :].expand_as(start))
    scale = cov.diagonal(0, 1, 2).mean(-1)
    shift = CHOLQR_SHIFT * torch.where(scale > 0, scale, 1)  # a zero block: C' = δ I
    shifted = cov + shift[:, None, None] * torch.eye(
        cov.shape[-1], dtype=cov.dtype, device=cov.device
    )
    for _ in range(iters):
        q = orthonormalize(shifted @ q)
    return torch.where((off_diagonal_ratio(a) <= skip_tol)[:, None, None], start, q)


@functools.cache
def _round_robin(slots: int, width: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Round-robin (circle-method) schedule of ``slots`` (even) slots of ``width`` indices.

    Round ``r`` pairs the slots ``layout_r[2k], layout_r[2k + 1]``; every two slots meet once
    per ``slots - 1`` rounds, after which the layout repeats. Returned at index level:
    ``layout_0`` (``(m,)``, ``m = slots width``) and ``steps`` (``(slots - 1, m)``), where
    ``steps[r][j]`` is the position in ``layout_r`` of ``layout_{r+1}[j]``, so that
    ``X[steps[r]]`` moves rows from one layout to the next.
    """
    players, layouts = list(range(slots)), []
    for _ in range(slots - 1):
        pairs = [(players[k], players[slots - 1 - k]) for k in range(slots // 2)]
        layouts.append([width * p + i for pair in pairs for p in pair for i in range(width)])
        players = [players[0], players[-1], *players[1:-1]]  # fix slot 0, rotate the rest
    steps = []
    for r, layout in enumerate(layouts):
        position = {index: j for j, index in enumerate(layout)}
        steps.append([position[index] for index in layouts[(r + 1) % (slots - 1)]])
    return torch.tensor(layouts[0], device=device), torch.tensor(steps, device=device)


def _pair_rotations(a: Tensor, width: int) -> Tensor:
    """``Jᵀ`` for each diagonal ``(2w, 2w)`` block of ``a`` (``(n m / 2w, 2w, 2w)``, ``w = width``).

    The transposed eigenvectors of each block from ``torch.linalg.eigh`` (one batched solver
    call on CUDA for ``2w <= 32``), column ``j`` the eigenvector whose eigenvalue has ``a_jj``'s
    rank among the block's diagonal: a nearly diagonal block gets a rotation near ``I``. (Sorted
    columns would permute slots and stall the sweeps, as outer rotations do in scalar Jacobi.)
    """
    n, m, _ = a.shape
    size, pairs = 2 * width, m // (2 * width)
    blocks = a.view(n, pairs, size, pairs, size).diagonal(0, 1, 3).permute(0, 3, 1, 2)
    vectors = torch.linalg.eigh(blocks).eigenvectors  # (n, pairs, 2w, 2w), eigenvalues ascending
    rank = blocks.diagonal(0, -2, -1).argsort(-1).argsort(-1)
    vectors = vectors.gather(-1, rank[..., None, :].expand_as(vectors))
    return vectors.reshape(n * pairs, size, size).mT


def _jacobi_round(a: Tensor, qt: Tensor, step: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """Diagonalise every adjacent slot pair of every block, then move to the next layout.

    With ``Jᵀ`` from ``_pair_rotations`` on each pair of row slots,
    ``A <- Jᵀ A J = Jᵀ (Jᵀ A)ᵀ`` (``A`` symmetric) and ``Qᵀ <- Jᵀ Qᵀ``; ``a`` and ``qt`` are
    ``(n, m, m)`` in the current layout.
    """
    n, m, _ = a.shape
    rot = _pair_rotations(a, width)
    rows = rot.shape[-1]
    b = torch.bmm(rot, a.view(-1, rows, m)).view(n, m, m)  # Jᵀ A
    a = torch.bmm(rot, b.mT.index_select(2, step).view(-1, rows, m))  # Jᵀ Bᵀ, columns moved
    a = a.view(n, m, m).index_select(1, step)
    qt = torch.bmm(rot, qt.view(-1, rows, m)).view(n, m, m).index_select(1, step)
    return a, qt


def jacobi_basis(
    cov: Tensor,
    basis: Tensor,
    sweeps: int = JACOBI_SWEEPS,
    width: int = JACOBI_WIDTH,
    skip_tol: float = SKIP_TOL,
) -> Tensor:
    """Warm-started cyclic (block) Jacobi: ``sweeps`` round-robin sweeps on ``A = Qᵀ C Q``.

    The indices are split into an even number of ``slots`` of ``w <= width`` indices each
    (padded with dummy indices, decoupled and with diagonal ``-(1 + ||A||_F)``, below every
    eigenvalue). Each of a sweep's ``slots - 1`` rounds diagonalises the ``(2w, 2w)``
    submatrices of all disjoint slot pairs of all blocks at once, with a fixed number of
    batched kernels (one of them ``eigh``, which on CUDA reads its error flag on the host), so a
    call dispatches ``O(sweeps s / w)`` kernels for any ``n`` (one round, exact, when
    ``s <= 2w``). Started from the previous eigenbasis ``A`` is nearly diagonal and the sweeps
    converge quadratically. Returns ``Q J`` with columns sorted by decreasing ``diag(A)``,
    re-orthonormalised by one Cholesky-QR pass. Blocks with
    ``off_diagonal_ratio(Qᵀ C Q) <= skip_tol`` keep their (warm) basis.
    """
    n, s, _ = cov.shape
    slots = 2 * -(-s // (2 * width))
    w = -(-s // slots)
    m = slots * w
    start = _orthonormal_start(basis)
    a0 = start.mT @ cov @ start
    a, qt = a0, start.mT
    if m > s:
        a = torch.nn.functional.pad(a, (0, m - s, 0, m - s))
        a[:, s:, s:].diagonal(0, 1, 2).copy_(-(1 + a0.norm(dim=(1, 2)))[:, None].expand(n, m - s))
        qt = torch.nn.functional.pad(qt, (0, m - s, 0, m - s))
        qt[:, s:, s:].diagonal(0, 1, 2).fill_(1)
    layout, steps = _round_robin(slots, w, cov.device)
    a, qt = a.index_select(1, layout).index_select(2, layout), qt.index_select(1, layout)
    for _ in range(sweeps if slots > 2 else 1):
        for step in steps:
            a, qt = _jacobi_round(a, qt, step, w)
    order = a.diagonal(0, 1, 2).argsort(dim=-1, descending=True)[:, :s]  # drops the dummies
    q = qt.gather(1, order[:, :, None].expand(n, s, m))[:, :, :s].mT
    q, _ = cholesky_qr(q)
    return torch.where((off_diagonal_ratio(a0) <= skip_tol)[:, None, None], start, q)


def cupy_eigenbasis(cov: Tensor) -> Tensor:
    """CuPy's ``eigh`` on the whole CUDA stack (shared memory through DLPack), like ``eigenbasis``.

    Runs on PyTorch's current stream, so it is ordered after the kernels that wrote ``cov``
    and before those that read the result. CuPy is never a dependency: raises if it is not
    importable or ``cov`` is not on CUDA.
    """
    try:
        import cupy
    except ImportError as err:
        raise RuntimeError(
            "basis_method='cupy' needs CuPy (pip install cupy-cuda12x); "
            "use basis_method='jacobi' or 'auto' without it"
        ) from err
    if cov.device.type != "cuda":
        raise ValueError(f"basis_method='cupy' needs CUDA tensors, got device {cov.device}")
    dtype = torch.promote_types(cov.dtype, torch.float32)
    scale = cov.diagonal(0, 1, 2).mean(-1).clamp_min(torch.finfo(dtype).tiny)
    eye = torch.eye(cov.shape[-1], dtype=dtype, device=cov.device)
    jittered = (cov.to(dtype) + (EIGH_JITTER * scale)[:, None, None] * eye).contiguous()
    stream = torch.cuda.current_stream(cov.device)
    with cupy.cuda.Device(cov.device.index), cupy.cuda.ExternalStream(stream.cuda_stream):
        _, vectors = cupy.linalg.eigh(cupy.from_dlpack(jittered))
        return torch.from_dlpack(vectors).flip(-1)


def _eigh64(cov: Tensor) -> Tensor:
    """float64 eigenvectors (decreasing eigenvalues); a non-finite block gets the identity."""
    eye = torch.eye(cov.shape[-1], dtype=torch.float64, device=cov.device)
    finite = cov.isfinite().all(-1).all(-1)[:, None, None]
    return torch.linalg.eigh(torch.where(finite, cov.double(), eye)).eigenvectors.flip(-1)


def orthogonality_error(q: Tensor) -> Tensor:
    """``max |QᵀQ - I|`` of each block (``(n,)``; NaN where ``Q`` is not finite)."""
    eye = torch.eye(q.shape[-1], dtype=q.dtype, device=q.device)
    return (q.mT @ q - eye).abs().amax((-2, -1))


@contextlib.contextmanager
def full_precision_matmuls():
    """fp32 matmuls in IEEE precision inside the block (TF32, which a trainer may enable with
    ``set_float32_matmul_precision("high")``, would cost the solvers three digits)."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def guarded(method: str, solve: Callable[[Tensor, Tensor], Tensor]):
    """``solve`` in at least fp32 with IEEE matmuls, and a safety net: blocks it returns
    non-finite or not orthonormal (``orthogonality_error > ORTHO_TOL``) are recomputed with
    float64 ``eigh``, and one warning names ``method`` and how many blocks. A ``LinAlgError``
    inside ``solve`` (which cannot say which block failed) sends every block to the fallback.
    One host read per call (two on failure).
    """

    def run(cov: Tensor, basis: Tensor) -> Tensor:
        dtype = torch.promote_types(cov.dtype, torch.float32)
        cov = cov.to(dtype)
        with full_precision_matmuls():
            try:
                q = solve(cov, basis.to(dtype))
            except torch.linalg.LinAlgError:
                q = torch.full_like(cov, float("nan"))
            bad = ~(orthogonality_error(q) <= ORTHO_TOL)  # NaN is bad
        if bool(bad.any()):
            index = bad.nonzero()[:, 0]
            q = q.index_copy(0, index, _eigh64(cov.index_select(0, index)).to(q.dtype))
            warnings.warn(
                f"basis_method={method!r} returned a non-finite or non-orthonormal basis for "
                f"{index.numel()} of {q.shape[0]} blocks of size {q.shape[-1]}; recomputed "
                "them with float64 eigh",
                RuntimeWarning,
                stacklevel=2,
            )
        return q

    return run


def basis_solver(method: str, device: torch.device) -> Callable[[Tensor, Tensor], Tensor]:
    """The ``(cov, basis) -> new basis`` function of ``method`` for stacks on ``device``."""
    if method not in BASIS_METHODS:
        raise ValueError(f"invalid basis method {method!r}; choose one of {BASIS_METHODS}")
    if method == "auto":
        method = AUTO_CUDA if device.type == "cuda" else "eigh"
    if method == "eigh":
        return lambda cov, _: eigenbasis(cov)
    if method == "power_qr":
        return power_qr_basis
    solve = {
        "jacobi": jacobi_basis,
        "cholqr": cholqr_basis,
        "cupy": lambda cov, _: cupy_eigenbasis(cov),
    }[method]
    return guarded(method, solve)


def refresh_bases(
    covs: list[Tensor], bases: list[Tensor], method: str = "eigh", run=None
) -> list[Tensor]:
    """New bases for many stacks at once: one batched call per block size.

    ``covs[i]`` and ``bases[i]`` are ``(n_i, s_i, s_i)``; stacks of equal size (across all
    layers) are concatenated so that the solver of ``method`` (one of ``BASIS_METHODS``) runs
    once per distinct block size. ``run(fn, cov, basis)`` evaluates ``fn`` on the concatenated
    stacks (default: directly; Dobb can pass ``dobb.distributed.sharding.split_over_ranks`` to
    share the work between ranks).
    """
    run = run or (lambda fn, *stacks: fn(*stacks))
    by_size: dict[tuple[int, torch.dtype, torch.device], list[int]] = {}
    for i, cov in enumerate(covs):
        by_size.setdefault((cov.shape[-1], cov.dtype, cov.device), []).append(i)
    new: list[Tensor] = [torch.empty(0)] * len(covs)
    for (_, _, device), indices in by_size.items():
        basis_fn = basis_solver(method, device)
        cov = torch.cat([covs[i] for i in indices])
        result = run(basis_fn, cov, torch.cat([bases[i] for i in indices]).to(cov.dtype))
        for i, part in zip(indices, result.split([covs[i].shape[0] for i in indices])):
            new[i] = part.to(bases[i].dtype)
    return new
