"""What a DHT server holds: libp2p 0.8.1's hooks for namespace ``swarmtrain``.

``SubkeyDictValidator`` checks every signed record of a PUT and selects, of the held and the
incoming value, the one that contributes a freshest entry. ``MergingValueStore`` merges subkey
entries where 0.8.1 would replace the value, keeps the parsed entries beside the encoded record
the Kad handler serves, and limits what each owner (the identity that signed an entry) may make
us hold (``StorageLimits``). ``p2p.dht.kademlia`` installs both on the node's ``KadDHT``.
"""

from __future__ import annotations

import fnmatch
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from libp2p.abc import IHost
from libp2p.kad_dht.common import format_time_rfc3339
from libp2p.kad_dht.pb.kademlia_pb2 import Record
from libp2p.kad_dht.value_store import ValueStore
from libp2p.peer.id import ID
from libp2p.records.validator import Validator

from p2p.dht.records import (
    MAX_RECORD_SET_BYTES,
    MAX_SUBKEYS,
    RecordRejected,
    SignedRecord,
    decode_record_set,
    encode_record_set,
    merge_records,
    valid_records,
)
from p2p.errors import RemoteProtocolError

NAMESPACE = "swarmtrain"
KEY_PREFIX = f"/{NAMESPACE}/".encode()


# Key families (``fnmatch`` patterns over the key after ``/swarmtrain/``) whose writers
# legitimately hold several subkeys of one key, with how many each owner may hold there. Every
# other key holds one entry per owner: each run key but one is written once per peer, under its
# own subkey (declarations, progress, state hashes, joins, starts, claims, verdicts, stage and
# trainer announcements, addresses). The exception is a round's aggregation audit records: a
# member splits its record over tagged values, one per claim at most, and it claims only the
# parts it reduced, of a round audited only up to 64 parts (``swarm.averaging.audit``,
# ``MAX_AUDIT_VALUES``): what an honest reducer writes for one round. (It was 256, a record's
# claims at most: 4 identities aged in advance filled a round's 1,024 subkeys.) The table is
# plain data here (p2p imports nothing above it) because every storing peer must apply the same
# caps, whatever program runs it; tests/unit/test_records.py checks it against the run keys.
MULTI_ENTRY_KEY_FAMILIES: tuple[tuple[str, int], ...] = (("run/*/aggregate/*", 64),)


@dataclass(frozen=True)
class StorageLimits:
    """What one identity may make a storing peer hold, and what the store holds in all.

    An honest peer writes a few keys a round (declaration, progress, state hash, claims), each
    living 10 minutes to an hour: a few thousand entries of under 1 KiB at one-second rounds.
    Under one key an owner holds ``max_entries_per_owner_per_key`` entries, or what the first
    matching pattern of ``key_families`` allows. Raises ValueError for a limit under 1.
    """

    max_entries_per_owner: int = 8192
    max_bytes_per_owner: int = 8 << 20
    max_bytes: int = 512 << 20
    max_entries_per_owner_per_key: int = 1
    key_families: tuple[tuple[str, int], ...] = MULTI_ENTRY_KEY_FAMILIES

    def __post_init__(self) -> None:
        caps = [self.max_entries_per_owner_per_key, *(cap for _, cap in self.key_families)]
        if min(caps) < 1:
            raise ValueError(f"an owner's entries per key must be at least 1, got {min(caps)}")

    def entries_per_owner(self, key: bytes) -> int:
        """How many entries one owner may hold under DHT key ``key`` (``/swarmtrain/...``)."""
        name = key.removeprefix(KEY_PREFIX).decode("utf-8", "replace")
        for pattern, cap in self.key_families:
            if fnmatch.fnmatchcase(name, pattern):
                return cap
        return self.max_entries_per_owner_per_key


class SubkeyDictValidator(Validator):
    """libp2p's validator hook for namespace ``swarmtrain``: values are signed record sets."""

    def validate(self, key: str, value: bytes) -> None:
        """Raise ``RecordRejected`` unless every record in ``value`` is valid for ``key``."""
        valid_records(value, key=key.encode(), now=time.time(), strict=True)

    def select(self, key: str, values: list[bytes]) -> int:
        """The last value that holds at least one entry of the merge of all of them.

        In a PUT, ``values`` is ``[held, incoming]``: 1 (accept, then merge) unless the incoming
        entries are all stale. Callers validate values first (kad does), so this only decodes.
        """
        now = time.time()
        parsed: list[list[SignedRecord]] = []
        for value in values:
            try:
                parsed.append(decode_record_set(value))
            except RemoteProtocolError:
                parsed.append([])
        merged: dict[bytes, SignedRecord] = {}
        for records in parsed:
            merged = merge_records(merged, records, now=now)
        for index in reversed(range(len(parsed))):
            if any(merged.get(r.subkey) == r for r in parsed[index]):
                return index
        return 0


