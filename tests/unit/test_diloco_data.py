"""The embedded stdlib corpus, its held-out split, and deterministic data assignment."""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest
import torch

from diloco import (
    ByteTransformer,
    ByteTransformerConfig,
    Corpus,
    eval_batches,
    evaluate,
    inner_batches,
    is_heldout,
    load_stdlib_corpus,
    validation_split,
)
from diloco.data import SPLIT_BLOCK
from diloco.token_stream import TokenStream

torch.set_num_threads(1)
SMALL = 1 << 20


def test_corpus_loads_within_the_cap_with_a_disjoint_name_based_split() -> None:
    corpus = load_stdlib_corpus(SMALL)
    assert SMALL <= len(corpus.train) + len(corpus.heldout) <= SMALL + 1
    assert len(corpus.train) > 10 * len(corpus.heldout) > 0
    assert not set(corpus.train_files) & set(corpus.heldout_files)
    assert all(is_heldout(name) for name in corpus.heldout_files)
    assert not any(is_heldout(name) for name in corpus.train_files)
    assert list(corpus.train_files) == sorted(corpus.train_files)
    assert b"def " in corpus.train.tobytes()


def test_corpus_is_deterministic() -> None:
    first = load_stdlib_corpus(SMALL)
    load_stdlib_corpus.cache_clear()
    second = load_stdlib_corpus(SMALL)
    assert first.fingerprint == second.fingerprint
    assert first.train.tobytes() == second.train.tobytes()
    assert first.heldout_files == second.heldout_files


def test_a_too_small_cap_is_refused() -> None:
    with pytest.raises(ValueError):
        load_stdlib_corpus(100)


def _batches(**overrides: object) -> list[tuple[torch.Tensor, torch.Tensor]]:
    arguments: dict = {"run_seed": 1, "round": 3, "peer_id": b"peer-a", "steps": 4}
    arguments.update(overrides)
    return inner_batches(load_stdlib_corpus(SMALL), batch_size=2, context=16, **arguments)


def _same(a: list, b: list) -> bool:
    return all(
        torch.equal(x, y) for pa, pb in zip(a, b, strict=True) for x, y in zip(pa, pb, strict=True)
    )


def test_assignment_is_deterministic_and_differs_across_peers_rounds_and_seeds() -> None:
    batches = _batches()
    assert len(batches) == 4
    inputs, targets = batches[0]
    assert inputs.shape == targets.shape == (2, 16)
    assert inputs.dtype == targets.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert _same(batches, _batches())
    assert not _same(batches, _batches(peer_id=b"peer-b"))
    assert not _same(batches, _batches(round=4))
    assert not _same(batches, _batches(run_seed=2))
    # A longer phase starts with the same batches: a peer's data does not depend on H.
    assert _same(batches, _batches(steps=6)[:4])


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError):
        _batches(steps=0)
    with pytest.raises(ValueError):
        _batches(round=-1)


def test_eval_batches_are_fixed_and_evaluate_gives_nats_per_byte() -> None:
    corpus = load_stdlib_corpus(SMALL)
    batches = eval_batches(corpus, batches=2, batch_size=4, context=16)
    again = eval_batches(corpus, batches=2, batch_size=4, context=16)
    assert _same(batches, again)
    model = ByteTransformer(ByteTransformerConfig(d_model=32, n_layers=1, n_heads=2, context=16))
    model.train()
    loss = evaluate(model, batches)
    assert abs(loss - math.log(256)) < 0.1
    assert model.training


def test_the_validation_split_is_disjoint_whole_files_and_a_pure_function_of_the_seed() -> None:
    corpus = load_stdlib_corpus(SMALL)
    views = validation_split(corpus, seed=0)
    assert all(isinstance(half, TokenStream) for half in views)  # views: nothing is copied
    validation, test = (np.asarray(half) for half in views)
    assert np.array_equal(validation, validation_split(corpus, seed=0)[0])
    # Whole files each: every piece of each half is exactly one held-out file's text.
    starts = [0, *itertools.accumulate(corpus.heldout_sizes)]
    files = [corpus.heldout[a:b].tobytes() for a, b in itertools.pairwise(starts)]
    assert len(files) >= 2 and sum(corpus.heldout_sizes) == len(corpus.heldout)
    halves = [validation.tobytes(), test.tobytes()]
    owners = [[f in half for half in halves] for f in files]
    assert all(sum(found) >= 1 for found in owners)
    # Disjoint and together all of it: the files' sizes add up exactly in each half.
    in_validation = [f for f, found in zip(files, owners, strict=True) if found[0] and not found[1]]
    in_test = [f for f, found in zip(files, owners, strict=True) if found[1] and not found[0]]
    assert sum(map(len, in_validation)) == len(validation)
    assert sum(map(len, in_test)) == len(test)
    assert len(validation) + len(test) == len(corpus.heldout)
    assert abs(len(in_validation) - len(in_test)) <= 1
    # Another seed deals the files otherwise.
    assert any(
        not np.array_equal(validation, validation_split(corpus, seed=s)[0]) for s in (1, 2, 3)
    )
    # Evaluation windows come from the half asked for.
    ((inputs, _),) = eval_batches(corpus, batches=1, batch_size=2, context=16, part=views[1])
    assert inputs[0].numpy().astype(np.uint8).tobytes() == test[:16].tobytes()


def test_a_corpus_without_file_sizes_is_split_in_whole_blocks() -> None:
    tokens = np.arange(3 * SPLIT_BLOCK + 5, dtype=np.uint32)  # every token says where it was
    corpus = Corpus(tokens[:10], tokens, ("f",), ("f",), "x", vocab_size=len(tokens))
    validation, test = (np.asarray(half) for half in validation_split(corpus, seed=7))
    assert not set(validation.tolist()) & set(test.tolist())
    assert np.array_equal(np.sort(np.concatenate([validation, test])), tokens)
    for half in (validation, test):
        assert np.all(np.diff(half) > 0)  # corpus order kept
        blocks = set((half // SPLIT_BLOCK).tolist())
        assert sum(min(SPLIT_BLOCK, len(tokens) - b * SPLIT_BLOCK) for b in blocks) == len(half)
    with pytest.raises(ValueError, match="validation split"):
        validation_split(dataclasses.replace(corpus, heldout=tokens[:100]), seed=0)
