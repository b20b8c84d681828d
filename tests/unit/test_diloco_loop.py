"""DiLoCo with real torch training among in-process peers (LocalAverage, one thread per peer)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import pytest
import torch

from diloco import (
    AverageOutcome,
    AveragingFailed,
    ByteTransformer,
    ByteTransformerConfig,
    DiLoCo,
    LocalAverage,
    RoundOutcome,
    eval_batches,
    evaluate,
    inner_batches,
    load_stdlib_corpus,
    nesterov_update,
    weighted_mean,
)

torch.set_num_threads(1)
CONFIG = ByteTransformerConfig(d_model=32, n_layers=1, n_heads=2, context=32)
CORPUS_BYTES = 1 << 20
BATCH = 4
PEER_DEADLINE_S = 60.0


def _batches(round: int, peer: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return inner_batches(
        load_stdlib_corpus(CORPUS_BYTES),
        run_seed=5,
        round=round,
        peer_id=f"peer-{peer}".encode(),
        steps=steps,
        batch_size=BATCH,
        context=CONFIG.context,
    )


def _train_phase(diloco: DiLoCo, model: ByteTransformer, peer: int) -> None:
    """One inner phase on this peer's data for the round in progress; ends in an outer round."""
    for inputs, targets in _batches(diloco.round, peer, diloco.inner_steps):
        model.loss(inputs, targets).backward()
        diloco.step(samples=inputs.numel())
        diloco.zero_grad()


def _run_peers(count: int, work: Callable[[int], object]) -> list[object]:
    """Run ``work(peer)`` in one thread per peer; re-raise the first failure."""
    results: list[object] = [None] * count
    errors: list[BaseException] = []

    def run(peer: int) -> None:
        try:
            results[peer] = work(peer)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=run, args=(peer,)) for peer in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(PEER_DEADLINE_S)
        assert not thread.is_alive(), "a peer did not finish before the deadline"
    if errors:
        raise errors[0]
    return results


def _peer(average: Callable, **options: object) -> tuple[DiLoCo, ByteTransformer]:
    model = ByteTransformer(CONFIG, seed=11)
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    return DiLoCo(model, inner, average, **options), model


def test_three_peers_hold_bit_identical_state_after_every_round() -> None:
    averaging = LocalAverage(3, timeout_s=PEER_DEADLINE_S)

    def work(peer: int) -> list[str]:
        diloco, model = _peer(averaging.member(f"peer-{peer}"), inner_steps=3)
        hashes = [diloco.state_hash()]
        with diloco:
            for _ in range(3):
                _train_phase(diloco, model, peer)
                hashes.append(diloco.state_hash())
        assert diloco.statistics().rounds_applied == 3
        assert diloco.statistics().last_contributors == {
            f"peer-{p}": 3.0 * BATCH * 32 for p in (0, 1, 2)
        }
        assert torch.equal(
            torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
            diloco.global_state.params,
        )
        return hashes

    first, *others = _run_peers(3, work)
    assert all(hashes == first for hashes in others)
    assert len(set(first)) == 4  # the state changed every round


def test_loss_decreases_over_rounds() -> None:
    averaging = LocalAverage(2, timeout_s=PEER_DEADLINE_S)
    held_out = eval_batches(load_stdlib_corpus(CORPUS_BYTES), batches=2, batch_size=8, context=32)

    def work(peer: int) -> tuple[float, float]:
        diloco, model = _peer(averaging.member(f"peer-{peer}"), inner_steps=8)
        before = evaluate(model, held_out)
        with diloco:
            for _ in range(4):
                _train_phase(diloco, model, peer)
        return before, evaluate(model, held_out)

    for before, after in _run_peers(2, work):
        assert after < before - 1.0, (before, after)


