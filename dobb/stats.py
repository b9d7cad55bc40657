"""Input-activation statistics: per-block second moments gathered by forward pre-hooks.

For a layer ``y = x Wᵀ`` with ``W`` of shape ``(d_out, d_in)``, every forward pass in
training mode adds ``A_b += X_bᵀ X_b`` for each input block ``b`` (``X`` is the input
flattened to ``(N, d_in)``) and ``n += N``. At the optimizer step the token average
``S_b = A_b / n`` is taken and the accumulators reset.
"""

import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from dobb.blocks import BlockStack

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch built without distributed support
    DTensor = ()


@dataclass(frozen=True)
class LayerSpec:
    """Where a layer keeps its weight, and which weight dim multiplies the layer's input."""

    weight: str = "weight"
    input_dim: int = 1  # 1: (d_out, d_in) as nn.Linear;  0: (d_in, d_out) as GPT-2's Conv1D


_LAYERS: dict[type[nn.Module], LayerSpec] = {nn.Linear: LayerSpec()}


def register_layer(layer_type: type[nn.Module], weight: str = "weight", input_dim: int = 1):
    """Let ``track`` and ``param_groups`` treat ``layer_type`` like ``nn.Linear``.

    The layer's forward must compute ``x @ W.T`` (``input_dim=1``) or ``x @ W``
    (``input_dim=0``) on its first positional input ``x``.
    """
    if input_dim not in (0, 1):
        raise ValueError(f"input_dim must be 0 or 1, got {input_dim}")
    _LAYERS[layer_type] = LayerSpec(weight, input_dim)


def tracked_layers() -> dict[type[nn.Module], LayerSpec]:
    """Registered layer types, plus ``transformers``' ``Conv1D`` once that is imported."""
    conv1d = getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)
    return {**_LAYERS, conv1d: LayerSpec(input_dim=0)} if conv1d else dict(_LAYERS)


def layer_weights(model: nn.Module) -> Iterator[tuple[nn.Module, Tensor, LayerSpec]]:
    """``(module, weight, spec)`` for every module of a tracked layer type in ``model``."""
    layers = tracked_layers()
    for module in model.modules():
        spec = next((s for t, s in layers.items() if isinstance(module, t)), None)
        weight = getattr(module, spec.weight, None) if spec else None
        if weight is not None:
            yield module, weight, spec


class BlockStatistics:
    """Running sums ``A`` (one ``(count, size, size)`` tensor per stack) and token count."""

    def __init__(self, stacks: tuple[BlockStack, ...], dtype: torch.dtype, device):
        self.stacks = stacks
        self.width = stacks[-1].stop - stacks[0].start
        self.sums = [
            torch.zeros(s.count, s.size, s.size, dtype=dtype, device=device) for s in stacks
        ]
        self.tokens = 0

    @torch.no_grad()
    def add(self, x: Tensor) -> None:
        """Accumulate ``x`` of shape ``(..., width)``: the layer input's local columns."""
        if isinstance(x, DTensor):  # row-parallel TP input: this rank's columns only
            x = x.to_local()
        x = x.detach().reshape(-1, x.shape[-1])  # (N, width)
        if x.shape[-1] != self.width:
            raise ValueError(f"activation has {x.shape[-1]} features, expected {self.width}")
        if self.sums[0].device != x.device:  # the model moved after track()
            self.sums = [total.to(x.device) for total in self.sums]
        offset = self.stacks[0].start
        for total, s in zip(self.sums, self.stacks):
            cols = x[:, s.start - offset : s.stop - offset].to(total.dtype)
            blocks = cols.unflatten(1, (s.count, s.size)).transpose(0, 1)  # (count, N, size)
            total.baddbmm_(blocks.transpose(1, 2), blocks)  # A_b += X_bᵀ X_b
        self.tokens += x.shape[0]

    def pop_mean(self) -> list[Tensor] | None:
        """``S_b = A_b / n`` for every stack, then reset; None if nothing was seen."""
        if self.tokens == 0:
            return None
        means = [total / self.tokens for total in self.sums]
        for total in self.sums:
            total.zero_()
        self.tokens = 0
        return means

    def reset(self) -> None:
        for total in self.sums:
            total.zero_()
        self.tokens = 0


def statistics_hook(stats: BlockStatistics):
    """A forward pre-hook feeding ``stats``; active only in training mode with grad on."""

    def hook(module: nn.Module, args) -> None:
        if module.training and torch.is_grad_enabled():
            stats.add(args[0])

    return hook
