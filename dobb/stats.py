"""Dobb's statistics: per-block second moments of a layer's inputs, gathered by hooks.

For a layer ``y = x Wᵀ`` with ``W`` of shape ``(d_out, d_in)``, every forward pass in
training mode adds ``A_b += X_bᵀ X_b`` (``(s_b, s_b)``) for each input block ``b`` of
``s_b`` columns (``X`` is the input flattened to ``(N, d_in)``, ``X_b`` its ``(N, s_b)``
slice) and ``n += N``. At the optimizer step the token average ``S_b = A_b / n`` is folded
into the optimizer's ``C_b`` (``dobb.optim.dobb_steps``) and the accumulators reset.
``DobbStatistics`` holds one optimizer's hooks and sums, and is the step's ``inputs`` to the
driver (``dobb.optim.base``): what must be finite, what a step without them does, what a
skipped step drops.

Blocks: ``d_in`` is split into ``B`` contiguous, near-equal blocks (``block_stacks``): the
first ``d_in % B`` blocks have ``ceil(d_in / B)`` columns, the rest ``floor(d_in / B)``.
Blocks of one size form a *stack* (``BlockStack``), so every per-block quantity is a
batched ``(count, size, size)`` tensor and a matrix has at most two stacks.

Cost: layers that share a ``GramCache`` and are fed the same input tensor (``q``, ``k``,
``v``) compute its products once. Under bf16/fp16 autocast on an accelerator the products
read the input in 16 bits and accumulate in fp32 (``gram_dtype``); elsewhere they are exact
fp32 (fp64 for fp64 parameters).
"""

import itertools
import sys
import weakref
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

from dobb._dtensor import DTensor


@dataclass(frozen=True)
class BlockStack:
    """``count`` consecutive blocks of ``size`` columns starting at column ``start``."""

    start: int
    size: int
    count: int

    @property
    def stop(self) -> int:
        return self.start + self.size * self.count


def block_stacks(d_in: int, num_blocks: int) -> tuple[BlockStack, ...]:
    """Near-equal contiguous blocks of ``range(d_in)``; ``num_blocks > d_in`` gives size 1."""
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    num_blocks = min(num_blocks, d_in)
    size, big = divmod(d_in, num_blocks)
    stacks = [BlockStack(0, size + 1, big)] if big else []
    stacks.append(BlockStack(big * (size + 1), size, num_blocks - big))
    return tuple(s for s in stacks if s.count)


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


def gram_dtype(device: torch.device, out_dtype: torch.dtype) -> torch.dtype:
    """The dtype in which the products ``X_bᵀ X_b`` read ``x``, summing into ``out_dtype``.

    Under autocast to bf16 or fp16 on an accelerator, the autocast dtype, as the layer's
    own GEMM reads it: fp32 accumulation where ``bmm`` has ``out_dtype`` (CUDA), else a
    bf16 product (fp16 products could overflow, so fp16 then keeps fp32). Otherwise
    ``out_dtype``: exact fp32 (fp64 for fp64 parameters). CPU keeps fp32 under autocast:
    its 16-bit ``bmm`` ran 2.0-2.7x slower than fp32 on our 2-core development machine.
    """
    kind = device.type
    if out_dtype != torch.float32 or kind == "cpu" or not torch.is_autocast_enabled(kind):
        return out_dtype
    dtype = torch.get_autocast_dtype(kind)
    if dtype == torch.bfloat16 or (dtype == torch.float16 and _has_out_dtype(device, dtype)):
        return dtype
    return out_dtype


_OUT_DTYPE_BMM: dict[tuple[str, torch.dtype], bool] = {}