def test_a_failed_round_applies_nothing_and_keeps_local_progress() -> None:
    averaging = LocalAverage(2, timeout_s=PEER_DEADLINE_S)

    def work(peer: int) -> tuple[list[str], dict[str, float]]:
        member = averaging.member(f"peer-{peer}")

        def flaky(round: int, vector: torch.Tensor, weight: float) -> AverageOutcome:
            if round == 1:
                raise ConnectionError("simulated lost round")
            return member(round, vector, weight)

        diloco, model = _peer(flaky, inner_steps=2)
        with diloco:
            _train_phase(diloco, model, peer)
            after_first = diloco.global_state
            _train_phase(diloco, model, peer)
            after_failed = diloco.global_state
            local = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            assert after_failed.round == 2 and diloco.round == 2
            assert torch.equal(after_failed.params, after_first.params)
            assert torch.equal(after_failed.momentum, after_first.momentum)
            assert not torch.equal(local, after_failed.params)  # progress kept, not reset
            _train_phase(diloco, model, peer)
            stats = diloco.statistics()
        assert (stats.rounds_applied, stats.rounds_failed) == (2, 1)
        return [after_first.state_hash(), diloco.state_hash()], stats.last_contributors

    (hashes_a, weights_a), (hashes_b, _) = _run_peers(2, work)
    assert hashes_a == hashes_b
    # The failed round's samples ride in the next round's weight: two phases of samples.
    assert weights_a == {"peer-0": 2 * 2.0 * BATCH * 32, "peer-1": 2 * 2.0 * BATCH * 32}


def test_the_step_that_ran_a_round_returns_its_outcome() -> None:
    member = LocalAverage(1).member("solo")

    def reporting(round: int, vector: torch.Tensor, weight: float) -> AverageOutcome:
        if round == 1:
            raise AveragingFailed("nobody came")
        if round == 2:
            raise ConnectionError("link down")
        mean = member(round, vector, weight)
        return AverageOutcome(mean.vector, mean.contributors, detail=("report", round))

    diloco, model = _peer(reporting, inner_steps=2)
    outcomes = []
    with diloco:
        for _ in range(4):
            for inputs, targets in _batches(diloco.round, 0, 2):
                model.loss(inputs, targets).backward()
                outcomes.append(diloco.step(samples=inputs.numel()))
                diloco.zero_grad()
    assert outcomes[0::2] == [None] * 4  # the first step of each phase runs no round
    weight = 2.0 * BATCH * CONFIG.context
    assert outcomes[1::2] == [
        RoundOutcome(0, ok=True, contributors={"solo": weight}, detail=("report", 0)),
        RoundOutcome(1, ok=False, error="nobody came"),
        RoundOutcome(2, ok=False, error="ConnectionError: link down"),
        # the failed rounds' samples ride in this one's weight
        RoundOutcome(3, ok=True, contributors={"solo": 3 * weight}, detail=("report", 3)),
    ]
    assert outcomes[1].peers == 1 and outcomes[3].peers == 0


def test_local_average_fails_the_round_when_a_peer_never_arrives(
    caplog: pytest.LogCaptureFixture,
) -> None:
    averaging = LocalAverage(2, timeout_s=0.2)
    with pytest.raises(AveragingFailed, match="1 of 2"):
        averaging.member("a")(0, torch.ones(2), 1.0)
    with pytest.raises(AveragingFailed):
        averaging.member("b")(0, torch.ones(2), 1.0)  # arrives after the round failed
    diloco, model = _peer(averaging.member("a"), inner_steps=1)
    with caplog.at_level(logging.WARNING, logger="diloco.loop"), diloco:
        _train_phase(diloco, model, 0)
    assert "round 0: averaging failed (AveragingFailed" in caplog.text
    assert diloco.round == 1 and diloco.statistics().rounds_failed == 1


def test_an_averaged_vector_of_the_wrong_shape_fails_the_round() -> None:
    def wrong(round: int, vector: torch.Tensor, weight: float) -> AverageOutcome:
        return AverageOutcome(torch.zeros(3), {"x": weight})

    diloco, model = _peer(wrong, inner_steps=1)
    start = diloco.global_state
    with diloco:
        _train_phase(diloco, model, 0)
    assert diloco.statistics().rounds_failed == 1
    assert torch.equal(diloco.global_state.params, start.params)


