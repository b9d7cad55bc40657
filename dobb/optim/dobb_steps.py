"""Dobb's placement: its step of every matrix, with both of its collectives, and where each
matrix's blocks live.

Dobb needs no other placement: a row of the update depends only on that row of the
momentum, so every shard updates alone, and ``DobbSteps`` claims every matrix. A step, in
this order, over the matrices with a gradient:

.. code-block:: text

    count     step <- step + 1 (CPU counters; capturable: on the device, counted on the
              host here too, so that the schedule reads nothing)
    fold      C <- S the first time, else C <- beta C + (1 - beta) S, for every side whose
              moments S arrived (the hooks' sums, ``dobb.stats``; or this step's gradient)
    average   C over each side's process groups: the only all-reduce of Dobb, on the
              matrices due a refresh, or on all of them with stats_sync="step"
    refresh   Q, P <- new bases of the due matrices (``dobb.eigensolve``); a side every data
              rank holds alike is shared out over them, one all-gather (``split_over_ranks``)
    update    ``core.updates`` per batch of one layout: same local shape, blocks, dtypes and
              device, at most ``BATCH_ELEMENTS``, the bases stacked once and kept

The maths of each phase is ``dobb.optim.dobb_core``'s (``fold``, ``gradient_moments``,
``refresh_due``, the update); the rest is bookkeeping that must outlive a call, held here:
the host counts of a capturable step, the stacked bases a captured steady step reads, and
which matrices have statistics folded since their last average.

Where a matrix's blocks live: an input block never straddles a column shard and a row
block never straddles a row shard (``local_block_stacks``), and each side's ``C`` and bases
are laid out like the parameter's dim they block (``block_state_like``), so a checkpoint
saves each rank's own blocks.
"""

import functools

import torch
import torch.distributed as dist
from torch import Tensor

from dobb._dtensor import DTensor, Replicate, Shard, local
from dobb.distributed.groups import shared_axis
from dobb.distributed.placement import matrix_placement
from dobb.distributed.reduce import all_reduce_
from dobb.eigensolve import refresh_bases
from dobb.optim.batching import each, group_by
from dobb.optim.dobb_core import (
    EXPERT_TOKENS,
    DobbBatch,
    DobbCore,
    expert_weights,
    fold,
    gradient_moments,
    refresh_due,
    rotation_dtype,
)
from dobb.optim.experts import expert_of, gemm_window, stack_groups
from dobb.optim.parts import COUNTERS, Matrix, Placement, Step, local_state, state_dtype
from dobb.stats import BlockStack, block_stacks

# torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single
ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
# Warm-started solvers need a start: a matrix's first refresh runs batched Jacobi from the
# identity with more sweeps (dobb.eigensolve.COLD_METHODS; no per-block eigh loop, no host
# read), or eigh where "auto" means eigh (CPU), or CuPy's eigh (CUDA, CuPy installed).
COLD_START = dict.fromkeys(("power_qr", "cholqr", "jacobi"), "jacobi_cold") | {"auto": "auto_cold"}
# Largest batch of same-shape matrices updated together (elements of the stacked momentum);
# bounds the batched step's temporary memory at a few copies of this many state elements.
BATCH_ELEMENTS = 1 << 26
GRADIENTS = "gradients"  # a side whose moments are this step's gradient's
COLUMN_ADVICE = (
    "choose num_blocks so that every column shard holds whole blocks (e.g. a multiple of "
    "the tensor-parallel degree that divides d_in)"
)


