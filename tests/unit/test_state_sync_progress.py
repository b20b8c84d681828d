"""Progress records and the agreed-state rule every reader applies the same way."""

from __future__ import annotations

import msgpack
import pytest

from swarmtrain.membership.plan import best_state
from swarmtrain.membership.progress import (
    AgreedState,
    JoinAnnouncement,
    Progress,
    ProgressRecord,
    announced_joiners,
    announcement,
    decode_all,
)

H1, H2 = b"\x01" * 32, b"\x02" * 32


def agreed_state(records: list[Progress], round_number: int | None = None) -> AgreedState | None:
    """The most-held state (``state_quorum = 0``): the ranking every quorum starts from."""
    return best_state(records, 2**31, quorum=0, round_number=round_number)


def _p(peer: str, rnd: int, ok: bool, digest: bytes) -> Progress:
    return Progress(peer, rnd, ok, digest, 3.5, 1000.0, 3, 10, 20, 2, 1.0)


def test_records_round_trip_and_malformed_ones_are_skipped() -> None:
    good = _p("a", 4, True, H1)
    assert Progress.from_bytes("a", good.to_bytes()) == good
    code = ProgressRecord.TYPE_CODE
    bad = {
        "short": msgpack.packb([1, code, [4, True]]),
        "hash": msgpack.packb([1, code, [4, True, H1[:31], 1.0, 1.0, 1, 1, 1, 1, 1.0, "public"]]),
        "negative": msgpack.packb([1, code, [-1, True, H1, 1.0, 1.0, 1, 1, 1, 1, 1.0, "public"]]),
        "bool round": msgpack.packb(
            [1, code, [True, True, H1, 1.0, 1.0, 1, 1, 1, 1, 1.0, "public"]]
        ),
        "nan": msgpack.packb(
            [1, code, [1, True, H1, float("nan"), 1.0, 1, 1, 1, 1, 1.0, "public"]]
        ),
        "version": msgpack.packb([2, code, [1, True, H1, 1.0, 1.0, 1, 1, 1, 1, 1.0, "public"]]),
        "other type": msgpack.packb([1, 1, [1, True, H1, 1.0, 1.0, 1, 1, 1, 1, 1.0, "public"]]),
        "huge": b"\x00" * 2000,
        "garbage": b"\xc1",
    }
    with pytest.raises(ValueError):  # a record no reader would accept is never written
        _p("x", 4, True, b"\x01" * 31).to_bytes()
    assert all(Progress.from_bytes(k, v) is None for k, v in bad.items())
    assert decode_all({"a": good.to_bytes(), **bad}) == [good]


def test_agreed_state_is_the_majority_of_successful_records_at_the_latest_round() -> None:
    records = [
        _p("a", 3, True, H1),
        _p("b", 3, True, H1),
        _p("c", 3, True, H2),  # a drifted minority
        _p("d", 4, False, H2),  # failed rounds never count, even newer ones
        _p("e", 2, True, H2),  # older rounds do not count either
    ]
    agreed = agreed_state(records)
    assert agreed is not None
    assert (agreed.round, agreed.state_hash, agreed.holders, agreed.published) == (
        3,
        H1,
        ("a", "b"),
        3,
    )
    at_2 = agreed_state(records, 2)
    assert at_2 is not None and (at_2.round, at_2.state_hash, at_2.holders) == (2, H2, ("e",))
    assert agreed_state([_p("d", 4, False, H2)]) is None and agreed_state([]) is None


def test_a_tie_breaks_on_the_hash_so_every_reader_names_the_same_state() -> None:
    one = [_p("a", 1, True, H1), _p("b", 1, True, H2)]
    assert agreed_state(one) == agreed_state(list(reversed(one)))
    assert agreed_state(one).state_hash == H2  # type: ignore[union-attr]


def test_a_join_announcement_counts_only_when_it_names_the_round_of_its_key() -> None:
    code = JoinAnnouncement.TYPE_CODE
    values = {
        "joiner": announcement(5),
        "other round": announcement(4),
        "old value": b"\x01",
        "negative": msgpack.packb([1, code, [-5]]),
        "bool": msgpack.packb([1, code, [True]]),
        "progress": _p("x", 5, True, H1).to_bytes(),
    }
    assert announced_joiners(values, 5) == {"joiner"}
    with pytest.raises(ValueError):  # an announcement no reader would accept is never written
        announcement(-1)
