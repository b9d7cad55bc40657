"""Dobb's statistics, from the hooks to the second moments its bases come from.

The lifecycle of one training step, for every tracked matrix (input block ``b`` of
``s_b`` columns, ``X_b`` the ``(N, s_b)`` slice of the layer's input, ``C_b`` ``(s_b, s_b)``):

.. code-block:: text

    hooks      A_b += X_bᵀ X_b, n += N on every forward pass in training mode (``dobb.stats``);
               two-sided with row_stats="outputs": the output gradients' moments likewise
    fold       S_b = A_b / n;  C_b <- S_b (first time)  else  C_b <- beta C_b + (1 - beta) S_b
               (also the gradient moments of basis_source="gradients" and of the row blocks
               with row_stats="gradients"); the accumulators reset
    average    C_b averaged over ``stats_group`` (the only communication of Dobb; a row
               block's over its side's groups), on refresh steps (exact, the EMA being
               linear) or every step
    sync       ``synchronize`` averages whatever was folded since the last average (before a
               checkpoint: every rank then saves the same C_b)

``DobbStatistics`` holds the hooks' accumulators and the bookkeeping; the ``C_b`` live in
the optimizer's state. Its interface is narrow: the optimizer hands it the layers to hook
with their layouts (``track``) and its matrices before a checkpoint (``synchronize``); its
core (``dobb.optim.dobb_core``) the matrices of a step, as ``Matrix`` entries (parameter,
state, group, layout: ``dobb.optim.dobb_layout``), to ``check_present``, ``fold`` and
``average``; ``pending_inputs`` / ``discard`` serve the non-finite check. Every phase loops
over a matrix's sides (input, row) alike.
"""

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from dobb._dtensor import local
from dobb.distributed.reduce import all_reduce_
from dobb.optim.base import state_dtype
from dobb.optim.batching import each, group_by, solo
from dobb.optim.dobb_layout import GRADIENTS, INPUT, ROW, Matrix, MatrixLayout
from dobb.stats import (
    BlockStatistics,
    GramCache,
    output_gradient_hook,
    statistics_hook,
    tracked_layers,
)

# A hooked side's source: what a missing one is called, its hook, where the hook goes.
HOOKS = {
    "activations": ("activation", statistics_hook, "register_forward_pre_hook"),
    "outputs": ("output-gradient", output_gradient_hook, "register_forward_hook"),
}


