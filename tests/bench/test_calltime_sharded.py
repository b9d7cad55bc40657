"""The sharded call-time benchmark runs every optimizer under FSDP, HSDP and TP."""

import json

import pytest
from multirank import run_ranks
from torch.distributed.tensor import Shard

from bench.model.workload import hidden_matrices
from bench.results import calltime_sharded
from bench.results.calltime import OPTIMIZERS
from bench.results.linear_stack import LinearStack
from bench.tools import launch
from bench.tools.records import LAB_NAMES, read_record


@pytest.mark.parametrize("layout, world", [("fsdp", 2), ("hsdp", 4), ("tp", 2)])
def test_sharded_calltime_times_every_optimizer(tmp_path, capsys, layout, world):
    out = tmp_path / "calltime.json"
    argv = ["--layout", layout, "--world", str(world), "--config", "tiny", "--layers", "1"]
    calltime_sharded.main(argv + ["--tokens", "32", "--repeats", "1", "--basis-interval", "2",
                                  "--out", str(out)])  # fmt: skip
    record = json.loads(out.read_text())
    per_rank, unsupported = record["per_rank_ms"], set(record["unsupported"])
    # row-parallel TP splits columns: optimizers that need whole rows are listed, not run
    assert unsupported == ({"normuon", "dion2", "nordion2"} if layout == "tp" else set())
    assert len(per_rank) == world
    for timings in per_rank:
        assert set(timings) == set(OPTIMIZERS) - unsupported
        for t in timings.values():
            assert 0 < t["q1"] <= t["median"] <= t["q3"] < 60_000
    printed = capsys.readouterr().out
    assert f"| dobb | {layout} | {world} |" in printed and "| 1.00 |" in printed


def placements(rank, world, layout):
    stack = LinearStack(hidden_matrices("tiny", 1), 8)
    calltime_sharded.shard(stack, layout, world)
    return {key: str(layer.weight.placements) for key, layer in stack.layers.items()}


def test_tp_splits_rows_of_column_parallel_and_columns_of_row_parallel_layers():
    got = run_ranks(placements, 2, "tp", timeout=60)[0]
    assert got["blocks_0_attn_q"] == got["blocks_0_mlp_fc"] == str((Shard(0),))
    assert got["blocks_0_attn_proj"] == got["blocks_0_mlp_proj"] == str((Shard(1),))


def test_hsdp_needs_an_even_world():
    with pytest.raises(ValueError, match="even --world"):
        calltime_sharded.main(["--layout", "hsdp", "--world", "3"])


def test_a_sharded_record_is_stamped_with_todays_lab_names_whoever_writes_it(monkeypatch):
    """``run``'s record carries ``lab_names``, so one that ``bench.results.measure`` writes
    reads back its ``dobb`` (the recommended) as ``dobb``, not as an old record's paper's."""
    monkeypatch.setattr(launch, "run_ranks", lambda *args, **kwargs: [{}])  # no ranks spawned
    record = calltime_sharded.run("fsdp", 2, config="tiny", names=("dobb", "muon"))
    assert record["lab_names"] == LAB_NAMES
    assert "--optimizers dobb,muon " in lab_record(record)["command"]


def lab_record(record):
    """``record`` as the reports read a record from a file (``read_record``)."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "record.json"
        path.write_text(json.dumps(record))
        return read_record(path)
