"""The library's one table of learning rates (``dobb.registry.TUNED_LR``) is the study's:
each entry's lr at each width is the tuned lr of the configuration the entry builds, in
section (f) of ``benchmarks/study/study.json`` (Dion2's from (a)); each class's default
lr is its value at width 256; ``recommended_lr`` picks the nearest width."""

import json
import warnings
from pathlib import Path

import pytest

import dobb
from dobb.registry import OPTIMIZERS, TUNED_LR, recommended_lr

STUDY = Path(__file__).resolve().parents[2] / "benchmarks" / "study" / "study.json"
# the (f) row of each entry's configuration
ROWS = {
    "dobb": (
        "recommended Dobb (two-sided SOAP, one input block, one row block per shard, "
        "update x 256/width)"
    ),
    "dobb_paper": "Dobb, 16 blocks",
    "dobb_sign": "two-sided Dobb, one input block",
    "dion": "Dion",
    "muon": "Muon",
    "muonbp": "MuonBP",
    "blockmuon": "BlockMuon",
    "normuon": "NorMuon",
    "nordion2": "NorDion2",
    "adamw": "AdamW",
}


def study() -> dict:
    return json.loads(STUDY.read_text())


@pytest.mark.parametrize("name", sorted(TUNED_LR))
def test_the_table_is_the_studys_tuned_lr(name):
    if name not in ROWS:  # tuned in (a) only, at the study's width
        assert TUNED_LR[name] == {128: study()["best_lr"][name]}
        return
    rows = {r["label"]: r for r in study()["tuning"]["rows"]}
    tuned = {e["n_embd"]: e["best_lr"] for e in rows[ROWS[name]]["widths"]}
    assert TUNED_LR[name] == tuned


def test_every_entry_has_a_row_and_the_classes_default_is_width_256s():
    assert set(TUNED_LR) == set(OPTIMIZERS)
    for name, entry in OPTIMIZERS.items():
        if 256 in TUNED_LR[name]:
            assert entry.lr == TUNED_LR[name][256], name


def test_recommended_lr_takes_the_nearest_width(monkeypatch):
    monkeypatch.setattr(dobb.registry, "_WARNED_BEYOND", set())
    assert recommended_lr("normuon", 128) == 1e-2 and recommended_lr("normuon", 200) == 5e-3
    with pytest.warns(UserWarning, match=r"tuned at widths \[128, 256\] only"):
        assert recommended_lr("normuon", 4096) == 5e-3  # beyond the table: its last width's
    assert dobb.recommended_lr("dobb", 64) == TUNED_LR["dobb"][128]


def test_recommended_lr_warns_once_beyond_the_widest_tuned_width(monkeypatch):
    """Beyond the widest tuned width the lr is that width's, with a warning naming the
    widths tuned, once per entry; within the table (and narrower than it) no warning."""
    monkeypatch.setattr(dobb.registry, "_WARNED_BEYOND", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert recommended_lr("dobb", 256) == TUNED_LR["dobb"][256]
        assert recommended_lr("dobb", 32) == TUNED_LR["dobb"][128]
    with pytest.warns(
        UserWarning,
        match=r"dobb's lr is tuned at widths \[128, 256, 512\] only; "
        r"width 1600 takes width 512's",
    ):
        assert recommended_lr("dobb", 1600) == TUNED_LR["dobb"][512]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        recommended_lr("dobb", 2048)  # once per entry
    with pytest.warns(UserWarning, match="muon's lr is tuned at widths"):
        recommended_lr("muon", 1024)
