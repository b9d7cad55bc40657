"""Offline assets for the torchtitan tests: a tokenizer and synthetic documents.

``make_assets(folder)`` writes ``folder/tokenizer`` (``tokenizer.json``, a word-level
tokenizer of the documents' words, and ``tokenizer_config.json`` naming its BOS/EOS
tokens) and ``folder/documents/data.json`` (JSON lines ``{"text": ...}``, the layout of
torchtitan's ``c4_test``). Deterministic: the same files on every machine.
"""

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers

DOCUMENTS = 400
WORDS = [f"w{i}" for i in range(500)] + ["the", "a", "of", "and", "to", "in", "."]
SPECIAL = ["<unk>", "<|begin_of_text|>", "<|end_of_text|>"]


def documents(count: int = DOCUMENTS, seed: int = 0) -> list[str]:
    """``count`` documents of 40-120 words with a Zipf-like word distribution."""
    rng = random.Random(seed)
    weights = [1.0 / (rank + 1) for rank in range(len(WORDS))]
    return [" ".join(rng.choices(WORDS, weights, k=rng.randint(40, 120))) for _ in range(count)]


def make_assets(folder: Path) -> Path:
    folder = Path(folder)
    tokenizer_dir, documents_dir = folder / "tokenizer", folder / "documents"
    tokenizer_dir.mkdir(parents=True, exist_ok=True)
    documents_dir.mkdir(parents=True, exist_ok=True)
    vocab = {token: i for i, token in enumerate(SPECIAL + WORDS)}  # 510 of the model's 2048
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(SPECIAL)
    tokenizer.save(str(tokenizer_dir / "tokenizer.json"))
    (tokenizer_dir / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": SPECIAL[1], "eos_token": SPECIAL[2], "add_bos_token": True})
    )
    lines = [json.dumps({"text": text}) for text in documents()]
    (documents_dir / "data.json").write_text("\n".join(lines) + "\n")
    return folder
