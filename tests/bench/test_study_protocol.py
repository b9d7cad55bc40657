"""Every committed run the study and the main job report follows the one weight-decay
protocol (docs/harness.md), read from the run's own logged config."""

import json
from pathlib import Path

import pytest

from bench.study.analysis import follows, protocol
from dobb.train.config import TrainConfig

ROOT = Path(__file__).resolve().parents[2] / "benchmarks"
RUNS = [
    pytest.param(folder, run.name, id=f"{folder.parent.name}/{run.name}")
    for folder in (ROOT / "study" / "runs", ROOT / "compare" / "runs")
    for run in sorted(folder.iterdir())
]


def test_the_protocol_is_no_weight_decay_on_any_parameter():
    assert protocol(TrainConfig()) == {"weight_decay": 0.0, "scalar_weight_decay": 0.0}


@pytest.mark.parametrize("folder, run", RUNS)
def test_each_committed_run_follows_the_protocol(folder, run):
    assert follows(folder.parent, run, TrainConfig()), f"{run} trained off the protocol"


def test_a_run_off_the_protocol_is_caught(tmp_path):
    """A Dion run logged before the protocol (no weight_decay field): its class default,
    0.01, decayed every parameter."""
    run = tmp_path / "runs" / "dion-lr0.01"
    run.mkdir(parents=True)
    config = TrainConfig(optimizer="dion").to_dict()
    for key in ("weight_decay", "scalar_weight_decay"):
        del config[key]
    (run / "run.json").write_text(json.dumps({"config": config}))
    assert not follows(tmp_path, run.name, TrainConfig())
