"""The CUDA path checked without a GPU: every registry optimizer on fake CUDA tensors.

``tests/fake_cuda.py`` runs a step on ``FakeTensorMode`` CUDA tensors (a device mismatch
raises ``FakeTensorDeviceMismatchError``, an op without a fake kernel raises) with real CPU
twins behind them, so each host read returns what the CPU step reads and is counted where
a GPU would wait. For each optimizer of ``dobb.registry``: construction, four steps
with its periodic work (Dobb: a cold refresh at step 1, a warm one at step 3; MuonBP: full
steps at 1 and 3), a ``state_dict`` round trip into a fresh optimizer and a step after it.
Every state tensor must be on the device (step counters on the host unless capturable),
the twins must equal a CPU run of the same steps bit for bit, and the host reads of each
step must equal the profiler's count on the CPU. Dobb's variants (two-sided, Adam
coefficients, bf16 projections, capturable, each solver) are held alike. The
per-optimizer table in docs/gpu.md ("Checked on fake CUDA") is held to the measured counts.
"""

import functools
import re
from pathlib import Path

import pytest
import torch
from fake_cuda import FakeCuda, prepare_step, run_steps, twin

from bench.tools.opcount import OpCounter
from dobb.eigensolve import resolve_method
from dobb.optim.parts import COUNTERS
from dobb.registry import OPTIMIZERS, build_optimizer

STEPS = 4
CUDA = torch.device("cuda")
# each optimizer's periodic work within STEPS: Dobb refreshes at steps 1 (cold) and 3
# (warm), MuonBP takes full steps at 1 and 3 (blockmuon never does)
PERIODIC = {
    "dobb": {"basis_interval": 2},
    "dobb_sign": {"basis_interval": 2},
    "muonbp": {"period": 2},
}
# The CPU profiler also counts torch.optim.AdamW's reads of its step counters
# (``_get_value(step)``: ``.item()`` of a CPU tensor, free on a GPU, where the counters stay
# on the host); on fake CUDA they are host tensors, not counted. SmallModel has 6
# parameters: the multi-tensor AdamW (foreach) reads each counter twice (both bias
# corrections), the single-tensor one once.
HOST_COUNTER_READS = {("adamw", None): 2 * 6, ("adamw", False): 6}
DOC = Path(__file__).parents[1] / "docs" / "gpu.md"


def cpu_options(name: str, options: dict) -> dict:
    """``options`` for the CPU run of what ``options`` do on CUDA: ``foreach=None`` batched
    (matrix by matrix on the CPU), Dobb's ``"auto"`` solver as it resolves on CUDA (``eigh``
    on the CPU), so that both runs compute the same step."""
    entry = OPTIMIZERS[name]
    options = {**options, "foreach": True if options["foreach"] is None else options["foreach"]}
    if entry.cls.__name__ == "Dobb" and options.get("basis_method", "auto") == "auto":
        return {**options, "basis_method": resolve_method("auto", CUDA, options.get("capturable"))}
    return options


def round_trip(name: str, opt, model, step: int, **options):
    """``opt``'s state loaded into a fresh optimizer, ready for step ``step``."""
    if hasattr(opt, "untrack"):
        opt.untrack()
    fresh = build_optimizer(name, model, **options)
    saved = opt.state_dict()
    fresh.load_state_dict(saved)
    prepare_step(model, fresh, step)
    return fresh


def check_devices(opt, capturable: bool) -> None:
    """Every state tensor on CUDA; the step counters on the host unless ``capturable``."""
    for state in opt.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                host = key in COUNTERS and not capturable
                assert value.device.type == ("cpu" if host else "cuda"), (key, value.device)


@functools.cache
def measure(name: str, foreach: bool | None, **options) -> dict:
    """Host reads of each step (fake CUDA and the CPU profiler), and the parameters after
    the steps and the round trip (the fake run's twins, and the CPU run's)."""
    options = {**PERIODIC.get(name, {}), "foreach": foreach, **options}
    with FakeCuda() as reads:
        fake, opt, model = run_steps(name, STEPS, reads, **options)
        check_devices(opt, options.get("capturable", False))
        before = reads.total
        fresh = round_trip(name, opt, model, STEPS, **options)
        load_reads = reads.total - before
        check_devices(fresh, options.get("capturable", False))
        before = reads.total
        fresh.step()
        fake.append(reads.total - before)
        fake_params = [twin(p) for p in model.parameters()]
    options = cpu_options(name, options)
    cpu, opt, model = run_steps(name, STEPS, **options)
    fresh = round_trip(name, opt, model, STEPS, **options)
    with OpCounter() as counter:
        fresh.step()
    cpu.append(counter.host_reads)
    params = (fake_params, list(model.parameters()))
    sites = reads.by_site()  # (op, library line) -> reads: where a mismatch comes from
    return {"fake": fake, "cpu": cpu, "load": load_reads, "params": params, "sites": sites}


