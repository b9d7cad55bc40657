"""Dobb's core (``dobb.optim.base.Core``): its step of every matrix, which ``Dobb`` drives.

A step of the matrices with a gradient (the maths: ``dobb.optim.dobb.Dobb``'s docstring),
each phase batched (kernels per distinct shape, not per matrix):

.. code-block:: text

    inputs       (in the driver's non-finite check, before anything changes) this step's
                 statistics, which must be finite
    check        (then, still before anything changes) RuntimeError if a matrix stepping
                 with lr > 0 has no statistics (unless missing_stats="identity")
    begin        (every matrix)  step <- step + 1;  fold this step's statistics into C_b
                 (``DobbStatistics.fold``);  due = the matrices with statistics whose
                 (step - 1) % basis_interval == 0;  average C_b over the data ranks (the due
                 ones, or all with stats_sync="step");  refresh the due bases Q_b, P_r
    local_step   (one set of math options, ``Local``'s call)  the update
                 U[R_r, I_b] = P_r D(P_rᵀ N[R_r, I_b] Q_b) Q_bᵀ  (``dobb.optim.dobb_update``)
                 per batch of same local shape, layout, dtypes and device

Dobb needs no placement but ``Local``: a row of the update depends only on that row of the
momentum, so every shard updates alone; its only collectives (the average, the shared
refresh) run in ``begin``, on every rank alike. The schedule reads the CPU counters
(``tolist``), or if capturable host counts kept here (read from the device once after a
load): no device sync.

The core gets what it needs at construction, from the optimizer: its config, its
``DobbStatistics``, a matrix's layout (``layout(param, group)``, which the optimizer caches),
the refresh's runner over the data ranks and the solver's ``BlockFailures``; the driver
passes each matrix's name to ``init_state`` (it seeds the ``"random"`` basis source).
"""

from typing import Any

import torch
from torch import Tensor

from dobb._dtensor import local
from dobb.eigensolve import refresh_bases
from dobb.optim.base import COUNTERS, Core, Entry, Group, state_dtype
from dobb.optim.batching import each
from dobb.optim.dobb_layout import Matrix, Side
from dobb.optim.dobb_update import dobb_update, dobb_update_batched, update_alpha

# Warm-started solvers need a start: a matrix's first refresh runs batched Jacobi from the
# identity with more sweeps (dobb.eigensolve.COLD_METHODS; no per-block eigh loop, no host
# read), or eigh where "auto" means eigh (CPU), or CuPy's eigh (CUDA, CuPy installed).
COLD_START = dict.fromkeys(("power_qr", "cholqr", "jacobi"), "jacobi_cold") | {"auto": "auto_cold"}
# Largest batch of same-shape matrices updated together (elements of the stacked momentum);
# bounds the batched step's temporary memory at a few copies of this many state elements.
BATCH_ELEMENTS = 1 << 26


