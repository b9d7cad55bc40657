"""Atomic, checksummed distributed checkpoints (DCP) that a killed run resumes from exactly.

`<root>/step_000120/` (written as `step_000120.tmp/` and renamed once complete; a `.tmp`
directory is an interrupted save, ignored) holds DCP's files (model, optimizer, `extra`
tensors such as the EMA weights), `rng_rank<r>.pt` (each rank's RNG states, tensors and
numbers only, loaded with `weights_only=True`) and `COMPLETE`, written last by rank 0: the
metadata (step, scheduler, config) and every other file's size and SHA-256. The data
position needs no saving: batch `step` is a pure function of (seed, step, rank). What a run
relies on (intact checks, retention, failed saves, trust): `docs/harness.md`.
"""

import functools
import hashlib
import json
import os
import random
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from dobb.optim.dobb import LegacyKeysLoadPlanner
from dobb.train.errors import RunError, RunWarning

MARKER = "COMPLETE"
CHECKPOINT_NAME = re.compile(r"^step_(\d{6,})$")


class CheckpointError(RunError):
    """No intact checkpoint to resume from, or one that does not fit the model."""


def checkpoint_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:06d}"


def checkpoint_dirs(root: str | Path) -> list[Path]:
    """Every `step_*` directory under `root`, marked or not, oldest first (`.tmp` ignored)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := CHECKPOINT_NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def complete_checkpoints(root: str | Path) -> list[Path]:
    """Checkpoints under `root` with a `COMPLETE` marker, oldest first (not verified)."""
    return [p for p in checkpoint_dirs(root) if (p / MARKER).is_file()]


def latest_checkpoint(root: str | Path) -> Path | None:
    """The complete checkpoint with the highest step under `root`, or None."""
    found = complete_checkpoints(root)
    return found[-1] if found else None


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The JSON metadata a complete checkpoint's `COMPLETE` marker holds."""
    return json.loads((Path(path) / MARKER).read_text())


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_manifest(directory: Path) -> dict[str, dict[str, Any]]:
    """`{name: {"bytes": size, "sha256": hex digest}}` of every file in `directory` but the
    marker, sorted by name: what `COMPLETE` records and `checkpoint_fault` checks."""
    files = sorted(p for p in directory.iterdir() if p.is_file() and p.name != MARKER)
    return {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in files}


def checkpoint_fault(path: str | Path) -> str | None:
    """What is wrong with the checkpoint directory `path` (a phrase), or None if intact.

    Intact: `COMPLETE` is valid JSON listing files, and each listed file exists with the
    recorded size and SHA-256. Files the marker does not list are not looked at.
    """
    path = Path(path)
    try:
        files = read_metadata(path)["files"]
    except FileNotFoundError:
        return f"no {MARKER} marker (its save never finished, or the marker was deleted)"
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
        return f"its {MARKER} marker is unreadable or lists no files"
    for name, expected in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if (size := file.stat().st_size) != expected["bytes"]:
            return f"{name} has {size} bytes, {expected['bytes']} were saved (truncated?)"
        if sha256_file(file) != expected["sha256"]:
            return f"{name} fails its SHA-256 check (corrupted)"
    return None


