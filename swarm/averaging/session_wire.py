"""What one all-reduce round puts on the wire: the stream's messages, how a vector is chunked for
it, and the bytes that carry a part's values (codec round trips, slice proofs, parts received
in place: ``settle_landings``).

Wire, per ordered pair of group members (sender -> receiver), one libp2p stream on ``PROTOCOL``:

    Hello(run_id, group_id, layout digest, kept channel id, its payloads sent, row size)
                                 <- Resumed(ok)   only when the Hello named a kept channel
    ( Item(kind, part, weight, contributors, nbytes, inline, proof)  [payload, bulk plane] )*
    Done()                       -- the sender finished; it may still forward parts after this
    (end of stream)              -- the sender will send nothing more this round

An item's payload rides inline when small (``INLINE_MAX_BYTES``), else on the pair's
``p2p.BulkChannel`` (``swarm.averaging.channels`` says which one). One stream per pair keeps each
pair's messages in order, which the machine's forwarding rule relies on (a forwarded reduced part
arrives before the forwarder's own slice).

``RoundValues`` holds one session's values as the wire carries them: its vector as peers will
decode it, the encoded bytes of reduced parts (a forward must carry exactly the bytes the reducer
sent: re-encoding a decoded int8 part may not reproduce them), and an audited round's signatures
and hashes of every slice.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING

import numpy as np
import trio

from p2p import Message, RemoteProtocolError, message, verify_peer_signature
from swarm.averaging.allreduce import SendPart, SendReduced, is_view_at, partition
from swarm.averaging.audit import MAX_PROOF_BYTES, proof_message, slice_hash
from swarm.averaging.commitment import LEAF_DIGEST_BYTES, MAX_LEAVES
from swarm.averaging.payload import Layout

if TYPE_CHECKING:
    from swarm.averaging.matchmaking import Group

log = logging.getLogger(__name__)

PROTOCOL = "/swarmtrain/allreduce/3"  # 2: kept data channels (Hello, Resumed); 3: row_size
KIND_SLICE, KIND_REDUCED = 0, 1
INLINE_MAX_BYTES = 256 * 1024
# Below this many elements work stays on the event loop: a thread hop costs more.
THREAD_MIN_NUMEL = 1 << 16
# Each peer's share is cut into chunks, so that a reducer reduces and sends chunk k while chunk
# k + 1 arrives: about CHUNK_SECONDS of the slowest member's declared link, between MIN and MAX
# bytes. On a 100 Mbit/s, 25 ms link (bench.allreduce_netlab) 8 MiB chunks reached 0.81-0.84 of
# the bandwidth limit where one 25 MB chunk per peer reached 0.75; on loopback, where the CPU is
# the limit, every extra chunk is overhead (32 MiB: 1.35 s, 8 MiB: 2.5 s for N=4, 25M floats).
CHUNK_SECONDS = 0.5
MIN_CHUNK_BYTES = 4 << 20
MAX_CHUNK_BYTES = 32 << 20
MAX_CHUNKS = 16


def chunks_for(numel: int, group_size: int, slowest_bps: float) -> int:
    """Chunks per peer: a function of the round's shape and the members' declarations only, so
    every member computes the same."""
    chunk = min(MAX_CHUNK_BYTES, max(MIN_CHUNK_BYTES, slowest_bps / 8 * CHUNK_SECONDS))
    return max(1, min(MAX_CHUNKS, math.ceil(4 * numel / group_size / chunk)))


@message(100, max_bytes=1024 + MAX_LEAVES * LEAF_DIGEST_BYTES)
class Hello(Message):
    run_id: str
    group_id: bytes
    layout: bytes
    # The data channel to the receiver the sender kept from an earlier round (b"": none), and
    # how many payloads it sent on it: the receiver uses it only if it counted as many.
    channel: bytes = b""
    channel_payloads: int = 0
    # The sender's ``AveragerConfig.row_size`` (0: None): it decides, with the group's size,
    # whether a round is flat or a grid and the grid's rows, so peers must agree on it.
    row_size: int = 0
    # A round whose contributions are committed (``SessionConfig.bound``): the parts' boundary
    # multiple, which every member must share, and the sender's contribution's leaf digests
    # (``swarm.averaging.commitment``), which its receivers check its slices against.
    align: int = 1
    leaves: bytes = b""

    def __post_init__(self) -> None:
        if len(self.channel) > 64 or self.channel_payloads < 0:
            raise ValueError("bad kept-channel fields")
        if self.row_size < 0:
            raise ValueError(f"row_size {self.row_size} is negative")
        if self.align < 1 or len(self.leaves) % LEAF_DIGEST_BYTES:
            raise ValueError("bad contribution fields")


def hello_refusal(hello: Hello, layout: bytes, row_size: int | None, align: int = 1) -> str | None:
    """Why a round whose layout digest is ``layout``, under our ``row_size`` and part alignment
    ``align``, refuses ``hello`` (None: it does not). A differing row size would make the two
    peers drive different machines (flat or grid) or grids: their items would read as garbage,
    so it is refused here, naming both values."""
    if hello.layout != layout:
        return "tensor layout or codecs differ from ours"
    ours = row_size or 0
    if hello.row_size != ours:
        return f"its row_size {hello.row_size or None} differs from ours ({ours or None})"
    if hello.align != align:
        return "part alignment differs from ours (a committed round?)"
    return None


@message(101, max_bytes=INLINE_MAX_BYTES + 64 * 1024)
class Item(Message):
    kind: int
    part_index: int
    weight: float
    contributors: tuple[bytes, ...]
    weights: tuple[float, ...]
    nbytes: int
    inline: bytes
    # A slice's sender signs (run, round, group, part, weight, SHA-256 of the slice) when the
    # round is audited (``SessionConfig.sign``): its reducer can then prove what it summed.
    proof: bytes = b""


@message(102, max_bytes=128)
class Done(Message):
    """The sender holds its result (no digest: hashing 100 MB costs a third of a second)."""


@message(103, max_bytes=64)
class Resumed(Message):
    """The receiver's answer to a Hello naming a kept channel: True, it carries this round's
    payloads; False, the sender opens a new one (and closes the one it kept)."""

    ok: bool


def settle_landings(
    result: np.ndarray,
    parts: Sequence[tuple[bytes, int, int]],
    held: Sequence[tuple[np.ndarray, frozenset[bytes]] | None],
    landed: Collection[int],
    landing: Collection[int],
) -> np.ndarray:
    """``result`` (the machine's assembled vector) with every part received in place put right.

    A copy of part p received into its place (``landed``) that the machine did not keep (it
    reduced p, or took a later copy) may have been written while the machine, in a worker
    thread, assembled ``result``: the held bytes go there again. If such a receive is still
    going on (``landing``), it goes on writing into ``result``: then this returns a copy.
    """
    settled = result.copy() if landing else result
    for p in landed:
        entry = held[p]
        assert entry is not None  # Finish means every part is held
        _, start, stop = parts[p]
        if not is_view_at(entry[0], settled, start):
            settled[start:stop] = entry[0]
    return settled


def check_item(
    item: Item, parts: Sequence[tuple[bytes, int, int]], layout: Layout
) -> tuple[int, int, int]:
    """``item``'s part range and payload size, ``(start, stop, nbytes)``, if it fits the round;
    else raises ``RemoteProtocolError`` saying why (an unknown kind, a part outside the round, a
    payload of the wrong size, contributors without their weights)."""
    if item.kind not in (KIND_SLICE, KIND_REDUCED):
        raise RemoteProtocolError(f"unknown item kind {item.kind}")
    if not 0 <= item.part_index < len(parts):
        raise RemoteProtocolError(f"part index {item.part_index} out of range")
    _, start, stop = parts[item.part_index]
    expected = layout.wire_bytes(start, stop)
    if item.kind == KIND_REDUCED and layout.gathers:
        # The contributors' slices, one each (``Layout.gathers``): at most the whole group.
        if not 1 <= len(item.contributors) <= len({peer for peer, _, _ in parts}):
            raise RemoteProtocolError(f"{len(item.contributors)} contributors in a reduced part")
        expected = layout.reduced_bytes(start, stop, len(item.contributors))
    if item.nbytes != expected:
        raise RemoteProtocolError(
            f"part {item.part_index} payload of {item.nbytes} bytes, expected {expected}"
        )
    if len(item.contributors) != len(item.weights):
        raise RemoteProtocolError("contributors and weights differ in length")
    if (item.inline or expected <= INLINE_MAX_BYTES) and len(item.inline) != expected:
        raise RemoteProtocolError(f"inline payload of {len(item.inline)} bytes")
    return start, stop, expected


class RoundValues:
    """One session's values as the wire carries them (see the module docstring)."""

    def __init__(
        self,
        run_id: str,
        group: Group,
        me: bytes,
        layout: Layout,
        local: np.ndarray,
        sign: Callable[[bytes], bytes] | None,
    ) -> None:
        self.run_id = run_id
        self.group = group
        self.me = me
        self.layout = layout
        self.local = local  # what we encode our slices from (their decoding is machine.local)
        self.sign = sign
        self.parts: list[tuple[bytes, int, int]] = []  # the machine's, once it exists
        self.encoded: dict[int, tuple[np.ndarray, bytes]] = {}  # by id() of the held array
        # A gathering layout's slice payloads, (part, sender) -> bytes, ours included: a part we
        # reduce travels as its contributors' slices (``Layout.gathers``).
        self.slices: dict[tuple[int, bytes], bytes] = {}
        # An audited round's evidence, (part, sender) -> the slice's signature and SHA-256: made
        # for our slices as we send them, checked for the others' as they arrive.
        self.proofs: dict[tuple[int, bytes], bytes] = {}
        self.digests: dict[tuple[int, bytes], bytes] = {}
        # Our slices' payloads are all in ``slices`` (``keep_own_payloads``): ``local`` may hold
        # the round's result.
        self._own_kept = False
        # Where a part we reduce goes once decoded (``place(part)``: its place in the round's
        # result, so it is not assembled from a copy), or None for an array of its own.
        self.place: Callable[[int], np.ndarray | None] | None = None

    def wire_values(
        self, peers: tuple[bytes, ...], bandwidths: list[int], chunks: int
    ) -> np.ndarray:
        """Our whole vector as peers will decode it: every slice we send goes through the
        codec. A full copy: a round makes it only when its caller asks for it (error feedback:
        ``AveragingResult.sent``); the reducer of a part takes its own slice's values from
        ``own_values``, one part at a time."""
        if self.layout.lossless():
            return self.local
        out = np.empty_like(self.local)
        if self._own_kept:  # ``local`` may hold the result now: from the kept payloads
            for part, (_, start, stop) in enumerate(self.parts):
                out[start:stop] = self.own_values(part)
            return out
        # The machine's parts (aligned in a committed round), as ``partition`` cut them.
        for _, start, stop in self.parts or partition(len(self.local), peers, bandwidths, chunks):
            out[start:stop] = self.layout.round_trip(self.local[start:stop], start)
        return out

    def keeps_own_payloads(self) -> bool:
        """Whether our slices' wire bytes cost at most half of their float32 values: then a
        round may keep them (``keep_own_payloads``) and let the mean land in ``local``."""
        numel = len(self.local)
        return (
            not self.layout.gathers
            and self.sign is None
            and 2 * self.layout.wire_bytes(0, numel) <= 4 * numel
        )

    def keep_own_payloads(self) -> None:
        """Encode our slice of every part now and keep the bytes: from here on nothing of ours
        is read from ``local`` (a forward of our slice, our values in a part we reduce, the
        round trip ``wire_values``), so the round may write its result there. Call once the
        machine's ``parts`` are set, before anything lands in ``local``."""
        for part, (_, start, stop) in enumerate(self.parts):
            self.slices[(part, self.me)] = bytes(self.layout.encode(self.local[start:stop], start))
        self._own_kept = True

    def own_values(self, part: int) -> np.ndarray:
        """Our slice of ``part`` as every peer decodes it: the machine's ``own``, made when this
        peer reduces the part (a part's worth of memory for a moment, not a vector's)."""
        _, start, stop = self.parts[part]
        if self._own_kept:
            return self.layout.decode(self.slices[(part, self.me)], start, stop)
        return self.layout.round_trip(self.local[start:stop], start)

    def finalizer(
        self, tamper: Callable[[int, np.ndarray], np.ndarray] | None
    ) -> Callable[[int, np.ndarray], np.ndarray] | None:
        """The machine's ``finalize``: a lossy codec's round trip, after ``tamper`` (the
        aggregation audit's tests: ``AveragingFaults``) when given; its values go where
        ``place`` says."""
        if self.layout.gathers:
            # Receivers recompute the mean from the slices: nothing to finalize, and a tampered
            # part could not travel as slices.
            if tamper is not None:
                raise ValueError("a reduced part that travels as its slices cannot be tampered")
            return None
        if tamper is not None:
            if self.layout.lossless():
                return tamper
            return lambda p, x: self._finalize(p, tamper(p, x))
        return None if self.layout.lossless() else self._finalize

    def _finalize(self, part_index: int, reduced: np.ndarray) -> np.ndarray:
        start = self.parts[part_index][1]
        data = self.layout.encode(reduced, start)
        values = self.layout.decode(data, start, start + len(reduced))
        target = None if self.place is None else self.place(part_index)
        if target is not None:
            target[:] = values
            values = target
        self.encoded[id(values)] = (values, data)
        return values

    def remember(self, values: np.ndarray, data: bytes) -> None:
        """A reduced part received as ``data`` that a lossy codec decoded to ``values``."""
        if not self.layout.lossless():
            self.encoded[id(values)] = (values, data)

    def remember_slice(self, part: int, sender: bytes, data: bytes) -> None:
        """A slice payload received, kept for the reduced part it goes into (gathering)."""
        self.slices[(part, sender)] = data

    def payload(self, order: SendPart | SendReduced) -> bytes | memoryview:
        if isinstance(order, SendPart):
            return self._slice(order.part_index)
        cached = self.encoded.get(id(order.data))
        if cached is not None and cached[0] is order.data:
            return cached[1]
        if self.layout.gathers:
            data = b"".join(self._slice(order.part_index, p) for p, _ in order.contributors)
            self.encoded[id(order.data)] = (order.data, data)
            return data
        return self.layout.encode(order.data, self.parts[order.part_index][1])

    def _slice(self, part: int, sender: bytes | None = None) -> bytes | memoryview:
        """The payload of ``sender``'s slice of ``part``: ours is encoded (kept when gathering;
        else a raw float32 slice is a view of ``local``, not a copy)."""
        sender = self.me if sender is None else sender
        data = self.slices.get((part, sender))
        if data is None:
            assert sender == self.me  # the machine reduces only over slices it received
            _, start, stop = self.parts[part]
            encoded = self.layout.encode(self.local[start:stop], start)
            if not self.layout.gathers:
                return encoded
            data = self.slices[(part, sender)] = bytes(encoded)
        return data

    async def own_proof(self, part: int, values: np.ndarray, weight: float) -> bytes:
        """Our signature over our slice ``values`` of ``part`` (as the wire carries it), made
        once."""
        proof = self.proofs.get((part, self.me))
        if proof is None:
            digest = self.digests[(part, self.me)] = await _hash(values)
            assert self.sign is not None
            proof = self.proofs[(part, self.me)] = self.sign(self._message(part, weight, digest))
        return proof

    async def check_proof(self, peer: bytes, item: Item, values: np.ndarray) -> None:
        """Refuse a slice its sender did not sign as it is: its reducer could not prove it."""
        if len(item.proof) > MAX_PROOF_BYTES:
            raise RemoteProtocolError("slice proof over its size limit")
        digest = await _hash(values)
        message = self._message(item.part_index, item.weight, digest)
        if not verify_peer_signature(peer, message, item.proof):
            raise RemoteProtocolError(f"slice of part {item.part_index}: its proof does not verify")
        self.proofs[(item.part_index, peer)] = item.proof
        self.digests[(item.part_index, peer)] = digest

    def _message(self, part: int, weight: float, digest: bytes) -> bytes:
        group = self.group
        return proof_message(self.run_id, group.round, group.group_id, part, weight, digest)


async def _hash(values: np.ndarray) -> bytes:
    if len(values) >= THREAD_MIN_NUMEL:
        return await trio.to_thread.run_sync(slice_hash, values)
    return slice_hash(values)
