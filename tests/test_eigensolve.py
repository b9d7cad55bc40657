"""The batched basis solvers against the reference ``eigh``, their guard and dispatch."""

import json
import sys
import warnings

import pytest
import torch
from multirank import run_ranks

from bench.results.eigensolve import eigen_residual, main, refresh_problem
from bench.tools.opcount import OpCounter
from dobb.eigensolve import (
    AUTO_CUDA,
    BASIS_METHODS,
    CAPTURABLE_METHODS,
    COLD_METHODS,
    JACOBI_COLD_SWEEPS,
    BlockFailures,
    _orthonormal_start,
    basis_solver,
    cholqr_basis,
    cold_jacobi_basis,
    eigenbasis,
    guarded,
    jacobi_basis,
    orthogonality_error,
    power_qr_basis,
    refresh_bases,
    resolve_method,
)


def psd_stack(values: torch.Tensor, n: int, seed: int = 0) -> torch.Tensor:
    """``(n, s, s)`` float32 blocks ``V diag(values) Vᵀ`` with random orthogonal ``V``."""
    gen = torch.Generator().manual_seed(seed)
    s = values.numel()
    v = torch.linalg.qr(torch.randn(n, s, s, generator=gen, dtype=torch.float64)).Q
    return ((v * values.double()) @ v.mT).float()


def projector_error(q: torch.Tensor, reference: torch.Tensor, groups) -> float:
    """Largest ``||P - P_ref||_max`` over the column groups (eigenspaces), basis-invariant."""
    q, reference = q.double(), reference.double()
    return max(
        (q[..., g] @ q[..., g].mT - reference[..., g] @ reference[..., g].mT).abs().max().item()
        for g in groups
    )


