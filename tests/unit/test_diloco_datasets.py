"""A user's local data (``diloco.datasets``): text files as bytes or through a tokenizer trained
here, pre-tokenized arrays memory-mapped, their fingerprint, and every bad input's one line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tiny_lm import DOCUMENTS, train_tokenizer, write_jsonl
from tokenizers import Tokenizer

from diloco import (
    DataError,
    check_sizes,
    eval_batches,
    inner_batches,
    load_text_corpus,
    load_token_corpus,
)


def test_text_as_bytes_joins_documents_and_holds_out_the_tail(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_text("second file")
    write_jsonl(tmp_path / "a.jsonl")
    corpus = load_text_corpus((str(tmp_path / "*.jsonl"), str(tmp_path / "b.txt")), field="text",
                              tokenizer="")  # fmt: skip
    stream = "".join(d + "\n" for d in [*DOCUMENTS, "second file"]).encode()
    assert corpus.vocab_size == 256 and corpus.train.dtype == np.uint8
    assert bytes(corpus.train) + bytes(corpus.heldout) == stream
    assert len(corpus.heldout) == len(stream) // 20
    assert corpus.train_files == (str(tmp_path / "a.jsonl"), str(tmp_path / "b.txt"))


def test_text_through_a_local_tokenizer(tmp_path: Path) -> None:
    path = train_tokenizer(tmp_path)
    write_jsonl(tmp_path / "a.jsonl")
    by_file = load_text_corpus((str(tmp_path / "a.jsonl"),), field="text", tokenizer=str(path))
    by_folder = load_text_corpus((str(tmp_path / "a.jsonl"),), field="text",
                                 tokenizer=str(tmp_path))  # fmt: skip
    assert by_file.fingerprint == by_folder.fingerprint
    assert by_file.vocab_size == Tokenizer.from_file(str(path)).get_vocab_size()
    assert by_file.train.dtype == np.uint16
    tokens = np.concatenate([by_file.train, by_file.heldout])
    # Subword tokens: far fewer than the bytes, and every id within the vocabulary.
    assert 0 < len(tokens) < sum(len(d) + 1 for d in DOCUMENTS) / 2
    assert int(tokens.max()) < by_file.vocab_size
    decoded = Tokenizer.from_file(str(path)).decode(tokens[:40].tolist())
    assert decoded.startswith(DOCUMENTS[0] + "\n" + DOCUMENTS[1])


def test_batches_stay_a_pure_function_of_seed_round_and_peer(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "a.jsonl")
    corpus = load_text_corpus((str(tmp_path / "a.jsonl"),), field="text",
                              tokenizer=str(train_tokenizer(tmp_path)))  # fmt: skip
    kwargs = dict(run_seed=3, round=2, steps=2, batch_size=4, context=16)
    a = inner_batches(corpus, peer_id=b"a", **kwargs)  # type: ignore[arg-type]
    again = inner_batches(corpus, peer_id=b"a", **kwargs)  # type: ignore[arg-type]
    other = inner_batches(corpus, peer_id=b"b", **kwargs)  # type: ignore[arg-type]
    assert all(x.equal(y) and t.equal(u) for (x, t), (y, u) in zip(a, again, strict=True))
    assert not a[0][0].equal(other[0][0])
    inputs, targets = a[0]
    assert inputs.shape == (4, 16) and inputs[:, 1:].equal(targets[:, :-1])
    assert eval_batches(corpus, batches=1, batch_size=2, context=16)[0][0].shape == (2, 16)


def test_tokens_bin_and_npy_are_memory_mapped(tmp_path: Path) -> None:
    ids = (np.arange(5000) * 7919 % 1000).astype("<u2")
    ids.tofile(tmp_path / "train.bin")
    np.save(tmp_path / "train.npy", ids)
    from_bin = load_token_corpus((str(tmp_path / "train.bin"),), dtype="uint16")
    from_npy = load_token_corpus((str(tmp_path / "train.npy"),), dtype="uint16")
    for corpus in (from_bin, from_npy):
        assert isinstance(corpus.train.base, np.memmap) or isinstance(corpus.train, np.memmap)
        assert np.array_equal(np.concatenate([corpus.train, corpus.heldout]), ids)
        assert corpus.vocab_size == int(ids.max()) + 1
    # Same tokens, but another file name and size: another fingerprint.
    assert from_bin.fingerprint != from_npy.fingerprint
    wide = ids.astype("<u4")
    wide.tofile(tmp_path / "wide.bin")
    corpus = load_token_corpus((str(tmp_path / "wide.bin"),), dtype="uint32")
    assert np.array_equal(np.concatenate([corpus.train, corpus.heldout]), wide)
    x, _ = inner_batches(corpus, run_seed=0, round=0, peer_id=b"p", steps=1, batch_size=2,
                         context=8)[0]  # fmt: skip
    assert x.max() < 1000


def test_several_token_files_are_read_in_sorted_order(tmp_path: Path) -> None:
    np.arange(100, dtype="<u2").tofile(tmp_path / "b.bin")
    np.arange(100, 200, dtype="<u2").tofile(tmp_path / "a.bin")
    corpus = load_token_corpus((str(tmp_path / "*.bin"),), dtype="uint16")
    whole = np.concatenate([corpus.train, corpus.heldout])
    assert np.array_equal(whole, np.concatenate([np.arange(100, 200), np.arange(100)]))


def test_the_fingerprint_is_stable_and_follows_the_data_and_settings(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "a.jsonl")
    first = load_text_corpus((str(path),), field="text", tokenizer="").fingerprint
    assert load_text_corpus((str(path),), field="text", tokenizer="").fingerprint == first
    with_tokenizer = load_text_corpus((str(path),), field="text",
                                      tokenizer=str(train_tokenizer(tmp_path)))  # fmt: skip
    assert with_tokenizer.fingerprint != first
    write_jsonl(path, [*DOCUMENTS[:-1], DOCUMENTS[-1].replace("dog", "cat")])
    assert load_text_corpus((str(path),), field="text", tokenizer="").fingerprint != first
    # A file far larger than what the fingerprint reads (its first and last MiB): a change in
    # its middle shows when it hits the sample index (4096 evenly spaced tokens per split).
    big = tmp_path / "big.bin"
    ids = np.zeros(3 * 2**20, dtype="<u2")
    ids.tofile(big)
    before = load_token_corpus((str(big),), dtype="uint16")
    train_length = len(before.train)
    sampled = int(np.linspace(0, train_length - 1, num=4096).astype(np.int64)[2048])
    assert 2**20 < 2 * sampled < 2 * train_length - 2**20  # outside the hashed edges
    ids[sampled] = 7
    ids.tofile(big)
    assert load_token_corpus((str(big),), dtype="uint16").fingerprint != before.fingerprint


@pytest.mark.parametrize(
    ("setup", "call", "message"),
    [
        (None, lambda d: load_text_corpus((str(d / "none*.jsonl"),), field="text", tokenizer=""),
         "data.paths: .*none.*matches no file"),
        ("bad.jsonl", lambda d: load_text_corpus((str(d / "bad.jsonl"),), field="text",
                                                  tokenizer=""), "bad.jsonl:2 is not a JSON line"),
        ("a.jsonl", lambda d: load_text_corpus((str(d / "a.jsonl"),), field="body", tokenizer=""),
         "data.field: .*a.jsonl:1 has no string 'body'"),
        ("a.jsonl", lambda d: load_text_corpus((str(d / "a.jsonl"),), field="text",
                                                tokenizer=str(d / "absent")),
         "data.tokenizer: .*absent does not exist"),
        ("a.jsonl", lambda d: load_text_corpus((str(d / "a.jsonl"),), field="text",
                                                tokenizer=str(d / "a.jsonl")),
         "data.tokenizer: .*is not a tokenizer.json"),
        ("odd.bin", lambda d: load_token_corpus((str(d / "odd.bin"),), dtype="uint16"),
         "data.dtype: .*odd.bin has 3 bytes"),
        ("wide.npy", lambda d: load_token_corpus((str(d / "wide.npy"),), dtype="uint16"),
         "data.dtype: .*wide.npy holds a 1-d uint32 array"),
        ("a.jsonl", lambda d: load_token_corpus((str(d / "a.jsonl"),), dtype="uint16"),
         "data.paths: .*a.jsonl is not one of .bin, .npy"),
    ],
)  # fmt: skip
def test_bad_data_is_refused_in_one_line_naming_the_key_and_file(
    tmp_path: Path, setup: str | None, call: object, message: str
) -> None:
    write_jsonl(tmp_path / "a.jsonl")
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{not json\n')
    (tmp_path / "odd.bin").write_bytes(b"abc")
    np.save(tmp_path / "wide.npy", np.arange(10, dtype="<u4"))
    with pytest.raises(DataError, match=message) as caught:
        call(tmp_path)  # type: ignore[operator]
    assert "\n" not in str(caught.value)


def test_a_dataset_too_small_for_one_batch_or_window_is_refused(tmp_path: Path) -> None:
    (tmp_path / "tiny.txt").write_text("x" * 400)
    corpus = load_text_corpus((str(tmp_path / "tiny.txt"),), field="text", tokenizer="")
    check_sizes(corpus, batch_size=2, sequence_length=8)  # 381 training, 20 held-out bytes
    with pytest.raises(DataError, match="fewer than one batch"):
        check_sizes(corpus, batch_size=8, sequence_length=64)
    with pytest.raises(DataError, match="held-out tokens are fewer than one sequence"):
        check_sizes(corpus, batch_size=1, sequence_length=32)
