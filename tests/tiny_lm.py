"""A user's data and model for the issue-18 tests, made on the spot: jsonl documents, a byte-level
BPE tokenizer trained on them with the ``tokenizers`` library, and a tiny Llama config (nothing is
downloaded). The documents, the config and the tokenizer's training are the README example's
(``examples/tiny_llama/prepare.py``), so the tests train what a user runs."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

_PREPARE = Path(__file__).resolve().parents[1] / "examples" / "tiny_llama" / "prepare.py"
_spec = importlib.util.spec_from_file_location("tiny_llama_prepare", _PREPARE)
assert _spec is not None and _spec.loader is not None
_example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_example)

DOCUMENTS: list[str] = _example.DOCUMENTS
TINY_LLAMA: dict[str, object] = _example.CONFIG


def write_jsonl(path: Path, documents: list[str] = DOCUMENTS, field: str = "text") -> Path:
    """One JSON object per line, the document under ``field`` (and an id beside it)."""
    lines = [json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(documents)]
    path.write_text("".join(lines))
    return path


def train_tokenizer(folder: Path, vocab_size: int = 400) -> Path:
    """The example's tokenizer, trained on DOCUMENTS, saved as ``folder/tokenizer.json``."""
    return _example.train_tokenizer(folder / "tokenizer.json", vocab_size)
