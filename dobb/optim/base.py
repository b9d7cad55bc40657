"""The driver every matrix optimizer in dobb runs on, and the two things it drives.

A ``MatrixOptimizer`` owns what is the same for every algorithm: parameter groups routed by
an ``algorithm`` key (the subclass's own name for hidden matrices, ``"adamw"`` or
``"lion"`` for everything else), group validation, the non-finite-gradient check that runs
before any state is touched, ``step(closure)``, the lazy state, and a ``load_state_dict``
that keeps state dtypes. An algorithm is the driver over two kinds of parts:

- its ``core`` (``Core``): the maths on plain local tensors, ``init_state`` and
  ``updates`` over the matrices of one set of math options, stacked by shape when
  ``batched`` (a stack of one is the per-matrix form); a core communicates nothing.
- its ``placements`` (``Local`` and its subclasses), in order: each claims the matrices it
  updates and steps them, the last one (``Local``: ``core.updates``, no communication)
  all the rest. The others hold every collective of a step: the owner exchange of Muon's
  family (``dobb.optim.owner_groups``), Dion's sharded protocol
  (``dobb.optim.dion_sharded``); or steps of another kind (MuonBP's block steps,
  ``dobb.optim.muonbp``: a placement that claims by a schedule).

A step: the non-finite check of the gradients and ``core.inputs``; ``core.check``, which
may refuse the step while nothing has changed; AdamW/Lion on the other groups; then the
matrices with a gradient, their state built lazily: ``core.begin`` over all of them
(Dobb's statistics and refreshes), and the placements claim and step theirs.

Two options every subclass takes, what they mean at more length:

nonfinite: ``"raise"`` (default) raises ``NonFiniteGradientError`` naming the first bad
    parameter; ``"skip"`` skips the whole step. Either way no state changes and the
    batch's pending statistics are dropped: the next clean batch steps normally. The
    check reads only this rank's shards and communicates nothing, so under FSDP or TP
    ranks can disagree; to skip consistently, decide on every rank from a global
    quantity (``torch.nn.utils.clip_grad_norm_`` returns the all-reduced total norm:
    skip ``step()`` when it is not finite).
foreach: stack same-shape matrices into shared kernels (``(n, m, k)`` bmm and foreach
    ops: a step's kernel count depends on the shapes, not the number of matrices).
    None (default): on every device but the CPU; both paths compute the same update (a
    test holds them together).
"""

from typing import Any

import torch
from torch import Tensor

from dobb._dtensor import local
from dobb.optim.batching import each, group_by
from dobb.optim.config import OptimizerConfig, math_key
from dobb.optim.scalar import (
    SCALAR_ALGORITHMS,
    SCALAR_DEFAULTS,
    adamw_updates,
    init_scalar_state,
    lion_updates,
)
from dobb.optim.state_init import is_state_init_step

GROUP_KEYS = {"params", "algorithm", "param_names", "initial_lr"}
COUNTERS = ("step", "stats_steps")  # CPU scalars (read for free), device ones if capturable
Group = dict[str, Any]
Entry = tuple[Tensor, dict[str, Any], Group]  # a matrix with a gradient: (param, state, group)


def state_dtype(param: Tensor) -> torch.dtype:
    """fp32, or the parameter's dtype where that is wider (fp64 params keep fp64 state)."""
    return torch.promote_types(param.dtype, torch.float32)


class NonFiniteGradientError(FloatingPointError):
    """A gradient (or activation statistic) held NaN or Inf; no state was changed."""


def batched_by_default(device: torch.device | str) -> bool:
    """What ``foreach=None`` means on ``device``: batched everywhere but on the CPU."""
    return torch.device(device).type != "cpu"


def local_state(state: dict[str, Any]) -> dict[str, Any]:
    """A state dict with the rank-local tensor of each DTensor."""
    return {key: local(value) for key, value in state.items()}


