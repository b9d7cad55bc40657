"""Optimizer steps on fake CUDA tensors, on a CPU-only torch, with their host reads counted.

``FakeTensorMode`` runs every op on shapes, dtypes and devices alone: a CUDA tensor mixed
with a CPU one raises ``FakeTensorDeviceMismatchError`` as the GPU would, and an op without
a fake kernel raises too. What it cannot do alone is read a value: a fake tensor has none.
``HostReads`` sits above it and gives every fake tensor a real **twin** on the CPU: each op
runs on the fake tensors (the device check) and then on their twins (the values, with
``cuda`` read as ``cpu``), so a host read returns the value the same step computes on the
CPU and the step takes the CPU run's branches. The reads are counted where a GPU would
wait for the device, that is on CUDA tensors:

- ``aten._local_scalar_dense``: ``.item()``, ``bool(t)``, ``int(t)``, and one per element
  of ``tolist()``;
- the error-flag check of a ``torch.linalg`` function (a ``_local_scalar_dense`` nested in
  its kernel, which the CPU profiler counts): ``aten._linalg_check_errors``, and the kernels
  that check inside (``_linalg_eigh``, ``_linalg_svd``), whose fake kernels do not;
- a blocking copy to the host (``.cpu()``); a ``non_blocking`` one (into pinned memory,
  its landing told by a ``torch.cuda.Event``) waits for nothing and is not counted;
- an output whose shape depends on the values (``nonzero``).

A read of a CPU tensor (a step counter, placement indices) is free on a GPU too: answered
from its twin, not counted. The CPU profiler cannot tell the two apart (on the CPU every
tensor is a host tensor): where it counts reads of host counters (``torch.optim.AdamW``'s
``step.item()``), this count is the lower, and the one a GPU sees.

What a CPU-only torch cannot do on a fake CUDA tensor, and how this module goes around it
(none of it is a check the fake mode would make):

- autograd aborts the process: the forward runs with parameters that do not require grad
  (Dobb's statistics hooks still see it: grad mode is on), and ``.grad`` is set directly;
- random initialisation on the device: values are drawn on the CPU and copied over;
- Python indexing (``t[i]``, ``t[:, None]``, ``t[idx] = v``), ``~t``, ``t.copy_(u)``,
  ``int(t)`` and ``float(t)`` take a CUDA device guard first: ``Unguarded`` runs the aten
  ops they would dispatch (``slice``, ``select``, ``unsqueeze``, ``index``, ``index_put_``,
  ``bitwise_not``, ``copy_``, ``_local_scalar_dense``), each checked by the fake mode;
- a CUDA ``torch.Generator`` needs the CUDA library: a CPU one stands in (the fake mode
  does not check a generator's device; the twins draw what the CPU run draws);
- pinned host memory and ``torch.cuda.Event`` need it too: memory is not pinned, and an
  event has always completed.
"""

