"""What one optimizer step dispatches, counted (never timed): kernels and host reads.

A non-refresh step of a batched optimizer costs a number of kernels set by the distinct
matrix shapes, not by the depth of the model, and reads the device at most once (the
non-finite check; Dion with randomized Cholesky QR once more, for its fallback). Counted
on the tiny GPT at 4 and 16 layers, on the batched path (``foreach=True``, the default
off the CPU), which the counts are about; the per-matrix path is a loop by design.
"""

import sys

import pytest
import torch
from opcount import count_step, count_steps, tiny_gpt

from bench.tools.opcount import OpCounter
from dobb.eigensolve import refresh_bases, resolve_method
from dobb.registry import build_optimizer
from dobb.stats import block_stacks
from dobb.train.model import GPT, gpt_config

BATCHED = [
    "dobb",
    "dobb_paper",
    "dobb_sign",
    "muon",
    "muonbp",
    "blockmuon",
    "dion",
    "normuon",
    "dion2",
    "nordion2",
]


@pytest.mark.parametrize("name", BATCHED)
def test_ops_per_step_do_not_grow_with_depth(name):
    # before batching, Dion dispatched 1031 ops at 4 layers and 4055 at 16, NorMuon 1011
    # and 3987, Dion2 932 and 3668
    shallow, deep = count_step(name, 4, foreach=True), count_step(name, 16, foreach=True)
    assert deep.total <= 1.15 * shallow.total, (shallow.total, deep.total, deep.ops)


@pytest.mark.parametrize("name", [name for name in BATCHED if name != "dion"])
def test_one_host_read_per_step(name):
    """Only the non-finite check reads the device (step counters live on the CPU)."""
    assert count_step(name, 4, foreach=True).host_reads == 1
    assert count_step(name, 16, foreach=True).host_reads == 1


@pytest.mark.parametrize("orthogonalize, reads", [("qr", 1), ("cholesky_qr", 2)])
def test_dion_reads_the_host_once_more_for_cholesky_qr(orthogonalize, reads):
    """Dion (97 reads at 4 layers before batching, 4 per matrix): the non-finite check,
    and with randomized Cholesky QR (the registry's default) one read of every matrix's
    factorization-failure flag, which decides where Householder QR must take over."""
    options = dict(orthogonalize=orthogonalize, foreach=True)
    assert count_step("dion", 4, **options).host_reads == reads
    assert count_step("dion", 16, **options).host_reads == reads


def test_eigh_refresh_reads_the_host_twice_per_block_size():
    """The reference ``eigh`` (Dobb's ``auto`` on CPU), step 11 (a warm refresh): each
    distinct block size's ``eigh`` reads its error flag (``_linalg_check_errors``, which a
    dispatch mode does not see) and ``eigenbasis`` checks its result once more."""
    counter = count_step("dobb_paper", 4, warmup_steps=10, num_blocks=3, foreach=True)
    widths = (32, 128)  # the tiny GPT's input widths: n_embd and the MLP's 4 n_embd
    sizes = {s.size for width in widths for s in block_stacks(width, 3)}
    assert counter.ops["aten::_linalg_eigh"] == len(sizes) == 4
    assert counter.nested_reads == len(sizes)
    assert counter.host_reads == 1 + 2 * len(sizes) == 9


@pytest.mark.parametrize("method", ["jacobi", "cholqr", "power_qr"])
@pytest.mark.parametrize("warmup_steps", [0, 10], ids=["cold", "warm"])
def test_batched_refresh_reads_the_host_only_for_the_non_finite_check(method, warmup_steps):
    """Every batched solver's refresh, the first (step 1: Jacobi from the identity, no eigh)
    and a warm one (step 11), reads the device once: the step's non-finite check. Before
    (profiler): 9 cold for every solver (eigh per block size), warm Jacobi 25 (an eigh per
    round), cholqr 5 (its guard once per block size), power_qr 1."""
    counter = count_step(
        "dobb_paper", 4, warmup_steps=warmup_steps, num_blocks=3, basis_method=method, foreach=True
    )
    assert counter.ops["aten::_linalg_eigh"] == 0, counter.ops
    assert counter.host_reads == 1
    # the statistics average looked up every matrix's placement (two aranges each, 48 here)
    # for row moments a one-sided matrix does not have
    assert counter.ops["aten::arange"] == 0


