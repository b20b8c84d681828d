"""The declared bandwidth: stable under noise, follows real changes, ignores garbage."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from swarm.averaging.bandwidth import MAX_BPS, MIN_BPS, SLACK, BandwidthEstimate, share_weights


def test_noise_within_the_slack_never_changes_the_declaration() -> None:
    estimate = BandwidthEstimate(1e9)
    for measured in [0.6e9, 1.4e9, 0.8e9, 1.9e9, 0.55e9, 1.2e9]:
        assert estimate.observe(measured) == 1e9


def test_a_slow_uplink_is_declared_within_two_rounds_as_a_power_of_two() -> None:
    estimate = BandwidthEstimate(1e9)
    declared = [estimate.observe(20e6) for _ in range(3)]
    assert declared[-1] < 1e9 / SLACK
    assert math.log2(declared[-1]).is_integer()
    assert declared[-1] / 20e6 < SLACK  # close to the truth once settled
    # and back up when the link recovers
    for _ in range(6):
        up = estimate.observe(1e9)
    assert up > 5e8


def test_rounds_without_bulk_data_or_with_garbage_keep_the_declaration() -> None:
    estimate = BandwidthEstimate(1e8)
    for bad in [None, float("nan"), float("inf"), 0.0, -5.0]:
        assert estimate.observe(bad) == 1e8


@given(st.lists(st.floats(min_value=1.0, max_value=1e15), max_size=30))
def test_declaration_stays_in_range(measurements: list[float]) -> None:
    estimate = BandwidthEstimate()
    for measured in measurements:
        declared = estimate.observe(measured)
        assert MIN_BPS / 2 <= declared <= MAX_BPS * 2


def test_members_within_4x_share_equally_slower_ones_get_a_quarter_per_factor_of_4() -> None:
    assert len(set(share_weights([2.5e9, 9e9, 5e9]))) == 1  # loopback noise: equal parts
    fast, five_x, twenty_x = share_weights([1e9, 2e8, 5e7])
    assert (fast / five_x, fast / twenty_x) == (4, 16)
    assert share_weights([0.0, 1e9])[0] >= 1  # a member declaring nothing still gets a sliver


@given(st.lists(st.floats(min_value=0.0, max_value=1e12), min_size=1, max_size=16))
def test_share_weights_are_positive_and_order_preserving(declared: list[float]) -> None:
    weights = share_weights(declared)
    assert all(w >= 1 for w in weights)
    for a, wa in zip(declared, weights, strict=True):
        for b, wb in zip(declared, weights, strict=True):
            if a <= b:
                assert wa <= wb
