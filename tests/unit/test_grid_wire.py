"""The hierarchical round on the wire, sans-IO: every item through ``GridItem``'s bytes and back
keeps a round bit-identical to the flat ``reduce_part``; garbage is a ``RemoteProtocolError``
(or a drop by the machine), never a crash; flat or grid is a pure function of the group and the
run's config."""

from __future__ import annotations

import contextlib
import dataclasses
import random

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p import LocalProtocolError, RemoteProtocolError
from p2p.wire import decode, encode
from swarm.averaging.aggregation import reduce_part
from swarm.averaging.allreduce import DropPeer, Fail, Finish, PeerLost
from swarm.averaging.averager import AveragerConfig, hierarchical
from swarm.averaging.codec import Compression
from swarm.averaging.grid import grid_plan, uses_grid
from swarm.averaging.grid_wire import (
    GridItem,
    GridKind,
    encode_slices,
    finalizer,
    from_wire,
    payload_bytes,
    to_wire,
)
from swarm.averaging.hierarchical import (
    Accumulated,
    GridAllReduce,
    GridState,
    ItemReceived,
    RawPart,
    Reduced,
    SendItem,
)
from swarm.averaging.payload import Layout
from swarm.averaging.session_wire import INLINE_MAX_BYTES, Hello, hello_refusal
from swarm.averaging.sparse_codec import SparseCodec

LOSSLESS = Layout.for_sizes([400_000], Compression.NONE)


def lossless(numel: int) -> Layout:
    return Layout.for_sizes([numel], Compression.NONE)


def through_the_wire(item: object, plan, layout: Layout) -> object:  # type: ignore[no-untyped-def]
    """``item`` as a receiver gets it: encoded, decoded, sized against the plan and layout,
    rebuilt (a payload over the inline limit travels apart, as on the bulk channel)."""
    msg, payload = to_wire(item)  # type: ignore[arg-type]
    received = decode(encode(msg), GridItem)
    size = payload_bytes(received, plan, layout)
    data = received.inline if received.inline or size == 0 else bytearray(payload)
    assert len(data) == size
    return from_wire(received, data, plan, layout)


# One layout of each kind a run may have: float32; one lossy codec; "auto"-like, tensors of
# different codecs (int8 blocks and tensor bounds cut across the grid's columns and sub-parts).
LAYOUTS = {
    "none": Layout((5000,), (Compression.NONE,)),
    "int8": Layout((5000,), (Compression.INT8,)),
    "fp16": Layout((5000,), (Compression.FP16,)),
    "mixed": Layout(
        (700, 2600, 1200, 500),
        (Compression.NONE, Compression.INT8, Compression.FP16, Compression.INT8),
    ),
}


def reference(plan, layout: Layout, vectors, contributors) -> np.ndarray:  # type: ignore[no-untyped-def]
    """What a grid round over ``contributors`` (peer -> weight) must give, from the codec's
    rules alone: each slice of a column as its head decodes it, the flat ``reduce_part`` of
    each sub-part over those, encoded once and decoded."""
    out = np.empty(plan.numel, np.float32)
    for c in range(plan.columns):
        start, stop = plan.part(c)
        seen = {p: layout.round_trip(vectors[p][start:stop], start) for p in contributors}
        for j in range(plan.rows):
            a, b = plan.sub(c, j)
            mean = reduce_part(
                {p: (seen[p][a - start : b - start], w) for p, w in contributors.items()}
            )
            out[a:b] = layout.round_trip(mean, a)
    return out


