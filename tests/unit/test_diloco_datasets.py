"""A user's local data (``diloco.datasets``): text files as bytes or through a tokenizer trained
here, pre-tokenized arrays memory-mapped, their fingerprint, and every bad input's one line."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest
from tiny_lm import DOCUMENTS, TINY_LLAMA, train_tokenizer, write_jsonl
from tokenizers import Tokenizer

from diloco import (
    Corpus,
    DataError,
    check_sizes,
    eval_batches,
    inner_batches,
    load_text_corpus,
    load_token_corpus,
)
from diloco.datasets import fingerprint, split_heldout
from diloco.token_stream import TokenStream, max_token
from swarmtrain.cli import main
from swarmtrain.config import RunConfig, with_base
from swarmtrain.training.workload import (
    WorkloadError,
    build_model,
    load_data,
    with_data_fingerprint,
    with_local_hashes,
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


def test_several_token_files_stay_mapped_and_read_as_their_concatenation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Files of uneven sizes: the corpus holds no concatenated copy (``TokenStream``), yet its
    batches (windows across file boundaries), held-out windows, validation split and
    fingerprint are those of the concatenated stream; its vocabulary is the exact largest id,
    found by a scan in chunks."""
    monkeypatch.setattr("diloco.token_stream.SCAN_TOKENS", 64)  # many chunks per file
    rng = np.random.default_rng(3)
    parts = [rng.integers(0, 900, size=n).astype("<u2") for n in (700, 53, 1400)]
    parts[1][-1] = 977  # the largest id, the last token of the middle file
    parts[0].tofile(tmp_path / "a.bin")
    parts[1].tofile(tmp_path / "b.bin")
    np.save(tmp_path / "c.npy", parts[2])
    corpus = load_token_corpus((str(tmp_path / "[ab].bin"), str(tmp_path / "c.npy")),
                               dtype="uint16")  # fmt: skip
    assert isinstance(corpus.train, TokenStream) and corpus.vocab_size == 978
    whole = np.concatenate(parts)
    train, heldout = split_heldout(whole)
    files = [tmp_path / "a.bin", tmp_path / "b.bin", tmp_path / "c.npy"]
    in_memory = Corpus(train, heldout, (), (), "", 978)
    assert corpus.fingerprint == fingerprint("tokens", files, b"uint16", train, heldout)
    for peer in (b"p", b"q", b"r"):
        ours, theirs = (
            inner_batches(c, run_seed=5, round=2, peer_id=peer, steps=6, batch_size=8, context=16)
            for c in (corpus, in_memory)
        )
        assert all(x.equal(y) and t.equal(u) for (x, t), (y, u) in zip(ours, theirs, strict=True))
    held = [eval_batches(c, batches=2, batch_size=4, context=16) for c in (corpus, in_memory)]
    assert all(x.equal(y) for (x, _), (y, _) in zip(*held, strict=True))
    assert np.array_equal(corpus.train[695:760], whole[695:760])  # across two boundaries
    assert np.array_equal(corpus.train[[0, 752, 753, -1]], train[[0, 752, 753, -1]])
    assert max_token(parts[2]) == int(parts[2].max())


def test_each_token_file_is_scanned_once_per_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The vocabulary scan reads every token of every file: a node restarting on the same files
    reads its cached result instead; a rewritten file is scanned again."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    scans: list[int] = []

    def counted(array: np.ndarray) -> int:
        scans.append(len(array))
        return max_token(array)

    monkeypatch.setattr("diloco.datasets.max_token", counted)
    path = tmp_path / "t.bin"
    np.arange(1000, dtype="<u2").tofile(path)
    assert load_token_corpus((str(path),), dtype="uint16").vocab_size == 1000
    assert load_token_corpus((str(path),), dtype="uint16").vocab_size == 1000
    assert scans == [1000]  # the second start read the cache
    ids = np.arange(1000, dtype="<u2")
    ids[7] = 4000
    ids.tofile(path)  # the same size, rewritten: another version
    os.utime(path, ns=(1, 1))  # and a modification time no earlier run left in the cache
    assert load_token_corpus((str(path),), dtype="uint16").vocab_size == 4001
    assert scans == [1000, 1000]
    cache = tmp_path / "cache" / "swarmtrain" / "token-max"
    assert sorted(int(e.read_text()) for e in cache.iterdir()) == [999, 4000]  # one per version


def test_token_ids_beyond_the_models_vocabulary_are_refused_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Exactly: one id of 300 among bytes is refused for the default model (vocabulary 256) by
    the coordinator when it signs the spec, one line naming the data key and both numbers
    (``swarmtrain coordinator`` exits 1 with it), and by a node when it builds the model."""
    ids = np.zeros(3 * 2**20, dtype="<u2")
    ids[12345] = 300  # far from the fingerprint's sampled positions
    ids.tofile(tmp_path / "big.bin")
    config = RunConfig().replace(data={"kind": "tokens", "paths": ("big.bin",)})
    message = (
        "data.paths: the largest token id in the data is 300, not below the model's vocabulary "
        'size 256 (model.kind "default", which reads bytes); retokenize the data or widen the '
        "vocabulary"
    )
    with pytest.raises(WorkloadError, match=re.escape(message)):
        with_local_hashes(config, tmp_path)
    signed = with_data_fingerprint(with_base(config, tmp_path))
    with pytest.raises(WorkloadError, match=re.escape(
        'model.kind "default" reads bytes (vocabulary 256); the data\'s vocabulary is 301: use '
        'model.kind "transformers" or byte data'
    )):  # fmt: skip
        build_model(signed, load_data(signed).vocab_size)  # a node's check
    factory = signed.replace(model={"factory": "pipeline_user_model:build"})
    with pytest.raises(WorkloadError, match=re.escape(
        "vocabulary size 256 (the logits of model factory pipeline_user_model:build)"
    )):  # fmt: skip
        build_model(factory, 301)
    llama = config.replace(model={"kind": "transformers",
                                  "config": {**TINY_LLAMA, "vocab_size": 299}})  # fmt: skip
    with pytest.raises(WorkloadError, match=re.escape(
        "is 300, not below the model's vocabulary size 299 (model.config.vocab_size)"
    )):  # fmt: skip
        with_local_hashes(llama, tmp_path)
    (tmp_path / "run.toml").write_text('[data]\nkind = "tokens"\npaths = ["big.bin"]\n')
    status = main(["coordinator", "--config", str(tmp_path / "run.toml"),
                   "--identity", str(tmp_path / "c.key")])  # fmt: skip
    assert status == 1
    assert capsys.readouterr().err.strip().splitlines() == [f"swarmtrain coordinator: {message}"]


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
        ("empty.bin", lambda d: load_token_corpus((str(d / "empty.bin"),), dtype="uint16"),
         r"data.paths: .*empty.bin is empty$"),
        ("empty.npy", lambda d: load_token_corpus((str(d / "empty.npy"),), dtype="uint16"),
         r"data.paths: .*empty.npy is empty$"),
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
    (tmp_path / "empty.bin").write_bytes(b"")
    np.save(tmp_path / "empty.npy", np.zeros(0, dtype="<u2"))
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
