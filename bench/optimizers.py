"""The lab's table of optimizers: what the benchmarks and reports know of each one.

The library's registry (``dobb.registry``) says how to build an optimizer; this table
says how the lab runs and reports it: the label reports use, the settings the comparisons
run it with, its cost model, which tables carry it, and its periodic work. Every subset and
per-optimizer setting of the lab is derived from here; adding an optimizer means one class,
one library entry, one entry here and one cost module.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from bench.model.costs import adamw, dion, dion2, dobb, muon, muonbp, nordion2, normuon
from dobb.registry import PAPER_DOBB, OptimizerEntry, get_entry

# Two-sided Dobb's row blocks per matrix in the call-time runs: the rows one rank holds under
# FSDP over 32 ranks (the paper's call-time setting: GPT-2 XL on 32 GPUs), emulated on one.
DOBB2S_ROW_BLOCKS = 32
# the settings of every call-time figure, and of the cost model's predictions beside them
CALL_SETTINGS = dict(num_blocks=16, basis_interval=10, rank_fraction=1 / 16, period=5)
TABLES = ("calltime", "comm")  # call time and cost model; bytes sent inside step()
# where `python -m bench study` writes its tuned learning rates (in the clone)
STUDY_RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "study" / "study.json"


@dataclass(frozen=True)
class LabEntry:
    """How the lab runs and reports the registry optimizer ``name``."""

    name: str
    label: str
    """How reports name it in prose (``"two-sided Dobb"``)."""
    cost_model: ModuleType | None
    """Its module of ``bench.model.costs`` (state, work, bytes sent in ``step()``)."""
    harness_options: dict[str, Any] = field(default_factory=dict)
    """Constructor overrides of the comparisons (``python -m bench compare`` and ``study``,
    the communication table): the settings compared in the Dobb paper's abstract (Dobb's 16
    blocks, Dion's rank 1/16). Row-blocked optimizers emulate FSDP over 4 ranks in one
    process: MuonBP and BlockMuon tile each matrix's rows as its shards would, Dion2 selects
    rows per such block, two-sided Dobb keeps one row basis per block, with input blocks of
    32 columns (which tile row-parallel TP's column shards over 4 ranks at every width the
    study runs, >= 128)."""
    tables: frozenset[str] = frozenset(TABLES)
    """The tables of ``TABLES`` that carry it (BlockMuon's calls are MuonBP's block calls)."""
    splits_columns: bool = True
    """Runs on matrices split along their columns (row-parallel TP); False: rows only."""
    period_option: str | None = None
    """The constructor argument setting the period of its periodic work (Dobb's
    ``basis_interval``, MuonBP's ``period``); None: every call alike."""
    periodic_calls: tuple[str, str] | None = None
    """Names of the periodic call and of the others (``("refresh", "steady")``)."""
    calltime_settings: tuple[str, ...] = ()
    """The call-time benchmark's settings it takes (``calltime.optimizer_overrides``)."""
    calltime_fixed: dict[str, Any] = field(default_factory=dict)
    """Constructor overrides of the call-time runs, whatever the settings."""
    grid_centre: float | None = None
    """The centre of the study's lr grid in (a) (``start_lr``) where it is not the
    registry's lr: the study's runs are named by their lr, and the registry's lrs have
    since become the tuned ones (``dobb.registry.TUNED_LR``)."""

    @property
    def start_lr(self) -> float:
        """The lab's starting lr of this entry: (a)'s grid centre, the main job's default."""
        return self.grid_centre if self.grid_centre is not None else self.entry.lr

    @property
    def entry(self) -> OptimizerEntry:
        """Its entry in the library's registry."""
        return get_entry(self.name)


_DOBB_CALLTIME = ("num_blocks", "basis_interval", "basis_method")
# The lab's "dobb" is the paper's configuration (the registry's "dobb_paper", but for its lr,
# which the lab tunes): its runs, named "dobb-...", were trained so before the library's
# default became the recommended two-sided configuration
PAPER = {k: v for k, v in PAPER_DOBB.items() if k != "lr"}
_ROW_ONLY = dict(splits_columns=False)  # normalizes or selects whole rows
LAB: dict[str, LabEntry] = {
    e.name: e
    for e in (
        LabEntry(
            "dobb",
            "Dobb",
            dobb,
            PAPER,
            period_option="basis_interval",
            periodic_calls=("refresh", "steady"),
            calltime_settings=_DOBB_CALLTIME,
            calltime_fixed={k: v for k, v in PAPER.items() if k != "num_blocks"},
            grid_centre=1e-3,
        ),
        LabEntry(
            "dobb2s",
            "two-sided Dobb",
            dobb,
            {"row_blocks": 4, "block_size": 32},
            tables=frozenset({"calltime"}),
            period_option="basis_interval",
            periodic_calls=("refresh", "steady"),
            calltime_settings=_DOBB_CALLTIME,
            calltime_fixed={"block_size": None, "row_blocks": DOBB2S_ROW_BLOCKS},
            grid_centre=1e-3,
        ),
        LabEntry(
            "dion",
            "Dion",
            dion,
            {"rank_fraction": 1 / 16},
            calltime_settings=("rank_fraction",),
            grid_centre=0.02,
        ),
        LabEntry("muon", "Muon", muon),
        LabEntry(
            "muonbp",
            "MuonBP",
            muonbp,
            {"row_blocks": 4},
            period_option="period",
            periodic_calls=("full", "block"),
            calltime_settings=("period", "row_blocks"),
        ),
        LabEntry("blockmuon", "BlockMuon", muonbp, {"row_blocks": 4}, tables=frozenset()),
        LabEntry("normuon", "NorMuon", normuon, **_ROW_ONLY),
        LabEntry("dion2", "Dion2", dion2, {"row_blocks": 4}, **_ROW_ONLY),
        LabEntry("nordion2", "NorDion2", nordion2, {"row_blocks": 4}, **_ROW_ONLY),
        LabEntry("adamw", "AdamW", adamw, tables=frozenset({"calltime"})),
    )
}
COMPARED = tuple(LAB)  # the main job and the study: every entry, in this order
# Registry entries the lab runs under another name: the paper's Dobb is the lab's "dobb"
# (its harness options pin the paper's configuration, so its runs keep their names); the
# library's default, the recommended Dobb, is studied in (f) (bench/study/tuning.py).
STUDIED_AS = {"dobb_paper": "dobb", "dobb": "(f) recommended Dobb"}


# A block count and a block width set the same thing: one given on top of the harness's
# options replaces the other (the library refuses both)
BLOCK_OPTIONS = (("num_blocks", "block_size"), ("row_blocks", "row_block_size"))


def with_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """Entry ``name``'s harness options with ``options`` on top, where a block count or
    width in ``options`` replaces the harness's other one (``BLOCK_OPTIONS``)."""
    merged = dict(LAB[name].harness_options) | options
    for pair in BLOCK_OPTIONS:
        for given, other in (pair, pair[::-1]):
            if options.get(given) is not None and other not in options:
                merged.pop(other, None)
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
    """The cost-model module of ``name``; ``ValueError`` if it has none."""
    module = lab_entry(name).cost_model
    if module is None:
        raise ValueError(f"{name!r} has no cost model; it is measured only")
    return module


def tuned_lrs(path: Path = STUDY_RESULTS) -> dict[str, float]:
    """Best hidden-matrix learning rate of each optimizer in the committed study (section
    (a) of ``benchmarks/STUDY.md``); empty if the file is missing."""
    try:
        return dict(json.loads(Path(path).read_text())["best_lr"])
    except FileNotFoundError:
        return {}
