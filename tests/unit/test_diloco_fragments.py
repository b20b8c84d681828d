"""Streaming fragments (``DiLoCo(fragments=F)``) and the averaging's exposed time, with real
torch training among in-process peers (LocalAverage, one thread per peer)."""

from __future__ import annotations

import itertools
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_diloco_loop import (
    BATCH,
    CONFIG,
    PEER_DEADLINE_S,
    _batches,
    _coarse,
    _flat,
    _peer,
    _run_peers,
    _train_phase,
    _write,
)

from diloco import (
    AverageOutcome,
    ByteTransformer,
    LocalAverage,
    fragment_at,
    fragments_of,
    nesterov_update,
    weighted_mean,
)

SAMPLES_PER_ROUND = 3.0 * BATCH * CONFIG.context  # H = 3 steps of BATCH x context tokens


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 10_000), min_size=1, max_size=40), st.integers(1, 40))
def test_fragments_are_contiguous_nonempty_runs_of_whole_tensors(
    sizes: list[int], count: int
) -> None:
    if count > len(sizes):
        with pytest.raises(ValueError, match=f"fragments = {count} is more than"):
            fragments_of(sizes, count)
        return
    fragments = fragments_of(sizes, count)
    assert fragments == fragments_of(list(sizes), count)  # a pure function of the sizes
    assert len(fragments) == count
    assert [f.index for f in fragments] == list(range(count))
    assert fragments[0].first == 0 and fragments[-1].last == len(sizes)
    assert fragments[-1].stop == sum(sizes)
    for before, after in itertools.pairwise(fragments):
        assert before.last == after.first and before.stop == after.start
    for fragment in fragments:
        assert fragment.first < fragment.last  # never empty, never a cut tensor
        assert fragment.sizes == tuple(sizes[fragment.first : fragment.last])
        assert fragment.numel == sum(fragment.sizes)


def test_fragments_are_about_equal_in_elements() -> None:
    assert [(f.first, f.last) for f in fragments_of([10] * 4, 2)] == [(0, 2), (2, 4)]
    # 31 | 32 and 32 | 31 are as near the half: the tie goes to the earlier cut.
    assert [(f.first, f.last) for f in fragments_of([30, 1, 1, 1, 30], 2)] == [(0, 2), (2, 5)]
    assert [(f.first, f.last) for f in fragments_of([5, 90, 5], 3)] == [(0, 1), (1, 2), (2, 3)]
    sizes = [p.numel() for p in ByteTransformer(CONFIG, seed=11).parameters()]
    for count in (2, 3, 4):
        numels = [f.numel for f in fragments_of(sizes, count)]
        assert max(numels) - min(numels) <= max(sizes), numels
    assert [f.index for f in (fragment_at(fragments_of(sizes, 3), r) for r in range(7))] == [
        0, 1, 2, 0, 1, 2, 0,
    ]  # fmt: skip
    with pytest.raises(ValueError, match="fragments must be a positive integer"):
        fragments_of(sizes, 0)


def _recording(average: object, sizes: list[int]) -> object:
    def record(round: int, vector: torch.Tensor, weight: float) -> AverageOutcome:
        sizes.append(vector.numel())
        return average(round, vector, weight)  # type: ignore[operator]

    return record


def test_three_peers_with_two_fragments_match_the_fragment_math_and_agree_every_round() -> None:
    peers, rounds = 3, 4
    averaging = LocalAverage(peers, timeout_s=PEER_DEADLINE_S)
    handed: list[list[int]] = [[] for _ in range(peers)]

    def work(peer: int) -> tuple[list[str], torch.Tensor, torch.Tensor]:
        member = _recording(averaging.member(f"peer-{peer}"), handed[peer])
        diloco, model = _peer(member, inner_steps=3, fragments=2)
        first, second = diloco.fragments
        hashes = []
        with diloco:
            for r in range(rounds):
                before = diloco.global_state
                _train_phase(diloco, model, peer)
                after, local = diloco.global_state, _flat(model)
                hashes.append(diloco.state_hash())
                done, other = (first, second) if r % 2 == 0 else (second, first)
                kept = slice(other.start, other.stop)
                # Only the round's fragment moved on the global state...
                assert torch.equal(after.params[kept], before.params[kept])
                assert torch.equal(after.momentum[kept], before.momentum[kept])
                assert not torch.equal(after.params[done.start : done.stop], before.params[
                    done.start : done.stop
                ])  # fmt: skip
                # ... the model holds it, and the other fragment's local training goes on.
                assert torch.equal(local[done.start : done.stop], after.params[
                    done.start : done.stop
                ])  # fmt: skip
                assert not torch.equal(local[kept], after.params[kept])
        return hashes, diloco.global_state.params, diloco.global_state.momentum

    results = _run_peers(peers, work)
    assert all(hashes == results[0][0] for hashes, _, _ in results)
    assert len(set(results[0][0])) == rounds

    # The reference: the same peers in one thread, each fragment's round written out by hand.
    models = [ByteTransformer(CONFIG, seed=11) for _ in range(peers)]
    inners = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in models]
    fragments = fragments_of([p.numel() for p in models[0].parameters()], 2)
    params, momentum = _flat(models[0]).clone(), torch.zeros_like(_flat(models[0]))
    for r in range(rounds):
        for peer, (model, inner) in enumerate(zip(models, inners, strict=True)):
            for inputs, targets in _batches(r, peer, 3):
                model.loss(inputs, targets).backward()
                inner.step()
                inner.zero_grad()
        span = slice(fragments[r % 2].start, fragments[r % 2].stop)
        # A fragment weighs the samples since its last round: one phase in round 0, then two.
        weight = SAMPLES_PER_ROUND * (1 if r == 0 else 2)
        deltas = {
            f"peer-{p}": ([torch.sub(params[span], _flat(models[p])[span])], weight)
            for p in range(peers)
        }
        mean = weighted_mean(deltas)[0]
        new_params, new_momentum = nesterov_update(params[span], momentum[span], mean, 0.7, 0.9)
        params[span], momentum[span] = new_params, new_momentum
        for model in models:
            local = _flat(model)
            local[span] = params[span]
            _write(model, local)
    for _, global_params, global_momentum in results:
        assert torch.equal(global_params, params)
        assert torch.equal(global_momentum, momentum)
    # Each round handed the averaging its fragment's vector only.
    assert all(h == [fragments[r % 2].numel for r in range(rounds)] for h in handed)