def intact_checkpoint(root: str | Path) -> Path | None:
    """The newest intact checkpoint under `root`; None if `root` holds no checkpoint at all.

    Damaged ones (see `checkpoint_fault`) are skipped with a `RunWarning` naming each and
    its fault. If there are checkpoints but none is intact, `CheckpointError`: nothing on
    disk is changed, the user decides. Reads every file of each checkpoint it checks (run
    it on one rank and share the answer).
    """
    found = checkpoint_dirs(root)
    faults = []
    for path in reversed(found):
        fault = checkpoint_fault(path)
        if fault is None:
            return path
        faults.append(f"{path.name}: {fault}")
        warnings.warn(f"skipping damaged checkpoint {path}: {fault}", RunWarning, stacklevel=2)
    if found:
        raise CheckpointError(
            f"no intact checkpoint in {root} ({'; '.join(faults)}); nothing was changed: "
            "delete or repair the damaged ones to start again from the last intact step, or "
            "choose another out_dir"
        )
    return None


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _dcp(fn, state, path) -> None:
    """`dcp.save` or `dcp.load`; without a process group, one process (no warning about it)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        fn(state, checkpoint_id=path, no_dist=not _distributed())


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def rng_state() -> dict[str, Any]:
    """This process's RNG states as tensors, numbers and strings only (no pickled objects),
    so that `torch.load(..., weights_only=True)` reads them back."""
    name, key, pos, has_gauss, cached_gaussian = np.random.get_state()
    version, words, gauss_next = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "name": str(name),
            "key": torch.from_numpy(np.asarray(key, dtype=np.int64)),  # 624 uint32 words
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "python": {"version": version, "state": torch.tensor(words), "gauss_next": gauss_next},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    numpy = state["numpy"]
    key = numpy["key"].numpy().astype(np.uint32)
    np.random.set_state(
        (numpy["name"], key, numpy["pos"], numpy["has_gauss"], numpy["cached_gaussian"])
    )
    python = state["python"]
    random.setstate((python["version"], tuple(python["state"].tolist()), python["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def load_rng_file(path: Path) -> dict[str, Any]:
    """The RNG states in `path`, read with `weights_only=True` (runs no code from the file);
    `CheckpointError` if it holds anything else."""
    try:
        return torch.load(path, weights_only=True)
    except Exception as e:  # noqa: BLE001 - UnpicklingError, or whatever a crafted file raises
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"{path} holds more than RNG tensors and numbers, so it was not loaded ({first}); "
            "resume from a checkpoint this version of dobb wrote, or delete this one"
        ) from None


def _one_line(error: BaseException) -> str:
    """The first line of `error`'s message; for DCP's `CheckpointException` (a
    BaseException whose text is every rank's traceback) that of the first rank's error."""
    if isinstance(error, CheckpointException) and error.failures:
        error = next(iter(error.failures.values()))[0]
    if isinstance(error, OSError) and error.strerror:
        return f"{error.strerror}: {error.filename}" if error.filename else error.strerror
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _agree(error: str | None) -> str | None:
    """Every rank's `error` (None: this rank succeeded) shared: the first one, or None."""
    if not _distributed():
        return error
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e is not None), None)


# checkpoints this process wrote and hashed itself: retention need not read them again
_WRITTEN: set[Path] = set()


def prune_checkpoints(root: str | Path, keep: int) -> list[Path]:
    """Delete checkpoints older than the newest `keep` intact ones; return those deleted.

    Walks from the newest: a checkpoint counts when it is intact (`checkpoint_fault`; one
    this process saved is trusted), a damaged one is skipped and left in place. Only when
    `keep` intact ones are found are the older ones deleted, so there are never fewer
    intact checkpoints than asked (nor is any deleted while there are fewer).
    """
    found, kept, deleted = checkpoint_dirs(root), 0, []
    for index in range(len(found) - 1, -1, -1):
        path = found[index]
        if path.resolve() in _WRITTEN or checkpoint_fault(path) is None:
            kept += 1
        if kept == keep:
            for old in found[:index]:
                shutil.rmtree(old, ignore_errors=True)
                deleted.append(old)
            break
    return deleted


def _write_atomic(path: Path, text: str) -> None:
    part = path.with_name(path.name + ".part")
    with open(part, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)