def test_a_joiner_adopts_the_state_bytes_and_gets_the_same_hash() -> None:
    diloco, model = _peer(LocalAverage(1).member("a"), inner_steps=2)
    with diloco:
        _train_phase(diloco, model, 0)
        _train_phase(diloco, model, 0)
    other = ByteTransformer(CONFIG, seed=99)
    joiner = DiLoCo(
        other, torch.optim.AdamW(other.parameters()), LocalAverage(1).member("b"), inner_steps=2
    )
    assert joiner.state_hash() != diloco.state_hash()
    joiner.load_state(diloco.state_bytes())
    assert joiner.state_hash() == diloco.state_hash() and joiner.round == 2
    assert all(
        torch.equal(a, b) for a, b in zip(other.parameters(), model.parameters(), strict=True)
    )
    with pytest.raises(ValueError):
        joiner.load_state(diloco.state_bytes()[:-1])
    wider = ByteTransformer(ByteTransformerConfig(d_model=64, n_layers=1, n_heads=2, context=32))
    stranger = DiLoCo(
        wider, torch.optim.AdamW(wider.parameters()), LocalAverage(1).member("c"), inner_steps=2
    )
    with pytest.raises(ValueError, match="layout"):
        stranger.load_state(diloco.state_bytes())
    joiner.close()
    stranger.close()


def test_the_inner_optimizers_own_step_counts_while_attached() -> None:
    diloco, model = _peer(LocalAverage(1).member("a"), inner_steps=2)
    with diloco:
        for inputs, targets in _batches(0, 0, 2):
            model.loss(inputs, targets).backward()
            diloco.inner_optimizer.step()
            diloco.inner_optimizer.zero_grad()
    assert diloco.round == 1
    assert diloco.statistics().last_contributors == {"a": 2.0}  # one sample per bare step
    for inputs, targets in _batches(1, 0, 2):
        model.loss(inputs, targets).backward()
        diloco.inner_optimizer.step()
    assert diloco.round == 1  # detached: no more rounds


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _write(model: torch.nn.Module, flat: torch.Tensor) -> None:
    with torch.no_grad():
        offset = 0
        for param in model.parameters():
            param.copy_(flat[offset : offset + param.numel()].view(param.shape))
            offset += param.numel()


def _split(model: torch.nn.Module, flat: torch.Tensor) -> list[torch.Tensor]:
    return list(flat.split([p.numel() for p in model.parameters()]))


def test_overlap_equals_the_one_round_delayed_update_math() -> None:
    peers, rounds, steps = 2, 3, 2
    averaging = LocalAverage(peers, timeout_s=PEER_DEADLINE_S)

    def work(peer: int) -> tuple[str, torch.Tensor]:
        diloco, model = _peer(averaging.member(f"peer-{peer}"), inner_steps=steps, overlap=True)
        with diloco:
            for _ in range(rounds):
                _train_phase(diloco, model, peer)
        assert diloco.round == rounds
        return diloco.state_hash(), _flat(model)

    results = _run_peers(peers, work)

    # The reference: the same peers in one thread, the delayed update written out by hand.
    models = [ByteTransformer(CONFIG, seed=11) for _ in range(peers)]
    inners = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in models]
    global_params, momentum = _flat(models[0]).clone(), torch.zeros_like(_flat(models[0]))
    anchors = [global_params.clone() for _ in range(peers)]
    pending = None
    for round in range(rounds + 1):
        if round < rounds:
            for peer, (model, inner) in enumerate(zip(models, inners, strict=True)):
                for inputs, targets in _batches(round, peer, steps):
                    model.loss(inputs, targets).backward()
                    inner.step()
                    inner.zero_grad()
        deltas = [torch.sub(anchors[p], _flat(models[p])) for p in range(peers)]
        if pending is not None:
            averaged = torch.cat([t.reshape(-1) for t in weighted_mean(pending)])
            global_params, momentum = nesterov_update(global_params, momentum, averaged, 0.7, 0.9)
            anchors = [torch.sub(global_params, deltas[p]) for p in range(peers)]
            for model, anchor in zip(models, anchors, strict=True):
                _write(model, anchor)
        else:
            anchors = [_flat(m) for m in models]
        weight = float(steps * BATCH * CONFIG.context)
        pending = {f"peer-{p}": (_split(models[p], deltas[p]), weight) for p in range(peers)}

    hashes = {state_hash for state_hash, _ in results}
    assert len(hashes) == 1
    for peer, (_, local) in enumerate(results):
        assert torch.equal(local, _flat(models[peer]))
    # The global params are the ones in every peer's hash: rebuild the state and compare.
    probe, _ = _peer(LocalAverage(1).member("probe"), inner_steps=1)
    state = probe.global_state
    state.params, state.momentum, state.round = global_params, momentum, rounds
    assert state.state_hash() in hashes
    probe.close()