def wire_round(
    n: int, row: int, seed: int, layout: Layout, lost: bytes | None = None, kill_after: int = -1
):  # type: ignore[no-untyped-def]
    """One grid round between machines joined by a fake wire that delivers every item through
    its bytes, in a random order. ``lost`` never starts, or with ``kill_after`` >= 0 dies after
    sending that many items (its near peers are told, what it sent still arrives)."""
    rng = random.Random(seed)
    peers = [rng.randbytes(8) for _ in range(n)]
    weights = [rng.uniform(0.1, 10.0) for _ in range(n)]
    numel = sum(layout.sizes)
    vectors = {
        p: np.random.default_rng([seed, i]).standard_normal(numel).astype(np.float32)
        for i, p in enumerate(peers)
    }
    plan = grid_plan(peers, weights, numel, row)
    machines = {}
    for p in peers:
        if layout.lossless():
            machines[p] = GridAllReduce(p, plan, vectors[p], deadline=1e9)
        else:
            seen = np.empty(numel, np.float32)
            payloads = encode_slices(vectors[p], plan, layout, seen)
            machines[p] = GridAllReduce(
                p, plan, seen, 1e9, payloads=payloads, finalize=finalizer(layout)
            )
    wire: list[tuple[bytes, object]] = []
    results: dict[bytes, Finish] = {}
    gathered: dict[tuple[int, frozenset[bytes]], set[bytes]] = {}  # column bytes on the wire
    kinds: set[GridKind] = set()
    sends = {p: 0 for p in peers}

    def near(a: bytes, b: bytes) -> bool:
        return abs(machines[a].row_index[b] - machines[a].my_row) <= 1

    def kill() -> None:
        for p, machine in machines.items():
            if p != lost and near(p, lost) and machine.state is not GridState.FAILED:
                apply(p, machine.handle(PeerLost(lost), 0.0))

    def apply(peer: bytes, actions: list[object]) -> None:
        for action in actions:
            assert not isinstance(action, DropPeer | Fail), action
            if isinstance(action, SendItem):
                if peer == lost and sends[peer] == kill_after:
                    sends[peer] += 1
                    kill()
                if peer == lost and sends[peer] > kill_after:
                    continue
                sends[peer] += 1
                msg, payload = to_wire(action.item)  # type: ignore[arg-type]
                kinds.add(msg.kind)
                if msg.kind is GridKind.GATHERED:
                    key = (msg.column, frozenset(msg.excluded))
                    gathered.setdefault(key, set()).add(bytes(payload))
                wire.append(
                    (action.peer, ItemReceived(peer, through_the_wire(action.item, plan, layout)))
                )
            elif isinstance(action, Finish):
                results[peer] = action

    started = {p: m.start(0.0) for p, m in machines.items() if p != lost or kill_after >= 0}
    for p, actions in started.items():
        apply(p, actions)
    if lost is not None and kill_after < 0:
        kill()
    while wire:
        dst, event = wire.pop(rng.randrange(len(wire)))
        if dst != lost or sends[lost] <= kill_after:
            apply(dst, machines[dst].handle(event, 0.0))
    return plan, vectors, results, gathered, kinds


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    codec=st.sampled_from(sorted(LAYOUTS)),
    n=st.integers(5, 30),
    row=st.integers(3, 6),  # rows of 2 or more: a lone peer's row has no successor for it
    seed=st.integers(0, 10**6),
    kill_after=st.integers(-1, 40),
)
def test_a_round_over_the_wire_is_bit_identical_and_exactly_the_codecs_mean(
    codec, n, row, seed, kill_after
) -> None:
    """A peer never starts, or dies after a number of sends (a head mid-chain, mid-gather): the
    survivors hold the same bytes, which are exactly the codec's mean over the contributors
    they report (``reference``; lossless: the flat ``reduce_part``), and every column that
    went out did so as one set of bytes whose decoding is the result."""
    layout = LAYOUTS[codec]
    rng = random.Random(seed)
    lost = sorted(rng.randbytes(8) for _ in range(n))[seed % n]  # wire_round's peers
    plan, vectors, results, gathered, kinds = wire_round(n, row, seed, layout, lost, kill_after)
    assert set(results) >= set(plan.peers) - {lost}  # the victim too, if it finished first
    contributors = dict(next(iter(results.values())).contributors)
    assert {r.contributors for r in results.values()} == {tuple(contributors.items())}
    assert lost not in contributors or kill_after >= 0
    expected = reference(plan, layout, vectors, contributors)
    assert {r.result.tobytes() for r in results.values()} == {expected.tobytes()}
    if layout.lossless():
        flat = reduce_part({p: (vectors[p], w) for p, w in contributors.items()})
        assert expected.tobytes() == flat.tobytes()
    final = frozenset(plan.peers) - frozenset(contributors)
    for c in range(plan.columns):
        start, stop = plan.part(c)
        copies = gathered.get((c, final), set())
        assert len(copies) <= 1  # one encoding of each column per exclusion set, ever
        for data in copies:
            item = from_wire(
                GridItem(GridKind.GATHERED, c, 0, 0, 0.0, (), (), len(data), b""),
                data, plan, layout,
            )  # fmt: skip
            assert item.data.tobytes() == expected[start:stop].tobytes()
    assert {GridKind.RAW, GridKind.GATHERED} <= kinds
    assert GridKind.ACCUMULATED in kinds or plan.rows == 1


