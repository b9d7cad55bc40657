"""Offline data for ``bench.timebudget``: ``.py`` sources tokenized with GPT-2's BPE
into llm.c shards (``train.bin``, ``val.bin``, ``meta.json``)."""

import json
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch

from dobb.train.data import (
    GPT2_VOCAB_SIZE,
    STDLIB_SKIP,
    gpt2_tokenizer,
    stdlib_files,
    write_bin_shard,
)

EOT = 50256  # GPT-2's <|endoftext|>


def source_files(source: str) -> list[Path]:
    """``.py`` files of ``source``: "stdlib", "torch" (the installed package) or a directory.

    Tests, caches and vendored trees (``dobb.train.data.STDLIB_SKIP``) are skipped; sorted.
    """
    if source == "stdlib":
        return stdlib_files()
    root = Path(torch.__file__).parent if source == "torch" else Path(source)
    if not root.is_dir():
        raise FileNotFoundError(
            f"source {source!r} is neither 'stdlib', 'torch' nor a directory of .py files"
        )
    files = [p for p in root.rglob("*.py") if not STDLIB_SKIP & set(p.relative_to(root).parts)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def prepare(
    out: Path,
    sources: tuple[str, ...] = ("stdlib",),
    *,
    max_tokens: int | None = None,
    val_every: int = 20,
    progress: Callable[[str], None] = lambda _: None,
) -> dict:
    """Tokenize ``sources`` into ``out/train.bin`` and ``out/val.bin`` (GPT-2 BPE).

    File ``i`` of the concatenated source lists goes to validation if
    ``i % val_every == val_every - 1``. Stops adding files once ``max_tokens`` tokens
    (train + val) are reached. Writes and returns ``out/meta.json``.
    """
    if val_every < 2:
        raise ValueError(f"val_every must be >= 2 (one file in n is held out), got {val_every}")
    started = time.perf_counter()
    tokenizer = gpt2_tokenizer()
    files = [f for source in sources for f in source_files(source)]
    if not files:
        raise FileNotFoundError(f"no .py files in the sources {sources}")
    splits: dict[str, list[int]] = {"train": [], "val": []}
    used, num_bytes = 0, 0
    for i, path in enumerate(files):
        data = path.read_bytes()
        split = "val" if i % val_every == val_every - 1 else "train"
        splits[split] += tokenizer.encode(data.decode("utf-8", "replace")) + [EOT]
        used, num_bytes = i + 1, num_bytes + len(data)
        total = len(splits["train"]) + len(splits["val"])
        if used % 200 == 0:
            progress(f"{used}/{len(files)} files, {total:,} tokens")
        if max_tokens is not None and total >= max_tokens:
            break
    out.mkdir(parents=True, exist_ok=True)
    for split, tokens in splits.items():
        write_bin_shard(out / f"{split}.bin", np.array(tokens, np.uint16), GPT2_VOCAB_SIZE)
    meta = {
        "sources": list(sources),
        "files": used,
        "bytes": num_bytes,
        "train_tokens": len(splits["train"]),
        "val_tokens": len(splits["val"]),
        "val_every": val_every,
        "max_tokens": max_tokens,
        "tokenizer": "gpt2",
        "seconds": time.perf_counter() - started,
        "python": sys.version.split()[0],
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta
