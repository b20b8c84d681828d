"""download_state's driver with injected fetches (trio in-process, no sockets): several sources,
a source that dies mid-download is resumed elsewhere, a lying source cannot poison the result."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Hashable

import pytest
import trio

from swarmtrain.membership.state_sync import StateSyncFailed, download_state, state_hash_of
from swarmtrain.membership.state_sync_plan import Piece

PIECE = 1000


def _state(size: int = 10_000) -> tuple[bytes, bytes]:
    body = os.urandom(size - 32)
    digest = hashlib.sha256(body).digest()
    return body + digest, digest


def _fetcher(data: bytes, behaviour: dict[str, str], calls: list[tuple[str, Piece]]):
    served: dict[str, int] = {}

    async def fetch(source: Hashable, piece: Piece) -> bytes:
        name = str(source)
        calls.append((name, piece))
        served[name] = served.get(name, 0) + 1
        await trio.sleep(0)  # let the other sources interleave
        mode = behaviour.get(name, "good")
        if mode == "dies-after-2" and served[name] > 2:
            raise ConnectionResetError("source died")
        if mode == "lies":
            return bytes(piece.length)  # zeros: right length, wrong bytes
        return data[piece.offset : piece.end]

    return fetch


def test_ranges_are_split_across_sources_and_verified() -> None:
    data, digest = _state()
    calls: list[tuple[str, Piece]] = []
    got = trio.run(
        lambda: download_state(
            _fetcher(data, {}, calls), digest, len(data), ["a", "b", "c"], piece_bytes=PIECE
        )
    )
    assert bytes(got.data) == data and state_hash_of(got.data) == digest
    assert set(got.pieces_by_source) == {"a", "b", "c"}  # every source carried some ranges
    assert sum(got.pieces_by_source.values()) == 10


def test_a_source_dying_mid_download_is_resumed_from_another() -> None:
    data, digest = _state()
    calls: list[tuple[str, Piece]] = []
    got = trio.run(
        lambda: download_state(
            _fetcher(data, {"a": "dies-after-2"}, calls),
            digest,
            len(data),
            ["a", "b"],
            piece_bytes=PIECE,
        )
    )
    assert bytes(got.data) == data
    assert "source died" in got.failures["a"]
    failed_piece = [p for s, p in calls if s == "a"][2]
    assert ("b", failed_piece) in calls  # the missing range came from the survivor
    assert got.pieces_by_source["a"] == 2 and got.pieces_by_source["b"] == 8


def test_a_lying_source_is_found_by_the_hash_and_the_honest_copy_wins() -> None:
    data, digest = _state()
    got = trio.run(
        lambda: download_state(
            _fetcher(data, {"b": "lies"}, []), digest, len(data), ["b", "a"], piece_bytes=PIECE
        )
    )
    assert bytes(got.data) == data
    assert "fail the hash" in got.failures["b"]


def test_no_good_copy_anywhere_raises_and_returns_nothing() -> None:
    data, digest = _state()
    with pytest.raises(StateSyncFailed):
        trio.run(
            lambda: download_state(
                _fetcher(data, {"a": "lies", "b": "dies-after-2"}, []),
                digest,
                len(data),
                ["a", "b"],
                piece_bytes=PIECE,
            )
        )
    with pytest.raises(StateSyncFailed, match="no source"):
        trio.run(lambda: download_state(_fetcher(data, {}, []), digest, len(data), []))
