"""Iterate averaging: an exponential moving average (EMA) of the weights, for evaluation.

With decay d in [0, 1) and w_t the weights after optimizer step t = 1, 2, ...:

    m_t = d * m_{t-1} + (1 - d) * w_t,   m_0 = 0
    ema_t = m_t / (1 - d**t)      bias-corrected: the weights (1 - d) d**(t-s) / (1 - d**t)
                                  of w_1 .. w_t sum to 1, the initial weights w_0 get none

kept directly as `ema_t = lerp(ema_{t-1}, w_t, (1 - d) / (1 - d**t))` (one
`torch._foreach_lerp_` per step): the first step copies w_1, later ones approach the
plain EMA weight 1 - d. d = 0 gives the live weights.

The averages are fp32 copies of the floating-point parameters, on their device; a DTensor
parameter (FSDP2, TP) gets a DTensor average with its placements, and the arithmetic runs
on the local shards. The trainer checkpoints `averages` (DCP reshards them like the model)
and `updates` (t).
"""

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from dobb._dtensor import local


class WeightEMA:
    """The bias-corrected EMA of `model`'s floating-point parameters (see the module doc)."""

    def __init__(self, model: nn.Module, decay: float):
        if not 0 <= decay < 1:
            raise ValueError(f"EMA decay {decay} is not in [0, 1)")
        base = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        self.decay, self.updates = decay, 0
        # names as in the unwrapped model's state dict, so a checkpoint moves between layouts
        self.params = {n: p for n, p in base.named_parameters() if p.is_floating_point()}
        with torch.no_grad():
            self.averages = {
                n: p.detach().to(torch.float32, copy=True) for n, p in self.params.items()
            }

    @torch.no_grad()
    def update(self) -> None:
        """After an optimizer step: ema <- lerp(ema, w, (1 - d) / (1 - d**t)), t += 1 first."""
        self.updates += 1
        weight = (1 - self.decay) / (1 - self.decay**self.updates)
        averages = [local(a) for a in self.averages.values()]
        weights = [local(p).float() for p in self.params.values()]  # fp32: no copy
        torch._foreach_lerp_(averages, weights, weight)

    def load(self, averages: dict[str, torch.Tensor], updates: int) -> None:
        """Take the averages (loaded from a checkpoint) and their count of updates t."""
        with torch.no_grad():
            for name, average in self.averages.items():
                if averages[name] is not average:
                    local(average).copy_(local(averages[name]))
        self.updates = updates

    @contextmanager
    def swapped_in(self, model: nn.Module) -> Iterator[None]:
        """The averages in the parameters for the block, the live weights copied back after.

        No-op before the first update (the average of no weights is taken to be the live
        weights). FSDP2 modules are resharded on both sides, so no all-gathered copy of one
        set of weights (the root module keeps its own after a no-grad forward) outlives it.
        """
        if not self.updates:
            yield
            return
        params = [local(p) for p in self.params.values()]
        with torch.no_grad():
            live = [p.clone() for p in params]
            _reshard(model)
            torch._foreach_copy_(params, [local(a) for a in self.averages.values()])
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(params, live)
                _reshard(model)


def _reshard(model: nn.Module) -> None:
    """Free FSDP2's unsharded parameters: the next forward all-gathers the shards again."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