def _coarse(flat: torch.Tensor) -> torch.Tensor:
    # Power-of-two scaling is exact, so this quantizer is deterministic to the bit.
    return torch.round(flat * 256.0) / 256.0


@pytest.mark.parametrize("decay", [1.0, 0.75])
def test_error_feedback_sends_the_quantized_corrected_progress_and_keeps_the_rest(
    decay: float,
) -> None:
    """``decay`` < 1: SparseLoCo's decayed residual, one float32 multiply before the add; what
    was sent plus the new residual is the corrected progress exactly."""
    member = LocalAverage(1).member("solo")
    holder: list[DiLoCo] = []
    residual = torch.zeros(0)
    observed: list[int] = []

    def checking(round: int, vector: torch.Tensor, weight: float) -> AverageOutcome:
        nonlocal residual
        diloco = holder[0]
        sent = vector
        progress = torch.sub(diloco.global_state.params, _flat(diloco.model))
        kept = torch.mul(residual, torch.tensor(decay, dtype=torch.float32))
        corrected = torch.add(progress, kept)
        assert torch.equal(sent, _coarse(corrected))
        assert torch.count_nonzero(sent) < sent.numel()  # the quantizer really loses something
        observed.append(round)
        if round == 1:
            raise ConnectionError("lost")  # the residual must stay as it was
        residual = torch.sub(corrected, sent)
        assert torch.equal(torch.add(residual, sent), corrected)
        return member(round, vector, weight)

    diloco, model = _peer(checking, inner_steps=2, compress=_coarse, error_feedback_decay=decay)
    residual = torch.zeros_like(diloco.global_state.params)
    holder.append(diloco)
    with diloco:
        for _ in range(3):
            _train_phase(diloco, model, 0)
    assert observed == [0, 1, 2]
    assert diloco.statistics().rounds_failed == 1
    with pytest.raises(ValueError, match="error_feedback_decay"):
        _peer(checking, inner_steps=2, compress=_coarse, error_feedback_decay=1.5)


def test_error_feedback_keeps_what_the_averaging_reports_it_dropped() -> None:
    """Without ``compress`` the averaging quantizes (the swarm's int8, whose blocks follow the
    round's parts) and says what its peers received (``AverageOutcome.sent``): DiLoCo sends the
    corrected progress as it is and keeps corrected - received for the next round."""
    member = LocalAverage(1).member("solo")
    holder: list[DiLoCo] = []
    residual = torch.zeros(0)
    observed: list[int] = []

    def lossy(round: int, vector: torch.Tensor, weight: float) -> AverageOutcome:
        nonlocal residual
        diloco = holder[0]
        progress = torch.sub(diloco.global_state.params, _flat(diloco.model))
        corrected = torch.add(progress, residual)
        assert torch.equal(vector, corrected)  # sent unquantized: the averaging quantizes
        received = _coarse(vector)
        assert torch.count_nonzero(torch.sub(vector, received)) > 0
        observed.append(round)
        if round == 1:
            raise ConnectionError("lost")  # the residual must stay as it was
        residual = torch.sub(corrected, received)
        outcome = member(round, received, weight)
        return AverageOutcome(outcome.vector, outcome.contributors, sent=received)

    diloco, model = _peer(lossy, inner_steps=2, error_feedback=True)
    residual = torch.zeros_like(diloco.global_state.params)
    holder.append(diloco)
    with diloco:
        for _ in range(3):
            _train_phase(diloco, model, 0)
    assert observed == [0, 1, 2]
    assert diloco.statistics().rounds_failed == 1


