"""One config per optimizer: a frozen dataclass whose fields are the constructor's options.

Each matrix optimizer nests a ``Config`` (``Dobb.Config``, ``Muon.Config``, ...): a field per
option, carrying its default, the rule its values must follow and its marks, written once:

- ``math``: the option changes the update. Matrices whose groups differ in a marked option
  never share a kernel: the batching key is ``config.math_key()``, derived from the marks,
  so an option cannot be left out of it.
- ``group``: the option may differ between parameter groups (it goes into torch.optim's
  ``defaults``); unmarked options belong to the optimizer (``nonfinite``, process groups).
- ``layout``: the option shapes a matrix's layout (Dobb's blocks), which is derived from
  the options so marked and kept out of the checkpoint.

A field's docstring (the string under it) says its unit and meaning; the option tables of
``docs/algorithm.md`` and ``docs/baselines.md`` are rendered from them
(``python -m bench.tools.config_docs``), and so is the constructor's signature
(``signature``): ``Dobb(params, lr, *, momentum=..., ...)`` takes exactly the fields.
Constructing a config validates it: every group is checked by building the optimizer's
config with the group's values (``for_group``); at each step the driver reads a group's
options into a config once (``with_group``, unchecked: a scheduler's ``lr`` may be a tensor),
which the core and the placements read as attributes, never by string keys.

Options renamed before the first release (``renamed``, old -> new, and ``renamed_values``)
are refused with the new spelling in the message, in the constructor and in a parameter
group; a checkpoint saved under an old spelling loads (``upgrade_group``). One idea has one
name in every config (docs/baselines.md, "One vocabulary").
"""

import copy
import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch

LABELS = {"lr": "learning rate"}  # how an error message names an option, where not its name


@dataclass(frozen=True)
class Rule:
    """The values an option accepts: ``test(value)`` is true for them; ``want`` says which."""

    test: Callable[[Any], bool]
    want: str

    def holds(self, value: Any) -> bool:
        """Whether ``value`` follows the rule (a value of the wrong type does not)."""
        try:
            return bool(self.test(value))
        except TypeError:
            return False


def is_count(value: Any) -> bool:
    """An integer >= 1 (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def between(low: float, high: float, *, low_open: bool = False, high_open: bool = True) -> Rule:
    """A number in the interval from ``low`` to ``high`` (closed unless ``*_open``)."""
    above = (lambda v: v > low) if low_open else (lambda v: v >= low)
    below = (lambda v: v < high) if high_open else (lambda v: v <= high)
    interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    return Rule(lambda v: above(v) and below(v), f"in {interval}")


def one_of(*choices: Any) -> Rule:
    """One of ``choices``."""
    names = ", ".join(f'"{c}"' if isinstance(c, str) else repr(c) for c in choices)
    return Rule(lambda v: v in choices, f"one of {names}")


def optional(rule: Rule) -> Rule:
    """``rule``, or None."""
    return Rule(lambda v: v is None or rule.test(v), f"{rule.want}, or None")


UNIT = between(0, 1)  # an EMA factor: [0, 1)
NON_NEGATIVE = Rule(lambda v: v >= 0, ">= 0")
POSITIVE = Rule(lambda v: v > 0, "> 0")
COUNT = Rule(is_count, "an integer >= 1")
BOOL = Rule(lambda v: isinstance(v, bool), "True or False")
SPLITS = Rule(
    lambda v: all(map(is_count, v)) and len(v) > 0 if isinstance(v, tuple | list) else is_count(v),
    "an integer >= 1, or a tuple of them for nested splits",
)


def option(
    default: Any,
    rule: Rule | None = None,
    *,
    math: bool = False,
    group: bool = True,
    layout: bool = False,
):
    """A config field: ``default``, the ``rule`` its values follow (None: any), whether it
    changes the update (``math``), whether a parameter group may set it (``group``) and
    whether it shapes a matrix's layout (``layout``)."""
    marks = {"rule": rule, "math": math, "group": group, "layout": layout}
    return field(default=default, metadata=marks)


def inherit(config: type, name: str, default: Any):
    """``config``'s field ``name`` (its rule and marks) with another default."""
    return field(default=default, metadata=config.__dataclass_fields__[name].metadata)