@torch.compiler.assume_constant_result  # traced code gets the answer, never the probe
def _has_out_dtype(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.bmm(a, b, out_dtype=torch.float32)`` runs for ``dtype`` inputs on
    ``device`` (CUDA on recent torch; not CPU). Probed once per device type and dtype."""
    key = (device.type, dtype)
    if key not in _OUT_DTYPE_BMM:
        probe = torch.zeros(1, 1, 1, dtype=dtype, device=device)
        try:
            torch.bmm(probe, probe, out_dtype=torch.float32)
            _OUT_DTYPE_BMM[key] = True
        except (RuntimeError, NotImplementedError, TypeError):
            _OUT_DTYPE_BMM[key] = False
    return _OUT_DTYPE_BMM[key]


def block_grams(
    x: Tensor, stacks: tuple[BlockStack, ...], compute_dtype: torch.dtype, out_dtype: torch.dtype
) -> list[Tensor]:
    """``X_bᵀ X_b`` for each stack, ``(count, size, size)``; ``X`` is ``x`` as ``(N, width)``.

    ``x`` holds columns ``stacks[0].start`` onward. The products read ``X`` in
    ``compute_dtype`` (one cast of the whole input when its dtype differs; each block is a
    strided view, never a copy) and return ``out_dtype``, or the 16-bit product where the
    device has no 16-bit-in, fp32-out ``bmm``. Autocast is off inside: it would round the
    exact path's fp32 products to 16 bits.
    """
    x = x.detach().reshape(-1, x.shape[-1]).to(compute_dtype)  # (N, width)
    widen = compute_dtype != out_dtype and _has_out_dtype(x.device, compute_dtype)
    kind = x.device.type
    grams = []
    with torch.autocast(kind, enabled=False) if torch.is_autocast_enabled(kind) else nullcontext():
        for s in stacks:
            cols = x[:, s.start - stacks[0].start : s.stop - stacks[0].start]
            blocks = cols.unflatten(1, (s.count, s.size)).transpose(0, 1)  # (count, N, size)
            if widen:
                grams.append(torch.bmm(blocks.mT, blocks, out_dtype=out_dtype))
            else:
                grams.append(torch.bmm(blocks.mT, blocks))
    return grams


class GramCache:
    """Block Gram products of recent layer inputs, so that layers fed one tensor share them.

    Layers fed the same input in a forward pass (``q``, ``k`` and ``v`` of attention) would
    each compute ``X_bᵀ X_b``; with one cache the first computes it and the others reuse the
    result. An entry is keyed by what fixes the products: the input's address, shape,
    strides, dtype and device, the block layout relative to its first column, and the
    compute and output dtypes. It is used only while the tensor that made it is alive (a
    weak reference: the cache never keeps an input alive), still at that address and
    unmodified (its ``_version``, bumped by every in-place op on it or its views). An entry
    is dropped when its input is freed, when ``max_entries`` newer inputs have been seen (so
    a forward pass holds a few ``(d_in, size)`` results at most, not one per layer: layers
    that share an input usually run one after another), or at ``clear()``.
    """

    def __init__(self, max_entries: int = 4):
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._entries: dict[tuple, tuple[weakref.ref, int, list[Tensor]]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()

    def grams(
        self,
        x: Tensor,
        stacks: tuple[BlockStack, ...],
        compute_dtype: torch.dtype,
        out_dtype: torch.dtype,
    ) -> list[Tensor]:
        """``block_grams(x, stacks, compute_dtype, out_dtype)``, computed once per input."""
        if x.is_inference():  # no version counter: an in-place change could not be seen
            return block_grams(x, stacks, compute_dtype, out_dtype)
        layout = tuple((s.start - stacks[0].start, s.size, s.count) for s in stacks)
        address = x.data_ptr()
        key = (address, x.device, x.dtype, x.shape, x.stride(), layout, compute_dtype, out_dtype)
        entry = self._entries.get(key)
        if entry is not None:
            ref, version, grams = entry
            source = ref()
            if (
                source is not None
                and source.data_ptr() == address
                and source._version == version == x._version
            ):
                self._entries[key] = self._entries.pop(key)  # most recently used last
                return grams
        grams = block_grams(x, stacks, compute_dtype, out_dtype)
        entries = self._entries
        entries.pop(key, None)
        while len(entries) >= self.max_entries:
            del entries[next(iter(entries))]  # the least recently used

        def drop(dead: weakref.ref) -> None:  # the input was freed: its address may be reused
            if entries.get(key, (None,))[0] is dead:
                del entries[key]

        entries[key] = (weakref.ref(x, drop), x._version, grams)
        return grams


class BlockStatistics:
    """Running sums ``A`` (one ``(count, size, size)`` tensor per stack) and token count ``n``.

    ``tokens`` is a 0-d tensor on the sums' device, in their dtype (exact to 2^24 tokens per
    step in fp32, then rounded by at most 2^-24 relatively), so that adding to it reads
    nothing on the host and a compiled model traces it; ``seen`` (host) says whether
    anything was added since the last reset, and ``empty`` (host) whether those additions
    held no token (a layer called on 0 rows), both written only by the accumulating code
    that runs with real tensors (the row count is the shape's), never read in traced code.
    Layers that share a ``GramCache`` and are fed the same input tensor in one forward pass
    compute its products ``X_bᵀ X_b`` once; sums are bit-identical with or without a cache.
    """

    def __init__(
        self,
        stacks: tuple[BlockStack, ...],
        dtype: torch.dtype,
        device,
        cache: GramCache | None = None,
    ):
        self.stacks = stacks
        self.width = stacks[-1].stop - stacks[0].start
        self.sums = [
            torch.zeros(s.count, s.size, s.size, dtype=dtype, device=device) for s in stacks
        ]
        self.tokens = torch.zeros((), dtype=dtype, device=device)
        self.seen = False
        self.empty = True
        self.cache = cache
        # How the op ``dobb::observe`` finds this object: a CPU tensor, not an int, so that a
        # compiled block traces it as an input and every block shares one graph (an int
        # would be a constant guarded on, one recompile per layer).
        key = next(_KEYS)
        self.key = torch.tensor(key, device="cpu")
        _LIVE[key] = self

    def local_input(self, x: Tensor) -> Tensor:
        """``x`` as this rank's ``(..., width)`` columns, the sums moved to its device."""
        if isinstance(x, DTensor):  # this rank's features only (e.g. row-parallel TP input)
            x = x.to_local()
        if x.shape[-1] != self.width:
            raise ValueError(f"activation has {x.shape[-1]} features, expected {self.width}")
        if self.sums[0].device != x.device:  # the model moved after track()
            self.sums = [total.to(x.device) for total in self.sums]
            self.tokens = self.tokens.to(x.device)
        return x

    def observe(self, x: Tensor, forward: bool = False) -> None:
        """``add(x)`` gated as a forward pre-hook's input (``forward``) or not (an output
        gradient): ``gated``, which a compiler traces as the op ``dobb::observe``."""
        x = self.local_input(x)
        compute_dtype = gram_dtype(x.device, self.sums[0].dtype)
        gates = (compute_dtype, forward, torch.is_grad_enabled())
        if torch.compiler.is_compiling():
            observe_op(x, self.sums, self.tokens, self.key, *gates)
        else:
            self.gated(x, self.sums, self.tokens, *gates)

    def gated(
        self,
        x: Tensor,
        sums: list[Tensor],
        tokens: Tensor,
        compute_dtype: torch.dtype,
        forward: bool,
        grad_enabled: bool,
    ) -> None:
        """``accumulate(x, ...)`` if ``x`` is to be counted.

        ``forward``: ``x`` is a layer's input, counted unless this forward is an
        activation-checkpoint recompute in backward, or runs without grad outside a reentrant
        checkpoint's forward (``grad_enabled``: the grad mode where the hook ran, as a
        compiled graph runs its ops under no_grad). Else ``x`` is an output gradient, always
        counted. These checks read the autograd engine and the Python stack, so a compiled
        model runs them inside the op ``dobb::observe``, with real tensors."""
        if forward and in_backward():
            return
        if not forward or grad_enabled or in_reentrant_checkpoint_forward():
            self.accumulate(x, sums, tokens, compute_dtype)

    @torch.no_grad()
    def add(self, x: Tensor) -> None:
        """Accumulate ``x`` of shape ``(..., width)``: the layer input's local columns."""
        x = self.local_input(x)
        self.accumulate(x, self.sums, self.tokens, gram_dtype(x.device, self.sums[0].dtype))

    def accumulate(
        self, x: Tensor, sums: list[Tensor], tokens: Tensor, compute_dtype: torch.dtype
    ) -> None:
        """``A_b += X_bᵀ X_b`` into ``sums``, ``n += N`` into ``tokens``; ``X``: ``x`` as
        ``(N, width)``, its products read in ``compute_dtype`` (shared through the cache).
        ``sums``/``tokens`` are this object's (eager) or the compiled graph's copies of them."""
        out_dtype = sums[0].dtype
        if self.cache is not None:
            grams = self.cache.grams(x, self.stacks, compute_dtype, out_dtype)
        else:
            grams = block_grams(x, self.stacks, compute_dtype, out_dtype)
        torch._foreach_add_(sums, grams)  # A_b += X_bᵀ X_b
        tokens.add_(x.numel() // self.width)
        self.seen = True
        self.empty = self.empty and x.numel() == 0

    def pop_mean(self) -> list[Tensor] | None:
        """``S_b = A_b / n`` for every stack, then reset; None if nothing was seen."""
        if not self.seen:
            return None
        means = [total / self.tokens for total in self.sums]
        self.reset()
        return means

    def reset(self) -> None:
        """Zero the sums and the token count, and empty the shared cache."""
        torch._foreach_zero_([*self.sums, self.tokens])
        self.folded()
        if self.cache is not None:
            self.cache.clear()

    def folded(self) -> None:
        """Nothing added since: the host flags of sums the step has read (and zeroed)."""
        self.seen, self.empty = False, True


_KEYS = itertools.count()
_LIVE: "weakref.WeakValueDictionary[int, BlockStatistics | ExpertStatistics]"
_LIVE = weakref.WeakValueDictionary()


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread.

    A forward pass then is an activation-checkpoint recompute (``torch.utils.checkpoint``,
    reentrant or not, and ``checkpoint_wrapper``, which calls it): the same tokens again.
    """
    return torch._C._current_graph_task_id() != -1


# Reentrant checkpointing runs the forward under no_grad inside this function, and the
# recompute (with grad on) inside its backward.
_REENTRANT_FORWARD = torch.utils.checkpoint.CheckpointFunction.forward.__code__


def in_reentrant_checkpoint_forward() -> bool:
    """True inside the no-grad forward of ``checkpoint(..., use_reentrant=True)``."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _REENTRANT_FORWARD:
            return True
        frame = frame.f_back
    return False


def observe_tensor(
    x: Tensor,
    sums: list[Tensor],
    tokens: Tensor,
    key: Tensor,
    compute_dtype: torch.dtype,
    forward: bool,
    grad_enabled: bool,
) -> None:
    """A statistics hook's work in a compiled model: ``BlockStatistics.gated`` of the object
    whose ``key`` (a 0-d CPU tensor) this is, on ``sums`` and ``tokens`` (its own, or the
    compiled graph's copies of them)."""
    stats = _LIVE.get(int(key))
    if stats is not None:
        stats.gated(x, sums, tokens, compute_dtype, forward, grad_enabled)


# ``observe_tensor`` as one opaque op to a compiler. Python runs inside at every call (the
# checks, the cache), so a CUDA graph must not replay it: inductor leaves it out of its
# CUDA graphs (cudagraph_unsafe). Eager hooks call ``BlockStatistics.gated`` directly and
# skip the op's dispatch (~0.2 ms a call on our CPU, as much as a small layer's products).
observe_op = torch.library.custom_op(
    "dobb::observe",
    observe_tensor,
    mutates_args=("sums", "tokens"),
    tags=(torch.Tag.cudagraph_unsafe,),
)


@observe_op.register_fake
def _(x, sums, tokens, key, compute_dtype, forward, grad_enabled) -> None:
    """No outputs: the op only adds into ``sums`` and ``tokens``."""


def observe_experts_tensor(x: Tensor, offsets: Tensor, key: Tensor, grad_enabled: bool) -> None:
    """An expert stack's hook in a compiled model: ``ExpertStatistics.gated`` of the object
    whose ``key`` this is."""
    stats = _LIVE.get(int(key))
    if stats is not None:
        stats.gated(x, offsets, grad_enabled)


# ``observe_experts_tensor`` as one opaque op; it mutates no argument (the sums are made by
# its first call, their shape unknown before), so it is declared a side effect, which keeps
# it in a traced graph that uses none of its (no) outputs
observe_experts_op = torch.library.custom_op(
    "dobb::observe_experts",
    observe_experts_tensor,
    mutates_args=(),
    tags=(torch.Tag.cudagraph_unsafe,),
)
torch.fx.node.has_side_effect(torch.ops.dobb.observe_experts.default)


@observe_experts_op.register_fake
def _(x, offsets, key, grad_enabled) -> None:
    """No outputs."""


def statistics_hook(stats: BlockStatistics):
    """A forward pre-hook feeding ``stats`` each token once per forward pass: in training
    mode with grad on, or in the no-grad forward of reentrant activation checkpointing; never
    in a checkpoint's recompute during backward (the same tokens again, on backward's
    critical path). Traced by ``torch.compile`` without a graph break: what it reads here
    (``module.training``, grad and autocast modes, shapes) Dynamo guards on, and the rest
    is the op ``dobb::observe``."""

    def hook(module: nn.Module, args) -> None:
        if module.training:
            stats.observe(args[0], forward=True)

    return hook


def output_gradient_hook(stats: BlockStatistics):
    """A forward hook that feeds ``stats`` the gradient ``δ = dL/dy`` of the layer's output
    when backward reaches it (K-FAC's output factor ``E[δᵀδ]`` per block of output
    features); active only in training mode with grad on. Under activation checkpointing
    each ``δ`` still arrives once: a non-reentrant recompute's outputs get no gradient, and
    a reentrant checkpoint's forward runs without grad, its recompute's outputs getting the
    only ``δ``."""

    def hook(module: nn.Module, args, output: Tensor) -> None:
        if module.training and torch.is_grad_enabled() and output.requires_grad:
            output.register_hook(stats.observe)

    return hook


class ExpertStatistics:
    """Running sums per expert of one ``(E, d_out, d_in)`` expert stack's inputs: ``A_e,b +=
    X_e,bᵀ X_e,b`` and ``n_e += N_e``, where ``X_e`` are the ``N_e`` rows a grouped GEMM
    multiplies by expert ``e`` (the tokens routed to it).

    ``sums``: one ``(E_seen, count, size, size)`` tensor per stack of input blocks,
    ``tokens``: ``(E_seen,)``, made at the first call, where ``E_seen`` is the number of
    experts the module's grouped GEMM sees: this rank's (one process, DDP, expert
    parallelism), every expert (FSDP, which gathers the whole stack for the forward while
    each rank keeps some experts' state), or its expert-parallel rank's (FSDP over expert
    parallelism). ``window`` names them (``dobb.optim.experts.gemm_window``); the sums
    are added over the ranks that saw the same experts before the fold
    (``dobb.optim.dobb_steps``). An expert that got no rows adds
    nothing and its count stays. ``seen`` as ``BlockStatistics``' (host).

    Cost: one host read of the offsets per call (torchtitan's token dispatch reads the same
    counts), and per expert with rows one ``bmm`` per stack. In a compiled model the hook is
    the op ``dobb::observe_experts`` (no graph break; the sums are made by its first call,
    so the op mutates no argument and is kept as a side effect), which a CUDA graph leaves
    out (``cudagraph_unsafe``).
    """

    def __init__(self, stacks: tuple[BlockStack, ...], dtype: torch.dtype, device):
        self.stacks, self.dtype, self.device = stacks, dtype, device
        self.width = stacks[-1].stop - stacks[0].start
        self.sums: list[Tensor] | None = None
        self.tokens: Tensor | None = None
        self.seen = False
        self.window: tuple[int, ...] = ()  # the stack's experts the rows are (``place``)
        self.rows: dict[int, int] = {}  # an expert's number -> its row
        key = next(_KEYS)  # as BlockStatistics': how the compiled op finds this object
        self.key = torch.tensor(key, device="cpu")
        _LIVE[key] = self

    def observe(self, x: Tensor, offsets: Tensor) -> None:
        """Add ``x`` (``(N, width)`` rows sorted by expert) split at ``offsets``
        (``(E_seen,)`` cumulative row counts: expert ``e``'s rows end at ``offsets[e]``), as
        a forward input (``gated``); traced as the op ``dobb::observe_experts``."""
        if torch.compiler.is_compiling():
            observe_experts_op(x.detach(), offsets, self.key, torch.is_grad_enabled())
        else:
            self.gated(x, offsets, torch.is_grad_enabled())

    def place(self, window: tuple[int, ...]) -> None:
        """Name the rows: the ``window`` of the stack's experts the grouped GEMM saw, in
        order (``dobb.optim.experts.gemm_window``)."""
        if window != self.window:
            self.window, self.rows = window, {number: row for row, number in enumerate(window)}

    def gated(self, x: Tensor, offsets: Tensor, grad_enabled: bool) -> None:
        """``add`` unless in an activation-checkpoint recompute or without grad outside a
        reentrant checkpoint's forward (``BlockStatistics.gated``)."""
        if in_backward():
            return
        if grad_enabled or in_reentrant_checkpoint_forward():
            self.add(x, offsets)

    @torch.no_grad()
    def add(self, x: Tensor, offsets: Tensor) -> None:
        """Accumulate every expert's rows of ``x`` (see ``observe``)."""
        x = x.detach().reshape(-1, x.shape[-1])
        if x.shape[-1] != self.width:
            raise ValueError(f"expert input has {x.shape[-1]} features, expected {self.width}")
        experts = offsets.shape[0]
        if self.sums is None:
            self.sums = [
                torch.zeros(experts, s.count, s.size, s.size, dtype=self.dtype, device=x.device)
                for s in self.stacks
            ]
            self.tokens = torch.zeros(experts, dtype=self.dtype, device=x.device)
        if self.tokens.shape[0] != experts:
            raise ValueError(
                f"a grouped GEMM saw {experts} experts where it saw {self.tokens.shape[0]} before"
            )
        compute_dtype = gram_dtype(x.device, self.dtype)
        ends = offsets.tolist()  # the one host read
        for e, (start, stop) in enumerate(zip([0, *ends[:-1]], ends)):
            if stop > start:
                grams = block_grams(x[start:stop], self.stacks, compute_dtype, self.dtype)
                torch._foreach_add_([total[e] for total in self.sums], grams)
        self.tokens += torch.diff(offsets, prepend=offsets.new_zeros(1)).to(self.dtype)
        self.seen = True

    def reset(self) -> None:
        """Zero the sums and the token counts."""
        if self.sums is not None:
            torch._foreach_zero_([*self.sums, self.tokens])
        self.seen = False


class ExpertSlice:
    """One expert's part of an ``ExpertStatistics`` (``of``), as Dobb's fold reads a layer's
    ``BlockStatistics``: ``sums`` (``(count, size, size)`` views), ``tokens`` (a 0-d view),
    ``seen``, ``reset`` and ``folded`` (the whole stack's). The expert is number ``number`` of the
    stack; its row of the sums is its place in ``of.window``, the experts the grouped GEMM
    saw (set before each fold by Dobb's placement: ``dobb.optim.experts.gemm_window``)."""

    def __init__(self, of: ExpertStatistics, number: int):
        self.of, self.number = of, number

    @property
    def row(self) -> int:
        return self.of.rows[self.number]

    @property
    def seen(self) -> bool:
        return self.of.seen

    @seen.setter
    def seen(self, value: bool) -> None:
        self.of.seen = value

    @property
    def sums(self) -> list[Tensor]:
        return [total[self.row] for total in self.of.sums]

    @property
    def tokens(self) -> Tensor:
        return self.of.tokens[self.row]

    def reset(self) -> None:
        self.of.reset()

    def folded(self) -> None:
        """Nothing added since (``BlockStatistics.folded``): the whole stack's."""
        self.of.seen = False


@dataclass(frozen=True)
class ExpertsSpec:
    """How a grouped-experts module multiplies its stacks (``register_experts``)."""

    calls: tuple[str, ...]
    method: str = "_grouped_mm"


_EXPERT_MODULES: dict[type[nn.Module], ExpertsSpec] = {}


def register_experts(module_type: type[nn.Module], calls, method: str = "_grouped_mm") -> None:
    """Let ``Dobb.track`` gather per-expert statistics in ``module_type``'s modules.

    The protocol: a forward of such a module calls ``self.<method>(A, B_t, offs)`` (or with
    those keywords) once per expert stack, in the order of ``calls`` (the stacks' attribute
    names), where ``A`` is ``(N, d_in)`` rows sorted by expert, ``B_t`` the stack's
    ``(E, d_in, d_out)`` transpose (any dtype) and ``offs`` the ``(E,)`` cumulative row
    counts; it returns the ``(N, d_out)`` products (torchtitan's ``GroupedExperts``:
    ``calls=("w1_EFD", "w3_EFD", "w2_EDF")``, method ``_grouped_mm``).
    """
    _EXPERT_MODULES[module_type] = ExpertsSpec(tuple(calls), method)


def expert_modules(model: nn.Module) -> Iterator[tuple[nn.Module, ExpertsSpec]]:
    """``(module, spec)`` of every module of ``model`` of a registered experts type."""
    for module in model.modules():  # a subclass's registration before its base's
        spec = next(
            (_EXPERT_MODULES[t] for t in type(module).__mro__ if t in _EXPERT_MODULES), None
        )
        if spec is not None:
            yield module, spec


class GroupedMatmulHook:
    """Feeds each stack's ``ExpertStatistics`` the left operand of its grouped GEMM.

    It shadows ``module.<method>`` with a wrapper on the instance (the class's method, read
    at each call, still computes: a shim installed later is used), and counts the calls of a
    forward (a forward pre-hook resets the count) to tell the stacks apart by ``calls``. The
    right operand's shape is checked against the stack's, so that a module computing in
    another order raises rather than mixes its experts' statistics. ``remove`` undoes both.
    """

    def __init__(self, module: nn.Module, spec: ExpertsSpec, stats: dict[str, ExpertStatistics]):
        self.module, self.spec, self.stats, self.call = module, spec, stats, 0
        self._reset = module.register_forward_pre_hook(self._start)
        setattr(module, spec.method, self._wrapped)

    def _start(self, module, args) -> None:
        self.call = 0

    def _observe(self, name: str, a: Tensor, b_t: Tensor, offs: Tensor) -> None:
        stack = getattr(self.module, name)
        expected = (stack.shape[-1], stack.shape[-2])
        if tuple(b_t.shape[-2:]) != expected:
            raise RuntimeError(
                f"{type(self.module).__name__}.{self.spec.method} call {self.call} multiplies by "
                f"a {tuple(b_t.shape)} operand, but the registered order {self.spec.calls} "
                f"names {name}, whose transpose is (E, {expected[0]}, {expected[1]}); register "
                "the module's stacks in the order its forward multiplies by them "
                "(dobb.stats.register_experts)"
            )
        self.stats[name].observe(a, offs)

    def _wrapped(self, *args, **kwargs) -> Tensor:
        names = ("A", "B_t", "offs")
        bound = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
        name = self.spec.calls[self.call % len(self.spec.calls)]
        self.call += 1
        if self.module.training and name in self.stats:
            self._observe(name, bound["A"], bound["B_t"], bound["offs"])
        return getattr(type(self.module), self.spec.method)(self.module, *args, **kwargs)

    def remove(self) -> None:
        self._reset.remove()
        if self.module.__dict__.get(self.spec.method) == self._wrapped:
            delattr(self.module, self.spec.method)


# A hooked side's source: what a missing one is called, its hook, where the hook goes.
HOOKS = {
    "activations": ("activation", statistics_hook, "register_forward_pre_hook"),
    "outputs": ("output-gradient", output_gradient_hook, "register_forward_hook"),
}


def several_ranks() -> bool:
    """Whether this process is one of several ranks of an initialized process group."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def fsdp_data_ranks(model: nn.Module) -> int:
    """The most data ranks over which ``fully_shard`` shards a module of ``model`` (the mesh
    it shards over: its shard and replicate axes, never tensor-parallel ones); 1 if none. A
    pipeline stage sharded over one rank counts 1. FSDP2 keeps that mesh on a private
    attribute of each module that holds parameters of its own, one per parameter group
    (torchtitan's expert parallelism shards a block's experts on a mesh of their own); a
    module without (a root
    whose parameters all belong to its children, or a torch that renamed the attribute)
    counts 1: the first step's check of the ranks' statistics still refuses a drift."""
    ranks = 1
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)  # several: a mesh per parameter
        if groups is None:  # a torch before per-parameter meshes
            groups = [getattr(state, "_fsdp_param_group", None)]
        for group in groups:
            mesh = getattr(getattr(group, "mesh_info", None), "mesh", None)
            ranks = max(ranks, mesh.size() if mesh is not None else 1)
    return ranks