def test_a_lossy_round_sends_the_codecs_bytes_and_the_chain_in_float64() -> None:
    """int8: a slice travels as about a quarter of its float32 bytes, a reduced sub-part too;
    the partial sums stay float64 (8 bytes a value), whatever the codec."""
    layout = LAYOUTS["int8"]
    plan = grid_plan([b"a", b"b", b"c", b"d"], [1.0] * 4, 5000, 2)
    vector = np.random.default_rng(1).standard_normal(5000).astype(np.float32)
    seen = vector.copy()
    payloads = encode_slices(seen, plan, layout, seen)  # in place: ``result_in_local``
    assert (
        seen.tobytes()
        == layout.round_trip(vector[:2500], 0).tobytes()
        + layout.round_trip(vector[2500:], 2500).tobytes()
    )
    assert [len(p) for p in payloads] == [2500 + 4 * 3] * 2
    raw, _ = to_wire(RawPart(1, seen[2500:], 1.0, payloads[1]))
    assert raw.nbytes == payload_bytes(raw, plan, layout) == 2512
    assert from_wire(raw, raw.inline, plan, layout).data.tobytes() == seen[2500:].tobytes()
    partial = Accumulated(1, 1, 0, frozenset(), np.zeros(1250, np.float64))
    assert payload_bytes(to_wire(partial)[0], plan, layout) == 8 * 1250
    finalize = finalizer(layout)
    assert finalize is not None and finalizer(lossless(5000)) is None
    values, data = finalize(vector[3750:], 3750)
    reduced, _ = to_wire(Reduced(1, 1, frozenset(), values, data))
    assert payload_bytes(reduced, plan, layout) == len(data) == 1250 + 8
    back = from_wire(reduced, reduced.inline, plan, layout)
    assert back.payload == data and back.data.tobytes() == values.tobytes()
    for bad in (dataclasses.replace(raw, nbytes=10_000), dataclasses.replace(reduced, nbytes=5000)):
        with pytest.raises(RemoteProtocolError, match="expected"):
            payload_bytes(bad, plan, layout)
    nan = dataclasses.replace(raw, inline=raw.inline[:8] + b"\xff\xff\xff\x7f" + raw.inline[12:])
    with pytest.raises(RemoteProtocolError):
        from_wire(nan, nan.inline, plan, layout)  # a NaN scale: refused, not summed