def local_tensors(entries: list[Entry]) -> tuple[list[Tensor], list[Tensor], list[dict]]:
    """The rank-local pieces of the params, gradients and states of ``entries``."""
    params = [local(p) for p, _, _ in entries]
    return params, [local(p.grad) for p, _, _ in entries], [local_state(s) for _, s, _ in entries]


def partition(entries: list[Entry], mine: list[bool]) -> tuple[list[Entry], list[Entry]]:
    """A placement's claim: the entries flagged ``mine``, and the rest, each in order."""
    return [e for e, m in zip(entries, mine) if m], [e for e, m in zip(entries, mine) if not m]


class Core:
    """An algorithm's maths, which communicates nothing (a base with the defaults).

    ``init_state`` and ``updates`` are every core's; the others only a core whose step
    consumes more than gradients (Dobb's activation statistics, its refreshes and the
    update that reads each matrix's layout) overrides.
    """

    def init_state(self, param: Tensor, group: Group, name: str) -> dict[str, Any]:
        """A matrix's state, placed as ``param`` (a DTensor's is a DTensor); ``name``: the
        parameter's, equal on every rank (what seeds a matrix's own random draws)."""
        raise NotImplementedError

    def updates(self, params, grads, states, group: Group, *, batched: bool) -> None:
        """The whole update, in place, of matrices no other rank shares: lists of plain
        local tensors (``states``: state dicts of local tensors) of one set of math options
        (``group``: their options), stacked by shape where ``batched``."""
        raise NotImplementedError

    def local_step(self, entries: list[Entry], group: Group, *, batched: bool) -> None:
        """``updates`` of ``entries`` on their local tensors (``Local``'s call)."""
        self.updates(*local_tensors(entries), group, batched=batched)

    def check(self, groups: list[Group]) -> None:
        """Refuse the step (raise) while nothing has changed yet, after the non-finite
        check: ``groups`` are the matrix groups."""

    def begin(self, entries: list[Entry], live: Tensor | None) -> None:
        """The step's first phase, over every matrix with a gradient, before any update
        (``live``: the capturable step's finite flag, else None)."""

    def inputs(self) -> list[tuple[Tensor, Tensor]]:
        """The ``(param, tensor)`` pairs besides gradients the step consumes, which must be
        finite."""
        return []

    def discard(self) -> None:
        """Drop this step's inputs (a skipped or failed step)."""


class Local:
    """The placement of matrices no other rank shares, and the last of every optimizer's:
    it claims what the others left and runs ``core.local_step`` once per set of math
    options and device (``math_key``); no communication.

    A ``Placement`` (this class is the base with the defaults) holds what a step of the
    matrices it claims needs besides the core: their collectives, and any state of its own
    (``init_state``), which the driver merges into each matrix's.
    """

    def init_state(self, param: Tensor, group: Group, name: str) -> dict[str, Any]:
        """State beside the core's (none here)."""
        return {}

    def claim(self, entries: list[Entry]) -> tuple[list[Entry], list[Entry]]:
        """``entries`` split into the ones this placement steps and the rest."""
        return entries, []

    def step(self, entries: list[Entry], driver: "MatrixOptimizer") -> None:
        """One step of the claimed ``entries`` (with their gradients)."""
        options = driver.math_options
        by_options = group_by(entries, lambda e: (math_key(e[2], options), local(e[0]).device))
        for indices in by_options.values():
            mine = [entries[i] for i in indices]
            self.run(driver.core, mine, batched=driver.batched(local(mine[0][0]).device))

    def run(self, core: Core, entries: list[Entry], *, batched: bool) -> None:
        """The step of matrices of one set of math options."""
        core.local_step(entries, entries[0][2], batched=batched)