import traceback
from collections import Counter

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._subclasses.fake_tensor import (
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.weak import WeakTensorKeyDictionary

from bench.tools.opcount import OpCounter
from dobb.registry import build_optimizer

aten = torch.ops.aten
SCALAR_READ = aten._local_scalar_dense.default
# ops that read a CUDA input's values on the host: the error flag (``_linalg_check_errors``)
# and kernels that check theirs inside (their fake kernels do not dispatch the check)
CHECKS = (aten._linalg_check_errors.default, aten._linalg_eigh.default, aten._linalg_svd.default)
COPIES = (aten._to_copy.default, aten.copy_.default)
CPU = torch.device("cpu")
# One fake mode and one twin table for every block: the library caches small device
# tensors (Jacobi's round-robin layout), and a fake tensor works only in the mode that made it.
FAKE_MODE = FakeTensorMode()
TWINS = WeakTensorKeyDictionary()  # fake tensor -> its real values, on the CPU


class HostReads(TorchDispatchMode):
    """Runs every op on the fake tensors and on their CPU twins; counts the host reads of
    CUDA tensors (``total``; ``sites``: the op and the library line of each)."""

    def __init__(self):
        super().__init__()
        self.sites: list[tuple[str, str]] = []

    @property
    def total(self) -> int:
        return len(self.sites)

    def by_site(self) -> Counter:
        return Counter(self.sites)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is SCALAR_READ:
            if _on_cuda(args[0]):
                self._count(func)
            with unset_fake_temporarily():
                return twin(args[0]).item()
        if func in CHECKS and _on_cuda(args[0]):
            self._count(func)
        if func in COPIES and _to_host(func, args, kwargs):
            if not kwargs.get("non_blocking", len(args) > 2 and args[2]):
                self._count(func)  # a non-blocking copy (to pinned memory) does not wait
        if kwargs.get("pin_memory"):  # no pinned allocator without CUDA; fake memory anyway
            kwargs = {**kwargs, "pin_memory": False}
        with unset_fake_temporarily():
            real_out = func(*tree_map(_real, args), **tree_map(_real, kwargs))
            if func is aten.lift_fresh.default:  # torch.tensor(...): the fake mode keeps
                real_out = real_out.clone()  # this one as its constant; the twin is a copy
        try:
            out = func(*args, **kwargs)
        except DynamicOutputShapeException:  # nonzero & co: the GPU reads the size
            self._count(func)
            out = tree_map(_fake_like(args), real_out)
        for fake, real in zip(tree_leaves(out), tree_leaves(real_out)):
            if isinstance(fake, FakeTensor):
                TWINS[fake] = real
        return out

    def _count(self, func) -> None:
        frames = [f for f in traceback.extract_stack() if "/dobb/" in f.filename]
        where = f"{frames[-1].filename.split('/dobb/')[-1]}:{frames[-1].lineno}" if frames else "?"
        self.sites.append((func.__name__, where))


def twin(t: Tensor) -> Tensor:
    """The real values of ``t`` (itself if real); ``KeyError`` naming it if unknown."""
    if not isinstance(t, FakeTensor):
        return t
    if t not in TWINS:
        if t.constant is None:
            raise KeyError(f"a fake tensor with no values: {t}, made outside HostReads")
        with unset_fake_temporarily():  # the fake mode updates its constant: take a copy
            TWINS[t] = t.constant.clone()
    return TWINS[t]


def _real(x):
    """An op argument for the twins' run: tensors as their twins, every device the CPU."""
    if isinstance(x, Tensor):
        return twin(x)
    if isinstance(x, torch.device):
        return CPU
    return x


def _fake_like(args):
    """Fake tensors on the device of ``args``' first tensor, shaped like real outputs."""
    device = next(t.device for t in tree_leaves(args) if isinstance(t, Tensor))

    def fake(x):
        if not isinstance(x, Tensor):
            return x
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=device)

    return fake


class Unguarded(TorchFunctionMode):
    """``Tensor.__getitem__`` / ``__setitem__`` / ``__invert__`` / ``copy_`` / ``__int__`` /
    ``__float__`` as the aten ops they dispatch, without their device guard. Indexing:
    basic indices (int, slice, None, ``...``) as views, then one ``aten.index``
    (``index_put_``) for the tensor indices, at the dims they reach."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is Tensor.__invert__:
            return torch.bitwise_not(args[0])
        if func is Tensor.copy_:
            return aten.copy_.default(*args, **(kwargs or {}))
        if func in (Tensor.__int__, Tensor.__float__):  # a read: _local_scalar_dense
            return (int if func is Tensor.__int__ else float)(aten._local_scalar_dense(args[0]))
        if func is Tensor.__getitem__:
            view, tensors = _basic_indexing(*args)
            return aten.index.Tensor(view, tensors) if any(t is not None for t in tensors) else view
        if func is Tensor.__setitem__:
            target, index, value = args
            view, tensors = _basic_indexing(target, index)
            if not isinstance(value, Tensor):
                value = torch.tensor(value, dtype=target.dtype, device=target.device)
            if any(t is not None for t in tensors):
                aten.index_put_.default(view, tensors, value)
            else:
                aten.copy_.default(view, value)
            return None
        return func(*args, **(kwargs or {}))


def _basic_indexing(t: Tensor, index) -> tuple[Tensor, list[Tensor | None]]:
    """``t`` indexed by the basic parts of ``index``, and the tensor indices per dim of the
    result (None where a dim is taken whole), as torch's ``applySlicing`` splits them."""
    index = index if isinstance(index, tuple) else (index,)
    consumed = sum(_dims_taken(i) for i in index)
    tensors: list[Tensor | None] = []
    dim = 0
    for i in index:
        if i is Ellipsis:
            dim += t.ndim - consumed
            tensors += [None] * (t.ndim - consumed)
        elif i is None:
            t = t.unsqueeze(dim)
            tensors.append(None)
            dim += 1
        elif isinstance(i, slice):
            t = aten.slice.Tensor(t, dim, i.start, i.stop, 1 if i.step is None else i.step)
            tensors.append(None)
            dim += 1
        elif isinstance(i, Tensor) or isinstance(i, list):
            i = torch.as_tensor(i, device=t.device) if isinstance(i, list) else i
            tensors.append(i)
            dim += 1 if i.dtype != torch.bool else i.ndim
        else:  # an integer
            t = t.select(dim, i)
    return t, tensors


