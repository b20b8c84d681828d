"""A user's data and model for the issue-18 tests, made on the spot: jsonl documents, a byte-level
BPE tokenizer trained on them with the ``tokenizers`` library, and a tiny Llama config (nothing is
downloaded)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

DOCUMENTS = [f"document {i}: the quick brown fox jumps over dog {i * 7}." for i in range(200)]

TINY_LLAMA = {
    "model_type": "llama",
    "vocab_size": 400,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}


def write_jsonl(path: Path, documents: list[str] = DOCUMENTS, field: str = "text") -> Path:
    """One JSON object per line, the document under ``field`` (and an id beside it)."""
    lines = [json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(documents)]
    path.write_text("".join(lines))
    return path


def train_tokenizer(folder: Path, vocab_size: int = 400) -> Path:
    """A byte-level BPE tokenizer trained on DOCUMENTS, saved as ``folder/tokenizer.json``."""
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    # Every byte in the alphabet, so text the training set lacks (the newlines) still encodes.
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["[UNK]"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(DOCUMENTS, trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"
