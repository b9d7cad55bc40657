"""Dobb's step inputs: the hooks of one optimizer and the sums they gather between steps.

``DobbStatistics`` hooks the layers (``dobb.stats``' ``BlockStatistics``, one per side of a
tracked layer) and the grouped-experts modules (``ExpertStatistics``, one per expert
stack, each expert's view reading its slice) that ``Dobb.track`` hands it, and is the
step's ``inputs`` to the driver (``dobb.optim.base``): what must be finite (``pending``),
what refuses a step (``check``), what a skipped step drops (``discard``). Dobb's placement
(``dobb.optim.dobb_steps``) reads each hooked side's sums to fold them; the ``C_b``
themselves live in the optimizer's state.
"""

import zlib

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from dobb._dtensor import DTensor, local
from dobb.optim.experts import expert_of
from dobb.stats import (
    HOOKS,
    BlockStatistics,
    ExpertSlice,
    ExpertStatistics,
    GramCache,
    GroupedMatmulHook,
    several_ranks,
)


class DobbStatistics:
    """The hooks of one ``Dobb`` optimizer and the sums they gather between steps (the
    ``C_b`` themselves live in the optimizer's state).

    Its interface is narrow: the optimizer hands it the layers to hook with their layouts
    (``track``); the driver asks it for the step's inputs (``pending``, ``check``,
    ``discard``); Dobb's placement reads each hooked side's sums (``sums``) to fold them.
    ``name_of`` names a parameter in errors; ``layouts(param, config)`` is a matrix's
    layout (``dobb.optim.dobb.Layouts``).
    """

    def __init__(self, *, name_of, layouts):
        self.name_of, self.layouts = name_of, layouts
        self._stats: dict[Tensor, dict[str, BlockStatistics]] = {}  # param -> side -> sums
        self._experts: dict[Tensor, ExpertStatistics] = {}  # expert stack -> its sums
        self._gram_cache = GramCache()  # layers fed one input tensor (q, k, v) share X_bᵀ X_b
        self._hooks: list[RemovableHandle] = []
        self._replicas_checked = False  # _check_replicas ran (once per optimizer)

    def track(self, layers: list[tuple[nn.Module, Tensor, object]]) -> list[RemovableHandle]:
        """Hook each ``(module, weight, layout)`` on every side of ``layout`` whose moments
        come from hooks: the input activations' blocks (a forward pre-hook), the output
        gradients' (a forward hook). Returns the handles (``untrack`` removes all).
        Statistics buffers follow the activations' device, so the model may move later.
        """
        handles = []
        for module, weight, layout in layers:
            if weight in self._stats:
                raise ValueError(f"{self.name_of(weight)} is already tracked")
            dtype = torch.promote_types(weight.dtype, torch.float32)  # the state's dtype
            hooked = {}
            for side in layout.sides:
                if not side.hooked:
                    continue
                cache = self._gram_cache if side.source == "activations" else None
                stats = BlockStatistics(side.stacks, dtype, local(weight).device, cache)
                hooked[side.name] = stats
                _, hook, register = HOOKS[side.source]
                handles.append(getattr(module, register)(hook(stats)))
            if hooked:
                self._stats[weight] = hooked
        self._hooks += handles
        return handles

    def track_experts(self, modules: list[tuple]) -> list:
        """Hook each ``(module, spec, stacks)``'s grouped GEMMs (``GroupedMatmulHook``):
        ``stacks`` maps a stack's attribute name to ``(stack, layout)``, its parameter and an
        expert's ``MatrixLayout``. Each expert reads its slice of the stack's sums
        (``sums``)."""
        handles = []
        for module, spec, stacks in modules:
            by_name = {}
            for name, (stack, layout) in stacks.items():
                if stack in self._experts:
                    raise ValueError(f"{self.name_of(stack)} is already tracked")
                dtype = torch.promote_types(stack.dtype, torch.float32)  # the state's dtype
                stats = ExpertStatistics(layout.input.stacks, dtype, local(stack).device)
                self._experts[stack] = by_name[name] = stats
            handles.append(GroupedMatmulHook(module, spec, by_name))
        self._hooks += handles
        return handles

    def reset_experts(self) -> None:
        """Zero every expert stack's sums, the rows of experts other ranks hold included."""
        for stats in self._experts.values():
            stats.reset()

    def expert_statistics(self) -> list[tuple[Tensor, ExpertStatistics]]:
        """``(stack, sums)`` of every tracked expert stack, in the order tracked."""
        return list(self._experts.items())

    def untrack(self) -> None:
        """Remove every hook ``track`` added and drop the pending statistics."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._stats.clear()
        self._experts.clear()
        self._gram_cache.clear()

    def sums(self, param: Tensor, side) -> "BlockStatistics | ExpertSlice | None":
        """The hooks' sums of ``side`` of ``param`` (None: never tracked); an expert's
        (``dobb.optim.experts.expert_of``) are its slice of its stack's input sums."""
        expert = expert_of(param)
        if expert is None:
            return self._stats.get(param, {}).get(side.name)
        stats = self._experts.get(expert.stack)
        return ExpertSlice(stats, expert.number) if stats and side.name == "input" else None

    def clear_cache(self) -> None:
        """Forget the Gram products of this step's inputs (once they are folded)."""
        self._gram_cache.clear()

    def _hooked(self) -> list[tuple[Tensor, BlockStatistics]]:
        """``(param, BlockStatistics)`` of every layer's hook: input sides, then row sides."""
        names = ("input", "row")
        return [(p, s[name]) for name in names for p, s in self._stats.items() if name in s]

    def _accumulators(self) -> list[tuple[Tensor, "BlockStatistics | ExpertStatistics"]]:
        """``(param, sums)`` of every layer's and every expert stack's accumulators."""
        return [*self._hooked(), *self._experts.items()]

    def pending(self) -> list[tuple[Tensor, Tensor]]:
        """``(param, sum)`` of every accumulator holding this step's tokens (to check that
        they are finite before anything changes)."""
        return [(p, t) for p, s in self._accumulators() if s.seen for t in s.sums]

    def discard(self) -> None:
        """Drop this step's accumulated statistics (a skipped or failed step)."""
        for _, stats in self._accumulators():
            stats.reset()

    def check(self, matrices: list) -> None:
        """``RuntimeError`` before any state changes if this step cannot run: a multi-rank
        job whose ranks see other tokens but no ``stats_group`` (``_check_replicas``), or one
        of ``matrices`` (the Dobb matrices with a gradient, ``dobb.optim.parts.Matrix``)
        stepping with ``lr > 0`` lacks a hooked side's statistics for this step (unless
        ``missing_stats="identity"``); a tensor ``lr`` (capturable) is not read: statistics
        are needed."""
        self._check_replicas(matrices)
        if not matrices or matrices[0].config.missing_stats == "identity":
            return
        for m in matrices:
            if not isinstance(m.config.lr, Tensor) and m.config.lr == 0:
                continue
            if m.param.ndim == 3:  # an expert stack: its input side, from its grouped GEMMs
                stats = self._experts.get(m.param)
                hooked = {} if stats is None else {"input": stats}
                sides = [("input", "activations")] if m.config.basis_source in HOOKS else []
            else:
                hooked = self._stats.get(m.param, {})
                layout = self.layouts(m.param, m.config)
                sides = [(s.name, s.source) for s in layout.sides if s.hooked]
            missing = [s for s in sides if s[0] not in hooked or not hooked[s[0]].seen]
            if not missing:
                continue
            what = HOOKS[missing[0][1]][0]
            if missing[0][0] not in hooked:
                raise RuntimeError(
                    f"{m.name} has no {what} statistics for this step. "
                    "Call opt.track(model) before the forward pass (it hooks nn.Linear "
                    "layers and registered grouped-experts modules: "
                    "dobb.stats.register_experts) and backward through the layer, route the "
                    "parameter to algorithm='adamw', or construct Dobb with "
                    "missing_stats='identity'."
                )
            raise RuntimeError(
                f"{m.name} has no {what} statistics for this step, although opt.track() "
                "hooked its layer and the layer ran (it has a gradient): its hook did not "
                "count this step's tokens. Either the forward pass ran in eval mode (call "
                "model.train()), or the model is compiled and torch.compile reused a graph it "
                "traced for another instance of the same class, which has no hooks (Dynamo "
                "does not guard on module hooks): call torch._dynamo.reset() before "
                "compiling the tracked model, or compile it in a process that has compiled no "
                "other instance of its class."
            )

    def _check_replicas(self, matrices: list) -> None:
        """Refuse, once, a job of several ranks whose ranks hold the same matrices but see
        other tokens (DDP, FSDP) while ``stats_group`` is None: every rank would precondition
        with its own statistics and the replicas would drift apart. At the first step with
        statistics, one all-gather of three numbers over the default group compares the
        names and shapes of the plain (replicated, as under DDP) matrices with the sum of
        their statistics; ranks holding other matrices (pipeline stages) or seeing the same
        tokens pass. Sharded ones (DTensors: FSDP, TP) are ``Dobb.track``'s to refuse, which
        sees an FSDP module without a collective; tensor-parallel ranks see the same
        tokens."""
        if self._replicas_checked or self.layouts.data_groups or not several_ranks():
            return
        held = [(m, self._stats.get(m.param, {}).get("input")) for m in matrices]
        held = [(m, s) for m, s in held if s is not None and s.seen]
        held = [(m, s) for m, s in held if not isinstance(m.param, DTensor)]
        if not held:
            return
        self._replicas_checked = True
        shapes = repr(sorted((m.name, tuple(m.param.shape)) for m, _ in held))
        total = torch.stack([t.double().sum() for _, s in held for t in s.sums]).sum()
        mine = torch.tensor([zlib.crc32(shapes.encode()), len(held), float(total)])
        mine = mine.to(torch.float64)
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        same = [e for e in everyone if e[0] == mine[0] and e[1] == mine[1]]
        spread = max(abs(float(e[2] - mine[2])) for e in same)
        if len(same) > 1 and spread > 1e-6 * max(1.0, abs(float(mine[2]))):
            raise RuntimeError(
                f"Dobb runs on {dist.get_world_size()} ranks that hold the same matrices but "
                "see different tokens, and stats_group is None: each rank would precondition "
                "with its own activation statistics and the ranks' parameters would drift "
                "apart. Pass the data-parallel ranks as stats_group: the DDP process group "
                "(stats_group=dist.group.WORLD for a plain DDP job), or the data axes of the "
                "device mesh under FSDP or HSDP (docs/distributed.md)."
            )
