"""The hierarchical round on the wire, sans-IO: every item through ``GridItem``'s bytes and back
keeps a round bit-identical to the flat ``reduce_part``; garbage is a ``RemoteProtocolError``
(or a drop by the machine), never a crash; flat or grid is a pure function of the group and the
run's config."""

from __future__ import annotations

import contextlib
import dataclasses
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p import RemoteProtocolError
from p2p.wire import decode, encode
from swarm.averaging.aggregation import reduce_part
from swarm.averaging.allreduce import DropPeer, Finish, PeerLost
from swarm.averaging.averager import AveragerConfig, hierarchical
from swarm.averaging.codec import Compression
from swarm.averaging.grid import grid_plan, uses_grid
from swarm.averaging.grid_wire import GridItem, GridKind, from_wire, payload_bytes, to_wire
from swarm.averaging.hierarchical import (
    Accumulated,
    GridAllReduce,
    ItemReceived,
    RawPart,
    SendItem,
)
from swarm.averaging.session_wire import INLINE_MAX_BYTES


def through_the_wire(item: object, plan) -> object:  # type: ignore[no-untyped-def]
    """``item`` as a receiver gets it: encoded, decoded, sized against the plan, rebuilt (a
    payload over the inline limit travels apart, as on the bulk channel)."""
    msg, payload = to_wire(item)  # type: ignore[arg-type]
    received = decode(encode(msg), GridItem)
    size = payload_bytes(received, plan)
    data = received.inline if received.inline or size == 0 else bytearray(payload)
    assert len(data) == size
    return from_wire(received, data)


@settings(max_examples=10, deadline=None)
@given(n=st.integers(5, 30), row=st.integers(2, 6), seed=st.integers(0, 10**6))
def test_a_round_over_the_wire_gives_the_flat_reduce_part_bit_for_bit(n, row, seed) -> None:
    rng = random.Random(seed)
    peers = [rng.randbytes(8) for _ in range(n)]
    weights = [rng.uniform(0.1, 10.0) for _ in range(n)]
    numel = 200
    vectors = {
        p: np.random.default_rng([seed, i]).standard_normal(numel).astype(np.float32)
        for i, p in enumerate(peers)
    }
    plan = grid_plan(peers, weights, numel, row)
    lost = sorted(peers)[rng.randrange(n)]  # never starts: excluded by its row's heads
    machines = {p: GridAllReduce(p, plan, vectors[p], deadline=1e9) for p in peers if p != lost}
    wire: list[tuple[bytes, object]] = []
    results: dict[bytes, Finish] = {}
    kinds: set[GridKind] = set()

    def apply(peer: bytes, actions: list[object]) -> None:
        for action in actions:
            assert not isinstance(action, DropPeer), action
            if isinstance(action, SendItem):
                kinds.add(to_wire(action.item)[0].kind)  # type: ignore[arg-type]
                wire.append((action.peer, ItemReceived(peer, through_the_wire(action.item, plan))))
            elif isinstance(action, Finish):
                results[peer] = action

    for p, machine in machines.items():
        apply(p, machine.start(0.0))
    for p, machine in machines.items():
        if abs(machine.row_index[lost] - machine.my_row) <= 1:  # near peers watch it
            apply(p, machine.handle(PeerLost(lost), 0.0))
    while wire:
        dst, event = wire.pop(rng.randrange(len(wire)))
        if dst != lost:
            apply(dst, machines[dst].handle(event, 0.0))
    assert len(results) == n - 1
    contributors = {p: (vectors[p], w) for p, w in next(iter(results.values())).contributors}
    assert {r.result.tobytes() for r in results.values()} == {reduce_part(contributors).tobytes()}
    assert {GridKind.RAW, GridKind.GATHERED} <= kinds
    assert GridKind.ACCUMULATED in kinds or plan.rows == 1


