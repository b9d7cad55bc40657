"""Activation statistics: shared Gram products across layers, 16-bit products, op counts."""

import gc
import weakref
from collections import Counter

import pytest
import torch
from multirank import run_ranks
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from dobb.stats import (
    BlockStack,
    BlockStatistics,
    GramCache,
    block_grams,
    block_stacks,
    gram_dtype,
    statistics_hook,
)

WIDTH = 30
STACKS = block_stacks(WIDTH, 4)  # ragged: 2 blocks of 8, 2 of 7 (two stacks)


class Ops(TorchDispatchMode):
    """Counts the aten ops dispatched inside the ``with`` block, by name."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func._schema.name] += 1  # without the overload
        return func(*args, **(kwargs or {}))


def reference_sums(inputs, stacks=STACKS):
    """``sum over inputs of X_bᵀ X_b`` per block, in float64, one block at a time."""
    sums = [torch.zeros(s.count, s.size, s.size, dtype=torch.float64) for s in stacks]
    for x in inputs:
        x = x.detach().reshape(-1, x.shape[-1]).double()
        for total, s in zip(sums, stacks):
            for b in range(s.count):
                cols = x[:, s.start + b * s.size : s.start + (b + 1) * s.size]
                total[b] += cols.T @ cols
    return sums


class QKV(nn.Module):
    """Three layers fed one input (as attention's q, k, v), then one fed another."""

    def __init__(self, width=WIDTH):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(width, 8, bias=False) for _ in range(3))
        self.proj = nn.Linear(8, width, bias=False)

    def forward(self, x):
        h = self.q(x) * self.k(x) + self.v(x)
        return self.proj(torch.tanh(h))


def hooked(model, cache, stacks=STACKS):
    """Statistics for q, k, v (``stacks``) and proj (its own layout), hooks registered."""
    stats = {}
    for name in ("q", "k", "v", "proj"):
        layer = getattr(model, name)
        layout = stacks if name != "proj" else block_stacks(layer.in_features, 2)
        stats[name] = BlockStatistics(layout, torch.float32, "cpu", cache=cache)
        layer.register_forward_pre_hook(statistics_hook(stats[name]))
    return stats


def run_micro_batches(cache, batches, *, use_checkpoint=False):
    torch.manual_seed(0)
    model = QKV()
    stats = hooked(model, cache)
    for x in batches:
        out = checkpoint(model, x, use_reentrant=False) if use_checkpoint else model(x)
        out.square().sum().backward()
    return stats


def batches(seed=0, sizes=((2, 5), (3, 4), (1, 7))):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*size, WIDTH, generator=gen) for size in sizes]


# ----------------------------------------------------------------------------- sharing
def test_shared_sums_are_bit_identical_to_unshared_and_correct():
    xs = batches()
    shared = run_micro_batches(GramCache(), xs)
    alone = run_micro_batches(None, xs)
    expected = reference_sums(xs)
    for name in ("q", "k", "v"):
        for s, a, e in zip(shared[name].sums, alone[name].sums, expected):
            assert torch.equal(s, a)
            torch.testing.assert_close(s.double(), e, rtol=1e-5, atol=1e-4)


def test_micro_batches_count_tokens_per_layer():
    xs = batches()
    stats = run_micro_batches(GramCache(), xs)
    tokens = sum(x.shape[0] * x.shape[1] for x in xs)  # 10 + 12 + 7: each forward once
    assert {name: int(s.tokens) for name, s in stats.items()} == dict.fromkeys(stats, tokens)
    means = stats["k"].pop_mean()
    for mean, e in zip(means, reference_sums(xs)):
        torch.testing.assert_close(mean.double(), e / tokens, rtol=1e-5, atol=1e-6)
    assert stats["k"].tokens == 0 and not stats["k"].seen  # pops are per layer
    assert stats["q"].tokens == tokens and stats["q"].seen


def test_activation_checkpointing_counts_each_token_once_like_the_plain_path():
    """The recompute in backward adds nothing: shared, unshared and plain agree bit for bit."""
    xs = batches(sizes=((2, 5), (3, 4)))
    shared = run_micro_batches(GramCache(), xs, use_checkpoint=True)
    alone = run_micro_batches(None, xs, use_checkpoint=True)
    plain = run_micro_batches(GramCache(), xs)
    for name in shared:
        assert shared[name].tokens == alone[name].tokens == plain[name].tokens == 22
        for s, a, p in zip(shared[name].sums, alone[name].sums, plain[name].sums):
            assert torch.equal(s, a) and torch.equal(s, p)


