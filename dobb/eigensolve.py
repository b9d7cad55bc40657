"""Eigenbases of stacks of symmetric PSD blocks: the reference ``eigh`` and batched solvers.

Dobb refreshes an orthonormal eigenbasis ``Q_b`` of every block second moment ``C_b``
(``(n, s, s)`` stacks) every ``basis_interval`` steps. ``torch.linalg.eigh`` is the reference
and the fastest choice on CPU, but on CUDA it runs one solver call per matrix for
``32 < s <= 512`` (``torch.linalg.qr`` loops too), and it reads its error flag on the host.
The solvers here use batched kernels only (bmm, elementwise, ``cholesky_ex``, triangular
solve), so their kernel count per call depends on ``s`` and never on ``n``, they never read
the device, and they start from the previous basis:

- ``jacobi_basis``: cyclic Jacobi sweeps on ``A = Qᵀ C Q`` in round-robin order, each round
  rotating ``s/2`` disjoint index pairs of every block at once, rotations in closed form.
- ``cholqr_basis``: orthogonal iteration ``Q <- orth(C Q)`` (what ``power_qr`` does), with a
  shifted Cholesky-QR3 in place of Householder QR.
- ``cupy_eigenbasis``: CuPy's ``eigh`` on the whole stack through DLPack (optional, CUDA).

Both warm-started solvers keep the basis of blocks whose ``Qᵀ C Q`` is already nearly diagonal
(Distributed Shampoo's criterion). ``guarded`` decides on the device: a block whose result is
non-finite or not orthonormal keeps its previous basis, and ``BlockFailures`` counts such
blocks on the device and warns once the count reaches the host without a sync. A matrix's
first refresh (``COLD_METHODS``) runs Jacobi from the identity with more sweeps (or CuPy).
``refresh_bases`` is the one dispatch point (``python -m bench.results.eigensolve`` times
every method); ``resolve_method`` says which solver ``"auto"`` runs where: ``eigh`` on CPU,
CuPy or ``cholqr`` on CUDA, ``cholqr`` in a capturable refresh (CUDA graphs,
``torch.compile(fullgraph=True)``), whose failure counts stay on the device.
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
``cholqr_basis``; ``"cupy"`` ``cupy_eigenbasis``; ``"auto"`` (``resolve_method``):
``"eigh"`` on CPU tensors; on CUDA tensors ``"cupy"`` where CuPy is importable, else
``AUTO_CUDA``; ``AUTO_CAPTURABLE`` on every device for a capturable refresh. All but
``"eigh"`` are wrapped in ``guarded``.
"""
COLD_METHODS = ("jacobi_cold", "auto_cold")
"""Start methods for a matrix's first refresh (what Dobb's ``COLD_START`` maps to), when no
previous basis exists: ``"jacobi_cold"`` ``jacobi_basis`` from the identity with
``JACOBI_COLD_SWEEPS`` sweeps (batched, no host read, ``O(JACOBI_COLD_SWEEPS s)``
kernels); ``"auto_cold"`` ``"eigh"`` on CPU tensors, on CUDA tensors ``"cupy"`` where
CuPy is importable, else ``"jacobi_cold"``; ``"jacobi_cold"`` on every device for a
capturable refresh (it runs once per matrix, in the eager warm-up before a capture).
"""
# "auto" on CUDA without CuPy: cholqr's kernels and passes over the block stack per refresh
# do not grow with the block size s, jacobi's grow as O(s) (tests/test_step_counts.py counts
# both); torch's eigh and qr loop over the matrices on CUDA. "jacobi" was the default.
AUTO_CUDA = "cholqr"
AUTO_CAPTURABLE = "cholqr"  # "auto" with capturable=True, on every device
CAPTURABLE_METHODS = ("auto", "cholqr", "jacobi")
"""``method`` names a capturable refresh accepts: batched kernels only, no host read, no
Python branch on device values (``eigh`` and ``power_qr`` call per-matrix solvers on CUDA
that read their error flags, CuPy cannot be captured)."""