@pytest.mark.parametrize("name", [n for n in BATCHED if n != "blockmuon"])
def test_cpu_path_matrix_by_matrix_equals_the_batched_path(name):
    """On CPU the optimizers update matrix by matrix (stacking copies cost more than the
    launches they save there); both paths give the same parameters."""

    def train(batched: bool):
        model = tiny_gpt(4)
        opt = build_optimizer(name, model, foreach=batched)
        tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            model(tokens[:, :-1], tokens[:, 1:])[1].backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    per_matrix, batched = train(False), train(True)
    for a, b in zip(per_matrix, batched):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    batched_ops = count_step(name, 16, foreach=True).total
    assert count_step(name, 16, foreach=False).total > 2 * batched_ops  # matrix by matrix: a loop


def steady_bytes_per_element(**options) -> float:
    """Memory traffic of a steady Dobb step (``OpCounter.bytes``: what its ops read and
    write) per element of the Dobb matrices, batched, on a 1-layer GPT of width 128."""
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", n_layer=1, n_embd=128, n_head=4, block_size=16))
    counter = count_steps("dobb_paper", 0, model=model, foreach=True, **options)[0]
    opt_elements = sum(
        p.numel() for n, p in model.named_parameters() if "blocks" in n and p.ndim == 2
    )
    return counter.bytes / opt_elements


def test_bytes_per_steady_step():
    """Counted on 2026-12-01 (width 128; bytes per element): two-sided Dobb (4 row blocks,
    one input block) 264.9 -> 222.3 (width 256: 362.3 -> 217.3), one block 142.0 -> 139.4,
    16 blocks 89.7 -> 89.5. Each tile used to multiply its own copy of the row basis (now
    rows are rotated on whole row slabs) and the bases were stacked again every step (now
    kept between refreshes). bf16 projections: 16 blocks 83.6, two-sided 192.2. With large
    blocks the statistics' fold (``d_in x s`` per matrix, three passes) dominates."""
    two_sided = {"two_sided": True, "block_size": None, "num_blocks": 1, "row_blocks": 4}
    assert steady_bytes_per_element(**two_sided) < 235
    sixteen = steady_bytes_per_element()
    assert steady_bytes_per_element(projection_dtype="bfloat16") < 0.95 * sixteen


def refresh_counts(method: str, n: int, s: int) -> tuple[int, float]:
    """Ops and passes over the block stack of one warm-started ``refresh_bases`` call on
    ``n`` random PSD blocks of size ``s`` (a pass: reading or writing as many bytes as the
    ``(n, s, s)`` stack, ``OpCounter.bytes``), after a call on one block (Jacobi caches its
    schedule). The batched solvers' ops do not depend on the values."""
    x = torch.randn(n, s, s, generator=torch.Generator().manual_seed(0))
    cov, basis = x.mT @ x / s, torch.linalg.qr(x).Q
    refresh_bases([cov[:1]], [basis[:1]], method)
    with OpCounter() as counter:
        refresh_bases([cov], [basis], method)
    assert counter.host_reads == 0
    return counter.total, counter.bytes / (cov.numel() * cov.element_size())


def test_cuda_default_refresh_does_not_grow_with_the_block_size(monkeypatch):
    """What ``basis_method="auto"`` runs on CUDA without CuPy (``AUTO_CUDA``), counted on
    16 blocks: kernels and passes over the stack independent of ``s``. Counted on
    2026-12-02: cholqr 164 ops and 111 passes at s = 100 and 400; the previous default,
    jacobi, 11,216 and 44,816 ops, 4,919 and 19,319 passes (O(s) rounds a sweep)."""
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    method = resolve_method("auto", torch.device("cuda"))
    (ops, passes), (ops_400, passes_400) = (refresh_counts(method, 16, s) for s in (100, 400))
    assert ops == ops_400 <= 600
    assert max(passes, passes_400) <= 300
    jacobi = [refresh_counts("jacobi", 2, s)[0] for s in (20, 40)]  # ops do not depend on n
    assert jacobi[1] > 1.8 * jacobi[0] > 600