def test_in_place_change_between_hooks_is_a_new_input():
    x = torch.randn(6, WIDTH)
    cache = GramCache()
    first, second = (BlockStatistics(STACKS, torch.float32, "cpu", cache=cache) for _ in "ab")
    first.add(x)
    x.mul_(2)  # same storage, shape and strides: only _version tells
    second.add(x)
    for a, b in zip(first.sums, second.sums):
        torch.testing.assert_close(b, 4 * a)


def test_views_of_one_input_share_and_other_layouts_do_not():
    x = torch.randn(2, 3, WIDTH)
    cache = GramCache()
    shifted = tuple(BlockStack(s.start + 60, s.size, s.count) for s in STACKS)  # a TP shard
    layouts = [STACKS, STACKS, shifted, block_stacks(WIDTH, 7)]  # 7: two stacks too
    stats = [BlockStatistics(st, torch.float32, "cpu", cache=cache) for st in layouts]
    with Ops() as ops:
        stats[0].add(x)
        stats[1].add(x.view(2, 3, WIDTH))  # another tensor object, same data
        stats[2].add(x)
        stats[3].add(x)
    assert len(cache) == 2  # one entry per relative block layout
    assert ops.ops["aten::bmm"] == len(STACKS) + len(layouts[3])
    for st, s in zip(layouts, stats):
        relative = tuple(BlockStack(b.start - st[0].start, b.size, b.count) for b in st)
        for total, e in zip(s.sums, reference_sums([x], relative)):
            torch.testing.assert_close(total.double(), e, rtol=1e-5, atol=1e-4)


def test_cache_holds_no_tensor_after_pop_and_never_keeps_inputs_alive():
    cache = GramCache()
    stats = run_micro_batches(cache, batches(sizes=((2, 5),)))
    x = torch.randn(4, WIDTH)
    stats["q"].add(x)
    assert len(cache) == 1  # x is alive: its entry stays until the step pops
    stats["q"].pop_mean()
    assert len(cache) == 0
    stats["k"].add(x)
    alive = weakref.ref(x)
    del x
    gc.collect()
    assert alive() is None and len(cache) == 0  # a freed input takes its entry with it


def test_cache_keeps_the_most_recent_inputs_only():
    x, y = torch.randn(4, WIDTH), torch.randn(4, WIDTH)
    products = []
    for max_entries in (1, 2):
        cache = GramCache(max_entries)
        stats = BlockStatistics(STACKS, torch.float32, "cpu", cache=cache)
        with Ops() as ops:
            for z in (x, x, y, x):  # x, x share at any size; the last x only if x was kept
                stats.add(z)
        products.append(ops.ops["aten::bmm"] // len(STACKS))
        assert len(cache) == max_entries
    assert products == [3, 2]
    with pytest.raises(ValueError, match="max_entries must be >= 1"):
        GramCache(0)


def test_inference_tensors_are_not_cached():
    """An inference tensor has no version counter, so an in-place change would be unseen."""
    with torch.inference_mode():
        x = torch.randn(4, WIDTH)
    cache = GramCache()
    stats = BlockStatistics(STACKS, torch.float32, "cpu", cache=cache)
    stats.add(x)
    assert len(cache) == 0 and stats.tokens == 4 and stats.seen
    for total, e in zip(stats.sums, reference_sums([x])):
        torch.testing.assert_close(total.double(), e, rtol=1e-5, atol=1e-4)


# ----------------------------------------------------------------------------- precision
def test_16bit_products_match_fp32_within_bf16_tolerance():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, WIDTH, generator=gen) * torch.linspace(0.1, 3, WIDTH)
    exact = block_grams(x, STACKS, torch.float32, torch.float32)
    low = block_grams(x, STACKS, torch.bfloat16, torch.float32)
    for e, lo, ref in zip(exact, low, reference_sums([x])):
        torch.testing.assert_close(e.double(), ref, rtol=1e-5, atol=1e-4)
        scale = ref.diagonal(dim1=-2, dim2=-1).amax()
        assert (lo.double() - ref).abs().max() <= 2e-2 * scale  # bf16: 8 mantissa bits
        assert (lo.double() - ref).abs().max() > 0  # really read in 16 bits


