"""``[data] kind = "datasets"``: a Hugging Face ``datasets`` dataset read from this machine only,
a ``save_to_disk`` folder or local data files, gives the same token stream as the same documents
in a jsonl file (``kind = "text"``), its own fingerprint that follows the data, and one error per
bad input naming the key."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from tiny_lm import DOCUMENTS, train_tokenizer, write_jsonl

from diloco import DataError, load_datasets_corpus, load_text_corpus
from swarmtrain.config import ConfigError, RunConfig
from swarmtrain.training.workload import load_data

datasets = pytest.importorskip("datasets")


def saved(folder: Path, documents: list[str] = DOCUMENTS, split: bool = False) -> Path:
    table = datasets.Dataset.from_dict({"text": documents, "id": list(range(len(documents)))})
    if split:
        table = datasets.DatasetDict({"train": table, "test": table.select(range(3))})
    table.save_to_disk(str(folder))
    return folder


def stream(corpus) -> np.ndarray:  # type: ignore[no-untyped-def]
    return np.concatenate([corpus.train, corpus.heldout])


def test_a_saved_dataset_and_local_files_give_the_text_kinds_tokens(tmp_path: Path) -> None:
    (tmp_path / "tok").mkdir()
    tokenizer = str(train_tokenizer(tmp_path / "tok"))
    write_jsonl(tmp_path / "a.jsonl")
    text = load_text_corpus((str(tmp_path / "a.jsonl"),), field="text", tokenizer=tokenizer)
    on_disk = load_datasets_corpus(
        str(saved(tmp_path / "ds")), (), field="text", tokenizer=tokenizer
    )
    files = load_datasets_corpus("", (str(tmp_path / "*.jsonl"),), field="text",
                                 tokenizer=tokenizer)  # fmt: skip
    assert np.array_equal(stream(on_disk), stream(text))
    assert np.array_equal(stream(files), stream(text))
    assert on_disk.vocab_size == text.vocab_size
    # Other kind, other files: the fingerprints differ though the tokens are equal.
    assert len({text.fingerprint, on_disk.fingerprint, files.fingerprint}) == 3
    # A DatasetDict folder is read through its "train" split.
    both = load_datasets_corpus(str(saved(tmp_path / "dd", split=True)), (), field="text",
                                tokenizer=tokenizer)  # fmt: skip
    assert np.array_equal(stream(both), stream(text))


def test_the_fingerprint_follows_the_rows(tmp_path: Path) -> None:
    first = load_datasets_corpus(str(saved(tmp_path / "a")), (), field="text", tokenizer="")
    again = load_datasets_corpus(str(saved(tmp_path / "b")), (), field="text", tokenizer="")
    assert first.fingerprint == again.fingerprint  # same rows, same files
    fewer = load_datasets_corpus(str(saved(tmp_path / "c", DOCUMENTS[:-1])), (), field="text",
                                 tokenizer="")  # fmt: skip
    assert fewer.fingerprint != first.fingerprint


def test_the_run_config_reads_it_and_bad_inputs_are_one_error(tmp_path: Path) -> None:
    folder = saved(tmp_path / "ds")
    config = RunConfig().replace(data={"kind": "datasets", "path": str(folder)})
    assert load_data(config).vocab_size == 256
    with pytest.raises(ConfigError, match=re.escape("needs data.path (a save_to_disk folder)")):
        RunConfig().replace(data={"kind": "datasets"})
    with pytest.raises(ConfigError, match=re.escape('data.path needs data.kind "datasets"')):
        RunConfig().replace(data={"kind": "text", "paths": ["a.txt"], "path": str(folder)})
    with pytest.raises(DataError, match=re.escape("data.field: the dataset has no column 'body'")):
        load_datasets_corpus(str(folder), (), field="body", tokenizer="")
    with pytest.raises(DataError, match=re.escape("data.field: column 'id' does not hold text")):
        load_datasets_corpus(str(folder), (), field="id", tokenizer="")
    with pytest.raises(DataError, match=re.escape("is not a folder (a save_to_disk dataset)")):
        load_datasets_corpus(str(tmp_path / "nowhere"), (), field="text", tokenizer="")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=re.escape("is not a readable dataset")):
        load_datasets_corpus(str(tmp_path / "empty"), (), field="text", tokenizer="")
    write_jsonl(tmp_path / "a.jsonl")
    (tmp_path / "b.csv").write_text("text\nhello\n")
    with pytest.raises(DataError, match=re.escape("files of one format please")):
        load_datasets_corpus("", (str(tmp_path / "*.jsonl"), str(tmp_path / "b.csv")),
                             field="text", tokenizer="")  # fmt: skip