def local_block_stacks(
    stacks: tuple[BlockStack, ...],
    start: int,
    stop: int,
    describe: str,
    advice: str = COLUMN_ADVICE,
    what: str = "input blocks do not tile this rank's columns",
) -> tuple[BlockStack, ...]:
    """The blocks inside indices ``[start, stop)``, re-based to local index 0.

    Raises ``ValueError`` (``describe`` names the matrix, ``advice`` says what to change)
    if a block straddles a shard boundary: the update would then need another rank's
    columns (or rows, for two-sided Dobb's row blocks).
    """
    mine = []
    for s in stacks:
        first = max(0, -(-(start - s.start) // s.size))  # first block starting >= start
        last = min(s.count, (stop - s.start) // s.size)  # blocks ending <= stop
        if last > first:
            mine.append(BlockStack(s.start + first * s.size - start, s.size, last - first))
    covered = sum(s.size * s.count for s in mine)
    if covered != stop - start:
        raise ValueError(
            f"{describe}: the {what} [{start}, {stop}); {advice}, or route the parameter "
            "to algorithm='adamw'"
        )
    return tuple(mine)


def param_block_stacks(
    param: Tensor, dim: int, count: int, name: str, rows: bool = False
) -> tuple[BlockStack, ...]:
    """``count`` blocks along ``param``'s ``dim`` (its rows if ``rows``: two-sided Dobb),
    those of this rank's shard, re-based (``local_block_stacks``)."""
    stacks = block_stacks(param.shape[dim], count)
    placement = matrix_placement(param)
    start, stop = placement.span(dim)
    if (start, stop) == (0, param.shape[dim]):
        return stacks
    describe = (
        f"{name} of shape {tuple(param.shape)}, {'output' if rows else 'input'} dim {dim} "
        f"split over {placement.split_degree(dim)} ranks, "
        f"{'row_blocks' if rows else 'num_blocks'}={count}"
    )
    if not rows:
        return local_block_stacks(stacks, start, stop, describe)
    advice = "choose row_blocks as a multiple of the number of row shards, or None"
    return local_block_stacks(
        stacks, start, stop, describe, advice, "row blocks do not tile this rank's rows"
    )


def block_state_like(local_stack: Tensor, param: Tensor, dim: int) -> Tensor:
    """Wrap a per-block ``(count, s, s)`` stack as a DTensor on ``param``'s mesh.

    Blocks are split like ``param``'s ``dim`` (Shard(0) where that is sharded) and
    replicated elsewhere, so checkpoints save each rank's own blocks. Plain tensors for
    plain parameters.
    """
    if not isinstance(param, DTensor):
        return local_stack
    sharded = (dim, dim - param.ndim)
    placements = [
        Shard(0) if getattr(p, "dim", None) in sharded else Replicate() for p in param.placements
    ]
    return DTensor.from_local(local_stack, param.device_mesh, placements, run_check=False)


def split_over_ranks(fn, *stacks: Tensor, group) -> Tensor:
    """``fn(*stacks)`` for ``(n, ...)`` stacks, each rank of ``group`` computing ~n/P of it.

    Rank ``r`` evaluates ``fn`` on rows ``[r c, (r + 1) c)`` (``c = ceil(n / P)``; the end is
    padded with copies of the last row, a valid input for any solver) and one all-gather
    assembles the result, so every rank ends with the same bits, computed once.
    """
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    n = stacks[0].shape[0]
    chunk = -(-n // size)
    rows = torch.arange(rank * chunk, (rank + 1) * chunk, device=stacks[0].device).clamp_max(n - 1)
    mine = [t.index_select(0, rows) for t in stacks]
    result = fn(*mine).contiguous()
    gathered = result.new_empty(size * chunk, *result.shape[1:])
    ALL_GATHER_SINGLE(gathered, result, group=group)
    return gathered[:n]


def unseen_expert(state: dict) -> Tensor | None:
    """For an expert's ``state``, whether it has had no tokens yet (0-d, on its device: its
    refresh keeps the basis it has, and solves ``C = I`` in place of its ``C = 0``, which a
    Cholesky QR would count as a failure); None for a layer's."""
    return local(state[EXPERT_TOKENS]) == 0 if EXPERT_TOKENS in state else None


def identity_like(covs: Tensor) -> Tensor:
    """The identity in the shape of a ``(count, s, s)`` stack of ``C``."""
    return torch.eye(covs.shape[-1], dtype=covs.dtype, device=covs.device).expand_as(covs)


def averaged_every_step(matrix: Matrix) -> bool:
    """Whether ``matrix``'s statistics are averaged at every step (``stats_sync``: "step",
    or "auto" for a plain parameter, replicated as under DDP), else on refresh steps."""
    sync = matrix.config.stats_sync
    return sync == "step" or (sync == "auto" and not isinstance(matrix.param, DTensor))


def folds_nothing(matrix: Matrix, layout, sources: list, hooks: list) -> bool:
    """Whether ``matrix`` folds nothing this step, its hooks' sums then dropped: it has no
    side with moments, a hooked side saw nothing, or (a layer called on no token, 0 rows)
    it follows an idle expert's rule, its ``C`` and ``stats_steps`` kept. That rule holds
    for a layer whose ``C`` is averaged over no group; one averaged over ranks (DDP's, FSDP's
    row blocks) folds its zero statistics, so that its ranks keep one ``stats_steps`` and
    call the same collectives (its ``C`` decays by ``stats_beta``, as before the rule)."""
    local_only = EXPERT_TOKENS not in matrix.state and not any(s.groups for s in layout.sides)
    idle = local_only and any(h is not None and h.empty for h in hooks)
    if sources and not idle and all(h is not None and h.seen for h in hooks):
        return False
    for h in hooks:
        if h is not None:
            h.reset()
    return True


class DobbSteps(Placement):
    """Dobb's placement of every matrix (the module docstring).

    Given at construction: the optimizer's ``DobbStatistics`` (the hooks' sums), its
    ``layouts`` (``layouts(param, config)``: a matrix's ``MatrixLayout``), the group the
    shared refresh splits its work over (the innermost data axis; None: every rank computes
    every basis) and the solver's ``BlockFailures``.
    """

    def __init__(self, statistics, layouts, refresh_group, failures):
        self.statistics, self.layouts = statistics, layouts
        self.refresh_group, self.failures = refresh_group, failures
        self._host_counts: dict[Tensor, list[int]] = {}  # capturable: [step, stats_steps]
        self._basis_stacks: dict[tuple, tuple[list[Tensor], Tensor]] = {}  # _stacked_bases
        self._unsynced: set[int] = set()  # ids of the params with statistics not yet averaged

    def init_state(self, param: Tensor, config, name: str) -> dict[str, Tensor]:
        """Each side's ``C`` and bases (``Side.init_state``), laid out by shard."""
        self._host_counts[param] = [0, 0]
        self.failures.counter(local(param).device)  # made before any capture (BlockFailures)
        state = {}
        for side in self.layouts(param, config).sides:
            state.update(side.init_state(param, name))
        if expert_of(param) is not None:  # an expert's tokens seen (dobb_core.expert_weights)
            state[EXPERT_TOKENS] = torch.zeros((), dtype=state_dtype(param), device=param.device)
        return state

    def step(self, matrices: list[Matrix], core: DobbCore, step: Step) -> None:
        """Count, fold, average, refresh and update ``matrices`` (the module docstring)."""
        if not matrices:
            return
        layouts = [self.layouts(m.param, m.config) for m in matrices]
        steps, folded = self._count(matrices, layouts, step.live)
        due = [
            refresh_due(int(t), m.config.basis_interval) and stats_steps > 0
            for m, t, stats_steps in zip(matrices, steps, folded)
        ]
        every_step = [averaged_every_step(m) for m in matrices]
        due_or_every = [d or e for d, e in zip(due, every_step)]
        self.average([(m, a) for m, a, d in zip(matrices, layouts, due_or_every) if d])
        self._refresh([(m, a, f) for m, a, f, d in zip(matrices, layouts, folded, due) if d])
        if step.live is not None:  # Adam coefficients' bias correction: the device counts
            steps = [m.state["step"] for m in matrices]
        by_options = group_by(matrices, lambda m: (m.config.math_key(), local(m.param).device))
        for indices in by_options.values():
            mine = [(matrices[i], layouts[i], steps[i]) for i in indices]
            for batch in self._batches(mine, mine[0][0].config):
                core.updates(self._batch(batch, step.live), batch[0][0].config)

    def _count(self, matrices, layouts, live) -> tuple[list, list]:
        """Advance the step counters and fold this step's statistics; returns each matrix's
        ``step`` and ``stats_steps`` after them, read from the CPU counters, or (capturable)
        counted on the host, with no read."""
        counters = [m.state["step"] for m in matrices]
        torch._foreach_add_(counters, 1.0 if live is None else each(live, counters))
        if live is None:
            steps = torch.stack(counters).tolist()
            stats_steps = torch.stack([m.state["stats_steps"] for m in matrices]).tolist()
            return steps, self._fold(matrices, layouts, stats_steps, live)
        for m in matrices:  # capturable's host counts, read from the device once after a load
            if m.param not in self._host_counts:
                self._host_counts[m.param] = [int(m.state[key]) for key in COUNTERS]
        counts = [self._host_counts[m.param] for m in matrices]
        steps = [c[0] + 1 for c in counts]
        folded = self._fold(matrices, layouts, [c[1] for c in counts], live)
        for c, t, stats_steps in zip(counts, steps, folded):
            c[:] = t, stats_steps
        return steps, folded

    def _fold(self, matrices, layouts, stats_steps: list, live) -> list:
        """Fold this step's moments into ``C`` for every matrix that has them on every side
        (``dobb_core.fold``; an expert's, weighted by its tokens: ``expert_weights``);
        returns each matrix's ``stats_steps`` after the fold. A matrix missing a hooked
        side's moments folds nothing, nor does a layer called on no token (``folds_nothing``)."""
        stats_steps = list(stats_steps)
        self._add_expert_sums()
        pairs = [
            (i, side)
            for i, layout in enumerate(layouts)
            for side in layout.sides
            if side.stacks and side.source == GRADIENTS
        ]
        moments = gradient_moments(
            [local(matrices[i].param.grad) for i, _ in pairs],
            [side for _, side in pairs],
            [matrices[i].state["momentum"].dtype for i, _ in pairs],
            matrices[0].config.batched,
        )
        moments = {(i, side.name): found for (i, side), found in zip(pairs, moments)}
        folding, sums, tokens, used = [], [], [], []  # (index, sources); hook sums and counts
        counts = {}  # an expert's index -> its tokens this step
        for i, (m, layout) in enumerate(zip(matrices, layouts)):
            sources = self._sources(i, m, layout, moments)
            hooks = [src for _, src in sources if not isinstance(src, list)]
            if folds_nothing(m, layout, sources, hooks):
                continue
            folding.append((i, sources))
            used += hooks
            for h in hooks:
                sums += h.sums
                tokens += [h.tokens] * len(h.sums)
            if EXPERT_TOKENS in m.state and hooks:  # this step's n, kept from the reset below
                counts[i] = hooks[0].tokens.clone()
        for h in used:  # after the loop: the experts of a stack share one flag
            h.folded()
        if not folding:
            return stats_steps
        # S = A / n; an expert without tokens has A = 0 and n = 0 (its weight is 0)
        hook_means = iter(
            torch._foreach_div(sums, torch._foreach_clamp_min(tokens, 1.0)) if sums else []
        )
        if sums:
            torch._foreach_zero_([*sums, *dict.fromkeys(tokens)])  # each counter once
        self.statistics.clear_cache()
        self.statistics.reset_experts()  # every expert's rows: others' too (FSDP's)
        first, later, weighted = ([], []), {}, {}  # (Cs, Ss) copied; lerped by stats_beta; experts'
        for i, sources in folding:
            m = matrices[i]
            covs = [cov for side, _ in sources for cov in side]
            means = [
                mean
                for side, src in sources
                for mean in (src if isinstance(src, list) else [next(hook_means) for _ in side])
            ]
            stats_beta = m.config.stats_beta
            if i in counts:  # an expert's tokens: its token-weighted EMA
                entry = weighted.setdefault(stats_beta, ([], [], [], [], []))
                values = (covs, means, [counts[i]], [m.state[EXPERT_TOKENS]], [len(covs)])
                for part, value in zip(entry, values):
                    part.extend(value)
            else:
                target = first if stats_steps[i] == 0 else later.setdefault(stats_beta, ([], []))
                target[0].extend(covs)
                target[1].extend(means)
            stats_steps[i] += 1
            self._unsynced.add(id(m.param))
        fold(first, later, live)
        for stats_beta, (covs, means, ns, seen, widths) in weighted.items():
            gammas = expert_weights(ns, seen, stats_beta, live)
            weights = [g for g, k in zip(gammas, widths) for _ in range(k)]
            torch._foreach_lerp_(covs, means, weights)
        counters = [matrices[i].state["stats_steps"] for i, _ in folding]
        torch._foreach_add_(counters, 1.0 if live is None else each(live, counters))
        return stats_steps

    def _add_expert_sums(self) -> None:
        """Add up each expert stack's sums over the ranks that saw other tokens for the same
        experts, so that every rank holding an expert folds all of its tokens (one process's
        statistics): the data-parallel replicas of the stack (DDP's ranks, HSDP's replicate
        axis), and the ranks splitting the stack across the experts its grouped GEMM saw
        (``gemm_window``: FSDP gathers the stack, or each expert-parallel rank's experts,
        for the forward). Under expert parallelism alone each rank sees its own experts'
        routed tokens and nothing moves. One all-reduce per group and step
        (``dobb.stats.ExpertStatistics``)."""
        tensors, groups = [], []
        for stack, stats in self.statistics.expert_statistics():
            if not stats.seen:
                continue
            window, gathered = gemm_window(stack, stats.tokens.shape[0])
            stats.place(window)
            split, _ = stack_groups(stack)
            data = self.layouts.data_groups
            over = tuple(g for g in data if not split or shared_axis((g,), split) is None)
            if over + gathered:
                tensors += [*stats.sums, stats.tokens]
                groups += [over + gathered] * (len(stats.sums) + 1)
        if tensors:
            all_reduce_(tensors, groups)

    def _sources(self, i: int, matrix: Matrix, layout, moments: dict) -> list[tuple]:
        """``(Cs, source)`` for each side of a matrix that has moments: ``source`` is the
        hooks' ``BlockStatistics`` (None if never tracked) or this step's moments."""
        sources = []
        for side in layout.sides:
            if side.hooked:
                sources.append((side.covs(matrix.state), self.statistics.sums(matrix.param, side)))
            elif side.stacks and side.source == GRADIENTS:
                sources.append((side.covs(matrix.state), moments[(i, side.name)]))
        return sources

    def average(self, matrices: list[tuple[Matrix, object]]) -> None:
        """Average every side's ``C`` of ``(matrix, layout)`` over that side's groups (the
        only all-reduce of Dobb): the input blocks' over the data ranks, two-sided Dobb's
        row blocks' over the ranks they were computed on (``Dobb``'s ``matrix_layout``)."""
        covs, groups = [], []
        for m, layout in matrices:
            for side in layout.sides:
                new = side.covs(m.state)
                covs += new
                groups += [side.groups] * len(new)
        all_reduce_(covs, groups, average=True)
        self._unsynced -= {id(m.param) for m, _ in matrices}

    def synchronize(self, matrices: list[tuple[Matrix, object]]) -> None:
        """Average the ``C`` of those of ``(matrix, layout)`` (every matrix with state)
        folded since their last average (a collective under DP): exact at any time, the EMA
        being linear. Every data-parallel rank must call it."""
        unsynced = [(m, layout) for m, layout in matrices if id(m.param) in self._unsynced]
        if unsynced:
            self.average(unsynced)

    def _refresh(self, due: list[tuple[Matrix, object, float]]) -> None:
        """Recompute the bases of ``due`` ``(matrix, layout, stats_steps)``, one batched
        solver call per method, sharing and block size (``COLD_START`` on a matrix's first
        statistics; rejected blocks counted in ``failures``). A side's blocks are shared out
        over ``refresh_group`` if every data rank holds the same ``C`` (``Side.shared``: the
        input side), else computed where they live: an FSDP rank holds only its own row
        blocks."""
        by_method: dict[tuple[str, bool], list[tuple[dict, str, str]]] = {}
        for m, layout, stats_steps in due:
            method = m.config.basis_method
            method = COLD_START.get(method, method) if stats_steps == 1 else method
            for side in layout.sides:
                by_method.setdefault((method, side.shared), []).extend(
                    (m.state, cov_key, basis_key) for cov_key, basis_key in side.keys
                )
        for (method, shared), keys in by_method.items():
            if not keys:
                continue
            targets = [local(state[b]) for state, _, b in keys]
            covs = [local(state[c]) for state, c, _ in keys]
            unseen = [unseen_expert(state) for state, _, _ in keys]
            covs = [
                c if u is None else torch.where(u, identity_like(c), c)
                for c, u in zip(covs, unseen)
            ]
            run = None
            if shared and self.refresh_group is not None:
                run = functools.partial(split_over_ranks, group=self.refresh_group)
            solver = dict(failures=self.failures, capturable=due[0][0].config.capturable)
            bases = refresh_bases(covs, targets, method, run, **solver)
            bases = [
                b if u is None else torch.where(u, t, b) for b, t, u in zip(bases, targets, unseen)
            ]
            torch._foreach_copy_(targets, bases)
        if due:  # refill the stacked copies where a captured steady step reads them
            for bases, stacked in self._basis_stacks.values():
                stacked.copy_(torch.stack(bases))

    def _batches(self, matrices: list[tuple], config) -> list[list[tuple]]:
        """``(matrix, layout, step)`` of one set of math options split into batches that can
        share kernels, each of at most ``BATCH_ELEMENTS`` elements: same local shape, layout,
        dtypes and device; one matrix each unless ``config.batched``."""
        batches: dict[tuple, list[list[tuple]]] = {}
        for entry in matrices:
            m, layout, _ = entry
            param, grad = local(m.param), local(m.param.grad)
            key = (tuple(param.shape), layout.input_dim, layout.width)
            key += (*(s.stacks for s in layout.sides), param.dtype, grad.dtype)
            key += (m.state["momentum"].dtype, param.device)
            chunks = batches.setdefault(key, [[]])
            full = (len(chunks[-1]) + 1) * param.numel() > BATCH_ELEMENTS
            if chunks[-1] and (full or not config.batched(param.device)):
                chunks.append([])
            chunks[-1].append(entry)
        return [chunk for chunks in batches.values() for chunk in chunks]

    def _batch(self, batch: list[tuple], live: Tensor | None) -> DobbBatch:
        """The core's ``DobbBatch`` of ``(matrix, layout, step)``: local tensors, and, but for
        a lone matrix outside a capturable step, each side's bases stacked (``_stacked_bases``)."""
        matrices = [m for m, _, _ in batch]
        layout = batch[0][1]
        bases = row_bases = None
        if len(batch) > 1 or live is not None:
            low = rotation_dtype(matrices[0].config, matrices[0].param)
            bases, row_bases = (self._stacked_bases(matrices, side, low) for side in layout.sides)
        return DobbBatch(
            [local(m.param) for m in matrices],
            [local(m.param.grad) for m in matrices],
            [local_state(m.state) for m in matrices],
            layout,
            bases,
            row_bases,
            [t for _, _, t in batch],
            live,
        )

    def _stacked_bases(self, matrices: list[Matrix], side, dtype) -> list[Tensor]:
        """``matrices``' bases of each stack of ``side``, stacked ``(n, count, s, s)`` in
        ``dtype`` (the rotations') once and kept between steps: bases change only in
        ``_refresh``, which refills these copies in place (a captured steady step reads them
        where the capture found them), and on a load, which drops them (``forget``;
        memory: a copy of the bases)."""
        out = []
        for _, key in side.keys:
            cache_key = (key, dtype, *(id(m.state) for m in matrices))
            if cache_key not in self._basis_stacks:
                bases = [local(m.state[key]) for m in matrices]
                self._basis_stacks[cache_key] = (bases, torch.stack(bases).to(dtype))
            out.append(self._basis_stacks[cache_key][1])
        return out

    def refresh_due(self, configs: list[tuple[list[Tensor], object]]) -> bool:
        """Capturable: whether the next step of the ``(params, config)`` groups may refresh a
        basis (host counts only); when due it also reports the solver's failures
        (``BlockFailures.report``)."""
        steps = {p: counts[0] for p, counts in self._host_counts.items()}  # absent: 0 steps
        due = any(
            refresh_due(steps.get(p, 0) + 1, config.basis_interval)
            for params, config in configs
            for p in params
        )
        if due:
            self.failures.report()
        return due

    def count_replay(self) -> None:
        """Capturable: count a replayed step (a CUDA graph replay runs no Python)."""
        for counts in self._host_counts.values():
            counts[0] += 1
            counts[1] += counts[1] > 0

    def forget(self) -> None:
        """After a load (the state holds other tensors, every ``C`` the same on every rank):
        drop the host counts (read again from the counters), the stacked bases (made again
        from the bases) and the record of unaveraged statistics."""
        self._host_counts.clear()
        self._basis_stacks.clear()
        self._unsynced.clear()
