"""The driver every matrix optimizer in dobb runs on, and the parts it drives.

A ``MatrixOptimizer`` owns what is the same for every algorithm: parameter groups routed by
an ``algorithm`` key (the subclass's own name for hidden matrices, ``"adamw"`` or
``"lion"`` for everything else), group validation, the non-finite-gradient check that runs
before any state is touched, ``step(closure)``, the lazy state, and a ``load_state_dict``
that keeps state dtypes. At each step it reads every matrix group's options into one typed
config (the optimizer's ``Config``, ``dobb.optim.config``) and hands the parts that config,
never the group dict. An algorithm is the driver over these parts, each with a short
interface:

- its ``core``: the maths on plain local tensors. It communicates nothing, keeps nothing
  from one call to the next and sees no DTensor but the parameter it makes a state for:

  - ``init_state(param, config, name)``: a matrix's state, placed as ``param`` (``name``,
    equal on every rank, seeds a matrix's own random draws);
  - ``updates(batch, config)``: the update, in place, of a ``Batch`` of matrices of one set
    of math options, stacked by shape where ``config.batched(device)``.

- its ``placements``, in order (``self.placements``): each ``claim``\\ s the matrices it
  steps from those the ones before it left, then ``step``\\ s them with the core. Every
  collective of a step lives in a placement: the owner exchange of Muon's family
  (``dobb.optim.owner_groups``), Dion's sharded protocol (``dobb.optim.dion_sharded``),
  Dobb's statistics average and shared refresh (``dobb.optim.dobb_steps``). ``Local``,
  last for most optimizers, takes the rest and calls ``core.updates`` once per set of math
  options and device, with no communication. A placement may keep state of its own beside
  the core's (``init_state``: MuonBP's period counter). It receives the matrices, the core
  and the ``Step`` (every matrix parameter's config, the capturable step's finite flag),
  never the optimizer.

- its ``inputs`` (None for all but Dobb, whose activation statistics arrive through hooks
  between steps): ``pending()``, the ``(param, tensor)`` pairs the step consumes besides
  gradients; ``check(matrices)``, which refuses the step (raises); ``discard()``, which
  drops the step's inputs. These three stay on the driver's side because only the driver
  orders them before anything changes: the non-finite check must see the statistics with
  the gradients, and a refused or skipped step must leave every state, the scalar groups'
  included, as it was. For that reason too ``check`` holds the one collective outside the
  placements: once per optimizer, a multi-rank job with no ``stats_group`` compares its
  ranks' statistics (``dobb.optim.dobb_statistics.DobbStatistics``) and is refused if its
  replicas would drift apart.

A step, in order: the non-finite check of the gradients and ``inputs.pending()`` (skip or
raise: ``inputs.discard()``); ``inputs.check``; AdamW/Lion on the other groups; then the
matrices with a gradient, their state built lazily, are claimed by each placement in turn
and stepped.

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
from dobb.optim.batching import each
from dobb.optim.config import OptimizerConfig
from dobb.optim.experts import ExpertViews, experts_refusal, is_experts, stacked_state
from dobb.optim.parts import COUNTERS, Core, Group, Local, Matrix, Placement, Step
from dobb.optim.scalar import (
    SCALAR_ALGORITHMS,
    SCALAR_DEFAULTS,
    adamw_updates,
    init_scalar_state,
    lion_updates,
)
from dobb.optim.state_init import is_state_init_step

GROUP_KEYS = {"params", "algorithm", "param_names", "initial_lr"}


class NonFiniteGradientError(FloatingPointError):
    """A gradient (or activation statistic) held NaN or Inf; no state was changed."""


class MatrixOptimizer(torch.optim.Optimizer):
    """The driver: routing, validation, the step loop and the lazy state, over a ``core``,
    its ``placements`` and its ``inputs`` (the module docstring).

    Subclasses set ``algorithm`` (their group name), ``Config``, ``core`` and, where some
    matrices are shared with other ranks or a step consumes more than gradients,
    ``placements`` and ``inputs``, and construct with ``super().__init__(params, config)``;
    their constructor's signature is ``Config``'s (``OptimizerConfig.signature``).
    """

    algorithm: str
    Config: type[OptimizerConfig]  # the options: each subclass nests its own
    config: OptimizerConfig  # this optimizer's values of them
    core: Core
    placements: tuple[Placement, ...] = (Local(),)
    inputs = None  # what a step consumes besides gradients (Dobb's statistics)
    supports_experts = True  # steps (E, d_out, d_in) expert stacks (dobb.optim.experts)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "Config" in vars(cls):  # the constructor takes exactly the config's fields
            cls.__signature__ = cls.Config.signature()
            # its marked options, read now: a compiled step cannot read a dataclass's fields
            cls.Config.math_options(), cls.Config.layout_options()

    def __init__(self, params, config: OptimizerConfig):
        """``config``: this optimizer's options (``Config.from_options``)."""
        self.config = config
        self.nonfinite, self.foreach = config.nonfinite, config.foreach
        self.capturable = getattr(config, "capturable", False)
        self.skipped_steps: int | Tensor = 0
        self._live: Tensor | None = None  # capturable: 1.0 if this step's inputs are finite
        self._names: dict[Tensor, str] = {}
        self.expert_views = ExpertViews()  # each expert stack's matrices (dobb.optim.experts)
        super().__init__(params, {"algorithm": self.algorithm, **config.defaults()})

    # ----------------------------------------------------------------- groups
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Validate a group before ``torch.optim`` fills in the defaults."""
        algorithm = param_group.get("algorithm", self.algorithm)
        allowed = (self.algorithm, *SCALAR_ALGORITHMS)
        if algorithm not in allowed:
            raise ValueError(
                f"unknown algorithm {algorithm!r} in a parameter group of "
                f"{type(self).__name__}; expected one of {allowed} (dobb.param_groups(model, "
                f"algorithm={self.algorithm!r}) routes a model's matrices to it)"
            )
        if algorithm in SCALAR_ALGORITHMS:
            for key, value in SCALAR_DEFAULTS[algorithm].items():
                param_group.setdefault(key, value)
            keys = GROUP_KEYS | {"lr"} | set(SCALAR_DEFAULTS[algorithm])
        else:
            keys = GROUP_KEYS | set(self.defaults)
            self.config.refuse_old_spellings(f"{type(self).__name__} group", param_group)
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
            if is_experts(p):
                name, supported = self.name_of(p), self.supports_experts
                refusal = experts_refusal(p, name, self.algorithm, supported)
                if refusal is not None:
                    raise ValueError(refusal)
            elif p.ndim != 2:
                raise ValueError(
                    f"{self.name_of(p)} has {p.ndim} dimension(s), but algorithm="
                    f"{self.algorithm!r} needs 2-D weight matrices (or (E, d_out, d_in) "
                    "stacks of experts); put it in a group with algorithm='adamw' "
                    "(dobb.param_groups does this for a model)"
                )

    def _matrix_groups(self) -> list[Group]:
        """The groups of this optimizer's algorithm (not the AdamW/Lion ones)."""
        return [g for g in self.param_groups if g["algorithm"] == self.algorithm]

    def configs(self) -> list[tuple[Group, OptimizerConfig]]:
        """Each matrix group with its options read into a config, once (this step's)."""
        return [(g, self.config.with_group(g)) for g in self._matrix_groups()]

    def batched(self, device: torch.device) -> bool:
        """Whether same-shape matrices on ``device`` share kernels (``Config.batched``)."""
        return self.config.batched(device)

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
        configs = self.configs()
        replaced = [p for g, _ in configs for p in g["params"] if p not in self._names]
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
            self._live = self._inputs_live()
        elif not self._inputs_finite():
            self.skipped_steps += 1
            self._discard()
            return loss
        matrices = [
            Matrix(p, None, config, self.name_of(p))
            for g, config in configs
            for p in g["params"]
            if p.grad is not None
        ]
        if self.inputs is not None:
            self.inputs.check(matrices)  # may raise; nothing has been changed yet
        for group in self.param_groups:
            if group["algorithm"] in SCALAR_ALGORITHMS:
                self._scalar_step(group)
        if configs:
            matrices = [m._replace(state=self._state_of(m)) for m in matrices]
            matrices = [e for m in matrices for e in self._experts_of(m)]
            step = Step({p: config for g, config in configs for p in g["params"]}, self._live)
            self._matrix_step(matrices, step)
        return loss

    def _state_of(self, matrix: Matrix) -> dict[str, Any]:
        """``matrix``'s state, made on its first step (the core's and each placement's)."""
        state = self.state[matrix.param]
        if not state:
            config = matrix.config

            def init(param: Tensor, name: str) -> dict[str, Any]:
                state = self.core.init_state(param, config, name)
                for placement in self.placements:
                    state.update(placement.init_state(param, config, name))
                return state

            param, name = matrix.param, matrix.name
            if is_experts(param):
                state.update(stacked_state(param, name, init, self.expert_views.weights(param)))
            else:
                state.update(init(param, name))
        return state

    def _experts_of(self, matrix: Matrix) -> list[Matrix] | tuple[Matrix]:
        """An expert stack's matrices (``dobb.optim.experts``); any other matrix alone."""
        return self.expert_views.matrices(matrix) if is_experts(matrix.param) else (matrix,)

    def _matrix_step(self, matrices: list[Matrix], step: Step) -> None:
        """Each placement claims its matrices from those the ones before it left, then each
        steps them (in this order: a placement's collectives run in it on every rank)."""
        claimed = []
        for placement in self.placements:
            mine, matrices = placement.claim(matrices)
            claimed.append((placement, mine))
        for placement, mine in claimed:
            placement.step(mine, self.core, step)

    def _init_state(self) -> None:
        """The lazy state of every parameter with a gradient, as its first step builds it."""
        configs = dict((id(g), c) for g, c in self.configs())
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None or self.state[p]:
                    continue
                if group["algorithm"] in SCALAR_ALGORITHMS:
                    self.state[p].update(init_scalar_state(p, group["algorithm"], self.capturable))
                else:
                    self._state_of(Matrix(p, None, configs[id(group)], self.name_of(p)))

    def _discard(self) -> None:
        """Drop the step's inputs (a skipped or refused step)."""
        if self.inputs is not None:
            self.inputs.discard()

    def _step_inputs(self) -> list[tuple[Tensor, Tensor]]:
        """(param, tensor) of every gradient and step input (``inputs.pending()``) that must
        be finite."""
        tensors = [(p, local(p.grad)) for g in self.param_groups for p in g["params"]]
        tensors = [(p, t) for p, t in tensors if t is not None]
        tensors += self.inputs.pending() if self.inputs is not None else []
        return [(p, t) for p, t in tensors if t.numel()]  # FSDP shards may be empty

    def _inputs_live(self) -> Tensor:
        """Capturable: 1.0 (on the device) if every step input is finite, else 0.0, and the
        device counter ``skipped_steps`` moves; no host read. Exact: ``0 x`` is 0 where
        ``x`` is finite and NaN where not, so its norm cannot overflow."""
        tensors = [t for _, t in self._step_inputs()]
        device = tensors[0].device if tensors else torch.device("cpu")
        if not isinstance(self.skipped_steps, Tensor):
            self.skipped_steps = torch.zeros((), device=device)
        if not tensors:
            return torch.ones((), device=device)
        zeroed = torch._foreach_mul(tensors, 0.0)
        live = torch.stack(torch._foreach_norm(zeroed)).isfinite().all()
        self.skipped_steps.add_(live.logical_not())
        return live.float()

    def _inputs_finite(self) -> bool:
        """True if every gradient (and step input) is finite; raise or report otherwise."""
        tensors = self._step_inputs()
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
        self._discard()
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

    # ------------------------------------------------------------ checkpoints
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load state, keeping each saved tensor's dtype; ``ValueError`` if another
        optimizer saved it (its groups' algorithms differ from this optimizer's).

        ``torch.optim.Optimizer`` casts floating state to the parameter's dtype, which would
        turn fp32 state of bf16 parameters (and Dobb's bases) into bf16; we undo that. A
        group saved before one of today's options existed takes this optimizer's value of it;
        one saved under an option's old spelling loads as today's (``Config.upgrade_group``;
        ``state_dict`` itself is left as given).
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
        upgrade = self.config.upgrade_group
        groups = [
            upgrade(g) if g["algorithm"] == self.algorithm else g
            for g in state_dict["param_groups"]
        ]
        super().load_state_dict({**state_dict, "param_groups": groups})
        for group in self._matrix_groups():  # saved before an option existed: its default
            for name, value in self.config.defaults().items():
                group.setdefault(name, value)
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