@pytest.mark.parametrize("decay", [1.0, 0.75])
def test_overlap_with_error_feedback_never_keeps_and_resends_the_same_progress(
    decay: float,
) -> None:
    """Overlap and error feedback together (sparse DiLoCo over a WAN), written out by hand and
    compared bit for bit: a delayed round k-1, applied at the end of phase k, rebases the model
    on the new global params keeping only the progress made since k-1 was sent, so what the
    codec dropped from k-1 leaves the model and lives in the residual alone, which the next
    contribution carries once (scaled by ``decay``). A failed round's progress is sent again
    with the next phase's and its residual is left as it was. Outer lr 1, momentum 0: the
    global step is exactly ``G - sent``."""
    rounds, steps, failing = 4, 2, 1
    beta = torch.tensor(decay, dtype=torch.float32)
    member = LocalAverage(1).member("solo")
    given: dict[int, torch.Tensor] = {}

    def lossy(round: int, vector: torch.Tensor, weight: float) -> AverageOutcome:
        given[round] = vector.clone()
        if round == failing:
            raise ConnectionError("lost")
        return member(round, vector, weight)

    model = ByteTransformer(CONFIG, seed=11)
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ends: list[torch.Tensor] = []  # the model after each inner step, before DiLoCo's round
    inner.register_step_post_hook(lambda *_: ends.append(_flat(model).clone()))
    diloco = DiLoCo(model, inner, lossy, inner_steps=steps, overlap=True, compress=_coarse,
                    outer_lr=1.0, outer_momentum=0.0, error_feedback_decay=decay)  # fmt: skip
    global_params = diloco.global_state.params.clone()
    residual = torch.zeros_like(global_params)
    anchor = pending = None
    expected: dict[int, torch.Tensor] = {}
    with diloco:
        for round in range(rounds):
            _train_phase(diloco, model, 0)
            before = ends[-1]
            if pending is None:  # round 0: sent, the model trains on from where it is
                delta, rebased = torch.sub(global_params, before), before
            else:
                sent_delta, corrected, sent, failed = pending
                delta = torch.sub(anchor, before)  # progress since the pending round was sent
                if failed:
                    delta = torch.add(sent_delta, delta)
                else:
                    global_params = torch.sub(global_params, sent)
                    residual = torch.sub(corrected, sent)
                rebased = torch.sub(global_params, delta)
            assert torch.equal(_flat(model), rebased), round
            assert torch.equal(diloco.global_state.params, global_params), round
            kept = residual if decay == 1.0 else torch.mul(residual, beta)
            corrected = torch.add(delta, kept)
            expected[round] = _coarse(corrected)
            anchor, pending = rebased, (delta, corrected, expected[round], round == failing)
    # ``close`` applied the last round: the model is the global params, nothing trained since.
    global_params = torch.sub(global_params, pending[2])
    assert torch.equal(diloco.global_state.params, global_params)
    assert torch.equal(_flat(model), global_params)
    assert sorted(given) == list(range(rounds))
    for round, vector in given.items():
        assert torch.equal(vector, expected[round]), round
    assert torch.count_nonzero(residual) > 0  # the quantizer dropped something to carry
    assert diloco.statistics().rounds_failed == 1


def test_without_error_feedback_nothing_is_carried_and_a_bad_sent_vector_fails_the_round() -> None:
    member = LocalAverage(1).member("solo")
    sent_vectors: list[torch.Tensor] = []
    holder: list[DiLoCo] = []

    def lossy(round: int, vector: torch.Tensor, weight: float) -> AverageOutcome:
        progress = torch.sub(holder[0].global_state.params, _flat(holder[0].model))
        assert torch.equal(vector, progress)  # no residual added in any round
        sent_vectors.append(vector)
        outcome = member(round, _coarse(vector), weight)
        sent = _coarse(vector) if round == 0 else torch.zeros(3)
        return AverageOutcome(outcome.vector, outcome.contributors, sent=sent)

    diloco, model = _peer(lossy, inner_steps=2)
    holder.append(diloco)
    with diloco:
        _train_phase(diloco, model, 0)
        _train_phase(diloco, model, 0)  # its ``sent`` has the wrong shape: the round fails
    assert len(sent_vectors) == 2
    assert diloco.statistics().rounds_applied == 1
    assert diloco.statistics().rounds_failed == 1