def rotate_basis(basis: torch.Tensor, angle: float, seed: int = 1) -> torch.Tensor:
    """``basis`` times ``exp(K)``, ``K`` random skew with spectral norm ~``2 angle`` (stale)."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(basis.shape, generator=gen, dtype=torch.float64) / basis.shape[-1] ** 0.5
    return (basis.double() @ torch.linalg.matrix_exp(angle * (k - k.mT) / 2)).float()


@pytest.mark.parametrize("s", [7, 40, 101])
def test_jacobi_matches_eigh_on_separated_spectrum(s):
    cov = psd_stack(torch.logspace(0, -3, s), n=4)
    warm = rotate_basis(eigenbasis(cov), 0.05)
    q = jacobi_basis(cov, warm)
    reference = eigenbasis(cov)
    assert eigen_residual(cov, q).max() < 2e-5
    assert orthogonality_error(q).max() < 1e-5
    # gaps are >= 7%: each column is eigh's up to sign
    overlap = (q.double().mT @ reference.double()).diagonal(0, 1, 2).abs()
    assert (overlap > 1 - 1e-4).all()


def test_jacobi_resolves_clustered_spectrum_up_to_its_eigenspaces():
    values = torch.tensor([4.0, 1.0, 0.1, 0.01]).repeat_interleave(12)
    values = values * (1 + 1e-6 * torch.arange(48))  # clusters of 12 nearly equal eigenvalues
    cov = psd_stack(values, n=4)
    stale = rotate_basis(eigenbasis(cov), 0.05)
    # 2 x 2 rotations converge slowly until the coupling falls below the clusters' gaps:
    # residual 2e-4 after the default 4 sweeps, 5e-6 after 6 (the 32 x 32 eigh pivots of
    # the previous solver reached 1e-5 in 3)
    assert eigen_residual(cov, jacobi_basis(cov, stale)).max() > 1e-4
    q = jacobi_basis(cov, stale, sweeps=6)
    assert eigen_residual(cov, q).max() < 1e-5
    clusters = [list(range(12 * k, 12 * k + 12)) for k in range(4)]
    assert projector_error(q, eigenbasis(cov), clusters) < 1e-4


def test_cholqr_converges_over_refreshes_and_keeps_clusters():
    values = torch.tensor([8.0, 4.0, 2.0, 1.0]).repeat_interleave(8)  # clusters, ratio 1/2
    cov = psd_stack(values, n=3)
    q = rotate_basis(torch.eye(32).expand(3, 32, 32), 0.5)
    residuals = []
    for _ in range(25):
        q = cholqr_basis(cov, q, skip_tol=0.0)  # the skip would stop at residual ~SKIP_TOL
        residuals.append(eigen_residual(cov, q).max().item())
    assert residuals[-1] < 1e-5 < residuals[0]
    assert orthogonality_error(q).max() < 1e-5
    clusters = [list(range(8 * k, 8 * k + 8)) for k in range(4)]
    assert projector_error(q, eigenbasis(cov), clusters) < 1e-4


def test_warm_started_refreshes_track_a_drifting_second_moment():
    """A Dobb-like run: C_b <- 0.6 C_b + 0.4 S_b between refreshes, S_b from fresh tokens."""
    cov, basis, _ = refresh_problem(n=4, s=48, device="cpu", seed=0)
    gen = torch.Generator().manual_seed(1)
    stale, fresh = [], []
    for _ in range(4):
        x = torch.randn(4, 192, 48, generator=gen) @ torch.linalg.cholesky(cov.double()).mT.float()
        cov = 0.6 * cov + 0.4 * x.mT @ x / 192
        stale.append(eigen_residual(cov, basis).max().item())
        basis = jacobi_basis(cov, basis)
        fresh.append(eigen_residual(cov, basis).max().item())
    assert max(fresh) < 1e-5 < 1e-3 < min(stale)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.float64, 1e-9)])
def test_default_refresh_reaches_eigh_accuracy(dtype, tol):
    cov, basis, _ = (t.to(dtype) for t in refresh_problem(n=4, s=64, device="cpu"))
    assert eigen_residual(cov, basis).max() > 1e-2  # the stale basis is far off
    (q,) = refresh_bases([cov], [basis], "jacobi")
    assert q.dtype == dtype and eigen_residual(cov, q).max() < tol


@pytest.mark.parametrize("solver", [jacobi_basis, cholqr_basis])
def test_nearly_diagonal_blocks_keep_their_basis(solver):
    cov = psd_stack(torch.logspace(0, -2, 24), n=4)
    basis = eigenbasis(cov)
    basis[2:] = rotate_basis(basis[2:], 0.1)  # blocks 2, 3 are stale
    start = _orthonormal_start(basis)  # the basis, re-orthonormalised
    kept = solver(cov, basis)
    refreshed = solver(cov, basis, skip_tol=0.0)
    assert torch.equal(kept[:2], start[:2])
    assert not torch.equal(refreshed[:2], start[:2])
    assert torch.equal(kept[2:], refreshed[2:])


def test_guard_keeps_the_previous_basis_of_bad_blocks_and_warns_once():
    cov = psd_stack(torch.logspace(0, -2, 16), n=6)
    previous = rotate_basis(eigenbasis(cov), 0.05)

    def broken(cov, basis):
        q = jacobi_basis(cov, basis)
        q[1, 3, 3] = float("nan")
        q[4] *= 1.01  # not orthonormal
        return q

    failures = BlockFailures()
    with pytest.warns(RuntimeWarning, match=r"'jacobi'.* 2 blocks on cpu \(2 in all\)") as record:
        q = guarded("jacobi", broken, failures)(cov, previous)
    assert len(record) == 1 and failures.total == 2
    torch.testing.assert_close(q[[1, 4]], _orthonormal_start(previous[[1, 4]]))
    good = [0, 2, 3, 5]
    torch.testing.assert_close(q[good], jacobi_basis(cov[good], previous[good]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        failures.report()  # nothing new: no second warning
        guarded("jacobi", jacobi_basis, failures)(cov, previous)


def test_guard_decides_on_the_device_without_reading_it():
    """The guard's decision, count and report dispatch no host read (they did: one, and a
    float64 ``eigh`` of the bad blocks behind a second)."""
    cov = psd_stack(torch.logspace(0, -2, 16), n=3)
    cov[1, 2, 5] = float("nan")
    basis = torch.eye(16).expand(3, 16, 16)
    failures = BlockFailures()
    with OpCounter() as counter, pytest.warns(RuntimeWarning, match="1 blocks"):
        q = guarded("jacobi", jacobi_basis, failures)(cov, basis)
    assert counter.host_reads == 0 and counter.ops["aten::_linalg_eigh"] == 0
    assert torch.equal(q[1], torch.eye(16)) and orthogonality_error(q).max() < 1e-5


def test_guard_keeps_every_basis_when_the_solver_fails():
    cov = psd_stack(torch.logspace(0, -2, 16), n=3)
    basis = eigenbasis(cov)

    def failing(cov, basis):
        raise torch.linalg.LinAlgError("no convergence")

    with pytest.warns(RuntimeWarning, match="3 blocks"):
        q = guarded("cholqr", failing, BlockFailures())(cov, basis)
    torch.testing.assert_close(q, _orthonormal_start(basis))


@pytest.mark.parametrize("s", [40, 64, 101])
def test_cold_start_from_the_identity_reaches_eigh_accuracy(s):
    """A matrix's first refresh: no previous basis, no eigh, no host read."""
    cov = psd_stack(torch.logspace(0, -3, s), n=3)
    with OpCounter() as counter:
        (q,) = refresh_bases([cov], [torch.zeros_like(cov)], "jacobi_cold")
    assert counter.host_reads == 0 and counter.ops["aten::_linalg_eigh"] == 0
    assert eigen_residual(cov, q).max() < 1e-5 and orthogonality_error(q).max() < 1e-5
    overlap = (q.double().mT @ eigenbasis(cov).double()).diagonal(0, 1, 2).abs()
    assert (overlap > 1 - 1e-4).all()
    fewer = jacobi_basis(cov, torch.eye(s).expand_as(cov), sweeps=JACOBI_COLD_SWEEPS // 3)
    assert eigen_residual(cov, fewer).max() > 1e-4  # the cold start needs its extra sweeps
    assert torch.equal(q, cold_jacobi_basis(cov))


def test_auto_cold_is_eigh_on_cpu():
    cov, basis, _ = refresh_problem(n=3, s=20, device="cpu")
    (q,) = refresh_bases([cov], [basis], "auto_cold")
    assert torch.equal(q, eigenbasis(cov))
    assert set(COLD_METHODS) == {"jacobi_cold", "auto_cold"}


@pytest.mark.parametrize("method", ["jacobi", "cholqr"])
def test_zero_padding_blocks_give_an_orthonormal_basis_without_warning(method):
    """``split_over_ranks`` pads the last rank's stack with zero ``C`` and zero ``Q``."""
    cov = psd_stack(torch.logspace(0, -2, 12), n=3)
    cov[2] = 0
    basis = eigenbasis(cov)
    basis[2] = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (q,) = refresh_bases([cov], [basis], method)
    assert orthogonality_error(q).max() < 1e-5


@pytest.mark.parametrize("method", ["jacobi", "cholqr", "power_qr", "jacobi_cold"])
def test_kernel_count_does_not_grow_with_the_number_of_blocks(method):
    """Batched solvers: the same ops for 2 and 12 blocks, and no host read (the profiler
    counts the reads nested in library kernels; ``eigh`` has two per call)."""
    counts = []
    for n in (2, 12):
        cov, basis, _ = refresh_problem(n=n, s=40, device="cpu")
        refresh_bases([cov], [basis], method)  # the first call caches Jacobi's schedule
        with OpCounter() as counter:
            refresh_bases([cov], [basis], method)
        counts.append((counter.total, counter.host_reads))
    assert counts[0] == counts[1]
    assert counts[0][1] == 0
    with OpCounter() as counter:
        refresh_bases([cov], [basis], "eigh")
    assert counter.host_reads == 2 and counter.nested_reads == 1


def test_auto_is_eigh_on_cpu_and_old_methods_are_unchanged():
    cov, basis, _ = refresh_problem(n=3, s=20, device="cpu")
    (auto,) = refresh_bases([cov], [basis], "auto")
    assert torch.equal(auto, eigenbasis(cov))
    (power,) = refresh_bases([cov], [basis], "power_qr")
    assert torch.equal(power, power_qr_basis(cov, basis))
    assert set(BASIS_METHODS) == {"eigh", "power_qr", "jacobi", "cholqr", "cupy", "auto"}


def test_bad_method_and_missing_cupy_raise_clear_errors(monkeypatch):
    with pytest.raises(ValueError, match="invalid basis method 'qr'.*'jacobi'"):
        basis_solver("qr", torch.device("cpu"))
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    cov, basis, _ = refresh_problem(n=2, s=8, device="cpu")
    with pytest.raises(RuntimeError, match="needs CuPy"):
        refresh_bases([cov], [basis], "cupy")


def test_benchmark_writes_json_rows(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    out = tmp_path / "eigensolve.json"
    main(
        [
            "--sizes",
            "12:3,9:2",
            "--methods",
            "eigh,jacobi,cupy",
            "--repeats",
            "2",
            "--out",
            str(out),
        ]
    )
    result = json.loads(out.read_text())
    rows = {(r["method"], r["s"]): r for r in result["rows"]}
    assert "needs CuPy" in rows["cupy", 12]["error"]
    for key in [("eigh", 12), ("jacobi", 12), ("jacobi", 9)]:
        row = rows[key]
        assert row["residual"] < 1e-5 and row["orthogonality"] < 1e-5
        assert row["seconds"] > 0 and len(row["all_seconds"]) == 2 and row["ops"] > 0
    assert result["command"].startswith("python -m bench.results.eigensolve --sizes 12:3,9:2")


def test_solvers_run_in_fp32_with_ieee_matmuls_whatever_the_caller_chose():
    seen = []

    def spy(cov, basis):
        seen.append((cov.dtype, basis.dtype, torch.get_float32_matmul_precision()))
        return jacobi_basis(cov, basis)

    cov, basis, _ = refresh_problem(n=2, s=12, device="cpu")
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        q = guarded("jacobi", spy)(cov.bfloat16(), basis.bfloat16())
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(previous)
    assert seen == [(torch.float32, torch.float32, "highest")]
    assert q.dtype == torch.float32 and orthogonality_error(q).max() < 1e-5


def _refresh_split_over_ranks(rank, world_size):
    from dobb.optim.dobb_steps import split_over_ranks

    cov, basis, _ = refresh_problem(n=3, s=20, device="cpu")  # rank 1: 1 block + 1 zero pad
    results = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for method in ("jacobi", "cholqr"):
            (results[method],) = refresh_bases(
                [cov], [basis], method, lambda fn, *st: split_over_ranks(fn, *st, group=None)
            )
    return results


def test_sharded_refresh_matches_one_process():
    """Dobb's ``shard_refresh`` path: each rank solves ~n/P blocks, one all-gather."""
    cov, basis, _ = refresh_problem(n=3, s=20, device="cpu")
    for results in run_ranks(_refresh_split_over_ranks, 2):
        for method, q in results.items():
            torch.testing.assert_close(q, refresh_bases([cov], [basis], method)[0])


def test_auto_resolves_to_eigh_on_cpu_cupy_or_cholqr_on_cuda_and_cholqr_if_capturable(
    monkeypatch,
):
    cpu, cuda = torch.device("cpu"), torch.device("cuda:0")
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    table = {  # (method, device, capturable): solver, without CuPy
        ("auto", cpu, False): "eigh",
        ("auto", cuda, False): AUTO_CUDA,
        ("auto", cpu, True): "cholqr",
        ("auto", cuda, True): "cholqr",
        ("auto_cold", cpu, False): "eigh",
        ("auto_cold", cuda, False): "jacobi_cold",
        ("auto_cold", cpu, True): "jacobi_cold",
        ("jacobi", cuda, True): "jacobi",
    }
    assert {key: resolve_method(*key) for key in table} == table
    monkeypatch.setitem(sys.modules, "cupy", sys)  # an importable stand-in
    assert resolve_method("auto", cuda) == resolve_method("auto_cold", cuda) == "cupy"
    assert resolve_method("auto", cpu) == "eigh"
    assert resolve_method("auto", cuda, capturable=True) == "cholqr"  # CuPy is not capturable
    for method in set(BASIS_METHODS) - set(CAPTURABLE_METHODS):
        with pytest.raises(ValueError, match=f"{method!r} cannot run in a capturable refresh"):
            resolve_method(method, cuda, capturable=True)