def test_two_fragments_with_overlap_and_error_feedback_agree_and_send_a_fragment_a_round() -> None:
    peers, rounds = 3, 5
    averaging = LocalAverage(peers, timeout_s=PEER_DEADLINE_S)
    handed: list[list[int]] = [[] for _ in range(peers)]

    def work(peer: int) -> tuple[list[str], list[float]]:
        member = _recording(averaging.member(f"peer-{peer}"), handed[peer])
        diloco, model = _peer(member, inner_steps=3, fragments=2, overlap=True, compress=_coarse)
        hashes, weights = [], []
        with diloco:
            for _ in range(rounds):
                _train_phase(diloco, model, peer)
                hashes.append(diloco.state_hash())
                weights.append(diloco.statistics().last_contributors.get(f"peer-{peer}", 0.0))
        assert diloco.statistics().rounds_applied == rounds
        return [*hashes, diloco.state_hash()], weights

    results = _run_peers(peers, work)
    assert all(result == results[0] for result in results)
    assert len(set(results[0][0])) == rounds + 1  # the initial state, then one per round
    # Round r's result is applied at the end of phase r + 1; fragment 1 waited two phases.
    assert results[0][1] == [0.0, SAMPLES_PER_ROUND, *[2 * SAMPLES_PER_ROUND] * 3]
    fragments = fragments_of([p.numel() for p in ByteTransformer(CONFIG).parameters()], 2)
    assert all(h == [fragments[r % 2].numel for r in range(rounds)] for h in handed)


def test_an_adopted_state_sets_every_fragment_to_the_global_parameters() -> None:
    averaging = LocalAverage(2, timeout_s=PEER_DEADLINE_S)

    def work(peer: int) -> tuple[object, ByteTransformer]:
        diloco, model = _peer(averaging.member(f"peer-{peer}"), inner_steps=3, fragments=2)
        with diloco:
            for _ in range(3):
                _train_phase(diloco, model, peer)
        return diloco, model

    (ours, model), (theirs, _) = _run_peers(2, work)  # type: ignore[misc]
    # Round 2 synced fragment 0: fragment 1's local parameters are a phase past global.
    assert not torch.equal(_flat(model), ours.global_state.params)
    ours.load_state(theirs.state_bytes())  # a joiner's (or a re-syncing peer's) download
    assert ours.state_hash() == theirs.state_hash()
    assert torch.equal(_flat(model), ours.global_state.params)


def test_fragments_enter_the_fingerprint_and_need_whole_model_rounds_elsewhere() -> None:
    member = LocalAverage(1).member("solo")
    whole, _ = _peer(member, inner_steps=2)
    split, _ = _peer(member, inner_steps=2, fragments=2)
    assert whole.fingerprint != split.fingerprint
    with pytest.raises(ValueError, match="fragments=1"):
        split.finish_inner_phase(split.global_state.params, samples=1.0)
    with pytest.raises(ValueError, match="more than the model's"):
        _peer(member, inner_steps=2, fragments=1000)
    whole.close()
    split.close()


def test_the_outcome_reports_the_averaging_time_training_waited_for() -> None:
    averaging_s = 0.2
    finished = threading.Event()

    def slow(round: int, vector: torch.Tensor, weight: float) -> AverageOutcome:
        time.sleep(averaging_s)
        finished.set()
        return AverageOutcome(vector.clone(), {"solo": weight})

    # Without overlap training waits for the whole averaging.
    diloco, model = _peer(slow, inner_steps=2)
    outcome = None
    for inputs, targets in _split_batches():
        model.loss(inputs, targets).backward()
        outcome = diloco.step() or outcome
        diloco.zero_grad()
    assert outcome is not None and outcome.ok and outcome.exposed_s >= averaging_s
    diloco.close()

    # With overlap it waits only for what the next inner phase did not hide: here nothing.
    finished.clear()
    diloco, model = _peer(slow, inner_steps=2, overlap=True)
    for step, (inputs, targets) in enumerate(_split_batches() * 2):
        if step == 3:
            assert finished.wait(PEER_DEADLINE_S)  # round 0's averaging ended meanwhile
        model.loss(inputs, targets).backward()
        outcome = diloco.step()
        diloco.zero_grad()
    assert outcome is not None and outcome.round == 0 and outcome.ok
    assert 0 <= outcome.exposed_s < averaging_s
    diloco.close()


def _split_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return _batches(0, 0, 2)