@dataclass(frozen=True)
class OptimizerConfig:
    """The options every matrix optimizer takes; subclasses add theirs."""

    renamed: ClassVar[dict[str, str]] = {}
    """Options renamed before the first release, old -> new (subclasses')."""
    renamed_values: ClassVar[dict[tuple[str, Any], Any]] = {}
    """Values renamed so, ``(option, old) -> new``."""

    lr: float = option(None, NON_NEGATIVE, math=True)
    """Learning rate (each optimizer says its unit)."""
    weight_decay: float = option(0.0, NON_NEGATIVE, math=True)
    """Decoupled weight decay: ``W <- W (1 - lr weight_decay)`` each step."""
    nonfinite: str = option("raise", one_of("raise", "skip"), group=False)
    """On NaN/Inf gradients (or statistics): ``"raise"`` ``NonFiniteGradientError`` naming
    the first bad parameter, or ``"skip"`` the step; either way no state changes. Checked
    per rank: under sharding, skip on every rank from a global grad-norm check."""
    foreach: bool | None = option(None, one_of(None, True, False), group=False)
    """Stack same-shape matrices into shared kernels; None: on every device but the CPU.
    Both paths compute the same update."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value, rule = getattr(self, f.name), f.metadata.get("rule")
            if rule is not None and not rule.holds(value):
                raise ValueError(
                    f"invalid {LABELS.get(f.name, f.name)}: {value!r} "
                    f"({f.name} must be {rule.want})"
                )
        self.check()

    def check(self) -> None:
        """Rules between options (subclasses); ``ValueError`` naming the fix."""

    @classmethod
    def group_options(cls) -> tuple[str, ...]:
        """The options a parameter group may set (torch.optim's ``defaults``)."""
        return _marked(cls, "group")

    @classmethod
    def math_options(cls) -> tuple[str, ...]:
        """The group options that change the update: the batching key's."""
        return _marked(cls, "math")

    @classmethod
    def layout_options(cls) -> tuple[str, ...]:
        """The options a matrix's layout is made from (marked ``layout``)."""
        return _marked(cls, "layout")

    @classmethod
    def from_options(cls, owner: str, lr: Any, options: dict[str, Any]):
        """The config of a constructor's ``lr`` (None: the default) and keyword ``options``;
        ``TypeError`` naming an unknown option and the known ones (as Python would name it,
        with the list a signature does not give)."""
        names = [f.name for f in fields(cls)]
        cls.refuse_old_spellings(owner, options)
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise TypeError(
                f"{owner} got an unexpected keyword argument {unknown[0]!r}; its options: "
                f"{', '.join(names)}"
            )
        return cls(**options) if lr is None else cls(lr=lr, **options)

    @classmethod
    def refuse_old_spellings(cls, owner: str, options: dict[str, Any]) -> None:
        """``TypeError`` for an option or value of ``options`` under its old spelling
        (``renamed``, ``renamed_values``), giving the new one."""
        for old in sorted(set(options) & set(cls.renamed)):
            raise TypeError(f"{owner}'s option {old!r} is now called {cls.renamed[old]!r}")
        for name, value in options.items():
            new = cls.renamed_values.get((name, value)) if isinstance(value, str) else None
            if new is not None:
                raise ValueError(f"{owner}'s {name}={value!r} is now {name}={new!r}")

    @classmethod
    def upgrade_group(cls, group: dict[str, Any]) -> dict[str, Any]:
        """A saved parameter group with its old spellings (``renamed``, ``renamed_values``)
        replaced by today's: what a checkpoint written before a rename loads as."""
        group = {cls.renamed.get(key, key): value for key, value in group.items()}
        for (name, old), new in cls.renamed_values.items():
            if group.get(name) == old and isinstance(group[name], str):
                group[name] = new
        return group

    @classmethod
    def signature(cls) -> inspect.Signature:
        """The constructor's signature: ``params``, ``lr``, then every other option
        keyword-only, each with its default (what ``inspect.signature`` and the docs show)."""
        keyword = inspect.Parameter.KEYWORD_ONLY
        positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
        defaults = {f.name: f.default for f in fields(cls)}
        return inspect.Signature(
            [
                inspect.Parameter("params", positional),
                inspect.Parameter("lr", positional, default=defaults.pop("lr")),
                *(inspect.Parameter(n, keyword, default=d) for n, d in defaults.items()),
            ]
        )

    def defaults(self) -> dict[str, Any]:
        """torch.optim's ``defaults``: the values of the group options."""
        return {name: getattr(self, name) for name in self.group_options()}

    def for_group(self, group: dict[str, Any]):
        """This config with ``group``'s values of the group options (validated)."""
        return dataclasses.replace(self, **{k: group[k] for k in self.group_options()})

    def with_group(self, group: dict[str, Any]):
        """This config with ``group``'s values of the group options, not validated again: the
        step's reading of a group that ``for_group`` checked when it was added (its ``lr``
        since moved by a scheduler, or a 0-d tensor in a capturable step)."""
        config = copy.copy(self)
        for name in self.group_options():
            object.__setattr__(config, name, group[name])
        return config

    def math_key(self) -> tuple:
        """The values of the math options, hashable (a list as a tuple): matrices whose
        keys differ never share a kernel."""
        return tuple(_hashable(getattr(self, name)) for name in self.math_options())

    def batched(self, device: torch.device) -> bool:
        """Whether same-shape matrices on ``device`` share kernels: ``foreach``, or by
        default (None) everywhere but on the CPU, as ``torch.optim`` decides."""
        return self.foreach if self.foreach is not None else batched_by_default(device)


def batched_by_default(device: torch.device | str) -> bool:
    """What ``foreach=None`` means on ``device``: batched everywhere but on the CPU."""
    return torch.device(device).type != "cpu"


_MARKED: dict[tuple[type, str], tuple[str, ...]] = {}


def _marked(cls: type, mark: str) -> tuple[str, ...]:
    """The names of ``cls``'s fields with ``mark`` (the math and layout options among the
    group options), found once per class: a compiled step (``torch.compile``) reads them
    from here, as it cannot read a dataclass's fields."""
    if (cls, mark) not in _MARKED:
        group = [f for f in fields(cls) if f.metadata.get("group", True)]
        marked = group if mark == "group" else [f for f in group if f.metadata.get(mark)]
        _MARKED[(cls, mark)] = tuple(f.name for f in marked)
    return _MARKED[(cls, mark)]


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value