def test_autocast_on_cpu_keeps_the_exact_path():
    """CPU's 16-bit bmm is slower than fp32, so CPU autocast keeps exact fp32 sums."""
    xs = batches()
    plain = run_micro_batches(GramCache(), xs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = run_micro_batches(GramCache(), xs)
    for name in ("q", "k", "v"):  # fed x itself (proj's input is a bf16 result)
        for a, b in zip(plain[name].sums, cast[name].sums):
            assert b.dtype == torch.float32 and torch.equal(a, b)
    assert gram_dtype(torch.device("cpu"), torch.float32) == torch.float32


def test_gram_dtype_outside_autocast_and_for_fp64_parameters():
    cpu = torch.device("cpu")
    assert gram_dtype(cpu, torch.float64) == torch.float64
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert gram_dtype(cpu, torch.float64) == torch.float64
    x = torch.randn(5, WIDTH, dtype=torch.float64)
    stats = BlockStatistics(STACKS, torch.float64, "cpu", cache=GramCache())
    stats.add(x)
    for total, e in zip(stats.sums, reference_sums([x])):
        torch.testing.assert_close(total, e, rtol=1e-12, atol=1e-12)


def test_bf16_input_outside_autocast_is_widened_once():
    x = torch.randn(8, WIDTH).bfloat16()
    stats = BlockStatistics(STACKS, torch.float32, "cpu")
    with Ops() as ops:
        stats.add(x)
    assert ops.ops["aten::_to_copy"] == 1  # one cast of the whole input, not one per stack
    for total, e in zip(stats.sums, reference_sums([x])):
        torch.testing.assert_close(total.double(), e, rtol=1e-5, atol=1e-4)


# ----------------------------------------------------------------------------- op counts
def count_hooks(cache):
    torch.manual_seed(0)
    layers = [nn.Linear(WIDTH, 8, bias=False) for _ in range(3)]
    stats = [BlockStatistics(STACKS, torch.float32, "cpu", cache=cache) for _ in layers]
    x = torch.randn(4, WIDTH)
    with Ops() as ops:
        for layer, s in zip(layers, stats):
            statistics_hook(s)(layer, (x,))
    return ops.ops


def test_three_layers_on_one_input_dispatch_one_layers_products():
    shared, alone = count_hooks(GramCache()), count_hooks(None)
    assert alone["aten::bmm"] == 3 * len(STACKS)
    assert shared["aten::bmm"] == len(STACKS)  # the products run once
    assert shared["aten::_foreach_add_"] == alone["aten::_foreach_add_"] == 3  # one add each
    assert shared["aten::add_"] == alone["aten::add_"] == 3  # n += N on the device
    reusing_layers_ops = sum(shared.values()) - sum(alone.values()) / 3
    assert reusing_layers_ops <= 2 * 2  # each of the two dispatches only its two adds


# ----------------------------------------------------------------------------- DTensor
def _row_parallel_rank(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.randn(3, 4, 2 * WIDTH, generator=torch.Generator().manual_seed(0))
    x = distribute_tensor(full, mesh, [Shard(2)])  # a row-parallel layer's input
    stacks = tuple(BlockStack(s.start + rank * WIDTH, s.size, s.count) for s in STACKS)
    cache = GramCache()
    stats = [BlockStatistics(stacks, torch.float32, "cpu", cache=cache) for _ in range(2)]
    for s in stats:
        s.add(x)
    local = full[..., rank * WIDTH : (rank + 1) * WIDTH]
    return (
        len(cache),
        all(torch.equal(a, b) for a, b in zip(stats[0].sums, stats[1].sums)),
        max(
            float((t.double() - e).abs().max())
            for t, e in zip(stats[1].sums, reference_sums([local]))
        ),
        int(stats[1].tokens),
    )


@pytest.mark.timeout(120)
def test_row_parallel_dtensor_inputs_share_local_products():
    for entries, equal, error, tokens in run_ranks(_row_parallel_rank, 2):
        assert entries == 1 and equal and error < 1e-4 and tokens == 12
