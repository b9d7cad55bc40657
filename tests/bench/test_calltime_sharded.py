"""The sharded call-time benchmark runs every optimizer under FSDP and HSDP."""

import json

import pytest

from dobb.bench import calltime_sharded


@pytest.mark.parametrize("layout, world", [("fsdp", 2), ("hsdp", 4)])
def test_sharded_calltime_times_every_optimizer(tmp_path, capsys, layout, world):
    out = tmp_path / "calltime.json"
    argv = ["--layout", layout, "--world", str(world), "--config", "tiny", "--layers", "1"]
    calltime_sharded.main(argv + ["--tokens", "32", "--repeats", "1", "--basis-interval", "2",
                                  "--out", str(out)])  # fmt: skip
    per_rank = json.loads(out.read_text())["per_rank_ms"]
    assert len(per_rank) == world
    for timings in per_rank:
        assert set(timings) == {"dobb", "dion", "muon", "adamw"}
        assert all(0 < ms < 60_000 for ms in timings.values())
    printed = capsys.readouterr().out
    assert f"| dobb | {layout} | {world} |" in printed and "| 1.00 |" in printed


def test_hsdp_needs_an_even_world():
    with pytest.raises(ValueError, match="even --world"):
        calltime_sharded.main(["--layout", "hsdp", "--world", "3"])