def test_a_big_payload_is_not_inlined_and_sizes_are_checked_before_reading() -> None:
    plan = grid_plan([b"a", b"b", b"c", b"d"], [1.0] * 4, 400_000, 2)
    raw = RawPart(0, np.ones(200_000, np.float32), 2.0)
    msg, payload = to_wire(raw)
    assert msg.inline == b"" and msg.nbytes == len(payload) == 800_000 > INLINE_MAX_BYTES
    assert payload_bytes(msg, plan) == 800_000
    partial = Accumulated(1, 1, 0, frozenset(), np.zeros(100_000, np.float64))
    assert payload_bytes(to_wire(partial)[0], plan) == 800_000  # float64: 8 bytes a value
    for bad, why in [
        (dataclasses.replace(msg, nbytes=4), "expected 800000"),
        (dataclasses.replace(msg, column=2), "outside the grid"),
        (dataclasses.replace(msg, kind=GridKind.ACCUMULATED, sub=2), "outside the grid"),
        (dataclasses.replace(msg, kind=GridKind.READY), "expected 0"),
    ]:
        with pytest.raises(RemoteProtocolError, match=why):
            payload_bytes(bad, plan)


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=300))
def test_garbage_bytes_are_a_remote_protocol_error(data: bytes) -> None:
    with contextlib.suppress(RemoteProtocolError):
        decode(data, GridItem)


@settings(max_examples=200, deadline=None)
@given(
    kind=st.sampled_from(list(GridKind)),
    column=st.integers(-2, 5),
    sub=st.integers(-2, 5),
    row=st.integers(-2, 5),
    weight=st.floats(allow_nan=True, allow_infinity=True),
    names=st.lists(st.sampled_from([b"a", b"b", b"c", b"x", b""]), max_size=3),
    numel=st.integers(0, 12),
    nan=st.booleans(),
)
def test_a_well_formed_item_with_bad_fields_is_refused_or_dropped(
    kind, column, sub, row, weight, names, numel, nan
) -> None:
    """Whatever a peer sends that decodes: a size refusal, or the machine drops it, ignores
    it, or takes it; never an exception other than ``RemoteProtocolError``."""
    plan = grid_plan([b"a", b"b", b"c", b"d"], [1.0] * 4, 8, 2)
    machine = GridAllReduce(b"a", plan, np.zeros(8, np.float32), deadline=1e9)
    machine.start(0.0)
    width = 8 if kind is GridKind.ACCUMULATED else 4
    values = np.full(numel, np.nan if nan else 1.0, "<f8" if width == 8 else "<f4")
    msg = GridItem(kind, column, sub, row, weight, tuple(names), tuple(names),
                   values.nbytes, values.tobytes())  # fmt: skip
    try:
        payload_bytes(msg, plan)
        item = from_wire(msg, msg.inline)
    except RemoteProtocolError:
        return
    with contextlib.suppress(RemoteProtocolError):
        machine.handle(ItemReceived(b"b", item), 0.0)  # type: ignore[arg-type]


def test_flat_or_grid_is_a_pure_function_of_the_group_and_the_config() -> None:
    assert not uses_grid(32, 32, plain_mean=True)  # a row's worth: the flat butterfly
    assert uses_grid(33, 32, plain_mean=True)
    assert uses_grid(16, 4, plain_mean=True)
    assert not uses_grid(1000, None, plain_mean=True)  # hierarchy off
    assert not uses_grid(1000, 32, plain_mean=False)  # a codec, a robust rule, an audit
    for size in range(1, 70):
        assert uses_grid(size, 8, plain_mean=True) == uses_grid(size, 8, plain_mean=True)


def test_the_averager_config_turns_the_hierarchy_on_only_for_a_plain_mean() -> None:
    assert AveragerConfig("r").row_size == 32
    with pytest.raises(ValueError, match="row_size"):
        AveragerConfig("r", row_size=1)

    def on(**changes: object) -> bool:
        return hierarchical(AveragerConfig("r", **changes))  # type: ignore[arg-type]

    assert on()
    assert not on(row_size=None)
    assert not on(compression=Compression.INT8)
    assert not on(compression=None)  # "auto": int8 above 64K elements
    assert not on(aggregation="trimmed_mean")
    assert not on(audit=True)