def test_a_lossy_machine_refuses_reduced_items_without_their_bytes() -> None:
    layout = LAYOUTS["int8"]
    plan = grid_plan([b"a", b"b", b"c", b"d"], [1.0] * 4, 5000, 2)
    seen = np.zeros(5000, np.float32)
    payloads = encode_slices(seen, plan, layout, seen)
    with pytest.raises(LocalProtocolError):
        GridAllReduce(b"a", plan, seen, 1e9, payloads=payloads)
    machine = GridAllReduce(b"a", plan, seen, 1e9, payloads=payloads, finalize=finalizer(layout))
    machine.start(0.0)
    bare = Reduced(0, 0, frozenset(), np.zeros(1250, np.float32))
    actions = machine.handle(ItemReceived(b"c", bare), 0.0)
    assert [a.reason for a in actions if isinstance(a, DropPeer)] == [
        "no wire bytes in a lossy round"
    ]


def test_a_big_payload_is_not_inlined_and_sizes_are_checked_before_reading() -> None:
    plan = grid_plan([b"a", b"b", b"c", b"d"], [1.0] * 4, 400_000, 2)
    raw = RawPart(0, np.ones(200_000, np.float32), 2.0)
    msg, payload = to_wire(raw)
    assert msg.inline == b"" and msg.nbytes == len(payload) == 800_000 > INLINE_MAX_BYTES
    assert payload_bytes(msg, plan, LOSSLESS) == 800_000
    partial = Accumulated(1, 1, 0, frozenset(), np.zeros(100_000, np.float64))
    assert payload_bytes(to_wire(partial)[0], plan, LOSSLESS) == 800_000  # float64: 8 bytes a value
    for bad, why in [
        (dataclasses.replace(msg, nbytes=4), "expected 800000"),
        (dataclasses.replace(msg, column=2), "outside the grid"),
        (dataclasses.replace(msg, kind=GridKind.ACCUMULATED, sub=2), "outside the grid"),
        (dataclasses.replace(msg, kind=GridKind.READY), "expected 0"),
    ]:
        with pytest.raises(RemoteProtocolError, match=why):
            payload_bytes(bad, plan, LOSSLESS)


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
        payload_bytes(msg, plan, lossless(8))
        item = from_wire(msg, msg.inline, plan, lossless(8))
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


def test_the_averager_config_turns_the_hierarchy_on_for_any_dense_codec() -> None:
    assert AveragerConfig("r").row_size == 32
    with pytest.raises(ValueError, match="row_size"):
        AveragerConfig("r", row_size=1)

    def on(**changes: object) -> bool:
        return hierarchical(AveragerConfig("r", **changes))  # type: ignore[arg-type]

    assert on()
    assert not on(row_size=None)
    for codec in Compression:
        assert on(compression=codec)
    assert on(compression=None)  # "auto": int8 above 64K elements, DiLoCo's default
    assert not on(compression=SparseCodec())
    assert not on(aggregation="trimmed_mean")
    assert not on(audit=True)


def test_a_hello_with_another_row_size_is_refused_naming_both() -> None:
    """Peers that disagree on ``row_size`` would drive different machines (flat or grid) or
    grids; the Hello carries it so the receiver says so instead of dropping garbage."""
    layout = lossless(10).digest
    hello = Hello("run", b"g" * 32, layout, row_size=4)
    assert hello_refusal(hello, layout, 4) is None
    assert decode(encode(hello), Hello) == hello
    assert hello_refusal(hello, layout, 32) == "its row_size 4 differs from ours (32)"
    assert hello_refusal(hello, layout, None) == "its row_size 4 differs from ours (None)"
    flat = Hello("run", b"g" * 32, layout)
    assert hello_refusal(flat, layout, None) is None
    assert hello_refusal(flat, layout, 32) == "its row_size None differs from ours (32)"
    other = Layout.for_sizes([10], Compression.INT8).digest
    assert hello_refusal(hello, other, 4) == "tensor layout or codecs differ from ours"
    envelope = msgpack.unpackb(encode(hello))
    envelope[2][-3] = -1  # row_size, before align and leaves
    with pytest.raises(RemoteProtocolError, match="row_size -1 is negative"):
        decode(msgpack.packb(envelope), Hello)
