"""Dobb's statistics, from the hooks to the second moments its bases come from.

The lifecycle of one training step, for every tracked matrix (input block ``b`` of
``s_b`` columns, ``X_b`` the ``(N, s_b)`` slice of the layer's input, ``C_b`` ``(s_b, s_b)``):

.. code-block:: text

    hooks      A_b += X_bᵀ X_b, n += N on every forward pass in training mode (``dobb.stats``);
               two-sided with row_stats="outputs": the output gradients' moments likewise
    fold       S_b = A_b / n;  C_b <- S_b (first time)  else  C_b <- beta C_b + (1 - beta) S_b
               (also the gradient moments of basis_source="gradients" and of the row blocks
               with row_stats="gradients"); the accumulators reset
    average    C_b averaged over ``stats_group`` (the only communication of Dobb), on refresh
               steps (exact, the EMA being linear) or every step
    sync       ``synchronize`` averages whatever was folded since the last average (before a
               checkpoint: every rank then saves the same C_b)

``DobbStatistics`` holds the hooks' accumulators and the bookkeeping; the ``C_b`` live in
the optimizer's state. The optimizer calls ``check_present``, ``fold`` and ``average`` from
its step, ``pending_inputs`` / ``discard`` from the non-finite check.
"""

from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from dobb._dtensor import local
from dobb.distributed.placement import matrix_placement
from dobb.distributed.reduce import all_reduce_
from dobb.optim.base import state_dtype
from dobb.optim.batching import each, group_by, solo
from dobb.stats import (
    BlockStatistics,
    GramCache,
    layer_weights,
    output_gradient_hook,
    statistics_hook,
    tracked_layers,
)

STACK_KEYS = (("cov", "basis"), ("cov_tail", "basis_tail"))  # at most two block sizes
ROW_KEYS = (("row_cov", "row_basis"), ("row_cov_tail", "row_basis_tail"))  # two-sided


def tracks_outputs(group: dict[str, Any]) -> bool:
    """True if the group's row moments come from output-gradient hooks (two-sided Dobb)."""
    return group["two_sided"] and group["row_stats"] == "outputs"