EIGH_JITTER = 1e-7  # relative diagonal jitter: C + JITTER * mean(diag C) * I
# Sweeps per refresh, measured on bench.results.eigensolve.refresh_problem (eigh's fp32
# residual ~1e-6): from a basis one refresh old, 3 reach 1e-6 at s = 64 and 100, 3e-4 at
# s = 400 (4: 2e-6); from the identity, 10 reach 1e-6 at s = 64, 100 and 400.
JACOBI_SWEEPS = 4
JACOBI_COLD_SWEEPS = 10
JACOBI_WIDTH = 1  # indices per round-robin slot: 2 x 2 pivots, rotations in closed form
CHOLQR_ITERS = 1  # orthogonal-iteration steps per refresh, as power_qr (SOAP)
CHOLQR_SHIFT = 1e-3  # C + shift mean(diag C) I: positive definite, same eigenvectors
SKIP_TOL = 1e-5  # keep Q_b when ||offdiag(Qᵀ C Q)||_F <= SKIP_TOL ||Qᵀ C Q||_F
ORTHO_TOL = 1e-3  # guard: a basis with max |QᵀQ - I| above this keeps the previous one


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


@functools.cache
def _zero(dtype: torch.dtype, device: torch.device) -> Tensor:
    """A 0-d zero, made once per dtype and device (``addcdiv``'s input, no copy per round)."""
    return torch.zeros((), dtype=dtype, device=device)