class DobbCore(Core):
    """Dobb's state and step (the module docstring).

    ``config``: the optimizer's ``Dobb.Config`` (``capturable``, ``missing_stats``,
    ``stats_sync``); ``statistics``: its ``DobbStatistics``; ``layout(param, group)``: a
    matrix's ``MatrixLayout``; ``run``: the shared refresh's runner (``split_over_ranks``
    over the innermost data axis, or None); ``failures``: the ``BlockFailures`` counting
    blocks whose new basis was rejected.
    """

    def __init__(self, config, statistics, layout, run, failures):
        """The optimizer's parts (the class docstring)."""
        self.config, self.statistics, self.layout = config, statistics, layout
        self.run, self.failures = run, failures
        self._host_counts: dict[Tensor, list[int]] = {}  # capturable: [step, stats_steps]
        self._basis_stacks: dict[tuple, tuple[list[Tensor], Tensor]] = {}  # _stacked_bases
        self._live, self._counted = None, {}  # begin's: live, id(state) -> (matrix, step)

    def init_state(self, param: Tensor, group: Group, name: str) -> dict[str, Any]:
        """Counters, momentum, each side's ``C`` and bases (``Side.init_state``), and the
        Adam coefficients' ``V``."""
        dtype, device = state_dtype(param), local(param).device
        counter = device if self.config.capturable else "cpu"
        state = {key: torch.zeros((), device=counter) for key in COUNTERS}  # step, stats_steps
        state["momentum"] = torch.zeros_like(param, dtype=dtype)
        self._host_counts[param] = [0, 0]
        self.failures.counter(device)  # made before any capture (see BlockFailures)
        for side in self.layout(param, group).sides:
            state.update(side.init_state(param, name, dtype))
        if group["coefficients"] == "adam":
            state["variance"] = torch.zeros_like(param, dtype=dtype)
        return state

    def check(self, groups: list[Group]) -> None:
        """``RuntimeError`` if a matrix stepping with ``lr > 0`` has no statistics for this
        step (unless ``missing_stats="identity"``); a tensor ``lr`` (capturable) is not
        read: statistics are needed."""
        if self.config.missing_stats == "identity":
            return
        stepping = [g for g in groups if isinstance(g["lr"], Tensor) or g["lr"] != 0]
        needed = [(p, g) for g in stepping for p in g["params"] if p.grad is not None]
        self.statistics.check_present([(p, self.layout(p, g)) for p, g in needed])

    def inputs(self) -> list[tuple[Tensor, Tensor]]:
        """This step's statistics (``DobbStatistics.pending_inputs``)."""
        return self.statistics.pending_inputs()

    def discard(self) -> None:
        self.statistics.discard()

    def begin(self, entries: list[Entry], live: Tensor | None) -> None:
        """Count the steps, fold the statistics, average and refresh where due (the module
        docstring); ``local_step`` then updates with the steps counted here."""
        active = [Matrix(p, s, g, self.layout(p, g)) for p, s, g in entries]
        self._live, self._counted = live, {}
        if not active:
            return
        steps, folded = self._count(active)
        due = [
            (int(step) - 1) % m.group["basis_interval"] == 0 and stats_steps > 0
            for m, step, stats_steps in zip(active, steps, folded)
        ]
        every_step = self.config.stats_sync == "step"
        self.statistics.average([m for m, d in zip(active, due) if d or every_step])
        self._refresh([(m, stats_steps) for m, stats_steps, d in zip(active, folded, due) if d])
        if live is not None:  # Adam coefficients' bias correction: the device counts
            steps = [m.state["step"] for m in active]
        self._counted = {id(m.state): (m, step) for m, step in zip(active, steps)}

    def local_step(self, entries: list[Entry], group: Group, *, batched: bool) -> None:
        """The update of ``entries`` (of one set of math options, ``group``'s), batch by
        batch (``_batches``)."""
        matrices = [self._counted[id(state)][0] for _, state, _ in entries]
        for batch in self._batches(matrices, batched):
            self._update(batch, [self._counted[id(m.state)][1] for m in batch], group)

    def _count(self, active: list[Matrix]) -> tuple[list, list]:
        """Advance the step counters and fold this step's statistics; returns each matrix's
        ``step`` and ``stats_steps`` after them, read from the CPU counters, or (capturable)
        counted on the host, with no read."""
        counters, live = [m.state["step"] for m in active], self._live
        torch._foreach_add_(counters, 1.0 if live is None else each(live, counters))
        if live is None:
            return torch.stack(counters).tolist(), self.statistics.fold(active)
        for m in active:  # capturable's host counts, read from the device once after a load
            if m.param not in self._host_counts:
                self._host_counts[m.param] = [int(m.state[key]) for key in COUNTERS]
        counts = [self._host_counts[m.param] for m in active]
        steps = [c[0] + 1 for c in counts]
        folded = self.statistics.fold(active, [c[1] for c in counts], live)
        for c, step, stats_steps in zip(counts, steps, folded):
            c[:] = step, stats_steps
        return steps, folded

    def _batches(self, matrices: list[Matrix], batched: bool) -> list[list[Matrix]]:
        """``matrices`` (of one set of math options) split into batches that can share
        kernels, each of at most ``BATCH_ELEMENTS`` elements: same local shape,
        orientation, block layout, dtypes and device; one matrix each unless ``batched``."""
        batches: dict[tuple, list[list[Matrix]]] = {}
        for m in matrices:
            param, grad = local(m.param), local(m.param.grad)
            key = (tuple(param.shape), m.layout.input_dim, *(s.stacks for s in m.layout.sides))
            key += (param.dtype, grad.dtype, m.state["momentum"].dtype, param.device)
            chunks = batches.setdefault(key, [[]])
            full = (len(chunks[-1]) + 1) * param.numel() > BATCH_ELEMENTS
            if chunks[-1] and (full or not batched):
                chunks.append([])
            chunks[-1].append(m)
        return [chunk for chunks in batches.values() for chunk in chunks]

    def _update(self, batch: list[Matrix], steps: list, group: Group) -> None:
        """Dobb's update of one batch (``_batches``), ``steps`` its matrices' step counts:
        ``dobb_update`` on a lone matrix (the reference: no stacking copies), else
        ``dobb_update_batched``; each side gives its bases and stacks (the row side none
        one-sided)."""
        p, state, _, layout = batch[0]
        stacks, row_stacks = (s.stacks for s in layout.sides)
        adam = group["coefficients"] == "adam"
        hyper = dict(
            lr=group["lr"],
            beta=group["momentum"],
            nesterov=group["nesterov"],
            weight_decay=group["weight_decay"],
            scale=update_alpha(group["update_scale"], p.shape[layout.input_dim]),
            beta2=group["coefficient_beta"],
            row_stacks=row_stacks,
            projection_dtype=getattr(torch, group["projection_dtype"] or "", None),
        )
        if len(batch) == 1 and self._live is None:
            # (d_in, d_out) weights (Conv1D) are updated through their transpose
            orient = (lambda t: t.mT) if layout.input_dim == 0 else (lambda t: t)
            bases, row_bases = ([local(state[b]) for _, b in s.keys] for s in layout.sides)
            dobb_update(
                *(orient(local(t)) for t in (p, p.grad, state["momentum"])),
                bases,
                stacks,
                row_bases=row_bases,
                variance=orient(local(state["variance"])) if adam else None,
                step=steps[0],
                **hyper,
            )
            return
        low = hyper["projection_dtype"] or state_dtype(p)
        bases, row_bases = (self._stacked_bases(batch, side, low) for side in layout.sides)
        dobb_update_batched(
            [local(m.param) for m in batch],
            [local(m.param.grad) for m in batch],
            [local(m.state["momentum"]) for m in batch],
            bases,
            stacks,
            row_bases=row_bases or None,
            variances=[local(m.state["variance"]) for m in batch] if adam else None,
            steps=steps,
            transposed=layout.input_dim == 0,
            live=self._live,
            **hyper,
        )

    def _stacked_bases(self, batch: list[Matrix], side: Side, dtype) -> list[Tensor]:
        """``batch``'s bases of each stack of ``side``, stacked ``(n, count, s, s)`` in
        ``dtype`` (the projections') once and kept between steps: bases change only in
        ``_refresh``, which refills these copies in place (a captured steady step reads them
        where the capture found them), and on a load, which drops them (``forget``;
        memory: a copy of the bases)."""
        out = []
        for _, key in side.keys:
            cache_key = (key, dtype, *(id(m.state) for m in batch))
            if cache_key not in self._basis_stacks:
                bases = [local(m.state[key]) for m in batch]
                self._basis_stacks[cache_key] = (bases, torch.stack(bases).to(dtype))
            out.append(self._basis_stacks[cache_key][1])
        return out

    def _refresh(self, due: list[tuple[Matrix, float]]) -> None:
        """Recompute the bases of ``due`` ``(matrix, stats_steps)``, one batched solver call
        per method, sharing and block size (``COLD_START`` on a matrix's first statistics;
        rejected blocks counted in ``failures``). A side's blocks are shared out over the
        data ranks if they hold the same ``C`` (``Side.shared``: the input side, with
        ``shard_refresh``), else computed where they live: an FSDP rank holds only its own
        row blocks."""
        by_method: dict[tuple[str, bool], list[tuple[dict, str, str]]] = {}
        for m, stats_steps in due:
            method = m.group["basis_method"]
            method = COLD_START.get(method, method) if stats_steps == 1 else method
            for side in m.layout.sides:
                by_method.setdefault((method, side.shared), []).extend(
                    (m.state, cov_key, basis_key) for cov_key, basis_key in side.keys
                )
        for (method, shared), keys in by_method.items():
            if not keys:
                continue
            targets = [local(state[b]) for state, _, b in keys]
            covs = [local(state[c]) for state, c, _ in keys]
            run = self.run if shared else None
            solver = dict(failures=self.failures, capturable=self.config.capturable)
            torch._foreach_copy_(targets, refresh_bases(covs, targets, method, run, **solver))
        if due:  # refill the stacked copies where a captured steady step reads them
            for bases, stacked in self._basis_stacks.values():
                stacked.copy_(torch.stack(bases))

    def refresh_due(self, groups: list[Group]) -> bool:
        """Capturable: whether the next step of ``groups`` may refresh a basis (host counts
        only); when due it also reports the solver's failures (``BlockFailures.report``)."""
        steps = {p: counts[0] for p, counts in self._host_counts.items()}  # absent: 0 steps
        due = any(steps.get(p, 0) % g["basis_interval"] == 0 for g in groups for p in g["params"])
        if due:
            self.failures.report()
        return due

    def count_replay(self) -> None:
        """Capturable: count a replayed step (a CUDA graph replay runs no Python)."""
        for counts in self._host_counts.values():
            counts[0] += 1
            counts[1] += counts[1] > 0

    def forget(self) -> None:
        """Drop the host counts (read again from the counters) and the stacked bases (made
        again from the bases): after a load, the state holds other tensors."""
        self._host_counts.clear()
        self._basis_stacks.clear()