class DobbStatistics:
    """The statistics of one ``Dobb`` optimizer: hooks, accumulators, folding into the
    state's ``C_b``, and their average over each side's groups.

    ``name_of`` names a parameter in errors; ``batched(device)`` says whether same-shape
    matrices share kernels there (``MatrixOptimizer.batched``).
    """

    def __init__(self, *, name_of: Callable[[Tensor], str], batched: Callable[..., bool]):
        self.name_of, self.batched = name_of, batched
        self._stats: dict[Tensor, dict[str, BlockStatistics]] = {}  # param -> side -> sums
        self._gram_cache = GramCache()  # layers fed one input tensor (q, k, v) share X_bᵀ X_b
        self._hooks: list[RemovableHandle] = []
        self._unsynced: set[int] = set()  # ids of states with local statistics not yet averaged

    def track(self, layers: list[tuple[nn.Module, Tensor, MatrixLayout]]) -> list[RemovableHandle]:
        """Hook each ``(module, weight, layout)`` on every side of ``layout`` whose moments
        come from hooks: the input activations' blocks (a forward pre-hook), the output
        gradients' (a forward hook). Returns the handles (``untrack`` removes all).
        Statistics buffers follow the activations' device, so the model may move later.
        """
        handles = []
        for module, weight, layout in layers:
            if weight in self._stats:
                raise ValueError(f"{self.name_of(weight)} is already tracked")
            dtype, device = state_dtype(weight), local(weight).device
            hooked = {}
            for side in layout.sides:
                if not side.hooked:
                    continue
                cache = self._gram_cache if side.source == "activations" else None
                stats = hooked[side.name] = BlockStatistics(side.stacks, dtype, device, cache)
                _, hook, register = HOOKS[side.source]
                handles.append(getattr(module, register)(hook(stats)))
            if hooked:
                self._stats[weight] = hooked
        self._hooks += handles
        if not handles:
            raise ValueError(
                "track() found no layer whose weight is in a Dobb group; known layer types: "
                f"{[t.__name__ for t in tracked_layers()]}"
            )
        return handles

    def untrack(self) -> None:
        """Remove every hook ``track`` added and drop the pending statistics."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._stats.clear()
        self._gram_cache.clear()

    def _hooked(self) -> list[tuple[Tensor, BlockStatistics]]:
        """``(param, BlockStatistics)`` of every hook: input sides, then row sides."""
        return [(p, s[name]) for name in (INPUT, ROW) for p, s in self._stats.items() if name in s]

    def pending_inputs(self) -> list[tuple[Tensor, Tensor]]:
        """``(param, sum)`` of every accumulator holding this step's tokens (to check that
        they are finite before anything changes)."""
        return [(p, t) for p, s in self._hooked() if s.seen for t in s.sums]

    def discard(self) -> None:
        """Drop this step's accumulated statistics (a skipped or failed step)."""
        for _, stats in self._hooked():
            stats.reset()

    def check_present(self, matrices: list[tuple[Tensor, MatrixLayout]]) -> None:
        """``RuntimeError`` before any state changes if one of ``matrices`` (those that need
        this step's statistics) lacks a hooked side's."""
        for param, layout in matrices:
            hooked = self._stats.get(param, {})
            missing = [
                HOOKS[side.source][0]
                for side in layout.sides
                if side.hooked and (side.name not in hooked or not hooked[side.name].seen)
            ]
            if missing:
                raise RuntimeError(
                    f"{self.name_of(param)} has no {missing[0]} statistics for this step. "
                    "Call opt.track(model) before the forward pass (it hooks nn.Linear "
                    "layers) and backward through the layer, route the parameter to "
                    "algorithm='adamw', or construct Dobb with missing_stats='identity'."
                )

    def _gradient_moments(self, matrices: list[Matrix]) -> dict:
        """This step's gradient moments of every side whose source is the gradient,
        ``{(index into matrices, side name): [per stack]}``: ``G_bᵀ G_b / d_out`` on the
        input side (``basis_source="gradients"``), ``G_r G_rᵀ / d_in`` on the row side
        (two-sided, ``row_stats="gradients"``); one ``bmm`` per stack for each batch of
        same-shape matrices (matrix by matrix on CPU)."""
        entries = [  # (index into matrices, side)
            (i, side)
            for i, m in enumerate(matrices)
            for side in m.layout.sides
            if side.stacks and side.source == GRADIENTS
        ]

        def key(n: int) -> tuple:
            i, side = entries[n]
            grad = local(matrices[i].param.grad)
            momentum = matrices[i].state["momentum"]
            layout = (side.name, tuple(grad.shape), side.dim, side.stacks)
            batched = self.batched(grad.device)
            return *layout, grad.dtype, momentum.dtype, grad.device, *solo(n, batched)

        moments = {}
        batches = group_by(range(len(entries)), key)
        for (name, _, dim, stacks, _, dtype, *_), members in batches.items():
            chunk = [entries[n][0] for n in members]
            grads = torch.stack([local(matrices[i].param.grad) for i in chunk]).to(dtype)
            grads = grads.mT if dim == 0 else grads  # (n, other, blocked dim)
            per_stack = []
            for s in stacks:
                cols = grads[..., s.start : s.stop].unflatten(-1, (s.count, s.size))
                cols = cols.movedim(-2, 1)  # (n, count, other, size)
                per_stack.append((cols.mT @ cols / max(1, grads.shape[1])).unbind(0))
            for j, i in enumerate(chunk):
                moments[(i, name)] = [m[j] for m in per_stack]
        return moments

    def _sources(self, index: int, matrices: list[Matrix], moments: dict) -> list[tuple]:
        """``(covs, source)`` for each side of ``matrices[index]`` that has moments:
        ``source`` is the hooks' ``BlockStatistics`` (None if never tracked) or this step's
        moments (``_gradient_moments``)."""
        param, state, _, layout = matrices[index]
        sources = []
        for side in layout.sides:
            if side.stacks and side.source in HOOKS:
                hooked = self._stats.get(param, {}).get(side.name)
                sources.append((side.covs(state), hooked))
            elif side.stacks and side.source == GRADIENTS:
                sources.append((side.covs(state), moments[(index, side.name)]))
        return sources

    def fold(
        self, matrices: list[Matrix], stats_steps: list | None = None, live: Tensor | None = None
    ):
        """Fold this step's moments ``S_b`` into ``C_b`` for every matrix that has them.

        ``C_b <- S_b`` the first time, else ``C_b <- beta C_b + (1 - beta) S_b``, where
        ``S_b = A_b / n`` (``A_b``: the hooks' sums over ``n`` tokens, both on the device,
        then reset), for the input blocks and (two-sided) the row blocks alike. A matrix
        folds only when every side has moments. Returns every matrix's ``stats_steps``
        after the fold, counted from ``stats_steps`` (capturable: the host's counts, and
        ``live`` 0 keeps ``C_b``) or else read from the CPU counters.
        """
        if stats_steps is None:
            stats_steps = torch.stack([m.state["stats_steps"] for m in matrices]).tolist()
        stats_steps = list(stats_steps)
        folding, sums, tokens = [], [], []  # (index, sources); hook sums and token counts
        moments = self._gradient_moments(matrices)
        for i in range(len(matrices)):
            sources = self._sources(i, matrices, moments)
            hooks = [src for _, src in sources if not isinstance(src, list)]
            if not sources or any(h is None or not h.seen for h in hooks):
                for h in hooks:
                    if h is not None:
                        h.reset()
                continue
            folding.append((i, sources))
            for h in hooks:
                sums += h.sums
                tokens += [h.tokens] * len(h.sums)
                h.seen = False
        if not folding:
            return stats_steps
        hook_means = iter(torch._foreach_div(sums, tokens) if sums else [])  # device n
        if sums:
            torch._foreach_zero_([*sums, *dict.fromkeys(tokens)])  # each counter once
        self._gram_cache.clear()
        first, later = ([], []), {}  # (covs, means) to copy; beta -> (covs, means) to lerp
        for i, sources in folding:
            covs = [cov for side, _ in sources for cov in side]
            means = [
                mean
                for side, src in sources
                for mean in (src if isinstance(src, list) else [next(hook_means) for _ in side])
            ]
            _, state, group, _ = matrices[i]
            beta = group["stats_beta"]
            target = first if stats_steps[i] == 0 else later.setdefault(beta, ([], []))
            target[0].extend(covs)
            target[1].extend(means)
            stats_steps[i] += 1
            self._unsynced.add(id(state))
        for covs, means in (first, *later.values()) if live is not None else ():
            means[:] = [torch.where(live.bool(), m, c) for c, m in zip(covs, means)]
        if first[0]:
            torch._foreach_copy_(*first)
        for beta, (covs, means) in later.items():
            torch._foreach_lerp_(covs, means, 1 - beta)
        counters = [matrices[i].state["stats_steps"] for i, _ in folding]
        torch._foreach_add_(counters, 1.0 if live is None else each(live, counters))
        return stats_steps

    def average(self, matrices: list[Matrix]) -> None:
        """Average every side's ``C`` over that side's groups (the only communication of
        Dobb): the input blocks' over the data ranks, two-sided Dobb's row blocks' over the
        ranks they were computed on (``dobb.optim.dobb_layout.matrix_layout``)."""
        covs, groups = [], []
        for m in matrices:
            for side in m.layout.sides:
                new = side.covs(m.state)
                covs += new
                groups += [side.groups] * len(new)
        all_reduce_(covs, groups, average=True)
        self._unsynced -= {id(m.state) for m in matrices}

    def mark_synced(self) -> None:
        """Every ``C_b`` is now the same on every rank (just loaded from a checkpoint)."""
        self._unsynced.clear()

    def synchronize(self, matrices: list[Matrix]) -> None:
        """Average the ``C_b`` of those of ``matrices`` (every matrix with state) folded since
        their last average (a collective under DP): exact at any time, the EMA being linear.
        Every data-parallel rank must call it."""
        unsynced = [m for m in matrices if id(m.state) in self._unsynced]
        if unsynced:
            self.average(unsynced)