def _dims_taken(index) -> int:
    """How many dims of the indexed tensor ``index`` takes (``...`` and None: none)."""
    if index is None or index is Ellipsis:
        return 0
    if isinstance(index, Tensor) and index.dtype == torch.bool:
        return index.ndim
    return 1


def _on_cuda(t) -> bool:
    return isinstance(t, Tensor) and t.device.type == "cuda"


def _to_host(func, args, kwargs) -> bool:
    """True for a copy of a CUDA tensor into host memory (``.cpu()``, ``copy_``)."""
    if func is aten.copy_.default:
        return args[0].device.type == "cpu" and _on_cuda(args[1])
    device = kwargs.get("device")
    return _on_cuda(args[0]) and device is not None and torch.device(device).type == "cpu"


class FakeCuda:
    """``with FakeCuda() as reads:`` fake CUDA tensors (``FakeTensorMode``) with ``HostReads``
    above it; ``reads`` counts the host reads of the block."""

    def __enter__(self) -> HostReads:
        self._modes = [FAKE_MODE, HostReads(), Unguarded()]
        for mode in self._modes:
            mode.__enter__()
        self._saved = torch.Generator, torch.cuda.Event
        torch.Generator, torch.cuda.Event = HostGenerator, CompletedEvent
        return self._modes[1]

    def __exit__(self, *exc) -> None:
        torch.Generator, torch.cuda.Event = self._saved
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


class CompletedEvent:
    """``torch.cuda.Event`` on a CPU-only torch: every event has completed."""

    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True


_GENERATOR = torch.Generator


class HostGenerator(_GENERATOR):
    """``torch.Generator(device)`` on a CPU-only torch: a CPU generator for any device."""

    def __new__(cls, device=None) -> torch.Generator:
        return _GENERATOR()


class SmallModel(nn.Module):
    """Model-like parameters for the optimizers: an embedding and a head (the scalar group),
    two hidden Linears of one shape (a stack of two, one with a bias) and one of another."""

    def __init__(self, width: int = 8, hidden: int = 12, vocab: int = 10):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.fc = nn.Linear(width, hidden)
        self.gate = nn.Linear(width, hidden, bias=False)
        self.proj = nn.Linear(hidden, width, bias=False)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.wte(tokens)
        return self.head(self.proj(F.gelu(self.fc(x)) * self.gate(x)))


def small_model(device: str, seed: int = 0) -> SmallModel:
    """``SmallModel`` on ``device`` (``"cpu"``, or ``"cuda:0"`` inside ``FakeCuda``: a CUDA
    device without an index asks the CUDA library which is current), its parameters drawn
    on the CPU from ``seed``: the same values on either device."""
    with torch.device("meta"):
        model = SmallModel()
    generator = torch.Generator().manual_seed(seed)
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            value = torch.randn(p.shape, generator=generator) / p.shape[-1] ** 0.5
            setattr(module, name, nn.Parameter(value.to(device)))
    return model


def prepare_step(model: SmallModel, opt, step: int) -> None:
    """The forward (Dobb's statistics hooks) and gradients of training step ``step``,
    without autograd: grad mode on, parameters not requiring grad, ``.grad`` drawn on the
    CPU (from ``step``) and copied to the parameter's device."""
    params = list(model.parameters())
    device = params[0].device
    for p in params:
        p.requires_grad_(False)
    generator = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, model.wte.num_embeddings, (2, 8), generator=generator)
    with torch.enable_grad():
        model(tokens.to(device))
    for p in params:
        p.requires_grad_(True)
        p.grad = torch.randn(p.shape, generator=generator).to(device)


def run_steps(name: str, steps: int, reads: HostReads | None = None, **options):
    """``steps`` steps of registry optimizer ``name`` (constructor ``options``) on a
    ``small_model``: on fake CUDA if ``reads`` (the ``HostReads`` of an active ``FakeCuda``),
    else on the CPU. Returns the host reads of each ``opt.step()`` (fake CUDA: ``reads``;
    CPU: the profiler's ``OpCounter.host_reads``), the optimizer and the model."""
    model = small_model("cpu" if reads is None else "cuda:0")
    opt = build_optimizer(name, model, **options)
    counts = []
    for step in range(steps):
        prepare_step(model, opt, step)
        if reads is None:
            with OpCounter() as counter:
                opt.step()
            counts.append(counter.host_reads)
        else:
            before = reads.total
            opt.step()
            counts.append(reads.total - before)
    return counts, opt, model
