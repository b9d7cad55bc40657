"""One call-time record from per-optimizer runs: ``python -m bench.results.calltime_merge``.

``benchmarks/gpu_calltime.sh`` times each optimizer in a process of its own (a crash, an
out-of-memory or a timeout costs that optimizer's row, not the others'), then merges:

    python -m bench.results.calltime_merge --out calltime_xl.json part_dobb.json part_muon.json

The merged record has the first readable part's ``meta`` and ``hooks``, every part's
``optimizers`` entries (``RATIO_KEY`` recomputed over all of them), ``meta.commands``
(one per part), ``meta.complete`` (every part complete) and ``meta.missing`` (the parts that
could not be read, or were incomplete, by file name). Parts timed on another device, or
with another Newton-Schulz dtype, are refused: one table never mixes machines.
"""

import argparse
from pathlib import Path

from bench.optimizers import RATIO_KEY, SUBJECT
from bench.results.calltime import write_json
from bench.tools.records import read_record, stamped


def setting(record: dict, key: str):
    """``meta[key]``, or the Newton-Schulz dtype for ``"ns_dtype"`` (each process measures its
    own matmul times, so only the dtype they chose must agree)."""
    if key == "ns_dtype":
        return (record["meta"].get("newton_schulz") or {}).get("ns_dtype")
    return record["meta"].get(key)


def merge(parts: list[Path]) -> dict:
    """The record of ``parts`` (call-time JSON files, one optimizer or more each)."""
    record: dict | None = None
    missing, commands = [], []
    for path in parts:
        try:
            part = read_record(path)
        except (OSError, ValueError):
            missing.append(path.name)
            continue
        if not part.get("meta", {}).get("complete"):
            missing.append(path.name)
        commands.append(part.get("meta", {}).get("command", ""))
        if record is None:
            record = stamped({"meta": dict(part["meta"]), "hooks": part.get("hooks")})
            record["optimizers"] = {}  # each part's, read under today's names
        for key in ("device_name", "ns_dtype"):  # never one table from two machines
            if setting(part, key) != setting(record, key):
                raise ValueError(
                    f"{path.name} has {key} {setting(part, key)!r}, the first part "
                    f"{setting(record, key)!r}: time every part on one machine"
                )
        record["optimizers"].update(part.get("optimizers") or {})
        if part.get("hooks_recommended"):  # measured by the part that times the recommended
            record["hooks_recommended"] = part["hooks_recommended"]
    if record is None:
        raise ValueError(f"no readable call-time record among {[p.name for p in parts]}")
    optimizers = record["optimizers"]
    for entry in optimizers.values():
        entry.pop(RATIO_KEY, None)
        if SUBJECT in optimizers:
            entry[RATIO_KEY] = entry["call_s"]["median"] / optimizers[SUBJECT]["call_s"]["median"]
    record["meta"].update(complete=not missing, missing=missing, commands=commands)
    record["meta"]["command"] = " ; ".join(c for c in commands if c)
    return record


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("parts", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    record = merge(args.parts)
    write_json(args.out, record)
    print(f"wrote {args.out}: {sorted(record['optimizers'])}, missing {record['meta']['missing']}")


if __name__ == "__main__":
    main()
