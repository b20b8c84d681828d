"""The simulated DHT: one key-value store of signed-record dictionaries, with read and write
latency and byte counts.

What it keeps of the real one (``p2p.dht``): a key holds one record per owner (a peer's own
subkey); a read with ``latest=True`` asks all ``replicas`` holders, so it moves ``replicas``
copies of the whole record set; a key holds at most ``MAX_SUBKEYS`` records and
``MAX_RECORD_SET_BYTES``, and when a write would pass that the records of the owners first seen
most recently go first (``p2p.dht.store``). A record's size is its declaration's encoded bytes
plus the signed record's fixed fields, measured on a real ``RecordSigner`` record.

What it leaves out: replicas are always consistent (a write reaches every holder at once), and
holders never leave. An operation takes ``hops`` round trips between the peer and a typical DHT
node (the lookup, then the request itself): a write is visible, and a read takes its snapshot,
one leg before the operation returns; a read then also takes its bytes' time on the reader's
downlink.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import msgpack

from p2p import DhtConfig, RecordSigner, encode
from swarm.averaging.matchmaking import Declaration
from swarm.sim.clock import Clock
from swarm.sim.network import Network

# p2p.dht.records' limits of one key (a unit test checks these equal them).
MAX_SUBKEYS = 1024
MAX_RECORD_SET_BYTES = 512 * 1024
_SET_FRAMING_BYTES = 64


@functools.cache
def _record_overhead(key_bytes: int) -> int:
    """Bytes a signed record adds to its value, for a key of this length (measured once)."""
    signer = RecordSigner(bytes(32))
    value = b"v" * 80
    record = signer.sign(b"k" * key_bytes, value, 1.8e9)
    return len(msgpack.packb(record.to_wire(), use_bin_type=True)) - len(value)


def record_bytes(key: bytes, declaration: Declaration) -> int:
    """The wire size of ``declaration`` stored as a signed record under ``key``."""
    return len(encode(declaration)) + _record_overhead(len(key))


@dataclass(frozen=True)
class DhtModel:
    """How long operations take: ``hops`` round trips of ``2 (our leg + peer_leg_s)``."""

    hops: int = 2
    peer_leg_s: float = 0.04
    replicas: int = DhtConfig().replicas
    request_timeout_s: float = DhtConfig().request_timeout_s

    def __post_init__(self) -> None:
        if self.hops < 1 or self.replicas < 1:
            raise ValueError("dht.hops and dht.replicas must be >= 1")
        if not self.peer_leg_s >= 0 or not self.request_timeout_s > 0:
            raise ValueError("dht.peer_leg_s must be >= 0 and dht.request_timeout_s > 0")


class SimDht:
    """Round keys and their declarations; ``bytes_read[(peer, key)]`` counts what each peer
    read of each key (a round's key names its round)."""

    def __init__(self, clock: Clock, network: Network, model: DhtModel) -> None:
        self.clock = clock
        self.network = network
        self.model = model
        self.keys: dict[bytes, dict[bytes, Declaration]] = {}
        self.sizes: dict[bytes, int] = {}  # encoded bytes of each key's record set
        self.first_seen: dict[bytes, float] = {}
        self.evicted = 0
        self.bytes_read: dict[tuple[bytes, bytes], int] = {}

    def _legs(self, peer: bytes) -> tuple[float, float]:
        """(one leg, the whole operation) for ``peer``."""
        leg = self.network.links[peer].leg_s + self.model.peer_leg_s
        return leg, 2 * leg * self.model.hops

    def write(
        self, peer: bytes, key: bytes, declaration: Declaration, done: Callable[[], None]
    ) -> None:
        """Store ``declaration`` as ``peer``'s record under ``key``; ``done()`` when it returns."""
        leg, total = self._legs(peer)
        self.first_seen.setdefault(peer, self.clock.now)
        self.clock.after(total - leg, self._store, key, declaration)
        self.clock.after(total, done)

    def read(
        self,
        peer: bytes,
        key: bytes,
        done: Callable[[tuple[Declaration, ...]], None],
        *,
        latest: bool = True,
    ) -> None:
        """Read ``key`` from every replica (``latest=False``: from one, as ``Dht.get_records``
        does); ``done(declarations)`` when the bytes are in."""
        leg, total = self._legs(peer)
        replicas = self.model.replicas if latest else 1
        self.clock.after(total - leg, self._snapshot, peer, key, leg, replicas, done)

    def _snapshot(
        self,
        peer: bytes,
        key: bytes,
        leg: float,
        replicas: int,
        done: Callable[[tuple[Declaration, ...]], None],
    ) -> None:
        found = tuple(self.keys.get(key, {}).values())
        size = replicas * self.sizes.get(key, _SET_FRAMING_BYTES)
        self.count_read(peer, key, size)
        transfer = 8.0 * size / self.network.links[peer].down_bps
        self.clock.after(leg + transfer, done, found)

    def count_read(self, peer: bytes, key: bytes, size: int) -> None:
        self.bytes_read[(peer, key)] = self.bytes_read.get((peer, key), 0) + size

    def _store(self, key: bytes, declaration: Declaration) -> None:
        records = self.keys.setdefault(key, {})
        owner = declaration.peer_id
        known = records.get(owner)
        if known is not None and known._rank() >= declaration._rank():
            return
        size = self.sizes.get(key, _SET_FRAMING_BYTES) + record_bytes(key, declaration)
        if known is not None:
            size -= record_bytes(key, known)
        records[owner] = declaration
        if len(records) > MAX_SUBKEYS or size > MAX_RECORD_SET_BYTES:
            size = self._fit(key, records)
        self.sizes[key] = size

    def _fit(self, key: bytes, records: dict[bytes, Declaration]) -> int:
        """Keep the owners seen first that fit (``p2p.dht.store``'s rule); the new size."""
        size = _SET_FRAMING_BYTES
        kept: dict[bytes, Declaration] = {}
        for owner in sorted(records, key=lambda o: (self.first_seen[o], o)):
            entry = record_bytes(key, records[owner])
            if len(kept) < MAX_SUBKEYS and size + entry <= MAX_RECORD_SET_BYTES:
                kept[owner] = records[owner]
                size += entry
        self.evicted += len(records) - len(kept)
        records.clear()
        records.update(kept)
        return size