def save_checkpoint(
    root: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    metadata: dict[str, Any],
    keep: int = 0,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Save a checkpoint of `step` under `root` on every rank (a collective); return its path.

    metadata: JSON-serializable (step, scheduler state, config, ...), stored in `COMPLETE`
    beside the size and SHA-256 of every file (rank 0 reads them all once).
    keep: complete checkpoints to keep, oldest deleted first (0: all).
    extra: more state for DCP beside "model" and "optim", e.g. `{"ema": {name: tensor}}`.
    """
    final = checkpoint_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")

    def failed(error: str) -> CheckpointError:
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        return CheckpointError(
            f"saving checkpoint {final} failed ({error}); its partial files were removed and "
            "earlier checkpoints are untouched: free disk space (or fix out_dir), then rerun "
            "with resume=true"
        )

    error = None
    if _rank() == 0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed while saving
            tmp.mkdir(parents=True)
        except OSError as e:
            error = _one_line(e)
    if error := _agree(error):
        raise failed(error)
    # get_optimizer_state_dict calls Dobb's state_dict(), which averages statistics over the
    # data-parallel ranks: a collective, issued on every rank here
    state = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizer),
    } | (extra or {})
    try:
        _dcp(dcp.save, state, tmp)  # a collective: raises on every rank if one fails
        torch.save(rng_state(), tmp / f"rng_rank{_rank()}.pt")
    except (OSError, CheckpointException) as e:
        error = _one_line(e)
    if error := _agree(error):  # every rank's files are on disk, or every rank raises
        raise failed(error)
    if _rank() == 0:
        try:
            marker = {"step": step, **metadata, "files": file_manifest(tmp)}
            _write_atomic(tmp / MARKER, json.dumps(marker, indent=1))
            shutil.rmtree(final, ignore_errors=True)  # an unmarked dir of the same step, if any
            os.replace(tmp, final)
            _WRITTEN.add(final.resolve())
        except OSError as e:
            (tmp / (MARKER + ".part")).unlink(missing_ok=True)
            error = _one_line(e)
        if error is None and keep:
            prune_checkpoints(root, keep)
    if error := _agree(error):
        raise failed(error)
    return final


def load_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Load model, optimizer and this rank's RNG state from `path`; return its metadata.

    extra: state saved with `save_checkpoint(extra=...)`, loaded into its tensors in place
    (a tensor DCP replaces instead is the new value of its dict entry).

    Works into another world size or layout (DCP reshards); the RNG state of a rank that
    did not exist when saving is left as it is. Does not verify checksums (see
    `intact_checkpoint`); `CheckpointError` if `path` is unmarked or does not fit.
    """
    path = Path(path)
    if not (path / MARKER).is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint (no {MARKER} marker)")
    # an optimizer with empty state gets it here (DCP runs one zero-lr step to build it)
    state = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizer),
    } | (extra or {})  # the same inner dicts: DCP loads into the caller's
    fix = "resume with the config it was saved with, or choose another out_dir"
    unused = saved_model_keys(path) - {f"model.{k}" for k in state["model"]}
    if unused:  # DCP would load the rest and drop these without a word
        raise CheckpointError(
            f"{path} holds {len(unused)} model tensor(s) this model lacks (e.g. "
            f"{sorted(unused)[0]}): it was saved from a larger or different model; {fix}"
        )
    try:
        # Dobb state saved in the keys written up to d368fca (cov, cov_tail, ...) loads too
        _dcp(functools.partial(dcp.load, planner=LegacyKeysLoadPlanner()), state, path)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optim"])
    except (RuntimeError, KeyError, ValueError, CheckpointException) as e:  # another model,
        # optimizer or layout; DCP's CheckpointException is a BaseException of every rank
        raise CheckpointError(
            f"{path} does not load into this model and optimizer ({_one_line(e)}); {fix}"
        ) from None
    rng = path / f"rng_rank{_rank()}.pt"
    if rng.is_file():
        set_rng_state(load_rng_file(rng))
    return read_metadata(path)


def saved_model_keys(path: str | Path) -> set[str]:
    """The model tensors a checkpoint holds, as DCP names them (`model.<fqn>`), read from
    its `.metadata` (which DCP unpickles: checkpoints are trusted input)."""
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    return {k for k in metadata.state_dict_metadata if k.startswith("model.")}