def test_finish_pending_applies_the_round_in_flight_and_returns_its_outcome() -> None:
    averaging = LocalAverage(1, timeout_s=PEER_DEADLINE_S)
    diloco, model = _peer(averaging.member("solo"), inner_steps=2, overlap=True)
    with diloco:
        assert diloco.finish_pending() is None
        _train_phase(diloco, model, 0)  # round 0 starts in the background
        assert diloco.round == 1 and diloco.global_state.round == 0
        outcome = diloco.finish_pending()
        assert outcome is not None and outcome.ok and outcome.round == 0
        assert diloco.global_state.round == 1 and diloco.round == 1
        assert torch.equal(_flat(model), diloco.global_state.params)  # no progress since
        assert diloco.finish_pending() is None


def test_an_inner_steps_schedule_sets_h_per_round_and_peers_agree() -> None:
    averaging = LocalAverage(2, timeout_s=PEER_DEADLINE_S)

    def work(peer: int) -> tuple[list[int], str]:
        diloco, model = _peer(averaging.member(f"peer-{peer}"), inner_steps=[2, 3])
        boundaries = []
        with diloco:
            for step, (inputs, targets) in enumerate(_batches(0, peer, 8), start=1):
                model.loss(inputs, targets).backward()
                diloco.step(samples=inputs.shape[0])
                diloco.zero_grad()
                if diloco.statistics().local_step == 0:
                    boundaries.append(step)
        assert [diloco.inner_steps_at(r) for r in range(4)] == [2, 3, 3, 3]
        return boundaries, diloco.state_hash()

    (first, hash_a), (second, hash_b) = _run_peers(2, work)
    assert first == second == [2, 5, 8]  # H 2, then the last entry (3) repeats
    assert hash_a == hash_b


def test_the_fingerprint_covers_the_h_schedule_and_momentum_warmup() -> None:
    average = LocalAverage(1).member("solo")
    plain = _peer(average, inner_steps=4)[0].fingerprint
    # A one-entry schedule and no warm-up keep the fingerprint of before the options existed.
    assert _peer(average, inner_steps=[4])[0].fingerprint == plain
    assert _peer(average, inner_steps=[4, 8])[0].fingerprint != plain
    assert _peer(average, inner_steps=4, outer_momentum_warmup=3)[0].fingerprint != plain
    for bad in ([], [0], [4, -1]):
        with pytest.raises(ValueError):
            _peer(average, inner_steps=bad)


