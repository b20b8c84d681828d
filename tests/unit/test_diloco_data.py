"""The embedded stdlib corpus, its held-out split, and deterministic data assignment."""

from __future__ import annotations

import math

import pytest
import torch

from diloco import (
    ByteTransformer,
    ByteTransformerConfig,
    eval_batches,
    evaluate,
    inner_batches,
    is_heldout,
    load_stdlib_corpus,
)

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
