"""The aggregation rules of a part (``swarm.averaging.aggregation``): bit-identical whatever the
order, robust to one huge outlier or an inflated weight, "mean" exactly today's weighted mean."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco import LocalAverage, weighted_mean
from p2p import LocalProtocolError
from swarm.averaging import aggregation
from swarm.averaging.aggregation import (
    AGGREGATIONS,
    aggregate,
    capped_weights,
    reduce_part,
    trim_count,
)
from swarmtrain import config as run_config

ROBUST = ["centered_clip", "trimmed_mean"]


def ids(n: int) -> list[bytes]:
    return [bytes([65 + i]) * 4 for i in range(n)]


def group(rng: random.Random, n: int, numel: int, weights: bool = True) -> dict:
    gen = np.random.default_rng(rng.randrange(2**32))
    return {
        peer: (
            (gen.standard_normal(numel) * 10).astype(np.float32),
            rng.choice([1.0, 0.5, 3.0, rng.uniform(0.1, 10)]) if weights else 1.0,
        )
        for peer in ids(n)
    }


def honest_and_outlier(n_honest: int, numel: int = 4000) -> tuple[dict, np.ndarray]:
    """Honest slices scattered around one vector, and one peer sending a million times it."""
    gen = np.random.default_rng(7)
    base = gen.standard_normal(numel).astype(np.float32)
    honest = {
        peer: ((base + 0.3 * gen.standard_normal(numel)).astype(np.float32), 1.0)
        for peer in ids(n_honest)
    }
    outlier = {b"ZZZZ": ((-1e6 * base).astype(np.float32), 1.0)}
    return honest | outlier, reduce_part(honest)


@pytest.mark.parametrize("rule", AGGREGATIONS)
@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 8), numel=st.integers(0, 60), rng=st.randoms(use_true_random=False))
def test_a_permutation_of_the_peers_gives_the_same_bytes(rule, n, numel, rng):
    contributions = group(rng, n, numel)
    items = list(contributions.items())
    rng.shuffle(items)
    first = aggregate(rule, contributions)
    assert aggregate(rule, dict(items)).tobytes() == first.tobytes()
    out = np.full(numel, np.nan, np.float32)
    assert aggregate(rule, dict(items), out) is out and out.tobytes() == first.tobytes()
    assert first.dtype == np.float32 and np.isfinite(first).all()


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 8), numel=st.integers(0, 60), rng=st.randoms(use_true_random=False))
def test_with_equal_weights_the_trimmed_mean_does_not_care_who_sent_what(n, numel, rng):
    contributions = group(rng, n, numel, weights=False)
    slices = [v for v, _ in contributions.values()]
    rng.shuffle(slices)
    relabelled = {peer: (v, 1.0) for peer, v in zip(ids(n), slices, strict=True)}
    assert (
        aggregate("trimmed_mean", relabelled).tobytes()
        == aggregate("trimmed_mean", contributions).tobytes()
    )


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 8), numel=st.integers(0, 60), rng=st.randoms(use_true_random=False))
def test_mean_is_todays_weighted_mean_bit_for_bit(n, numel, rng):
    contributions = group(rng, n, numel)
    mean = aggregate("mean", contributions)
    assert mean.tobytes() == reduce_part(contributions).tobytes()
    # LocalAverage's torch weighted mean, the one bench.diloco has always run
    tensors = {p.decode(): ([torch.from_numpy(v)], w) for p, (v, w) in contributions.items()}
    assert weighted_mean(tensors)[0].numpy().tobytes() == mean.tobytes()


@pytest.mark.parametrize("rule", ROBUST)
@pytest.mark.parametrize("n_honest", [2, 4, 7])
def test_a_robust_rule_ignores_one_huge_outlier(rule: str, n_honest: int) -> None:
    contributions, honest_mean = honest_and_outlier(n_honest)
    result = aggregate(rule, contributions)
    spread = max(
        np.linalg.norm(v - honest_mean) for p, (v, _) in contributions.items() if p != b"ZZZZ"
    )
    # within twice the honest slices' own spread around their mean (centered clipping moves
    # towards the outlier by its share of the clipping radius); the mean is a million times off
    assert np.linalg.norm(result - honest_mean) <= 2 * spread
    assert np.linalg.norm(aggregate("mean", contributions) - honest_mean) > 1e4 * spread


@pytest.mark.parametrize("rule", ROBUST)
def test_a_declared_weight_counts_at_most_the_median_weight(rule: str) -> None:
    contributions, honest_mean = honest_and_outlier(4)
    outlier, _ = contributions[b"ZZZZ"]
    contributions[b"ZZZZ"] = (outlier, 1e9)
    result = aggregate(rule, contributions)
    spread = max(
        np.linalg.norm(v - honest_mean) for p, (v, _) in contributions.items() if p != b"ZZZZ"
    )
    assert np.linalg.norm(result - honest_mean) <= 2 * spread
    assert capped_weights([1.0, 1e9, 2.0, 3.0]).tolist() == [1.0, 2.0, 2.0, 2.0]


def test_centered_clip_of_an_honest_group_is_its_weighted_mean() -> None:
    # Slices within twice the median distance of the median: nothing is clipped, so the first
    # iteration lands on the weighted mean (weights capped at their median, 3) and the others
    # stay there, up to rounding.
    gen = np.random.default_rng(3)
    base = gen.standard_normal(5000).astype(np.float32)
    contributions = {
        peer: ((base + 0.1 * gen.standard_normal(5000)).astype(np.float32), 1.0 + i)
        for i, peer in enumerate(ids(5))
    }
    capped = {p: (v, min(w, 3.0)) for p, (v, w) in contributions.items()}
    np.testing.assert_allclose(
        aggregate("centered_clip", contributions), reduce_part(capped), atol=1e-6
    )


def test_trim_counts_a_quarter_and_at_least_one_from_three_peers() -> None:
    assert [trim_count(n) for n in range(1, 13)] == [0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2, 3]
    for n in range(1, 100):
        assert n - 2 * trim_count(n) >= 1


def test_a_large_part_is_reduced_in_blocks_the_same_way() -> None:
    # Longer than one block: the norms and the center are built block by block.
    rng = random.Random(5)
    contributions = group(rng, 4, 3 * aggregation._BLOCK + 17)
    for rule in ROBUST:
        whole = aggregate(rule, contributions)
        assert aggregate(rule, dict(reversed(contributions.items()))).tobytes() == whole.tobytes()


def test_bad_input_is_refused_with_the_reason() -> None:
    with pytest.raises(LocalProtocolError, match="unknown aggregation 'median'"):
        aggregate("median", {b"a": (np.zeros(2, np.float32), 1.0)})
    for rule in AGGREGATIONS:
        with pytest.raises(LocalProtocolError, match="at least one"):
            aggregate(rule, {})
        with pytest.raises(LocalProtocolError, match="differ in length"):
            aggregate(
                rule, {b"a": (np.zeros(2, np.float32), 1.0), b"b": (np.zeros(3, np.float32), 1.0)}
            )
        with pytest.raises(LocalProtocolError, match="out must be"):
            aggregate(rule, {b"a": (np.zeros(2, np.float32), 1.0)}, np.zeros(3, np.float32))


def test_the_run_config_names_the_swarms_rules() -> None:
    assert run_config.AGGREGATIONS == AGGREGATIONS


@pytest.mark.parametrize("rule", ROBUST)
def test_local_average_runs_the_swarms_rule(rule: str) -> None:
    """``diloco.LocalAverage`` (bench.byzantine's averaging) gives the rule's exact bytes."""
    import threading

    contributions, _ = honest_and_outlier(3, numel=500)
    local = LocalAverage(len(contributions), timeout_s=30, aggregation=rule)
    results: dict[bytes, bytes] = {}

    def member(peer: bytes) -> None:
        vector, weight = contributions[peer]
        outcome = local.member(peer.decode())(0, torch.from_numpy(vector), weight)
        results[peer] = outcome.vector.numpy().tobytes()

    threads = [threading.Thread(target=member, args=(p,)) for p in contributions]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert set(results.values()) == {aggregate(rule, contributions).tobytes()}
    with pytest.raises(ValueError, match="aggregation"):
        LocalAverage(2, aggregation="median")


def test_the_averager_refuses_an_unknown_rule_and_an_audited_robust_one() -> None:
    from swarm import AveragerConfig, Compression

    assert AveragerConfig(run_id="r", aggregation="centered_clip").aggregation == "centered_clip"
    with pytest.raises(ValueError, match="aggregation must be one of"):
        AveragerConfig(run_id="r", aggregation="median")
    with pytest.raises(ValueError, match='audit needs aggregation="mean"'):
        AveragerConfig(
            run_id="r", audit=True, compression=Compression.NONE, aggregation="trimmed_mean"
        )


def test_a_run_configs_rule_reaches_its_averager() -> None:
    from swarmtrain.training.loop import averager_config

    run = {"id": "robust"}
    config = run_config.config_from_mapping({"run": run, "swarm": {"aggregation": "trimmed_mean"}})
    assert averager_config(config).aggregation == "trimmed_mean"
    assert averager_config(run_config.config_from_mapping({"run": run})).aggregation == "mean"