class MergingValueStore(ValueStore):
    """libp2p's value store, except that our keys merge subkey entries instead of replacing,
    and what each owner (the identity that signed an entry) may make us hold is limited.

    The parsed entries of each key are kept beside the encoded protobuf record that the Kad
    handler serves, so a GET costs no decoding and a PUT verifies only the incoming entries.
    ``_usage`` counts every owner's entries and bytes over all keys; a merge that would take an
    owner, or the whole store, past ``StorageLimits`` is refused with ``RecordRejected("quota")``
    and changes nothing (seen before: one identity stored 47.5 MiB in 9 s).

    One owner holds at most ``StorageLimits.entries_per_owner(key)`` entries of a key (one for
    every run key but the audit records): its entries held already stay, and of its new
    subkeys only those that fit are kept, in subkey order; the rest are left out and counted
    in ``over_key_cap``, and the PUT succeeds with what was kept. Without this cap one identity
    seen early wrote 1,024 subkeys into a round's key and, its owner being the oldest there,
    pushed the members' later declarations out (below).

    A key holds at most ``MAX_SUBKEYS`` entries (and ``MAX_RECORD_SET_BYTES``). When a merge
    would pass that, the entries of the owners this store first saw most recently go first, the
    incoming ones included: identities are free, so 1,100 fresh ones written into a round's key
    would otherwise fill it and make every honest peer's store there fail (issue 19); an honest
    member has been storing its records since it started, a throwaway identity since the flood.
    A flood of identities aged in advance still costs its owner their upkeep.
    """

    def __init__(self, host: IHost, local_peer_id: ID, limits: StorageLimits | None = None) -> None:
        super().__init__(host, local_peer_id)
        self.limits = limits or StorageLimits()
        self._sets: dict[bytes, dict[bytes, SignedRecord]] = {}
        self._usage: dict[bytes, list[int]] = {}  # owner -> [entries, bytes]
        # When each owner's first entry here came (forgotten once it holds nothing here).
        self._first_seen: dict[bytes, float] = {}
        self.evicted_young = 0
        self.bytes_held = 0
        self.refused_over_quota = 0
        self.over_key_cap = 0  # entries left out: their owner held its cap of that key

    def put_record(self, key: bytes, record: Record) -> None:
        if not key.startswith(KEY_PREFIX):
            super().put_record(key, record)
            return
        # The Kad handler validated already; validating again keeps this store safe on its own.
        incoming = valid_records(record.value, key=key, now=time.time(), strict=True)
        self.merge(key, incoming.values())

    def merge(self, key: bytes, records: Iterable[SignedRecord]) -> None:
        """Merge validated ``records`` into what we hold for ``key``; ValueError if too big,
        ``RecordRejected`` (reason ``quota``) if an owner or the store would hold too much."""
        now = time.time()
        current = self.records(key, now)
        merged = self.cap_owners(key, merge_records(current, records, now=now), held=current)
        for record in merged.values():
            self._first_seen.setdefault(record.owner, now)
        merged = self._oldest_owners_fit(merged)
        self._check_quota(current, merged)
        self._write(key, merged)

    def cap_owners(
        self,
        key: bytes,
        records: dict[bytes, SignedRecord],
        *,
        held: Collection[bytes] = (),
    ) -> dict[bytes, SignedRecord]:
        """``records`` (entries of ``key``) with at most ``entries_per_owner(key)`` per owner:
        the subkeys in ``held`` first, then the others in subkey order. What is left out is
        counted in ``over_key_cap``. Readers apply it to what replicas answer, too."""
        cap = self.limits.entries_per_owner(key)
        count: dict[bytes, int] = {}
        for record in records.values():
            count[record.owner] = count.get(record.owner, 0) + 1
        if all(n <= cap for n in count.values()):
            return records
        kept: dict[bytes, SignedRecord] = {}
        taken: dict[bytes, int] = {}
        for subkey in sorted(records, key=lambda sk: (sk not in held, sk)):
            owner = records[subkey].owner
            if taken.get(owner, 0) < cap:
                taken[owner] = taken.get(owner, 0) + 1
                kept[subkey] = records[subkey]
        self.over_key_cap += len(records) - len(kept)
        return kept

    def _oldest_owners_fit(self, merged: dict[bytes, SignedRecord]) -> dict[bytes, SignedRecord]:
        """``merged`` without the entries of the most recently seen owners that do not fit."""
        budget = MAX_RECORD_SET_BYTES - 64  # the set's own msgpack framing
        if len(merged) <= MAX_SUBKEYS and sum(map(_wire_bytes, merged.values())) <= budget:
            return merged
        # Oldest owner first; ties (and one owner's subkeys) in subkey order.
        order = sorted(merged, key=lambda sk: (self._first_seen[merged[sk].owner], sk))
        kept: dict[bytes, SignedRecord] = {}
        size = 0
        for subkey in order:
            entry = _wire_bytes(merged[subkey])
            if len(kept) < MAX_SUBKEYS and size + entry <= budget:
                kept[subkey] = merged[subkey]
                size += entry
        self.evicted_young += len(merged) - len(kept)
        return kept

    def _check_quota(
        self, current: dict[bytes, SignedRecord], merged: dict[bytes, SignedRecord]
    ) -> None:
        delta = _usage_delta(current, merged)
        limits = self.limits
        for owner, (entries, nbytes) in delta.items():
            held = self._usage.get(owner, [0, 0])
            if (entries > 0 and held[0] + entries > limits.max_entries_per_owner) or (
                nbytes > 0 and held[1] + nbytes > limits.max_bytes_per_owner
            ):
                self.refused_over_quota += 1
                raise RecordRejected(
                    "quota",
                    f"its owner would hold over {limits.max_entries_per_owner} entries or "
                    f"{limits.max_bytes_per_owner} bytes here",
                )
        growth = sum(nbytes for _, nbytes in delta.values())
        if growth > 0 and self.bytes_held + growth > limits.max_bytes:
            self.refused_over_quota += 1
            raise RecordRejected("quota", f"this store is full ({limits.max_bytes} bytes)")

    def _write(self, key: bytes, merged: dict[bytes, SignedRecord]) -> None:
        if not merged:
            self.remove(key)
            return
        record = Record(key=key, value=encode_record_set(merged.values()))
        record.timeReceived = format_time_rfc3339()
        if key not in self.store:
            self._evict_if_full()
        self.store[key] = (record, max(r.expiration_time for r in merged.values()))
        self._account(self._sets.get(key, {}), merged)
        self._sets[key] = merged

    def _account(self, old: dict[bytes, SignedRecord], new: dict[bytes, SignedRecord]) -> None:
        for owner, (entries, nbytes) in _usage_delta(old, new).items():
            held = self._usage.setdefault(owner, [0, 0])
            held[0] += entries
            held[1] += nbytes
            self.bytes_held += nbytes
            if held[0] <= 0:
                del self._usage[owner]
                self._first_seen.pop(owner, None)

    def _forget_missing(self) -> None:
        # libp2p's own expiry and eviction delete from ``store`` without telling us.
        for key in [k for k in self._sets if k not in self.store]:
            self._account(self._sets.pop(key), {})

    def records(self, key: bytes, now: float) -> dict[bytes, SignedRecord]:
        """Our unexpired entries for ``key``."""
        if key not in self.store:
            if key in self._sets:
                self._account(self._sets.pop(key), {})
            return {}
        return {sk: r for sk, r in self._sets.get(key, {}).items() if r.expiration_time > now}

    def get(self, key: bytes) -> Record | None:
        held = self._sets.get(key)
        if held is not None:
            now = time.time()
            if any(r.expiration_time <= now for r in held.values()):
                self._write(key, self.records(key, now))
        return super().get(key)

    def remove(self, key: bytes) -> bool:
        if key in self._sets:
            self._account(self._sets.pop(key), {})
        return super().remove(key)

    def _evict_if_full(self) -> None:
        super()._evict_if_full()
        self._forget_missing()

    def prune(self, now: float) -> None:
        """Drop expired entries and keys."""
        for key in list(self._sets):
            self._write(key, self.records(key, now))
        self.cleanup_expired()
        self._forget_missing()

    def usage(self, owner: bytes) -> tuple[int, int]:
        """(entries, bytes) that ``owner``'s records take here."""
        entries, nbytes = self._usage.get(owner, [0, 0])
        return entries, nbytes


def _wire_bytes(record: SignedRecord) -> int:
    # At least what an entry takes in ``encode_record_set``: its byte fields plus msgpack's
    # headers and the two numbers (at most 9 bytes each).
    fields = (record.key, record.subkey, record.value, record.owner, record.public_key)
    return sum(len(f) for f in fields) + len(record.signature) + 48


def _entry_bytes(record: SignedRecord) -> int:
    # What an entry costs us: its variable fields plus the fixed ones and the parsed object.
    return len(record.value) + len(record.subkey) + len(record.key) + 256


def _usage_delta(
    old: dict[bytes, SignedRecord], new: dict[bytes, SignedRecord]
) -> dict[bytes, tuple[int, int]]:
    delta: dict[bytes, list[int]] = {}
    for sign, records in ((-1, old), (1, new)):
        for record in records.values():
            held = delta.setdefault(record.owner, [0, 0])
            held[0] += sign
            held[1] += sign * _entry_bytes(record)
    return {owner: (e, b) for owner, (e, b) in delta.items() if e or b}