def _pair_rotations(a: Tensor) -> Tensor:
    """``Jᵀ`` of each index pair ``(2k, 2k + 1)`` of ``a`` (``(n, m, m)``): ``(n m / 2, 2, 2)``.

    The classical Jacobi rotation, in closed form: with ``p = 2k``, ``q = 2k + 1`` and
    ``tan 2θ = 2 a_pq / (a_pp - a_qq)``, ``|θ| <= π/4``, ``J = [[c, -s], [s, c]]`` (``c = cos θ``,
    ``s = sin θ``) zeroes ``(Jᵀ A J)_pq``. The smaller of the two angles keeps a nearly
    diagonal pair nearly fixed (a swap would permute indices and stall the sweeps). A pair
    with ``a_pq = 0 = a_pp - a_qq`` gets ``0 / 0``, mapped to ``θ = 0``; ``a_pp = a_qq`` gets
    ``±∞``, ``θ = ±π/4``. (``s`` as ``cos(θ - π/2)`` would save two kernels but err by
    ~6e-8 absolute, which holds the residual at ~1e-5 instead of eigh's 1e-6.)
    """
    n, m, _ = a.shape
    diagonal = a.diagonal(0, 1, 2)
    off = a.diagonal(1, 1, 2)[:, 0::2]  # a_pq, (n, m/2)
    diff = diagonal[:, 0::2] - diagonal[:, 1::2]  # a_pp - a_qq
    tan_2theta = torch.addcdiv(_zero(a.dtype, a.device), off, diff, value=2).nan_to_num_(0.0)
    theta = torch.atan(tan_2theta).mul_(0.5)
    c, s = theta.cos(), theta.sin()
    return torch.stack([c, s, -s, c], -1).view(n * m // 2, 2, 2)  # Jᵀ = [[c, s], [-s, c]]


def _jacobi_round(a: Tensor, qt: Tensor, step: Tensor) -> tuple[Tensor, Tensor]:
    """Rotate every adjacent index pair of every block, then move to the next layout.

    With ``Jᵀ`` from ``_pair_rotations`` (block diagonal, ``m / 2`` blocks of ``2 x 2``),
    ``A <- Jᵀ A J = Jᵀ (Jᵀ A)ᵀ`` (``A`` symmetric) and ``Qᵀ <- Jᵀ Qᵀ``, three bmm of ``2 x 2``
    by ``2 x m``; ``a`` and ``qt`` are ``(n, m, m)`` in the current layout.
    """
    n, m, _ = a.shape
    rot = _pair_rotations(a)
    b = torch.bmm(rot, a.view(-1, 2, m)).view(n, m, m)  # Jᵀ A
    a = torch.bmm(rot, b.mT.index_select(2, step).view(-1, 2, m))  # Jᵀ Bᵀ, columns moved
    a = a.view(n, m, m).index_select(1, step)
    qt = torch.bmm(rot, qt.view(-1, 2, m)).view(n, m, m).index_select(1, step)
    return a, qt


def jacobi_basis(
    cov: Tensor, basis: Tensor, sweeps: int = JACOBI_SWEEPS, skip_tol: float = SKIP_TOL
) -> Tensor:
    """Warm-started cyclic Jacobi: ``sweeps`` round-robin sweeps on ``A = Qᵀ C Q``.

    The ``s`` indices (padded to an even ``m`` with a dummy index, decoupled and with
    diagonal ``-(1 + ||A||_F)``, below every eigenvalue) are paired in round-robin order:
    each of a sweep's ``m - 1`` rounds rotates ``m / 2`` disjoint pairs of every block at once
    with closed-form ``2 x 2`` rotations (``_pair_rotations``), a fixed number of batched
    kernels and no host read, so a call dispatches ``O(sweeps s)`` kernels for any ``n``
    (one round, exact, when ``s <= 2``). Every pair meets once per sweep; started from the
    previous eigenbasis ``A`` is nearly diagonal and the sweeps converge quadratically.
    Returns ``Q J`` with columns sorted by decreasing ``diag(A)``, re-orthonormalised by one
    Cholesky-QR pass. Blocks with ``off_diagonal_ratio(Qᵀ C Q) <= skip_tol`` keep their
    (warm) basis.
    """
    n, s, _ = cov.shape
    m = s + s % 2
    start = _orthonormal_start(basis)
    a0 = start.mT @ cov @ start
    a, qt = a0, start.mT
    if m > s:
        a = torch.nn.functional.pad(a, (0, 1, 0, 1))
        a[:, s, s] = -(1 + a0.norm(dim=(1, 2)))
        qt = torch.nn.functional.pad(qt, (0, 1, 0, 1))
        qt[:, s, s] = 1
    layout, steps = _round_robin(m, JACOBI_WIDTH, cov.device)
    a, qt = a.index_select(1, layout).index_select(2, layout), qt.index_select(1, layout)
    for _ in range(sweeps if m > 2 else 1):
        for step in steps:
            a, qt = _jacobi_round(a, qt, step)
    order = a.diagonal(0, 1, 2).argsort(dim=-1, descending=True)[:, :s]  # drops the dummy
    q = qt.gather(1, order[:, :, None].expand(n, s, m))[:, :, :s].mT
    q, _ = cholesky_qr(q)
    return torch.where((off_diagonal_ratio(a0) <= skip_tol)[:, None, None], start, q)


def cold_jacobi_basis(cov: Tensor, basis: Tensor | None = None) -> Tensor:
    """A first basis without a previous one: ``jacobi_basis`` from the identity with
    ``JACOBI_COLD_SWEEPS`` sweeps (``basis`` is ignored; it is there for ``guarded``)."""
    eye = torch.eye(cov.shape[-1], dtype=cov.dtype, device=cov.device).expand_as(cov)
    return jacobi_basis(cov, eye, sweeps=JACOBI_COLD_SWEEPS)


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
            "basis_method='cupy' needs CuPy (pip install 'dobb[cupy]', or cupy-cuda13x); "
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


def orthogonality_error(q: Tensor) -> Tensor:
    """``max |QᵀQ - I|`` of each block (``(n,)``; NaN where ``Q`` is not finite)."""
    eye = torch.eye(q.shape[-1], dtype=q.dtype, device=q.device)
    return (q.mT @ q - eye).abs().amax((-2, -1))


class BlockFailures:
    """Device-side counts of the blocks ``guarded`` rejected, reported without a sync.

    ``add`` adds a ``(n,)`` bool mask's count to a 0-d device counter (one per device, made
    by ``counter``) and nothing else: it can run inside a captured or compiled step.
    ``report`` queues a non-blocking copy of every counter to the host (pinned memory and an
    event on CUDA), then warns once for every counter whose copy has arrived and grown since
    its last report: on CPU at once, on CUDA at a later ``report``. It reads host memory
    only (``tolist``), never the device.
    """

    def __init__(self):
        self._device: dict[torch.device, Tensor] = {}
        self._methods: dict[torch.device, dict[str, None]] = {}  # ordered set of names
        self._host: dict[torch.device, tuple[Tensor, object]] = {}
        self._reported: dict[torch.device, int] = {}

    def counter(self, device: torch.device) -> Tensor:
        """The 0-d int64 counter of ``device``, made on first use (make it before a CUDA
        graph capture: a tensor made during one would be zeroed again at every replay)."""
        if device not in self._device:
            self._device[device] = torch.zeros((), dtype=torch.int64, device=device)
        return self._device[device]

    def add(self, method: str, bad: Tensor) -> None:
        """Count ``bad`` (``(n,)`` bool, blocks on one device) for ``method``."""
        self.counter(bad.device).add_(bad.sum())
        self._methods.setdefault(bad.device, {})[method] = None

    def report(self, stacklevel: int = 2) -> None:
        """One ``RuntimeWarning`` per counter that grew since its last report (see class)."""
        for device, count in self._device.items():
            host, _ = self._host.get(device, (None, None))
            if host is None:
                host = torch.zeros((), dtype=torch.int64, pin_memory=device.type == "cuda")
                self._reported[device] = 0
            host.copy_(count, non_blocking=True)
            event = torch.cuda.Event() if device.type == "cuda" else None
            if event is not None:
                event.record()
            self._host[device] = (host, event)
        for device, (host, event) in self._host.items():
            if event is not None and not event.query():
                continue  # the copy is still on its way; a later report reads it
            count = host.tolist()
            if count > self._reported[device]:
                methods = ", ".join(map(repr, self._methods.get(device, ())))
                warnings.warn(
                    f"basis_method {methods} returned a non-finite or non-orthonormal basis "
                    f"for {count - self._reported[device]} blocks on {device} ({count} in all); "
                    "they kept their previous basis",
                    RuntimeWarning,
                    stacklevel=stacklevel + 1,
                )
                self._reported[device] = count

    @property
    def total(self) -> int:
        """Blocks rejected so far, every device (reads the device: for tests and logs)."""
        return sum(int(count) for count in self._device.values())


BASIS_FAILURES = BlockFailures()  # what ``guarded`` counts into unless given another


@contextlib.contextmanager
def full_precision_matmuls():
    """fp32 matmuls in IEEE precision inside the block (TF32, which a trainer may enable with
    ``set_float32_matmul_precision("high")``, would cost the solvers three digits).

    Under ``torch.compile`` (where setting the precision breaks the graph) it changes
    nothing: a compiled refresh runs at the precision its caller set (``docs/gpu.md``)."""
    if torch.compiler.is_compiling():
        yield
        return
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def guarded(
    method: str,
    solve: Callable[[Tensor, Tensor], Tensor],
    failures: BlockFailures | None = None,
    report: bool = True,
):
    """``solve`` in at least fp32 with IEEE matmuls, and a safety net decided on the device.

    A block whose ``C`` is not finite, or that ``solve`` returns non-finite or not
    orthonormal (``orthogonality_error > ORTHO_TOL``, NaN included), keeps its previous
    basis, re-orthonormalised (``_orthonormal_start``: the identity where the previous one
    is singular); ``failures`` (default ``BASIS_FAILURES``) counts it on the device and, if
    ``report``, warns when the count reaches the host (a capturable refresh leaves the
    report to its caller). A ``LinAlgError`` inside ``solve`` (which cannot say which block
    failed) keeps every block's previous basis. No host read.
    """
    failures = BASIS_FAILURES if failures is None else failures

    def run(cov: Tensor, basis: Tensor) -> Tensor:
        dtype = torch.promote_types(cov.dtype, torch.float32)
        cov = cov.to(dtype)
        with full_precision_matmuls():
            basis = basis.to(dtype)
            previous = _orthonormal_start(basis)
            try:
                q = solve(cov, basis)
            except torch.linalg.LinAlgError:
                q = torch.full_like(cov, float("nan"))
            bad = ~(orthogonality_error(q) <= ORTHO_TOL)  # NaN is bad
            bad |= ~cov.isfinite().all(-1).all(-1)  # Jacobi maps a NaN pivot to θ = 0
        q = torch.where(bad[:, None, None], previous, q)
        failures.add(method, bad)
        if report:
            failures.report(stacklevel=2)
        return q

    return run


def cupy_available() -> bool:
    """Whether ``import cupy`` works (``"auto"`` then prefers CuPy's batched ``eigh`` on
    CUDA)."""
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_method(method: str, device: torch.device, capturable: bool = False) -> str:
    """The solver ``method`` (``BASIS_METHODS`` or ``COLD_METHODS``) names for stacks on
    ``device``: ``"auto"`` and ``"auto_cold"`` resolved (see ``BASIS_METHODS``)."""
    if method not in BASIS_METHODS + COLD_METHODS:
        raise ValueError(f"invalid basis method {method!r}; choose one of {BASIS_METHODS}")
    if capturable and method not in CAPTURABLE_METHODS + COLD_METHODS:
        raise ValueError(
            f"basis method {method!r} cannot run in a capturable refresh; choose one of "
            f"{CAPTURABLE_METHODS}"
        )
    if method == "auto_cold":
        cuda = device.type == "cuda" and not capturable
        if cuda and cupy_available():
            return "cupy"
        return "jacobi_cold" if cuda or capturable else "eigh"
    if method == "auto":
        if capturable:
            return AUTO_CAPTURABLE
        if device.type != "cuda":
            return "eigh"
        return "cupy" if cupy_available() else AUTO_CUDA
    return method


def basis_solver(
    method: str,
    device: torch.device,
    failures: BlockFailures | None = None,
    capturable: bool = False,
) -> Callable[[Tensor, Tensor], Tensor]:
    """The ``(cov, basis) -> new basis`` function of ``method`` (``BASIS_METHODS`` or
    ``COLD_METHODS``, through ``resolve_method``) for stacks on ``device``; ``failures`` and
    ``capturable`` (no report in the call) go to ``guarded``."""
    method = resolve_method(method, device, capturable)
    if method == "eigh":
        return lambda cov, _: eigenbasis(cov)
    solve = {
        "power_qr": power_qr_basis,
        "jacobi": jacobi_basis,
        "jacobi_cold": cold_jacobi_basis,
        "cholqr": cholqr_basis,
        "cupy": lambda cov, _: cupy_eigenbasis(cov),
    }[method]
    return guarded(method, solve, failures, report=not capturable)


def refresh_bases(
    covs: list[Tensor],
    bases: list[Tensor],
    method: str = "eigh",
    run=None,
    *,
    failures: BlockFailures | None = None,
    capturable: bool = False,
) -> list[Tensor]:
    """New bases for many stacks at once: one batched call per block size.

    ``covs[i]`` and ``bases[i]`` are ``(n_i, s_i, s_i)``; stacks of equal size (across all
    layers) are concatenated so that the solver of ``method`` (one of ``BASIS_METHODS``) runs
    once per distinct block size. ``run(fn, cov, basis)`` evaluates ``fn`` on the concatenated
    stacks (default: directly; Dobb can pass ``dobb.optim.dobb_steps.split_over_ranks`` to
    share the work between ranks). ``failures`` and ``capturable`` go to ``basis_solver``.
    """
    run = run or (lambda fn, *stacks: fn(*stacks))
    by_size: dict[tuple[int, torch.dtype, torch.device], list[int]] = {}
    for i, cov in enumerate(covs):
        by_size.setdefault((cov.shape[-1], cov.dtype, cov.device), []).append(i)
    new: list[Tensor] = [torch.empty(0)] * len(covs)
    for (_, _, device), indices in by_size.items():
        basis_fn = basis_solver(method, device, failures, capturable)
        cov = torch.cat([covs[i] for i in indices])
        result = run(basis_fn, cov, torch.cat([bases[i] for i in indices]).to(cov.dtype))
        for i, part in zip(indices, result.split([covs[i].shape[0] for i in indices])):
            new[i] = part.to(bases[i].dtype)
    return new
