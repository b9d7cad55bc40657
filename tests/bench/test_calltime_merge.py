"""``bench.results.calltime_merge``: per-optimizer call-time runs into one record."""

import json

import pytest

from bench.optimizers import RATIO_KEY
from bench.results.calltime_merge import main, merge
from bench.tools.records import read_record, stamped


def _part(path, name, median, complete=True):
    entry = {"call_s": {"median": median}, RATIO_KEY: 1.0}
    meta = {"command": f"calltime --optimizers {name}", "complete": complete, "layers": 9}
    path.write_text(
        json.dumps(stamped({"meta": meta, "hooks": {"share": 0.3}, "optimizers": {name: entry}}))
    )
    return path


def test_merge_keeps_every_row_and_names_the_missing_parts(tmp_path):
    dobb = _part(tmp_path / "part_dobb_paper.json", "dobb_paper", 0.02)
    muon = _part(tmp_path / "part_muon.json", "muon", 0.03)
    broken = tmp_path / "part_dion.json"
    broken.write_text('{"meta": ')  # the process died while writing
    absent = tmp_path / "part_adamw.json"  # the process died before writing
    half = _part(tmp_path / "part_normuon.json", "normuon", 0.05, complete=False)
    record = merge([dobb, muon, broken, absent, half])
    assert sorted(record["optimizers"]) == ["dobb_paper", "muon", "normuon"]
    assert record["optimizers"]["muon"][RATIO_KEY] == pytest.approx(1.5)
    assert record["meta"]["missing"] == ["part_dion.json", "part_adamw.json", "part_normuon.json"]
    assert not record["meta"]["complete"] and record["meta"]["layers"] == 9
    assert record["meta"]["command"].count("calltime --optimizers") == 3


def test_merge_of_complete_parts_is_complete_and_written(tmp_path, capsys):
    parts = [_part(tmp_path / f"{n}.json", n, 0.01 * (i + 1)) for i, n in enumerate("ab")]
    main(["--out", str(tmp_path / "merged.json"), *map(str, parts)])
    record = json.loads((tmp_path / "merged.json").read_text())
    assert record["meta"]["complete"] and record["meta"]["missing"] == []
    assert RATIO_KEY not in record["optimizers"]["a"]  # no Dobb row: no ratio
    assert "missing []" in capsys.readouterr().out


def test_merge_of_nothing_readable_raises(tmp_path):
    with pytest.raises(ValueError, match="no readable call-time record"):
        merge([tmp_path / "none.json"])


def test_parts_from_two_machines_are_refused(tmp_path):
    """One table never mixes machines: another device (or Newton-Schulz dtype) is refused."""
    parts = [_part(tmp_path / f"{n}.json", n, 0.01) for n in ("dobb_paper", "muon")]
    data = json.loads(parts[1].read_text())
    data["meta"]["device_name"] = "AMD EPYC"
    parts[1].write_text(json.dumps(data))
    with pytest.raises(ValueError, match="device_name 'AMD EPYC'.*one machine"):
        merge(parts)


def test_parts_with_their_own_newton_schulz_timings_merge_but_not_two_dtypes(tmp_path):
    """Each process measures its own Gram-matmul times: only the chosen dtype must agree."""
    parts = [_part(tmp_path / f"{n}.json", n, 0.01) for n in ("dobb_paper", "muon")]
    for part, (dtype, ms) in zip(parts, (("bfloat16", 12.0), ("bfloat16", 15.9))):
        data = json.loads(part.read_text())
        data["meta"]["newton_schulz"] = {"ns_dtype": dtype, "matmul_ms": {dtype: ms}}
        part.write_text(json.dumps(data))
    assert sorted(merge(parts)["optimizers"]) == ["dobb_paper", "muon"]
    data = json.loads(parts[1].read_text())
    data["meta"]["newton_schulz"]["ns_dtype"] = "float32"
    parts[1].write_text(json.dumps(data))
    with pytest.raises(ValueError, match="ns_dtype 'float32'.*one machine"):
        merge(parts)


def test_a_part_written_before_the_paper_s_dobb_was_renamed_merges_under_its_new_name(tmp_path):
    """A part without ``lab_names`` (written when the lab's "dobb" was the paper's
    configuration) merges as ``dobb_paper``, its ratio recomputed under today's field; the
    merged record is stamped, so reading it again renames nothing."""
    old = tmp_path / "old.json"
    entry = {"call_s": {"median": 0.02}, "ratio_vs_dobb": 1.0}
    meta = {"command": "calltime --optimizers dobb", "complete": True}
    old.write_text(json.dumps({"meta": meta, "optimizers": {"dobb": entry}}))
    new = _part(tmp_path / "new.json", "dobb", 0.04)  # today's dobb: the recommended one
    record = merge([old, new])
    assert sorted(record["optimizers"]) == ["dobb", "dobb_paper"]
    assert record["optimizers"]["dobb"][RATIO_KEY] == pytest.approx(2.0)
    assert "ratio_vs_dobb" not in record["optimizers"]["dobb_paper"]
    assert record["meta"]["commands"][0] == "calltime --optimizers dobb_paper"
    main(["--out", str(tmp_path / "merged.json"), str(old), str(new)])
    assert read_record(tmp_path / "merged.json")["optimizers"].keys() == {"dobb", "dobb_paper"}