def test_finish_inner_phase_averages_a_phase_computed_elsewhere_and_drops_carried_progress() -> (
    None
):
    """A verified run computes the inner phase outside the optimizer (RepOps, from the global
    parameters); the round then averages ``global - local`` with the given weight only."""
    averaging = LocalAverage(2, timeout_s=PEER_DEADLINE_S)

    def work(peer: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        member = averaging.member(f"peer-{peer}")

        def flaky(round: int, vector: torch.Tensor, weight: float) -> AverageOutcome:
            if round == 0:
                raise ConnectionError("simulated lost round")
            return member(round, vector, weight)

        diloco, model = _peer(flaky, inner_steps=2)
        with diloco:
            _train_phase(diloco, model, peer)  # fails: its progress and weight are carried
            start = diloco.global_state.params
            local = start + 0.01 * (peer + 1)
            diloco.finish_inner_phase(local, samples=10.0 * (peer + 1))
            stats = diloco.statistics()
            return start, diloco.global_state.params, stats.last_contributors

    (start, after_a, weights), (_, after_b, _) = _run_peers(2, work)
    assert torch.equal(after_a, after_b)
    assert weights == {"peer-0": 10.0, "peer-1": 20.0}  # the failed phase's samples are gone
    # The weighted mean of the deltas, then the outer step (momentum starts at zero).
    delta = -(0.01 * 10 + 0.02 * 20) / 30
    expected = nesterov_update(
        start, torch.zeros_like(start), torch.full_like(start, delta), lr=0.7, mu=0.9
    )
    assert torch.allclose(after_a, expected[0], atol=1e-6)


def test_finish_inner_phase_refuses_a_vector_of_another_size() -> None:
    diloco, _ = _peer(LocalAverage(1).member("solo"), inner_steps=2)
    with diloco, pytest.raises(ValueError, match="flat float32"):
        diloco.finish_inner_phase(torch.zeros(3), samples=1.0)


def test_global_parameters_are_a_named_copy_of_the_global_state() -> None:
    diloco, model = _peer(LocalAverage(1).member("solo"), inner_steps=2)
    with diloco:
        named = diloco.global_parameters()
        assert list(named) == [n for n, p in model.named_parameters() if p.requires_grad]
        flat = torch.cat([t.reshape(-1) for t in named.values()])
        assert torch.equal(flat, diloco.global_state.params)
        assert all(named[n].shape == p.shape for n, p in model.named_parameters())
        next(iter(named.values())).add_(1.0)  # a copy: the global state does not move
        assert not torch.equal(
            torch.cat([t.reshape(-1) for t in named.values()]), diloco.global_state.params
        )


def test_the_rounds_step_frees_the_gradients_before_the_round_runs() -> None:
    model = ByteTransformer(CONFIG, seed=1)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    held: list[bool] = []

    def average(round: int, vector: torch.Tensor, weight: float) -> AverageOutcome:
        held.append(any(p.grad is not None for p in model.parameters()))
        return AverageOutcome(vector, {"solo": weight})

    with DiLoCo(model, inner, average, inner_steps=2) as diloco:
        for step, (inputs, targets) in enumerate(_batches(0, 0, 2)):
            model.loss(inputs, targets).backward()
            diloco.step()
            # A step inside the phase leaves the gradients to the user's loop, as torch does.
            assert all(p.grad is not None for p in model.parameters()) == (step == 0)
    assert held == [False]  # the round's buffers never met a full set of gradients


def test_a_step_the_gradient_scaler_skips_still_counts_toward_the_round() -> None:
    model = ByteTransformer(CONFIG, seed=1)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    rounds: list[int] = []

    def average(round: int, vector: torch.Tensor, weight: float) -> AverageOutcome:
        rounds.append(round)
        return AverageOutcome(vector, {"solo": weight})

    with DiLoCo(model, inner, average, inner_steps=2, grad_scaler=scaler) as diloco:
        (inputs, targets), second = _batches(0, 0, 2)
        scaler.scale(model.loss(inputs, targets)).backward()
        next(model.parameters()).grad[0, 0] = float("inf")  # an fp16 overflow
        before = [p.detach().clone() for p in model.parameters()]
        scaler.unscale_(inner)
        diloco.step()
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
        assert scaler.get_scale() == 2.0**9 and rounds == []  # skipped, backed off
        diloco.zero_grad()
        scaler.scale(model.loss(*second)).backward()
        scaler.unscale_(inner)
        assert diloco.step() is not None  # the second step is the H-th: the round ran
    assert rounds == [0] and diloco.round == 1


def test_the_gradient_scalers_scale_resumes_from_the_checkpoint(tmp_path) -> None:
    """fp16: a restart resumes at the scale the last round's step left (growth and backoff
    included), not at the initial one."""

    def average(round: int, vector: torch.Tensor, weight: float) -> AverageOutcome:
        return AverageOutcome(vector, {"solo": weight})

    def fresh() -> tuple[ByteTransformer, torch.optim.AdamW, torch.amp.GradScaler]:
        model = ByteTransformer(CONFIG, seed=1)
        inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return model, inner, torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)

    model, inner, scaler = fresh()
    with DiLoCo(model, inner, average, inner_steps=2, state_dir=tmp_path,
                grad_scaler=scaler) as diloco:  # fmt: skip
        for inputs, targets in _batches(0, 0, 4):
            scaler.scale(model.loss(inputs, targets)).backward()
            scaler.unscale_(inner)
            diloco.step()
            diloco.zero_grad()
    # Every finite step doubles the scale (growth_interval=1): the checkpoint of round 1, made
    # by the 4th step, holds what that step's update left.
    assert scaler.get_scale() == 2.0**14 and diloco.round == 2
    model, inner, resumed = fresh()
    with DiLoCo(model, inner, average, inner_steps=2, state_dir=tmp_path, grad_scaler=resumed):
        assert resumed.get_scale() == 2.0**14
        assert resumed.state_dict() == scaler.state_dict()
        assert inner.state_dict()["state"]  # the optimizer's own state still resumes
