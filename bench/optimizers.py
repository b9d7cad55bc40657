"""The lab's table of optimizers: what the benchmarks and reports know of each one.

The library's registry (``dobb.registry``) says how to build an optimizer; this table
says how the lab runs and reports it: the label reports use, the settings the comparisons
run it with, which tables carry it, and its periodic work, with its cost model (the module
of ``bench.model.costs`` that names the entry). Every subset and per-optimizer setting of
the lab is derived from here; adding an optimizer means one class, one library entry, one
entry here and one cost module.

The table sits above the cost model (``bench.model``, which knows the registry, not the
table) and below what runs and reports the optimizers (``bench.compare``,
``bench.results``, ``bench.study``, ...): ``bench.tools.import_graph.LAYERS["bench"]``.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from bench.model import costs
from bench.model.workload import XL_WORLD
from dobb.optim.dion import Dion
from dobb.optim.dobb import Dobb
from dobb.optim.dobb_core import refresh_due
from dobb.optim.muonbp import MuonBP, full_step_due
from dobb.registry import PAPER_DOBB, OptimizerEntry, get_entry

# Two-sided Dobb's row blocks per matrix in the call-time runs: the rows one rank holds under
# FSDP over the paper's call-time setting (GPT-2 XL on XL_WORLD = 32 GPUs), emulated on one.
DOBB_SIGN_ROW_BLOCKS = XL_WORLD
# the settings of every call-time figure, and of the cost model's predictions beside them:
# the optimizers' defaults, Dobb's the paper's configuration (16 blocks) and Dion's rank
# fraction 1/16 (the paper's)
CALL_SETTINGS = dict(
    num_blocks=PAPER_DOBB["num_blocks"],
    basis_interval=Dobb.Config.basis_interval,
    rank_fraction=Dion.Config.rank_fraction,
    period=MuonBP.Config.period,
)
# The lab's choices for the comparisons (``LabEntry.harness_options``): row-blocked
# optimizers emulate FSDP over 4 ranks in one process, and two-sided Dobb takes input
# blocks of 32 columns
EMULATED_SHARDS = 4
DOBB_SIGN_INPUT_BLOCK = 32
# call time and cost model; bytes sent inside step(); loss against wall-clock time
TABLES = ("calltime", "comm", "timebudget")
MEASURED = frozenset({"calltime", "comm"})  # the tables an entry is in unless it says


@dataclass(frozen=True)
class LabEntry:
    """How the lab runs and reports the registry optimizer ``name``."""

    name: str
    label: str
    """How reports name it in prose (``"two-sided Dobb"``)."""
    harness_options: dict[str, Any] = field(default_factory=dict)
    """Constructor overrides of the comparisons (``python -m bench compare`` and ``study``,
    the communication table) on top of the registry entry's settings, which are the
    configuration the name stands for (the paper's Dobb's 16 blocks and the sign are
    ``dobb_paper``'s own; Dion's rank 1/16 is its class's default, written into every run's
    record). Besides the lr, an override only lays out a single process as a sharded job
    would be: row-blocked optimizers emulate FSDP over ``EMULATED_SHARDS``
    (4) ranks in one process: MuonBP and BlockMuon tile each matrix's rows as its shards
    would, Dion2 selects rows per such block, two-sided Dobb keeps one row basis per block.
    One exception remains: two-sided Dobb also takes input blocks of
    ``DOBB_SIGN_INPUT_BLOCK`` (32) columns, finer than the registry's ``dobb_sign`` (one
    block up to 1,024 columns): its study runs were trained so, and (b) to (f) build on them
    (the registry's ``dobb_sign`` is (f)'s "two-sided Dobb, one input block")."""
    tables: frozenset[str] = MEASURED
    """The tables of ``TABLES`` that carry it (BlockMuon's calls are MuonBP's block calls;
    the time-budget runs, ``bench.timebudget``, train the paper's comparison and BlockMuon
    on a GPU within one time limit)."""
    splits_columns: bool = True
    """Runs on matrices split along their columns (row-parallel TP); False: rows only."""
    period_option: str | None = None
    """The constructor argument setting the period of its periodic work (Dobb's
    ``basis_interval``, MuonBP's ``period``); None: every call alike."""
    periodic_calls: tuple[str, str] | None = None
    """Names of the periodic call and of the others (``("refresh", "steady")``)."""
    schedule: Callable[[int, Any], bool] | None = None
    """The library's schedule of its periodic work: whether a matrix's call ``step`` (from
    1) does it, given the value of ``period_option`` (``dobb.optim.dobb_core.refresh_due``,
    ``dobb.optim.muonbp.full_step_due``)."""
    calltime_settings: tuple[str, ...] = ()
    """The call-time benchmark's settings it takes (``calltime.optimizer_overrides``)."""
    calltime_fixed: dict[str, Any] = field(default_factory=dict)
    """Constructor overrides of the call-time runs, whatever the settings."""
    sharded_note: str | None = None
    """What a reader needs beside its sharded call time (MuonBP's: its steady call is
    BlockMuon's)."""
    grid_centre: float | None = None
    """The centre of the study's lr grid in (a) (``start_lr``) where it is not the
    registry's lr: the study's runs are named by their lr, and the registry's lrs have
    since become the tuned ones (``dobb.registry.TUNED_LR``)."""

    tuned_in: str = "(a)"
    """The study's section that tunes it: "(a)", the tuned comparison (its lr sweeps, seeds
    and ablations), or "(f)", the tuned-at-each-width table only."""

    @property
    def start_lr(self) -> float:
        """The lab's starting lr of this entry: (a)'s grid centre, the main job's default."""
        return self.grid_centre if self.grid_centre is not None else self.entry.lr

    @property
    def entry(self) -> OptimizerEntry:
        """Its entry in the library's registry."""
        return get_entry(self.name)

    @property
    def cost_model(self) -> ModuleType | None:
        """Its module of ``bench.model.costs`` (state, work, bytes sent in ``step()``): the
        one naming it in its ``ENTRIES``; None: measured only."""
        return costs.MODELS.get(self.name)


_DOBB_CALLTIME = ("num_blocks", "basis_interval", "basis_method")
_ROW_ONLY = dict(splits_columns=False)  # normalizes or selects whole rows
_ROW_BLOCKS = {"row_blocks": EMULATED_SHARDS}
_REFRESHES = dict(  # Dobb's periodic work: a refresh of the bases
    period_option="basis_interval", periodic_calls=("refresh", "steady"), schedule=refresh_due
)
LAB: dict[str, LabEntry] = {
    e.name: e
    for e in (
        LabEntry(
            "dobb_paper",
            "Dobb (paper)",
            tables=MEASURED | {"timebudget"},
            **_REFRESHES,
            calltime_settings=_DOBB_CALLTIME,
            grid_centre=1e-3,
        ),
        # the library's default; (a) does not tune it: (f) does, as "recommended Dobb"
        LabEntry(
            "dobb",
            "Dobb (recommended)",
            tables=frozenset({"calltime"}),
            **_REFRESHES,
            calltime_settings=("basis_interval", "basis_method"),
            tuned_in="(f)",
        ),
        LabEntry(
            "dobb_sign",
            "two-sided Dobb",
            {"row_blocks": EMULATED_SHARDS, "block_size": DOBB_SIGN_INPUT_BLOCK},
            tables=frozenset({"calltime"}),
            **_REFRESHES,
            calltime_settings=_DOBB_CALLTIME,
            calltime_fixed={"block_size": None, "row_blocks": DOBB_SIGN_ROW_BLOCKS},
            grid_centre=1e-3,
        ),
        LabEntry(
            "dion",
            "Dion",
            {"rank_fraction": Dion.Config.rank_fraction},
            tables=MEASURED | {"timebudget"},
            calltime_settings=("rank_fraction",),
            grid_centre=0.02,
        ),
        LabEntry("muon", "Muon", tables=MEASURED | {"timebudget"}),
        LabEntry(
            "muonbp",
            "MuonBP",
            _ROW_BLOCKS,
            period_option="period",
            periodic_calls=("full", "block"),
            schedule=full_step_due,
            calltime_settings=("period", "row_blocks"),
            sharded_note="a BlockMuon call is its block step",
        ),
        LabEntry("blockmuon", "BlockMuon", _ROW_BLOCKS, tables=frozenset({"timebudget"})),
        LabEntry("normuon", "NorMuon", **_ROW_ONLY),
        LabEntry("dion2", "Dion2", _ROW_BLOCKS, **_ROW_ONLY),
        LabEntry("nordion2", "NorDion2", _ROW_BLOCKS, **_ROW_ONLY),
        LabEntry("adamw", "AdamW", tables=frozenset({"calltime", "timebudget"})),
    )
}
# the lab's Dobb, the entry the reports set the others' call times against: the paper's
# configuration, whose call time the paper reports
SUBJECT = "dobb_paper"
RATIO_KEY = f"ratio_vs_{SUBJECT}"  # a call-time record's field: an entry's median over SUBJECT's
COMPARED = tuple(LAB)  # the main job: every entry, in this order
STUDIED = tuple(name for name, e in LAB.items() if e.tuned_in == "(a)")  # the study's (a)


# A block count and a block width set the same thing: one given on top of the harness's
# options replaces the other (the library refuses both)
BLOCK_OPTIONS = (("num_blocks", "block_size"), ("row_blocks", "row_block_size"))


def with_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """Entry ``name``'s harness options with ``options`` on top, where a block count or
    width in ``options`` replaces the other one: the harness's is dropped, the registry
    entry's is set to None (the paper's Dobb names 16 blocks: ``block_size=32`` replaces
    them)."""
    merged = dict(LAB[name].harness_options) | options
    named = get_entry(name).hyperparameters
    for pair in BLOCK_OPTIONS:
        for given, other in (pair, pair[::-1]):
            if options.get(given) is not None and other not in options:
                merged.pop(other, None)
                if named.get(other) is not None:
                    merged[other] = None
    return merged


def in_table(table: str) -> tuple[str, ...]:
    """The entries a table of ``TABLES`` carries, in the table's order."""
    if table not in TABLES:
        raise ValueError(f"unknown table {table!r}; one of {TABLES}")
    return tuple(name for name, e in LAB.items() if table in e.tables)


def lab_entry(name: str) -> LabEntry:
    """The lab's entry ``name``; ``ValueError`` listing the known names if none."""
    if name not in LAB:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {sorted(LAB)}")
    return LAB[name]


def cost_model(name: str) -> ModuleType:
    """The cost-model module of the lab's entry ``name``; ``ValueError`` if it has none."""
    return costs.cost_model(lab_entry(name).name)
