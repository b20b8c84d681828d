"""The DHT a node runs: libp2p 0.8.1 Kademlia as the server, our own fast client on top.

What 0.8.1 gives and where this layer departs from it (read ``libp2p/kad_dht/kad_dht.py``):

* **Server side is libp2p's.** ``KadDHT.handle_stream`` serves FIND_NODE / GET_VALUE / PUT_VALUE
  on ``/ipfs/kad/1.0.0``. A PUT is checked by the ``NamespacedValidator`` (we register namespace
  ``swarmtrain`` with strict validation, so keys outside a registered namespace are refused), then
  ``validator.select([held, incoming])`` decides: index 0 rejects and resets the stream, 1 calls
  ``value_store.put_record``, which in 0.8.1 *replaces* the held value. Our
  ``MergingValueStore`` (``p2p.dht.store``) merges instead, so a key keeps every owner's
  subkey; our ``select`` accepts any incoming value that contributes at least one freshest
  entry.
* **Client side is ours.** ``KadDHT.get_value`` first runs a full iterative FIND_NODE lookup, then
  queries candidates ALPHA at a time over a fresh stream each (a multistream-select negotiation,
  ~7 ms here, per request), keeps querying until candidates run out, then pushes "entry
  corrections" to every peer that lacked the value -- a get costs several round trips plus
  stores, 118 ms median across 12 hosts. Here a get asks only the ``replicas`` closest peers it
  knows, all at once, over pooled streams that stay open (the Kad handler loops over messages on
  one stream), and walks closer peers named in the answers only when they beat what it asked.
* **Joining.** The DHT does not add connected peers to its routing table by itself. ``bootstrap``
  connects, asks the bootstrap peers for our own id (FIND_NODE), then asks every peer returned;
  each peer we ask adds us (its handler does), and we add each one that answers. Peers joining
  in one instant miss each other in the bootstrap peer's table (measured: one of 4 knew only the
  relay, and its first round split), so ``refresh`` repeats that self-lookup: ``open_node`` once
  after the reachability check, ``run`` 1, 3, 7, ... s after the start, then every
  ``refresh_interval_s``.
* **Limits.** 0.8.1 caps concurrent inbound Kad streams at 12 and resets the rest; pooled streams
  each hold one slot while idle, so the cap is raised to ``DhtConfig.max_inbound_streams``.

Every network wait is bounded by ``DhtConfig.request_timeout_s`` per peer; a peer a caller names
with ``suspect`` (the averager names those its round lost) is skipped for ``suspect_s`` while other
peers can answer, so a frozen process does not cost every later lookup a timeout.

Measured (``python -m bench.dht --peers 8 --keys 300``, loaded 2-core box): get p50 5.5 ms and p99
10.4 ms for keys the reader does not hold, a peer joins a formed swarm in 0.51 s (host start
included); ``latest=True`` gets 19 ms p50; stores 42/s sequential (a lookup round, then the puts).

What a server holds (the validator, the merging store and its quotas) is ``p2p.dht.store``.
The answer filter (``p2p.dht.answers``) and the removal of departed peers (``p2p.dht.upkeep``)
live apart. This module is over 600 lines on purpose: the admission of Kad servers, the routing
table's refresh and the client's lookups all work on one routing table and one pool of streams;
apart they would hand that state back and forth.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgpack
import trio
import varint
from libp2p.identity.identify_push.identify_push import push_identify_to_peers
from libp2p.kad_dht.common import (
    BUCKET_SIZE,
    MAX_DHT_MESSAGE_SIZE,
    PROTOCOL_ID,
)
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.kad_dht.pb.kademlia_pb2 import Message
from libp2p.kad_dht.utils import maybe_consume_signed_record, sort_peer_ids_by_distance
from libp2p.network.stream.net_stream import INetStream
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.peer.peerstore import env_to_send_in_RPC
from libp2p.utils.varint import read_varint_prefixed_bytes_limited
from multiaddr import Multiaddr

from p2p.dht.answers import AnswerFilter
from p2p.dht.records import (
    MAX_RECORD_SET_BYTES,
    RecordSigner,
    SignedRecord,
    encode_record_set,
    merge_records,
    subkey_values,
    valid_records,
)
from p2p.dht.store import (
    NAMESPACE,
    MergingValueStore,
    StorageLimits,
    SubkeyDictValidator,
)
from p2p.dht.upkeep import TableUpkeep
from p2p.errors import P2PError, RemoteProtocolError
from p2p.host import reset_quietly

if TYPE_CHECKING:
    from p2p.host import Host

log = logging.getLogger(__name__)

ADDRSKEY_PREFIX = "addrs/"
_MAX_ADDRS = 32
_MAX_KAD_KEY_BYTES = 128
FIRST_REFRESH_S = 1.0  # then doubling up to DhtConfig.refresh_interval_s
# A pooled stream idle longer is not reused: the serving peer closes Kad streams idle for its
# read deadline (``HostConfig.control_read_timeout_s``, 10 s by default).
POOLED_IDLE_S = 5.0
ADMIT_WAIT_S = 3.0  # how long a peer that opened a Kad stream may take to prove it is a server
MAX_ADMITTING = 256  # peers being looked at again at once


@dataclass(frozen=True)
class DhtConfig:
    replicas: int = 3  # peers that hold each key (hivemind's num_replicas is 5; 3 suffices here)
    request_timeout_s: float = 3.0
    lookup_rounds: int = 3
    # Requests in flight to one peer; each holds one stream, kept open afterwards for reuse.
    streams_per_peer: int = 8
    max_inbound_streams: int = 512
    refresh_interval_s: float = 60.0
    # A peer named by ``suspect`` is skipped this long while others can answer: a frozen process
    # otherwise costs every later lookup a whole request timeout.
    suspect_s: float = 30.0
    storage: StorageLimits = field(default_factory=StorageLimits)


@dataclass(frozen=True)
class DhtStatistics:
    routing_table_size: int
    keys_held: int
    requests_failed: int
    bytes_held: int = 0
    refused_over_quota: int = 0
    peers_forgotten: int = 0  # departed peers removed from the routing table
    # Entries left out because their owner already had its cap of that key (``StorageLimits``),
    # in PUTs we served and in the answers we read.
    over_key_cap: int = 0


def dht_key(key: str) -> bytes:
    """The Kademlia key (and record key) for an application key; ValueError if too long."""
    kbytes = f"/{NAMESPACE}/{key}".encode()
    # 0.8.1's Kad handler resets GET_VALUE streams for keys over 128 bytes.
    if len(kbytes) > _MAX_KAD_KEY_BYTES:
        raise ValueError(f"DHT key over {_MAX_KAD_KEY_BYTES} bytes: {key!r}")
    return kbytes


class Dht:
    """Signed, subkey-dictionary DHT on a running ``p2p.host.Host``.

    Start with ``await nursery.start(dht.run)``; stop by cancelling that nursery.
    """

    def __init__(self, host: Host, config: DhtConfig | None = None, *, server: bool = True) -> None:
        self.config = config or DhtConfig()
        self._host = host
        self._libp2p = host.libp2p
        self.peer_id: ID = host.peer_id
        self.signer = RecordSigner(self._libp2p.get_private_key().to_bytes())
        self._kad = KadDHT(
            self._libp2p, DHTMode.SERVER if server else DHTMode.CLIENT, strict_validation=True
        )
        self._kad.register_validator(NAMESPACE, SubkeyDictValidator())
        self.store_local = MergingValueStore(self._libp2p, self.peer_id, self.config.storage)
        self._kad.value_store = self.store_local
        self._kad._inbound_limiter = trio.CapacityLimiter(self.config.max_inbound_streams)
        # Replace KadDHT's raw registration with the host's guarded one: an exception escaping a
        # handler kills a 0.8.1 host. A client serves nothing (its identify lists no Kad).
        if server:
            host.set_handler(str(PROTOCOL_ID), self._serve_kad)
        else:
            self._libp2p.remove_stream_handler(PROTOCOL_ID)
        # 0.8.1 adds every peer that opens a Kad stream to us; we admit only Kad servers.
        self._add_server = self._kad.add_peer
        self._kad.add_peer = self._admit  # type: ignore[method-assign]
        self._admitting: set[ID] = set()
        self._nursery: trio.Nursery | None = None
        # Pooled streams and when each went idle (the peer resets one idle past its read deadline).
        self._idle: dict[ID, list[tuple[INetStream, float]]] = {}
        self._slots: dict[ID, trio.Semaphore] = {}
        self._requests_failed = 0
        # Called with (seconds, ok) after each request to a peer (a caller's metrics); None: off.
        self.on_request: Callable[[float, bool], None] | None = None
        self._suspect_until: dict[ID, float] = {}
        self.upkeep = TableUpkeep(
            host,
            self._kad.routing_table,
            timeout_s=self.config.request_timeout_s,
            on_forget=self._drop_pool,
        )

    # ------------------------------------------------------------------ lifecycle

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve and keep the routing table fresh until cancelled.

        The first refreshes come soon (1, 2, 4, ... s apart, then every ``refresh_interval_s``):
        peers that joined together, and islands that merge later, learn each other only through
        a refresh.
        """
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self.upkeep.start(nursery)
                task_status.started()
                delay = min(FIRST_REFRESH_S, self.config.refresh_interval_s)
                while True:
                    await trio.sleep(delay)
                    delay = min(2 * delay, self.config.refresh_interval_s)
                    self.store_local.prune(time.time())
                    await self.refresh()
                    await self.upkeep.sweep()
        finally:
            self._nursery = None
            self.upkeep.stop()
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                for streams in self._idle.values():
                    for stream, _ in streams:
                        await reset_quietly(stream)
            self._idle.clear()

    @property
    def is_server(self) -> bool:
        return self._kad.mode is DHTMode.SERVER

    async def serve(self) -> None:
        """Become a Kad server (a peer found publicly reachable): serve ``/ipfs/kad/1.0.0`` and
        tell connected peers (identify push), so that they admit us to their tables.

        The push runs in the background, bounded by ``request_timeout_s``: it waits on every
        connected peer, and one that never answers (a frozen process, a connection whose host
        is gone: the dial-back probe's, before it closed its connection) held the node's start
        for that whole timeout. A peer that gets our Kad stream before the push looks again
        for ``ADMIT_WAIT_S`` (``_admit``)."""
        if self.is_server:
            return
        self._kad.mode = DHTMode.SERVER
        self._host.set_handler(str(PROTOCOL_ID), self._serve_kad)
        if self._nursery is not None:
            self._nursery.start_soon(self._push_identify)
        else:
            await self._push_identify()

    async def _push_identify(self) -> None:
        with trio.move_on_after(self.config.request_timeout_s):
            await push_identify_to_peers(self._libp2p)

    # ------------------------------------------------------------------ routing table

    def _drop_pool(self, peer: ID) -> None:
        """Forget what we keep for a departed peer (its idle streams, its request slots)."""
        streams = self._idle.pop(peer, [])
        slots = self._slots.get(peer)
        if slots is not None and slots.value == self.config.streams_per_peer:
            del self._slots[peer]
        if streams and self._nursery is not None:
            for stream, _ in streams:
                self._nursery.start_soon(reset_quietly, stream)

    async def _serve_kad(self, stream: INetStream) -> None:
        await self._kad.handle_stream(AnswerFilter(stream, self._may_hand_out))  # type: ignore[arg-type]

    def _may_hand_out(self, peer: bytes) -> bool:
        """Only peers in our routing table (admitted servers) and we ourselves are named."""
        if peer == self.peer_id.to_bytes():
            return True
        try:
            return self._kad.routing_table.peer_in_table(ID(peer))
        except Exception:
            return False

    async def _admit(self, peer: ID, *, skip_server_mode_check: bool = False) -> bool:
        """0.8.1's Kad handler calls this for every peer that opens a stream to us. Admit the
        peer only if it is a server: identify lists Kad among its protocols, and it has an
        address that is not a relay circuit. Identify may still be running (or a push
        on its way) when its first stream arrives, so an unproven peer is looked at again
        for ``ADMIT_WAIT_S`` in the background; the stream is served meanwhile."""
        if self._serves_kad(peer):
            return await self._add_server(peer, skip_server_mode_check=True)
        nursery = self._nursery
        pending = self._admitting
        if nursery is not None and peer not in pending and len(pending) < MAX_ADMITTING:
            pending.add(peer)
            nursery.start_soon(self._admit_later, peer)
        return False

    async def _admit_later(self, peer: ID) -> None:
        try:
            with trio.move_on_after(ADMIT_WAIT_S):
                while not self._serves_kad(peer):
                    await trio.sleep(0.1)
                await self._add_server(peer, skip_server_mode_check=True)
        finally:
            self._admitting.discard(peer)

    def _serves_kad(self, peer: ID) -> bool:
        peerstore = self._libp2p.get_peerstore()
        try:
            protocols = peerstore.get_protocols(peer) or []
            addrs = peerstore.addrs(peer)
        except Exception:
            return False
        return str(PROTOCOL_ID) in protocols and any("/p2p-circuit" not in str(a) for a in addrs)

    async def bootstrap(self, peers: Sequence[PeerInfo]) -> int:
        """Join through ``peers``; returns the routing table size.

        Raises ``P2PError`` if no bootstrap peer can be reached.
        """
        connected = []
        async with trio.open_nursery() as nursery:
            for info in peers:
                nursery.start_soon(self._connect_one, info, connected)
        if not connected:
            raise P2PError("no bootstrap peer could be reached")
        await self._self_lookup(connected)
        return self._kad.routing_table.size()

    async def refresh(self) -> int:
        """Look ourselves up again at the peers we know: every peer asked learns us, and we learn
        whom they know. Returns the routing table size."""
        if self._kad.routing_table.size():
            await self._self_lookup(
                self._kad.routing_table.find_local_closest_peers(
                    self.peer_id.to_bytes(), BUCKET_SIZE
                )
            )
        return self._kad.routing_table.size()

    def statistics(self) -> DhtStatistics:
        return DhtStatistics(
            routing_table_size=self._kad.routing_table.size(),
            keys_held=len(self.store_local.store),
            requests_failed=self._requests_failed,
            bytes_held=self.store_local.bytes_held,
            refused_over_quota=self.store_local.refused_over_quota,
            peers_forgotten=self.upkeep.forgotten,
            over_key_cap=self.store_local.over_key_cap,
        )

    def suspect(self, peer_id: ID, seconds: float | None = None) -> None:
        """Skip ``peer_id`` in lookups and stores for ``seconds`` (default ``suspect_s``) while
        other peers can answer: the caller saw it freeze or leave. Not done on a mere timeout: a
        loaded but healthy peer skipped for a while gives peers different views of a key."""
        span = self.config.suspect_s if seconds is None else seconds
        self._suspect_until[peer_id] = time.monotonic() + span

    def is_suspect(self, peer_id: ID) -> bool:
        until = self._suspect_until.get(peer_id)
        if until is None:
            return False
        if until <= time.monotonic():
            del self._suspect_until[peer_id]
            return False
        return True

    def routing_table_peers(self) -> list[ID]:
        return self._kad.routing_table.find_local_closest_peers(self.peer_id.to_bytes(), 10**6)

    # ------------------------------------------------------------------ values

    async def store(
        self, key: str, value: bytes, expiration_time: float, *, tag: bytes = b"", version: int = 0
    ) -> int:
        """Sign ``value`` under our own subkey of ``key`` and store it at the closest peers.

        We keep it too, closest or not, so ``get_records_from(us)`` finds it whatever the
        replicas lost. Returns how many of the closest peers (ourselves included if we are one)
        hold it now; 0 means no replica took it.
        """
        record = self.signer.sign(dht_key(key), value, expiration_time, tag=tag, version=version)
        self.store_local.merge(dht_key(key), [record])
        return await self.store_records(key, [record])

    async def store_records(self, key: str, records: Iterable[SignedRecord]) -> int:
        """Store already-signed records (ours or relayed from their owners) under ``key``.

        Returns how many peers (ourselves included) accepted them. Raises ``RecordRejected``
        if a record is invalid (peers would refuse it, so that is a local bug).
        """
        kbytes = dht_key(key)
        data = encode_record_set(records)
        incoming = valid_records(data, key=kbytes, now=time.time(), strict=True)
        targets, _ = await self._lookup(kbytes)
        stored = [0]
        if self.peer_id in targets:
            self.store_local.merge(kbytes, incoming.values())
            stored[0] += 1

        async def one(peer: ID) -> None:
            if await self.put_raw(peer, kbytes, data):
                stored[0] += 1

        async with trio.open_nursery() as nursery:
            for peer in targets:
                if peer != self.peer_id:
                    nursery.start_soon(one, peer)
        return stored[0]

    async def get(self, key: str, *, latest: bool = False) -> dict[bytes, bytes]:
        """``{subkey: value}`` of the freshest unexpired entries (empty if none was found).

        See ``get_records`` for ``latest``.
        """
        return subkey_values(await self.get_records(key, latest=latest), now=time.time())

    async def get_records(self, key: str, *, latest: bool = False) -> dict[bytes, SignedRecord]:
        """Valid unexpired entries of ``key``, merged per subkey.

        ``latest=False`` (hivemind's default too): what we hold, else what the single closest
        peer holding the key has; every store reaches that peer, so it lacks an entry only if
        that store failed there. ``latest=True`` asks all ``replicas`` closest peers and merges.
        """
        kbytes = dht_key(key)
        if not latest:
            _, merged = await self._lookup(kbytes, width=1)
            if merged:
                return merged
        _, merged = await self._lookup(kbytes, width=self.config.replicas)
        return merged

    async def get_records_from(self, peer: ID, key: str) -> dict[bytes, SignedRecord] | None:
        """The valid entries ``peer`` itself holds under ``key``, or None if it did not answer.

        Every peer keeps what it stored (``store``), so asking the owner finds its own entry
        when the replicas missed it.
        """
        kbytes = dht_key(key)
        if peer == self.peer_id:
            return self.store_local.records(kbytes, time.time())
        answers: list[tuple[ID, dict[bytes, SignedRecord], list[ID]]] = []
        await self._get_one(peer, kbytes, answers)
        return answers[0][1] if answers else None

    async def _lookup(
        self, kbytes: bytes, *, width: int | None = None
    ) -> tuple[list[ID], dict[bytes, SignedRecord]]:
        """Iterative GET_VALUE: the ``width`` closest live peers (maybe us) and their entries.

        Each round asks, all at once, those of the ``width`` (default ``replicas``) closest known
        peers not yet asked; answers name closer peers, which join the candidates. In a swarm
        whose routing tables are complete this is one round.
        """
        width = width or self.config.replicas
        now = time.time()
        local = merged = self.store_local.records(kbytes, now)
        asked: set[ID] = {self.peer_id}
        answered: list[ID] = [self.peer_id]
        named: list[ID] = []
        # A round in which nobody answered (departed peers another peer named) does not count
        # towards ``lookup_rounds``, else a few dead peers closer to the key than the live ones
        # end the lookup before it reaches them; such rounds are bounded on their own.
        rounds = silent = 0
        while rounds < self.config.lookup_rounds and silent < self.config.lookup_rounds:
            # Wider than ``width`` by the suspects, which are skipped below while others answer.
            known = self._kad.routing_table.find_local_closest_peers(
                kbytes, width + len(self._suspect_until)
            )
            # Candidates: peers not asked yet, and those that answered (a silent one is skipped).
            pool = [p for p in dict.fromkeys([*known, *named]) if p not in asked] + answered
            fresh = [p for p in pool if p not in asked and not self.is_suspect(p)]
            if not fresh and len(answered) == 1:  # only suspects left and nobody answered yet
                fresh = [p for p in pool if p not in asked]
            wanted = sort_peer_ids_by_distance(kbytes, fresh + answered)[:width]
            batch = [p for p in wanted if p not in asked]
            if not batch:
                break
            asked.update(batch)
            answers: list[tuple[ID, dict[bytes, SignedRecord], list[ID]]] = []
            async with trio.open_nursery() as nursery:
                for peer in batch:
                    nursery.start_soon(self._get_one, peer, kbytes, answers)
            if answers:
                rounds += 1
            else:
                silent += 1
            for peer, held, closer in answers:
                answered.append(peer)
                named.extend(p for p in closer if p not in named)
                if held:
                    merged = merge_records(merged, held.values(), now=now)
        closest = sort_peer_ids_by_distance(kbytes, answered)[:width]
        # Each answer was capped per owner, but two replicas may keep different entries of one.
        return closest, self.store_local.cap_owners(kbytes, merged, held=local)

    # ------------------------------------------------------------------ addresses

    async def publish_addrs(self, addrs: Sequence[Multiaddr], expiration_time: float) -> int:
        """Publish where we can be reached (``/p2p-circuit`` relay addresses included)."""
        packed = msgpack.packb([a.to_bytes() for a in addrs[:_MAX_ADDRS]], use_bin_type=True)
        return await self.store(ADDRSKEY_PREFIX + self.peer_id.to_base58(), packed, expiration_time)

    async def find_addrs(self, peer_id: ID) -> list[Multiaddr]:
        """The addresses ``peer_id`` published about itself (only its own signed entry counts)."""
        records = await self.get_records(ADDRSKEY_PREFIX + peer_id.to_base58())
        record = records.get(peer_id.to_bytes())
        if record is None:
            return []
        try:
            raw = msgpack.unpackb(record.value, raw=False, max_array_len=_MAX_ADDRS)
            return [Multiaddr(a) for a in raw if isinstance(a, bytes)]
        except Exception as exc:
            log.info("peer %s published unreadable addresses: %r", peer_id, exc)
            return []

    # ------------------------------------------------------------------ wire

    async def put_raw(self, peer: ID, kbytes: bytes, data: bytes) -> bool:
        """Send one PUT_VALUE with ``data`` as-is to ``peer``; True if it accepted.

        No local validation: tools and tests use it to see what peers refuse.
        """
        request = Message(type=Message.MessageType.PUT_VALUE, key=kbytes)
        request.record.key = kbytes
        request.record.value = data
        response = await self._request(peer, request)
        return response is not None and response.key == kbytes

    async def _get_one(
        self,
        peer: ID,
        kbytes: bytes,
        answers: list[tuple[ID, dict[bytes, SignedRecord], list[ID]]],
    ) -> None:
        """Ask ``peer`` for ``kbytes``; if it answers, append (peer, its valid unexpired entries
        (none if it holds none, or sent an oversized or malformed value), the closer peers it
        named)."""
        request = Message(type=Message.MessageType.GET_VALUE, key=kbytes)
        response = await self._request(peer, request)
        if response is None:
            return
        closer = self._learn_peers(response)
        data = response.record.value if response.HasField("record") else None
        held: dict[bytes, SignedRecord] = {}
        if data is not None and len(data) <= MAX_RECORD_SET_BYTES:
            try:
                held = valid_records(data, key=kbytes, now=time.time(), strict=False)
                # A replica that does not cap (an older or a hostile one) is capped here.
                held = self.store_local.cap_owners(kbytes, held)
            except RemoteProtocolError as exc:
                log.info("peer %s sent a malformed value: %s", peer, exc)
        answers.append((peer, held, closer))

    async def _request(self, peer: ID, request: Message, *, fresh: bool = False) -> Message | None:
        """One request/response on a pooled (or, if ``fresh``, a new) stream.

        Returns None (logged, counted) on any failure or timeout.
        """
        payload = varint.encode(request.ByteSize()) + request.SerializeToString()
        slots = self._slots.setdefault(peer, trio.Semaphore(self.config.streams_per_peer))
        started = time.monotonic()
        response = None
        with trio.move_on_after(self.config.request_timeout_s) as scope:
            async with slots:
                response = await self._request_in_slot(peer, request.type, payload, fresh)
        if scope.cancelled_caught:
            self._requests_failed += 1
            log.debug("kad request %s to %s timed out", request.type, peer)
        if self.on_request is not None:
            self.on_request(time.monotonic() - started, response is not None)
        return response

    async def _request_in_slot(
        self, peer: ID, kind: int, payload: bytes, fresh: bool
    ) -> Message | None:
        """The request itself, holding one of the peer's stream slots."""
        idle = [] if fresh else self._idle.get(peer)
        while idle:
            stream, since = idle.pop()
            if stream.is_closed:
                continue
            if trio.current_time() - since > POOLED_IDLE_S:
                await reset_quietly(stream)
                continue
            # A pooled stream may have died while idle (peer restarted, reset): retry fresh.
            response = await self._exchange(peer, stream, payload, kind)
            if response is not None:
                return response
        try:
            stream = await self._host.open_stream(peer, str(PROTOCOL_ID))
        except P2PError as exc:
            self._requests_failed += 1
            log.debug("cannot open kad stream to %s: %s", peer, exc)
            # Gone, or no Kad server: out of the table, and skipped by lookups for a while.
            self.upkeep.forget(peer, str(exc))
            self.suspect(peer)
            return None
        response = await self._exchange(peer, stream, payload, kind)
        if response is None:
            self._requests_failed += 1
        return response

    async def _exchange(
        self, peer: ID, stream: INetStream, payload: bytes, kind: int
    ) -> Message | None:
        """Write one framed request, read one framed answer; pool the stream if all went well."""
        ok = False
        try:
            await stream.write(payload)
            raw = await read_varint_prefixed_bytes_limited(stream, MAX_DHT_MESSAGE_SIZE)
            response = Message()
            response.ParseFromString(raw)
            if response.type != kind:
                raise RemoteProtocolError(f"answer of type {response.type} to {kind}")
            ok = True
            return response
        except Exception as exc:
            log.debug("kad exchange with %s failed: %r", peer, exc)
            return None
        finally:
            pool = self._idle.setdefault(peer, [])
            if ok and len(pool) < self.config.streams_per_peer:
                pool.append((stream, trio.current_time()))
            else:
                with trio.CancelScope(shield=True):
                    await reset_quietly(stream)

    def _learn_peers(self, response: Message) -> list[ID]:
        """Record the addresses of peers named in an answer; return their ids."""
        found = []
        table = self._kad.routing_table
        for proto in response.closerPeers:
            try:
                pid = ID(proto.id)
                if pid == self.peer_id:
                    continue
                # Parsing multiaddrs is most of a small answer's cost: skip peers we know.
                if proto.addrs and not table.peer_in_table(pid):
                    self._libp2p.get_peerstore().add_addrs(
                        pid, [Multiaddr(a) for a in proto.addrs[:_MAX_ADDRS]], 600
                    )
                found.append(pid)
            except Exception as exc:
                log.debug("ignoring unreadable peer entry: %r", exc)
        return found

    # ------------------------------------------------------------------ joining

    async def _connect_one(self, info: PeerInfo, connected: list[ID]) -> None:
        try:
            await self._host.connect(info.peer_id, info.addrs)
        except P2PError as exc:
            log.warning("bootstrap peer %s unreachable: %s", info.peer_id, exc)
            return
        connected.append(info.peer_id)

    async def _self_lookup(self, start: Sequence[ID]) -> None:
        """FIND_NODE(our id) at ``start``, then at every new peer named, for a few rounds."""
        asked: set[ID] = {self.peer_id}
        batch = list(start)
        for _ in range(self.config.lookup_rounds):
            batch = [p for p in dict.fromkeys(batch) if p not in asked]
            if not batch:
                return
            asked.update(batch)
            named: list[ID] = []
            async with trio.open_nursery() as nursery:
                for peer in batch[:BUCKET_SIZE]:
                    nursery.start_soon(self._find_node_one, peer, named)
            batch = named

    async def _find_node_one(self, peer: ID, named: list[ID]) -> None:
        request = Message(type=Message.MessageType.FIND_NODE, key=self.peer_id.to_bytes())
        # Our signed peer record lets the answering peer learn our listen addresses.
        request.senderRecord = env_to_send_in_RPC(self._libp2p)[0]
        response = await self._request(peer, request)
        if response is None:
            return
        if not maybe_consume_signed_record(response, self._libp2p, peer):
            log.info("peer %s sent an invalid signed peer record", peer)
        # It answered Kad: a server, whatever identify says yet.
        await self._add_server(peer, skip_server_mode_check=True)
        named.extend(self._learn_peers(response))
        # 0.8.1's Kad handler adds the remote peer to its routing table when a stream starts,
        # before reading the signed peer record that tells it our addresses; so the first
        # stream from a new peer never gets us added. A second stream, opened now that it
        # knows our addresses, does.
        await self._request(peer, request, fresh=True)
