"""Write everything a small Llama-style run needs into a folder, with nothing downloaded: a
jsonl file of documents, a byte-level BPE tokenizer trained on them (the ``tokenizers``
library), the model's ``config.json`` and the ``run.toml`` that names them.

    python examples/tiny_llama/prepare.py mine
    swarmtrain local --config mine/run.toml --rounds 3 --inner-steps 8

Paths in the run.toml are relative to its folder (a node of a real swarm reads them from its
``--data-dir``, its copy of that folder). Swap in your own documents (one JSON object per line
with a "text" field) and a bigger config for a real run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

DOCUMENTS = [f"document {i}: the quick brown fox jumps over dog {i * 7}." for i in range(200)]

CONFIG = {
    "model_type": "llama",
    "vocab_size": 400,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}

RUN_TOML = """\
[model]
kind = "transformers"
config = "model/config.json"   # paths are relative to this file; or a [model.config] table

[data]
kind = "text"
paths = ["data/*.jsonl"]
field = "text"
tokenizer = "tokenizer"

[training]
batch_size = 8
sequence_length = 32
"""


def train_tokenizer(path: Path, vocab_size: int = CONFIG["vocab_size"]) -> Path:
    """A byte-level BPE tokenizer trained on DOCUMENTS, saved as ``path`` (a tokenizer.json)."""
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
    tokenizer.save(str(path))
    return path


def prepare(folder: Path) -> Path:
    """Write the run's files under ``folder``; returns its run.toml."""
    for name in ("data", "tokenizer", "model"):
        (folder / name).mkdir(parents=True, exist_ok=True)
    with (folder / "data" / "a.jsonl").open("w") as out:
        out.writelines(json.dumps({"text": d}) + "\n" for d in DOCUMENTS)
    train_tokenizer(folder / "tokenizer" / "tokenizer.json")
    (folder / "model" / "config.json").write_text(json.dumps(CONFIG, indent=1) + "\n")
    run_toml = folder / "run.toml"
    run_toml.write_text(RUN_TOML)
    return run_toml


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "mine")
    print(f"wrote {prepare(target)}; run: swarmtrain local --config {target}/run.toml")
