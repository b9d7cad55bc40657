"""Rank 0's records of a run: ``run.json``, ``metrics.jsonl`` and ``summary.json``."""

import json
import math
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dobb.train.errors import RunError, RunWarning


def _finite_or_none(record: dict[str, Any]) -> dict[str, Any]:
    """`record` with NaN and infinite numbers as None (JSON has no NaN: `null`)."""
    return {
        k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()
    }


def _write_atomic(path: Path, text: str) -> None:
    part = path.with_name(path.name + ".part")
    part.write_text(text)
    os.replace(part, path)


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of `metrics.jsonl`; a line that is not a JSON record (torn by a full
    disk or a kill mid-append) is dropped with a `RunWarning` naming its line."""
    records = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError("not a step record")
        except ValueError:
            warnings.warn(
                f"{path}: line {number} is not a complete record ({line[:40]!r}); dropped",
                RunWarning,
                2,
            )
            continue
        records.append(record)
    return records


class RunLog:
    """Rank 0's files in `out_dir`: run.json, metrics.jsonl, summary.json (other ranks: no-op).

    Nothing is written until every record to keep has been read. A write that fails (a
    full disk) is a `RunError`: the run can resume from its last checkpoint.
    """

    def __init__(self, out: Path, enabled: bool, info: dict[str, Any], resumed_step: int | None):
        self.enabled, self.out, self.time_s, self.skipped = enabled, out, 0.0, 0
        if not enabled:
            return
        path, run_json = out / "metrics.jsonl", out / "run.json"
        records = read_records(path) if resumed_step and path.exists() else []
        # after a resume, drop the records of steps that are about to be redone
        kept = [r for r in records if r["step"] <= resumed_step]
        if resumed_step and run_json.exists():  # the earlier parts' records stay
            try:
                earlier = json.loads(run_json.read_text())
                info = info | {"previous": earlier.pop("previous", []) + [earlier]}
            except ValueError:
                warnings.warn(f"{run_json} is unreadable; replaced", RunWarning, 2)
        self._guard(lambda: (out / "summary.json").unlink(missing_ok=True))  # written at the end
        self._guard(lambda: _write_atomic(run_json, json.dumps(info, indent=1)))
        self._guard(lambda: _write_atomic(path, "".join(json.dumps(r) + "\n" for r in kept)))
        self.time_s = kept[-1]["time_s"] if kept else 0.0  # training time so far
        self.skipped = sum(1 for r in kept if r.get("skipped"))
        self.metrics = self._guard(lambda: open(path, "a"))

    def _guard(self, write: Callable[[], Any]) -> Any:
        try:
            return write()
        except OSError as e:
            raise RunError(
                f"writing the run's logs in {self.out} failed ({e.strerror}: {e.filename}); "
                "free disk space (or fix out_dir), then rerun with resume=true"
            ) from None

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            self.skipped += bool(record.get("skipped"))
            line = json.dumps(_finite_or_none(record), allow_nan=False) + "\n"
            self._guard(lambda: (self.metrics.write(line), self.metrics.flush()))

    def finish(self, summary: dict[str, Any]) -> None:
        if self.enabled:
            self.metrics.close()
            text = json.dumps(_finite_or_none(summary), indent=1, allow_nan=False)
            self._guard(lambda: _write_atomic(self.out / "summary.json", text))
