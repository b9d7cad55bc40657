"""A CPU shim for running torchtitan 0.3 on gloo in tests: a test fixture, not a feature.

torchtitan targets accelerators. On a CPU-only machine it needs, before it builds anything:

- the device probe: ``torchtitan.tools.utils`` falls back to ``"cuda"`` when no accelerator
  is found; here the device is ``cpu`` and the device module a small stand-in for
  ``torch.cuda``'s memory calls (which report zeros);
- gloo has no ``ReduceOp.PREMUL_SUM``, which FSDP2 uses once torchtitan sets a gradient
  divide factor; FSDP2 is told to reduce with SUM and divide afterwards (the same math);
- ``triton``, imported by torchtitan's model package for its GPU kernels: when it is not
  installed, those kernel modules are replaced by stubs (no kernel runs on CPU);
- ``torch.distributed.set_timeout`` (newer than torch 2.13), with which torchtitan shortens
  the timeouts after step 1: the timeouts are kept;
- attention: the test's config selects SDPA instead of FlexAttention (see
  ``titan_configs.py``);
- grouped GEMMs: ``torch._grouped_mm``'s backward fails on CPU in torch 2.13 (``Invalid
  strides/sizes``), so the routed experts (``GroupedExperts._grouped_mm``, torchtitan's own
  seam for other kernels) run one matmul per expert over its rows between consecutive
  offsets (the same product; rows past the last offset, padding, are zeros); under expert
  parallelism it multiplies each rank's local experts, and torchtitan's all-to-all token
  dispatch (``AllToAllTokenDispatcher``: uneven ``all_to_all_single``) runs on gloo as it
  is: nothing more is needed for EP (its jobs set ``--training.disable_cuda_graphs``,
  which torchtitan's config asks for with that dispatcher on any device);
- pipeline schedules: torchtitan 0.3 hands its microbatches, already split, to
  ``schedule.step(arg_mbs=, kwarg_mbs=, target_mbs=)``, a signature newer than torch
  2.13's, whose ``step`` splits a whole batch itself (and would take those three lists for
  model keyword arguments); the schedules are taught that call, running their own
  ``_step_microbatches`` on the lists as given (not CPU-specific: any torch 2.13 job).

``install()`` must run in each rank's process before torchtitan's modules are imported.
"""

import importlib.util
import inspect
import sys
import types

import torch


class _Anything:
    """Stands for any ``triton`` attribute: callable, subscriptable, a decorator."""

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # @triton.jit
        return self

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self

    def __getitem__(self, key):
        return self


# torchtitan modules holding Triton GPU kernels that its model package imports
TRITON_KERNEL_MODULES = ("torchtitan.distributed.minimal_async_ep.kernels",)


def _stub_triton_kernels() -> None:
    """Stand-ins for ``TRITON_KERNEL_MODULES`` when ``triton`` is not installed (never
    ``triton`` itself: torch's inductor probes for it)."""
    if importlib.util.find_spec("triton") is not None:
        return

    def anything(attr: str):
        if attr.startswith("__"):  # module machinery (__file__, __path__): absent
            raise AttributeError(attr)
        return _Anything()

    for name in TRITON_KERNEL_MODULES:
        module = types.ModuleType(name)
        module.__getattr__ = anything
        sys.modules[name] = module


class CpuDeviceModule:
    """``torch.cpu`` plus the ``torch.cuda`` memory calls torchtitan makes (zeros)."""

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    def set_device(self, device) -> None:
        pass

    def reset_peak_memory_stats(self, *args) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def memory_stats(self, *args) -> dict:
        return {
            "active_bytes.all.peak": 0,
            "reserved_bytes.all.peak": 0,
            "num_alloc_retries": 0,
            "num_ooms": 0,
        }

    def get_device_name(self, *args) -> str:
        return "cpu"

    def get_device_properties(self, *args):
        return types.SimpleNamespace(total_memory=1 << 40, name="cpu")

    def device_count(self) -> int:
        return 1

    def current_device(self) -> int:  # an index, as barrier(device_ids=...) wants
        return 0


def _sum_then_divide() -> None:
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives

    factors = collectives._get_gradient_divide_factors

    def gloo_factors(rs_group, ar_group, dtype, device_type="", factor=None, force_sum=False):
        return factors(rs_group, ar_group, dtype, device_type, factor, True)

    collectives._get_gradient_divide_factors = gloo_factors


def _keep_timeouts() -> None:
    """torchtitan shortens every group's timeout after step 1 with
    ``torch.distributed.set_timeout``, which torch 2.13 lacks; keep the timeouts."""
    if hasattr(torch.distributed, "set_timeout"):
        return
    import torchtitan.distributed.utils as dist_utils

    dist_utils.set_pg_timeouts = lambda timeout, parallel_dims: torch.distributed.barrier()


def _step_with_microbatches(schedule_class) -> None:
    """``schedule_class.step`` also takes torchtitan's pre-split microbatches: with
    ``arg_mbs``/``kwarg_mbs``/``target_mbs`` given, it prepares the stages as torch's
    ``step`` does (backward flag, runtime state cleared) and runs ``_step_microbatches`` on
    them; a call without them is torch's own ``step``."""
    whole_batch_step = schedule_class.step
    if "arg_mbs" in inspect.signature(whole_batch_step).parameters:
        return

    def step(self, *args, arg_mbs=None, kwarg_mbs=None, target_mbs=None, **kwargs):
        if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
            return whole_batch_step(self, *args, **kwargs)
        assert not args, "positional inputs and microbatches together"
        losses, return_outputs = kwargs.pop("losses", None), kwargs.pop("return_outputs", True)
        loss_kwargs = kwargs.pop("loss_kwargs", None)
        assert not kwargs, f"unexpected arguments {sorted(kwargs)}"
        for stage in getattr(self, "_stages", None) or [self._stage]:
            stage.has_backward = self._has_backward
            stage.clear_runtime_states()
        self._step_microbatches(
            arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs
        )
        assert not return_outputs, "torchtitan asks for no outputs"

    schedule_class.step = step


def _grouped_mm_per_expert() -> None:
    """``GroupedExperts._grouped_mm`` as a loop: ``A[offs[e-1]:offs[e]] @ B_t[e]``."""
    from torchtitan.models.common.moe import GroupedExperts

    def per_expert(self, *, A, B_t, offs):
        ends = offs.tolist()
        starts = [0, *ends[:-1]]
        out = A.new_zeros(A.shape[0], B_t.shape[-1])
        for e, (start, end) in enumerate(zip(starts, ends)):
            if end > start:
                out[start:end] = A[start:end] @ B_t[e]
        return out

    GroupedExperts._grouped_mm = per_expert


def install() -> None:
    """Apply the shim in this process (idempotent)."""
    if getattr(install, "done", False):
        return
    _stub_triton_kernels()
    import torchtitan.tools.utils as utils  # before any module copies its device names

    utils.device_type, utils.device_module = "cpu", CpuDeviceModule()
    utils.get_local_device = lambda: torch.device("cpu")
    _sum_then_divide()
    _keep_timeouts()
    from torch.distributed.pipelining import schedules

    for schedule_class in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
        _step_with_microbatches(schedule_class)
    _grouped_mm_per_expert()
    install.done = True
