"""The call-time benchmarks' workload: a model's hidden matrices as a stack of Linear
layers with fixed inputs and output cotangents, and the statistics hooks' overhead on it."""

from collections.abc import Callable
from contextlib import nullcontext

import torch
from torch import Tensor, nn

from bench.model.workload import Matrix
from bench.tools.timing import spread, timed
from dobb.optim.dobb import BLOCK_WIDTH
from dobb.stats import BlockStatistics, GramCache, block_stacks, statistics_hook

Progress = Callable[[str], None]


class LinearStack(nn.Module):
    """Every matrix as a bias-free ``nn.Linear`` fed a fixed input of its width.

    ``forward()`` returns ``sum_l <layer_l(X), C>``: ``X`` is a token batch of the layer's
    input width, one per ``Matrix.input`` (q, k and v share theirs, as in a GPT), and ``C``
    a fixed cotangent of its output width, so ``W.grad = Cᵀ X``. The inputs require grad,
    so the backward pass also computes input gradients, as a real network's does.
    """

    def __init__(self, matrices: list[Matrix], tokens: int, *, device=None, seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.matrices = matrices
        # "blocks.0.attn.q" -> "blocks_0_attn_q": ModuleDict keys may not contain dots
        self.layers = nn.ModuleDict(
            {
                m.name.replace(".", "_"): nn.Linear(m.d_in, m.d_out, bias=False, device=device)
                for m in matrices
            }
        )
        self.sources = {m.name.replace(".", "_"): m.input for m in matrices}
        widths = {m.input: m.d_in for m in matrices}
        self.inputs = {
            src: correlated_tokens(tokens, d, gen).to(device) for src, d in widths.items()
        }
        for x in self.inputs.values():
            x.requires_grad_(True)
        outs = sorted({m.d_out for m in matrices})
        self.cotangents = {d: torch.randn(tokens, d, generator=gen).to(device) for d in outs}

    def forward(self) -> Tensor:
        loss = 0.0
        for key, layer in self.layers.items():
            y = layer(self.inputs[self.sources[key]])  # (N, d_out)
            loss = loss + (y * self.cotangents[layer.out_features]).sum()
        return loss

    def clear_input_grads(self) -> None:
        for x in self.inputs.values():
            x.grad = None


def correlated_tokens(tokens: int, width: int, gen: torch.Generator) -> Tensor:
    """``(tokens, width)`` activations with unequal feature scales and a shared low-rank
    part, so that the second moment has a spread spectrum (as real activations do)."""
    scales = torch.randn(width, generator=gen).mul_(0.5).exp_()
    shared = torch.randn(tokens, 16, generator=gen) @ torch.randn(16, width, generator=gen)
    return torch.randn(tokens, width, generator=gen) * scales + 0.5 * shared


def autocast_context(device: torch.device, autocast: bool):
    return torch.autocast(device.type, dtype=torch.bfloat16) if autocast else nullcontext()


def forward_backward(stack: LinearStack, autocast: bool) -> None:
    stack.zero_grad(set_to_none=True)
    stack.clear_input_grads()
    device = next(stack.parameters()).device
    with torch.enable_grad(), autocast_context(device, autocast):
        loss = stack()
    loss.backward()


def input_blocks(width: int, num_blocks: int | None) -> tuple:
    """The input blocks of a ``width``-column layer: ``num_blocks`` of them, or (None) as
    the library's defaults cut them, near-equal blocks of at most ``BLOCK_WIDTH``."""
    return block_stacks(width, num_blocks if num_blocks is not None else -(-width // BLOCK_WIDTH))


def hook_overhead(
    stack: LinearStack,
    *,
    num_blocks: int | None,
    repeats: int,
    autocast: bool = False,
    progress: Progress = lambda _: None,
) -> dict:
    """Forward+backward of ``stack`` with and without statistics hooks, alternated, and
    the hooks alone. Leaves the gradients of the last pass in ``.grad``. ``num_blocks``
    input blocks per layer (the paper's 16), or None: blocks of at most ``BLOCK_WIDTH``
    columns, as the library's defaults cut them (the recommended configuration)."""
    device = next(stack.parameters()).device
    cache = GramCache()  # as Dobb.track: layers fed one input (q, k, v) share X_bᵀ X_b
    stats = {
        key: BlockStatistics(
            input_blocks(layer.in_features, num_blocks), torch.float32, device, cache=cache
        )
        for key, layer in stack.layers.items()
    }

    def with_hooks():
        handles = [
            stack.layers[key].register_forward_pre_hook(statistics_hook(s))
            for key, s in stats.items()
        ]
        try:
            forward_backward(stack, autocast)
        finally:
            for h in handles:
                h.remove()
            for s in stats.values():
                s.reset()

    def hooks_alone():
        with autocast_context(device, autocast):
            for key, s in stats.items():
                s.add(stack.inputs[stack.sources[key]])
        for s in stats.values():
            s.reset()

    plain, hooked, alone = [], [], []
    stack.train()
    for i in range(repeats + 1):  # the first round warms up
        t_plain = timed(lambda: forward_backward(stack, autocast), device)
        t_hooked = timed(with_hooks, device)
        t_alone = timed(hooks_alone, device)
        if i:
            plain.append(t_plain)
            hooked.append(t_hooked)
            alone.append(t_alone)
            progress(
                f"hooks {i}/{repeats}: fwd+bwd {t_plain * 1e3:.1f} ms, with hooks "
                f"{t_hooked * 1e3:.1f} ms, hooks alone {t_alone * 1e3:.1f} ms"
            )
    forward_backward(stack, autocast)  # gradients for the optimizers
    plain_s, hooked_s, alone_s = spread(plain), spread(hooked), spread(alone)
    return {
        "forward_backward_s": plain_s,
        "forward_backward_hooks_s": hooked_s,
        "hooks_alone_s": alone_s,
        "share_difference": (hooked_s["median"] - plain_s["median"]) / hooked_s["median"],
        "share_hooks_alone": alone_s["median"] / (plain_s["median"] + alone_s["median"]),
    }