class DobbStatistics:
    """The statistics of one ``Dobb`` optimizer (``opt``): hooks, accumulators, folding
    into the state's ``C_b``, and their average over ``data_groups`` (one process group per
    data axis; empty: one process)."""

    def __init__(self, opt, data_groups: list, *, missing_stats: str, stats_sync: str):
        self.opt = opt
        self.data_groups = data_groups
        self.missing_stats = missing_stats
        self.stats_sync = stats_sync
        self._stats: dict[Tensor, BlockStatistics] = {}
        self._row_stats: dict[Tensor, BlockStatistics] = {}  # two-sided, row_stats="outputs"
        self._gram_cache = GramCache()  # layers fed one input tensor (q, k, v) share X_bᵀ X_b
        self._hooks: list[RemovableHandle] = []
        self._unsynced: set[int] = set()  # ids of states with local statistics not yet averaged

    def track(self, model: nn.Module) -> list[RemovableHandle]:
        """Hook every layer of ``model`` whose weight is in a Dobb group.

        Layer types: ``nn.Linear``, ``transformers``' ``Conv1D`` (weight stored as
        ``(d_in, d_out)``: blocks run along its dim 0), and any type added with
        ``dobb.stats.register_layer``. Returns the hook handles (``untrack`` removes all).
        Statistics buffers follow the activations' device, so the model may move later.
        """
        groups = {
            p: g
            for g in self.opt.param_groups
            if g["algorithm"] == self.opt.algorithm
            and (g["basis_source"] == "activations" or tracks_outputs(g))
            for p in g["params"]
        }
        handles = []
        for module, weight, spec in layer_weights(model):
            if weight not in groups:
                continue
            if weight in self._stats or weight in self._row_stats:
                raise ValueError(f"{self.opt.name_of(weight)} is already tracked")
            group, dtype, device = groups[weight], state_dtype(weight), local(weight).device
            if spec.input_dim != 1:
                self.opt._input_dims[weight] = spec.input_dim
            if group["basis_source"] == "activations":
                stacks = self.opt._stacks(weight, group)
                stats = BlockStatistics(stacks, dtype, device, cache=self._gram_cache)
                self._stats[weight] = stats
                handles.append(module.register_forward_pre_hook(statistics_hook(stats)))
            row_stacks = self.opt._row_stacks(weight, group)
            if tracks_outputs(group) and row_stacks:  # rows never split over data ranks
                stats = BlockStatistics(row_stacks, dtype, device)
                self._row_stats[weight] = stats
                handles.append(module.register_forward_hook(output_gradient_hook(stats)))
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
        self._row_stats.clear()
        self._gram_cache.clear()

    def _hooked(self):
        """``(param, BlockStatistics)`` of every hook: input side, then output side."""
        return [*self._stats.items(), *self._row_stats.items()]

    def pending_inputs(self) -> list[tuple[Tensor, Tensor]]:
        """``(param, sum)`` of every accumulator holding this step's tokens (to check that
        they are finite before anything changes)."""
        return [(p, t) for p, s in self._hooked() if s.seen for t in s.sums]

    def discard(self) -> None:
        """Drop this step's accumulated statistics (a skipped or failed step)."""
        for _, stats in self._hooked():
            stats.reset()

    def check_present(self, matrix_groups) -> None:
        """``RuntimeError`` before any state changes if a matrix stepping with ``lr > 0`` has
        no statistics for this step (unless ``missing_stats="identity"``)."""
        if self.missing_stats == "identity":
            return
        for group in matrix_groups:
            if not isinstance(group["lr"], Tensor) and group["lr"] == 0:
                continue  # a tensor lr (capturable) is not read: statistics are needed
            for p in group["params"]:
                needed = {"activation": self._stats}
                if group["basis_source"] != "activations":
                    needed.clear()
                if tracks_outputs(group) and self.opt._row_stacks(p, group):
                    needed["output-gradient"] = self._row_stats
                missing = [k for k, s in needed.items() if p not in s or not s[p].seen]
                if p.grad is not None and missing:
                    raise RuntimeError(
                        f"{self.opt.name_of(p)} has no {missing[0]} statistics for this step. "
                        "Call opt.track(model) before the forward pass (it hooks nn.Linear "
                        "layers) and backward through the layer, route the parameter to "
                        "algorithm='adamw', or construct Dobb with missing_stats='identity'."
                    )

    def _gradient_moments(self, active: list[tuple[Tensor, dict, dict]]) -> dict:
        """This step's gradient moments, ``{(index into active, side): [per stack]}``: the
        input blocks' ``G_bᵀ G_b / d_out`` (``basis_source="gradients"``) and the row blocks'
        ``G_r G_rᵀ / d_in`` (two-sided, ``row_stats="gradients"``); one ``bmm`` per stack
        for each batch of same-shape matrices (matrix by matrix on CPU)."""
        entries = [  # (index into active, side)
            (i, side)
            for i, (_, state, group) in enumerate(active)
            for side, wanted in (
                ("cols", group["basis_source"] == "gradients"),
                ("rows", "row_cov" in state and not tracks_outputs(group)),
            )
            if wanted
        ]

        def key(n: int) -> tuple:
            i, side = entries[n]
            p, state, group = active[i]
            grad = local(p.grad)
            stacks = (
                self.opt._row_stacks(p, group) if side == "rows" else self.opt._stacks(p, group)
            )
            batched = self.opt.batched(grad.device)
            return (
                side,
                tuple(grad.shape),
                self.opt._input_dims.get(p, 1),
                stacks,
                grad.dtype,
                state["momentum"].dtype,
                grad.device,
                *solo(n, batched),
            )

        moments = {}
        batches = group_by(range(len(entries)), key)
        for (side, _, dim, stacks, _, dtype, *_), members in batches.items():
            chunk = [entries[n] for n in members]
            grads = torch.stack([local(active[i][0].grad) for i, _ in chunk]).to(dtype)
            grads = grads.mT if dim == 0 else grads  # (n, d_out, d_in)
            grads = grads.mT if side == "rows" else grads  # blocks along the last dim
            per_stack = []
            for s in stacks:
                cols = grads[..., s.start : s.stop].unflatten(-1, (s.count, s.size))
                cols = cols.movedim(-2, 1)  # (n, count, other, size)
                per_stack.append((cols.mT @ cols / max(1, grads.shape[1])).unbind(0))
            for j, entry in enumerate(chunk):
                moments[entry] = [m[j] for m in per_stack]
        return moments

    def _sources(self, index: int, active: list, moments: dict) -> list[tuple]:
        """``(covs, source)`` for each side of ``active[index]`` that has moments:
        ``source`` is the hooks' ``BlockStatistics`` (None if never tracked) or this step's
        moments (``_gradient_moments``)."""
        param, state, group = active[index]
        sources = []
        covs = [local(state[cov]) for cov, _ in STACK_KEYS if cov in state]
        if group["basis_source"] == "activations":
            sources.append((covs, self._stats.get(param)))
        elif group["basis_source"] == "gradients":
            sources.append((covs, moments[(index, "cols")]))
        row_covs = [local(state[cov]) for cov, _ in ROW_KEYS if cov in state]
        if row_covs and tracks_outputs(group):
            sources.append((row_covs, self._row_stats.get(param)))
        elif row_covs:
            sources.append((row_covs, moments[(index, "rows")]))
        return sources

    def fold(self, active, stats_steps: list | None = None, live: Tensor | None = None):
        """Fold this step's moments ``S_b`` into ``C_b`` for every matrix that has them.

        ``C_b <- S_b`` the first time, else ``C_b <- beta C_b + (1 - beta) S_b``, where
        ``S_b = A_b / n`` (``A_b``: the hooks' sums over ``n`` tokens, both on the device,
        then reset), for the input blocks and (two-sided) the row blocks alike. A matrix
        folds only when every side has moments. Returns every matrix's ``stats_steps``
        after the fold, counted from ``stats_steps`` (capturable: the host's counts, and
        ``live`` 0 keeps ``C_b``) or else read from the CPU counters.
        """
        if stats_steps is None:
            stats_steps = torch.stack([state["stats_steps"] for _, state, _ in active]).tolist()
        stats_steps = list(stats_steps)
        folding, sums, tokens = [], [], []  # (index, sources); hook sums and token counts
        moments = self._gradient_moments(active)
        for i in range(len(active)):
            sources = self._sources(i, active, moments)
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
            _, state, group = active[i]
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
        counters = [active[i][1]["stats_steps"] for i, _ in folding]
        torch._foreach_add_(counters, 1.0 if live is None else each(live, counters))
        return stats_steps

    def average(self, matrices: list[tuple[Tensor, dict, dict]]) -> None:
        """Average ``C_b`` over the data-parallel ranks (the only communication of Dobb), and
        two-sided Dobb's row moments over the ranks they were computed on: the data ranks
        (``row_stats="outputs"``) or the ranks splitting the columns (``"gradients"``)."""
        covs, groups = [], []
        for param, state, group in matrices:
            row_groups = self.data_groups
            if group["two_sided"] and group["row_stats"] == "gradients":  # one-sided: none
                row_groups = matrix_placement(param).groups_splitting(
                    self.opt._input_dims.get(param, 1)
                )
            for keys, over in ((STACK_KEYS, self.data_groups), (ROW_KEYS, row_groups)):
                new = [local(state[cov]) for cov, _ in keys if cov in state]
                covs += new
                groups += [tuple(over)] * len(new)
        all_reduce_(covs, groups, average=True)
        self._unsynced -= {id(state) for _, state, _ in matrices}

    def mark_synced(self) -> None:
        """Every ``C_b`` is now the same on every rank (just loaded from a checkpoint)."""
        self._unsynced.clear()

    def synchronize(self) -> None:
        """Average every ``C_b`` folded since its last average (a collective under DP).

        Exact at any time, the EMA being linear. Every data-parallel rank must call it.
        """
        matrices = [
            (p, self.opt.state[p], group)
            for group in self.opt.param_groups
            if group["algorithm"] == self.opt.algorithm
            for p in group["params"]
            if p in self.opt.state and id(self.opt.state[p]) in self._unsynced
        ]
        if matrices:
            self.average(matrices)