class MatrixOptimizer(torch.optim.Optimizer):
    """The driver: routing, validation, the step loop and the lazy state, over a ``core``
    and its ``placements`` (the module docstring).

    Subclasses set ``algorithm`` (their group name), ``core`` and, where some matrices are
    shared with other ranks, placements before ``Local``: ``self.placements``.

    Options: the subclass's ``Config`` (``dobb.optim.config``), set as ``self.config``
    before this constructor runs, which validates every group against it.
    """

    algorithm: str
    Config: type[OptimizerConfig]  # the options: each subclass nests its own
    config: OptimizerConfig  # this optimizer's values of them
    core: Core
    placements: tuple[Local, ...] = (Local(),)

    def __init__(
        self, params, defaults, *, nonfinite: str = "raise", foreach=None, capturable=False
    ):
        """``defaults``: ``self.config.defaults()``; the three options as in the config."""
        self.nonfinite, self.foreach, self.capturable = nonfinite, foreach, capturable
        self.math_options = self.config.math_options()  # the batching key's (math_key)
        self.skipped_steps: int | Tensor = 0
        self._live: Tensor | None = None  # capturable: 1.0 if this step's inputs are finite
        self._names: dict[Tensor, str] = {}
        super().__init__(params, {"algorithm": self.algorithm, **defaults})

    # ----------------------------------------------------------------- groups
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Validate a group before ``torch.optim`` fills in the defaults."""
        algorithm = param_group.get("algorithm", self.algorithm)
        allowed = self._allowed_algorithms()
        if algorithm not in allowed:
            raise ValueError(f"unknown algorithm {algorithm!r}; expected one of {allowed}")
        if algorithm in SCALAR_ALGORITHMS:
            for key, value in SCALAR_DEFAULTS[algorithm].items():
                param_group.setdefault(key, value)
            keys = GROUP_KEYS | {"lr"} | set(SCALAR_DEFAULTS[algorithm])
        else:
            keys = GROUP_KEYS | set(self.defaults)
        unknown = sorted(set(param_group) - keys)
        if unknown:
            raise ValueError(
                f"unknown key(s) {unknown} in a parameter group with algorithm={algorithm!r}; "
                f"allowed: {sorted(keys - GROUP_KEYS)}"
            )
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if algorithm in SCALAR_ALGORITHMS:  # scalar groups do not carry matrix defaults
            for key in set(group) - keys:
                del group[key]
        index = len(self.param_groups) - 1
        names = group.get("param_names") or [None] * len(group["params"])
        for j, (p, name) in enumerate(zip(group["params"], names, strict=True)):
            self._names[p] = name or f"param_groups[{index}]['params'][{j}] {tuple(p.shape)}"
        self._validate_group(group)

    def _allowed_algorithms(self) -> tuple[str, ...]:
        return (self.algorithm, *SCALAR_ALGORITHMS)

    def _validate_group(self, group: dict[str, Any]) -> None:
        """Check a group's options: a matrix group's by ``self.config.for_group`` (its
        rules, one place per optimizer), a scalar group's here; subclasses add checks that
        need the parameters."""
        if group["algorithm"] in SCALAR_ALGORITHMS:
            if not group["lr"] >= 0:
                raise ValueError(f"invalid learning rate: {group['lr']} (must be >= 0)")
            if not group["weight_decay"] >= 0:
                raise ValueError(f"invalid weight_decay: {group['weight_decay']} (must be >= 0)")
            for i, beta in enumerate(group["betas"]):
                if not 0.0 <= beta < 1.0:
                    raise ValueError(f"invalid beta parameter at index {i}: {beta}")
            if group.get("eps", 0.0) < 0:
                raise ValueError(f"invalid eps: {group['eps']} (must be >= 0)")
            return
        self.config.for_group(group)
        for p in group["params"]:
            if p.ndim != 2:
                raise ValueError(
                    f"{self.name_of(p)} has {p.ndim} dimension(s), but algorithm="
                    f"{self.algorithm!r} needs 2-D weight matrices; put it in a group with "
                    "algorithm='adamw' (dobb.param_groups does this for a model)"
                )

    def batched(self, device: torch.device) -> bool:
        """Whether same-shape matrices on ``device`` share kernels: ``foreach``, or by
        default (None) everywhere but on the CPU, as ``torch.optim`` decides."""
        return self.foreach if self.foreach is not None else batched_by_default(device)

    def name_of(self, param: Tensor) -> str:
        """The parameter's name if groups were built from named parameters, else its index."""
        return self._names.get(param, f"parameter of shape {tuple(param.shape)}")

    # ------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure=None):
        """Perform one step; ``closure`` re-evaluates the model and returns the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        matrix_groups = [g for g in self.param_groups if g["algorithm"] == self.algorithm]
        replaced = [p for g in matrix_groups for p in g["params"] if p not in self._names]
        if replaced:
            raise RuntimeError(
                f"{len(replaced)} parameter(s) of shape {tuple(replaced[0].shape)} were put into "
                "param_groups after construction (e.g. by a wrapper that re-creates parameters, "
                "such as accelerate's FSDP); build the optimizer after wrapping the model"
            )
        if is_state_init_step(self):
            self._init_state()  # DCP's state initialisation: no counter or schedule moves
            return loss
        if self.capturable:
            self._live = self._inputs_live(matrix_groups)
        elif not self._inputs_finite(matrix_groups):
            self.skipped_steps += 1
            self.core.discard()
            return loss
        self.core.check(matrix_groups)  # may raise; nothing has been changed yet
        for group in self.param_groups:
            if group["algorithm"] in SCALAR_ALGORITHMS:
                self._scalar_step(group)
        if matrix_groups:
            self._matrix_step(matrix_groups)
        return loss

    def _init_state(self) -> None:
        """The lazy state of every parameter with a gradient, as its first step builds it."""
        for group in self.param_groups:
            scalar = group["algorithm"] in SCALAR_ALGORITHMS
            for p in group["params"]:
                if p.grad is None or self.state[p]:
                    continue
                if scalar:
                    self.state[p].update(init_scalar_state(p, group["algorithm"], self.capturable))
                else:
                    self.state[p].update(self._init_matrix_state(p, group))

    def _step_inputs(self, matrix_groups) -> list[tuple[Tensor, Tensor]]:
        """(param, tensor) of every gradient and core input (``Core.inputs``) that must be
        finite."""
        tensors = [(p, local(p.grad)) for g in self.param_groups for p in g["params"]]
        tensors = [(p, t) for p, t in tensors if t is not None] + self.core.inputs()
        return [(p, t) for p, t in tensors if t.numel()]  # FSDP shards may be empty

    def _inputs_live(self, matrix_groups) -> Tensor:
        """Capturable: 1.0 (on the device) if every step input is finite, else 0.0, and the
        device counter ``skipped_steps`` moves; no host read. Exact: ``0 x`` is 0 where
        ``x`` is finite and NaN where not, so its norm cannot overflow."""
        tensors = [t for _, t in self._step_inputs(matrix_groups)]
        device = tensors[0].device if tensors else torch.device("cpu")
        if not isinstance(self.skipped_steps, Tensor):
            self.skipped_steps = torch.zeros((), device=device)
        if not tensors:
            return torch.ones((), device=device)
        zeroed = torch._foreach_mul(tensors, 0.0)
        live = torch.stack(torch._foreach_norm(zeroed)).isfinite().all()
        self.skipped_steps.add_(live.logical_not())
        return live.float()

    def _inputs_finite(self, matrix_groups) -> bool:
        """True if every gradient (and subclass input) is finite; raise or report otherwise."""
        tensors = self._step_inputs(matrix_groups)
        if not tensors:
            return True
        # Fast path: a NaN/Inf makes the 2-norm non-finite (one fused pass over all tensors).
        finite = torch.stack(torch._foreach_norm([t for _, t in tensors])).isfinite()
        if bool(finite.all()):
            return True
        # Exact check (a huge finite tensor can overflow its norm)
        finite = torch.stack([torch.isfinite(t).all() for _, t in tensors])
        if bool(finite.all()):
            return True
        bad = self.name_of(tensors[int((~finite).nonzero()[0])][0])
        if self.nonfinite == "skip":
            return False
        # the failed batch's inputs are dropped, so the next clean batch steps normally
        self.core.discard()
        raise NonFiniteGradientError(
            f"non-finite values (NaN or Inf) in the gradient or statistics of {bad}; no state "
            "was changed. Lower the learning rate, clip gradients, or construct the optimizer "
            "with nonfinite='skip' to skip such steps."
        )

    def _scalar_step(self, group: dict[str, Any]) -> None:
        """AdamW or Lion on every parameter of ``group`` with a gradient, with torch's
        multi-tensor kernels (``adamw_updates``, ``lion_updates``): a few per group."""
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        states = [self.state[p] for p in params]
        for p, state in zip(params, states):
            if not state:
                state.update(init_scalar_state(p, group["algorithm"], self.capturable))
        steps = [state["step"] for state in states]  # CPU scalars: no device sync
        torch._foreach_add_(steps, 1 if self._live is None else each(self._live, steps))
        hp = dict(lr=group["lr"], betas=group["betas"], weight_decay=group["weight_decay"])
        grads, exp_avgs = [local(p.grad) for p in params], [local(s["exp_avg"]) for s in states]
        params, live = [local(p) for p in params], self._live
        if group["algorithm"] == "adamw":
            exp_avg_sqs = [local(state["exp_avg_sq"]) for state in states]
            if live is None:
                steps = torch.stack(steps).tolist()  # one read for the whole group
            moments = exp_avgs, exp_avg_sqs
            adamw_updates(params, grads, *moments, steps, eps=group["eps"], **hp, live=live)
        else:
            lion_updates(params, grads, exp_avgs, **hp, live=live)

    def _matrices_with_grad(self, groups: list[dict[str, Any]]):
        """``(param, state, group)`` for every matrix with a gradient; state built lazily."""
        for group in groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(self._init_matrix_state(p, group))
                yield p, state, group

    def _matrix_step(self, groups: list[Group]) -> None:
        """Every matrix of ``groups`` with a gradient: ``core.begin`` over all of them, then
        each placement claims its matrices from those the ones before it left, and steps
        them (in this order: a placement's collectives run in it on every rank)."""
        entries = list(self._matrices_with_grad(groups))
        self.core.begin(entries, self._live)
        claimed = []
        for placement in self.placements:
            mine, entries = placement.claim(entries)
            claimed.append((placement, mine))
        for placement, mine in claimed:
            placement.step(mine, self)

    def _init_matrix_state(self, param: Tensor, group: Group) -> dict[str, Any]:
        """The core's state of a matrix, and each placement's beside it."""
        name = self.name_of(param)
        state = self.core.init_state(param, group, name)
        for placement in self.placements:
            state |= placement.init_state(param, group, name)
        return state

    # ------------------------------------------------------------ checkpoints
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load state, keeping each saved tensor's dtype; ``ValueError`` if another
        optimizer saved it (its groups' algorithms differ from this optimizer's).

        ``torch.optim.Optimizer`` casts floating state to the parameter's dtype, which would
        turn fp32 state of bf16 parameters (and Dobb's bases) into bf16; we undo that.
        """
        saved_algorithms = [g.get("algorithm") for g in state_dict["param_groups"]]
        algorithms = [g["algorithm"] for g in self.param_groups]
        if saved_algorithms != algorithms:
            raise ValueError(
                f"{type(self).__name__} cannot load this state: it was saved by an optimizer "
                f"with parameter groups {saved_algorithms}, this one has {algorithms}; load "
                "it into the optimizer (and scalar algorithm) that saved it, or start afresh"
            )
        saved = state_dict["state"]
        super().load_state_dict(state_dict)
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = dict(zip(ids, (p for g in self.param_groups for p in g["params"]), strict=True))
        for index, entry in saved.items():
            param = params[index]
            state = self.state[param]
            for key, value in entry.items():
                if isinstance(value, Tensor) and state[key].dtype != value.dtype:
                    state[key] = state[key].to(value.dtype)
                if key in COUNTERS and isinstance(value, Tensor):
                    # torch moves some onto the device (a sync every step): copy the saved
                    # counter instead, so that moving it back to the host reads no device
                    device = local(param).device if self.capturable else "cpu"
                    state[key] = value.detach().to(device, copy=True)