def check_against_cpu(result: dict, extra_cpu_reads: int = 0) -> None:
    """The fake run's parameters equal the CPU run's bit for bit, each step reads the host
    as often as the profiler counts on the CPU (less ``extra_cpu_reads``, reads of host
    tensors that only the CPU profiler counts), and building and loading read nothing."""
    for fake, cpu in zip(*result["params"], strict=True):
        assert torch.equal(fake, cpu)
    expected = [n - extra_cpu_reads for n in result["cpu"]]
    assert result["fake"] == expected, result["sites"]
    # state_dict, a fresh optimizer (Dobb's placement indices: host tensors), load, forward
    assert result["load"] == 0, result["sites"]


@pytest.mark.parametrize("foreach", [None, False], ids=["default", "matrix-by-matrix"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_optimizer_steps_on_fake_cuda(name, foreach):
    """Construction, steady and periodic steps, a round trip: no device mismatch, no op
    without a fake kernel, state on the device; the same parameters and host reads as on
    the CPU (``foreach=None``: batched on CUDA, and on the CPU here)."""
    check_against_cpu(measure(name, foreach), HOST_COUNTER_READS.get((name, foreach), 0))


DOBB_VARIANTS = {
    "two-sided, adam coefficients, bf16 projections": dict(
        two_sided=True, coefficients="adam", projection_dtype="bfloat16"
    ),
    "two-sided, capturable": dict(two_sided=True, capturable=True, nonfinite="skip"),
    "jacobi": dict(basis_method="jacobi"),
    "power_qr": dict(basis_method="power_qr"),
    "eigh": dict(basis_method="eigh"),  # reads each eigh's error flag and checks its result
    "lion scalars": dict(scalar_algorithm="lion"),
}


@pytest.mark.parametrize("variant", DOBB_VARIANTS)
def test_dobb_variants_step_on_fake_cuda(variant):
    check_against_cpu(measure("dobb", None, **DOBB_VARIANTS[variant]))


def test_capturable_dobb_reads_nothing_on_fake_cuda():
    """``capturable=True``: no host read in any step, refreshes included, on fake CUDA as
    with the CPU profiler; counters on the device. The first step after a load reads each
    matrix's two device counters once (``DobbCore._count``: the refresh schedule is kept
    on the host), 3 matrices here."""
    result = measure("dobb", None, capturable=True, nonfinite="skip")
    assert result["fake"] == result["cpu"] == [0] * STEPS + [2 * 3]
    for fake, cpu in zip(*result["params"], strict=True):
        assert torch.equal(fake, cpu)


def test_a_device_mismatch_and_a_device_read_are_caught():
    """The harness itself: a CPU tensor in a CUDA op raises; ``.item()`` of a CUDA tensor
    is counted and returns its value; a read of a host counter is free."""
    from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError

    with FakeCuda() as reads:
        x = torch.arange(4.0).to("cuda:0")
        with pytest.raises(FakeTensorDeviceMismatchError):
            x + torch.ones(4)
        step = torch.zeros(())
        step += 1
        assert int(step) == 1 and reads.total == 0
        assert x.sum().item() == 6.0 and reads.total == 1


def doc_table() -> dict[str, tuple[list[int], list[int]]]:
    """``{name: (fake CUDA reads, CPU profiler reads)}`` from docs/gpu.md's table."""
    section = DOC.read_text().split("## Checked on fake CUDA", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| ([\d, ]+) \| ([\d, ]+) \|", section, re.M)
    counts = lambda text: [int(n) for n in text.split(",")]  # noqa: E731
    return {name: (counts(fake), counts(cpu)) for name, fake, cpu in rows}


def test_the_doc_holds_the_measured_reads():
    table = doc_table()
    assert sorted(table) == sorted(OPTIMIZERS)
    for name, (fake, cpu) in table.items():
        result = measure(name, None)
        assert (fake, cpu) == (result["fake"], result["cpu"]), name
    text = " ".join(DOC.read_text().split("## Checked on fake CUDA", 1)[1].split())
    dion = int(re.search(r"Matrix by matrix, Dion reads (\d+) times", text)[1])
    assert [dion] * (STEPS + 1) == measure("dion", False)["fake"]
    after_load = int(re.search(r"and (\d+) times in the first step after a load", text)[1])
    assert after_load == measure("dobb", None, capturable=True, nonfinite="skip")["fake"][-1]
