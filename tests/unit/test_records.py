"""Signed DHT records without sockets: signing, every rejection reason, merge, decoder fuzzing."""

from __future__ import annotations

import dataclasses
import time

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p.dht.records import (
    MAX_RECORD_SET_BYTES,
    MAX_SUBKEYS,
    MAX_VALUE_BYTES,
    RecordRejected,
    RecordSigner,
    SignedRecord,
    decode_record_set,
    encode_record_set,
    merge_records,
    subkey_owner,
    subkey_values,
    valid_records,
    validate_record,
    verify_peer_signature,
)
from p2p.errors import RemoteProtocolError

NOW = 1_700_000_000.0
KEY = b"run/alpha/members"

ALICE = RecordSigner(bytes(range(32)))
BOB = RecordSigner(bytes(range(1, 33)))


def _reason(record: SignedRecord, *, key: bytes = KEY, now: float = NOW) -> str:
    with pytest.raises(RecordRejected) as info:
        validate_record(record, key=key, now=now)
    return info.value.reason


def test_signed_record_validates_and_round_trips() -> None:
    record = ALICE.sign(KEY, b"hello", NOW + 60)
    validate_record(record, key=KEY, now=NOW)
    assert record.subkey == ALICE.peer_id
    assert subkey_owner(record.subkey) == ALICE.peer_id
    [decoded] = decode_record_set(encode_record_set([record]))
    assert decoded == record


def test_peer_id_matches_libp2p_derivation() -> None:
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.peer.id import ID

    key_pair = create_new_key_pair(bytes(range(32)))
    signer = RecordSigner(key_pair.private_key.to_bytes())
    assert signer.peer_id == ID.from_pubkey(key_pair.public_key).to_bytes()


def test_unsigned_is_rejected() -> None:
    record = dataclasses.replace(ALICE.sign(KEY, b"v", NOW + 60), signature=b"")
    assert _reason(record) == "unsigned"


def test_bad_signature_is_rejected() -> None:
    record = ALICE.sign(KEY, b"v", NOW + 60)
    tampered_value = dataclasses.replace(record, value=b"w")
    assert _reason(tampered_value) == "bad-signature"
    # Extending one's own expiry without re-signing is a bad signature too.
    tampered_expiry = dataclasses.replace(record, expiration_time=NOW + 6000)
    assert _reason(tampered_expiry) == "bad-signature"
    flipped = bytes([record.signature[0] ^ 1]) + record.signature[1:]
    assert _reason(dataclasses.replace(record, signature=flipped)) == "bad-signature"
    assert _reason(dataclasses.replace(record, signature=b"x" * 63)) == "bad-signature"


def test_forged_owner_is_rejected() -> None:
    # Bob claims Alice's subkey and owner, signing with his own key: the key does not derive
    # the owner id.
    bob_as_alice = dataclasses.replace(
        BOB.sign(KEY, b"evil", NOW + 60), owner=ALICE.peer_id, subkey=ALICE.peer_id
    )
    assert _reason(bob_as_alice) == "forged-owner"
    # Bob signs honestly as himself but writes Alice's subkey: the subkey is not his.
    honest_bob = BOB.sign(KEY, b"evil", NOW + 60)
    unsigned = dataclasses.replace(honest_bob, subkey=ALICE.peer_id, signature=b"")
    resigned = dataclasses.replace(
        unsigned, signature=BOB._private_key.sign(unsigned.signed_payload())
    )
    assert _reason(resigned) == "forged-owner"
    # Bob copies Alice's public key and id but cannot sign for them.
    stolen = dataclasses.replace(
        honest_bob, owner=ALICE.peer_id, subkey=ALICE.peer_id, public_key=ALICE.public_key
    )
    assert _reason(stolen) == "bad-signature"
    assert _reason(dataclasses.replace(honest_bob, public_key=b"short")) == "forged-owner"


def test_expired_and_replayed_under_other_key_are_rejected() -> None:
    record = ALICE.sign(KEY, b"v", NOW + 60)
    assert _reason(record, now=NOW + 60) == "expired"
    assert _reason(record, key=b"other") == "wrong-key"


def test_tagged_subkeys_are_owner_bound() -> None:
    record = ALICE.sign(KEY, b"v", NOW + 60, tag=b"stage-3")
    validate_record(record, key=KEY, now=NOW)
    assert record.subkey == ALICE.peer_id + b"/stage-3"
    assert subkey_owner(ALICE.peer_id + b"x") is None
    assert subkey_owner(b"short") is None


def test_oversized_is_rejected_before_decoding() -> None:
    with pytest.raises(RecordRejected) as info:
        decode_record_set(b"\x00" * (MAX_RECORD_SET_BYTES + 1))
    assert info.value.reason == "oversized"
    with pytest.raises(ValueError):
        ALICE.sign(KEY, b"v" * (MAX_VALUE_BYTES + 1), NOW + 60)
    big = dataclasses.replace(ALICE.sign(KEY, b"v", NOW + 60), value=b"v" * (MAX_VALUE_BYTES + 1))
    assert _reason(big) == "oversized"
    # An oversized value inside an otherwise well-formed set is refused by the decoder limits.
    wire = msgpack.packb([1, [big.to_wire()]], use_bin_type=True)
    with pytest.raises(RemoteProtocolError):
        decode_record_set(wire)


def test_malformed_shapes_raise_remote_protocol_error() -> None:
    record = ALICE.sign(KEY, b"v", NOW + 60)
    bad_inputs = [
        b"",
        msgpack.packb([2, []]),
        msgpack.packb([1, [record.to_wire()[:-1]]], use_bin_type=True),
        msgpack.packb([1, [[*record.to_wire()[:5], 5, 0, record.signature]]], use_bin_type=True),
        msgpack.packb({"a": 1}),
        msgpack.packb([True, []]),
        encode_record_set([record]) + b"\x00",
    ]
    for data in bad_inputs:
        with pytest.raises(RemoteProtocolError):
            decode_record_set(data)


def test_merge_keeps_freshest_per_subkey() -> None:
    old = ALICE.sign(KEY, b"old", NOW + 10, version=5)
    new = ALICE.sign(KEY, b"new", NOW + 20, version=0)
    same_expiry_newer_version = ALICE.sign(KEY, b"newer", NOW + 20, version=1)
    bob = BOB.sign(KEY, b"bob", NOW + 15)
    merged = merge_records({}, [old, bob], now=NOW)
    merged = merge_records(merged, [new], now=NOW)
    assert subkey_values(merged, now=NOW) == {ALICE.peer_id: b"new", BOB.peer_id: b"bob"}
    merged = merge_records(merged, [old, same_expiry_newer_version], now=NOW)
    assert merged[ALICE.peer_id].value == b"newer"
    # Expired entries are dropped, both held and incoming.
    assert subkey_values(merge_records(merged, [], now=NOW + 16), now=NOW + 16) == {
        ALICE.peer_id: b"newer"
    }
    assert merge_records({}, [old], now=NOW + 10) == {}


def test_valid_records_strict_rejects_lenient_drops() -> None:
    good = ALICE.sign(KEY, b"a", NOW + 60)
    forged = dataclasses.replace(BOB.sign(KEY, b"b", NOW + 60), subkey=ALICE.peer_id)
    data = encode_record_set([good, forged])
    with pytest.raises(RecordRejected):
        valid_records(data, key=KEY, now=NOW, strict=True)
    lenient = valid_records(data, key=KEY, now=NOW, strict=False)
    assert subkey_values(lenient, now=NOW) == {ALICE.peer_id: b"a"}


_signers = st.sampled_from([ALICE, BOB, RecordSigner(b"\x07" * 32)])
_records = st.builds(
    lambda signer, value, ttl, version, tag: signer.sign(
        KEY, value, NOW + ttl, version=version, tag=tag
    ),
    _signers,
    st.binary(max_size=64),
    st.floats(min_value=-100, max_value=100, allow_nan=False),
    st.integers(min_value=0, max_value=2**63 - 1),
    st.sampled_from([b"", b"a", b"stage/1"]),
)


@given(st.lists(_records, max_size=8))
@settings(max_examples=50, deadline=None)
def test_record_set_round_trips(records: list[SignedRecord]) -> None:
    decoded = decode_record_set(encode_record_set(records))
    assert sorted(decoded, key=lambda r: r.subkey) == sorted(records, key=lambda r: r.subkey)


@given(st.lists(_records, max_size=6), st.lists(_records, max_size=6))
@settings(max_examples=50, deadline=None)
def test_merge_is_commutative_and_idempotent(a: list[SignedRecord], b: list[SignedRecord]) -> None:
    ab = merge_records(merge_records({}, a, now=NOW), b, now=NOW)
    ba = merge_records(merge_records({}, b, now=NOW), a, now=NOW)
    assert ab == ba
    assert merge_records(ab, a + b, now=NOW) == ab
    for subkey, record in ab.items():
        candidates = [r for r in a + b if r.subkey == subkey and r.expiration_time > NOW]
        assert record.freshness() == max(r.freshness() for r in candidates)


@given(st.binary(max_size=4096))
@settings(max_examples=300, deadline=None)
def test_garbage_decodes_or_raises_remote_protocol_error(data: bytes) -> None:
    try:
        records = decode_record_set(data)
    except RemoteProtocolError:
        return
    assert all(isinstance(r, SignedRecord) for r in records)


@given(st.lists(_records, min_size=1, max_size=3), st.data())
@settings(max_examples=50, deadline=None)
def test_bit_flips_never_validate_as_someone_else(records: list[SignedRecord], data) -> None:
    wire = bytearray(encode_record_set(records))
    index = data.draw(st.integers(min_value=0, max_value=len(wire) - 1))
    wire[index] ^= data.draw(st.integers(min_value=1, max_value=255))
    try:
        held = valid_records(bytes(wire), key=KEY, now=NOW - 1000, strict=False)
    except RemoteProtocolError:
        return
    originals = {(r.subkey, r.value, r.expiration_time, r.version) for r in records}
    for record in held.values():
        assert (record.subkey, record.value, record.expiration_time, record.version) in originals


def test_kad_select_accepts_any_value_that_adds_a_freshest_entry() -> None:
    from p2p.dht.store import SubkeyDictValidator

    select = SubkeyDictValidator().select
    key = KEY.decode()
    far = 4_000_000_000.0  # select reads the real clock; these expire long after the test
    held = encode_record_set([ALICE.sign(KEY, b"a", far + 60), BOB.sign(KEY, b"b", far + 60)])
    newer_bob = encode_record_set([BOB.sign(KEY, b"b2", far + 120)])
    stale_bob = encode_record_set([BOB.sign(KEY, b"b0", far + 30)])
    assert select(key, [held, newer_bob]) == 1  # accepted, then merged by the store
    assert select(key, [held, held]) == 1  # a repeated store is acknowledged, not reset
    assert select(key, [held, stale_bob]) == 0
    assert select(key, [held, b"garbage"]) == 0


def test_merging_value_store_keeps_every_owner_and_drops_expired() -> None:
    from libp2p.kad_dht.pb.kademlia_pb2 import Record

    from p2p.dht.store import MergingValueStore

    store = MergingValueStore(host=None, local_peer_id=None)  # type: ignore[arg-type]
    key = b"/swarmtrain/members"
    far = time.time() + 3600  # the store reads the real clock; these expire long after the test
    alice = ALICE.sign(key, b"a", far)
    bob = BOB.sign(key, b"b", far + 1)
    store.put_record(key, Record(key=key, value=encode_record_set([alice])))
    store.put_record(key, Record(key=key, value=encode_record_set([bob])))
    served = store.get(key)
    assert served is not None
    assert decode_record_set(served.value) == sorted([alice, bob], key=lambda r: r.subkey)
    with pytest.raises(RecordRejected):
        store.put_record(
            key,
            Record(key=key, value=encode_record_set([dataclasses.replace(bob, value=b"forged")])),
        )
    assert store.records(key, far - 1) == {ALICE.peer_id: alice, BOB.peer_id: bob}
    assert store.records(key, far + 0.5) == {BOB.peer_id: bob}
    store.prune(far + 2)
    assert store.get(key) is None


def test_a_signed_message_verifies_against_the_signers_peer_id_only() -> None:
    alice, bob = RecordSigner(b"\x01" * 32), RecordSigner(b"\x02" * 32)
    signature = alice.sign_message(b"domain/message")
    assert verify_peer_signature(alice.peer_id, b"domain/message", signature)
    assert not verify_peer_signature(alice.peer_id, b"domain/other", signature)
    assert not verify_peer_signature(bob.peer_id, b"domain/message", signature)
    assert not verify_peer_signature(alice.peer_id, b"domain/message", signature[:-1])
    assert not verify_peer_signature(b"not a peer id", b"domain/message", signature)


def test_a_record_that_expires_beyond_the_maximum_lifetime_is_refused() -> None:
    from p2p.dht.records import MAX_RECORD_LIFETIME_S

    now = time.time()
    key = b"/swarmtrain/k"
    validate_record(ALICE.sign(key, b"v", now + 7 * 24 * 3600), key=key, now=now)
    for expiration in (now + 100 * 365 * 24 * 3600, 1e300, now + MAX_RECORD_LIFETIME_S + 1):
        with pytest.raises(RecordRejected, match="lifetime"):
            validate_record(ALICE.sign(key, b"v", expiration), key=key, now=now)


def test_the_store_holds_at_most_an_owners_quota_and_frees_it_when_entries_go() -> None:
    from libp2p.kad_dht.pb.kademlia_pb2 import Record

    from p2p.dht.store import MergingValueStore, StorageLimits

    limits = StorageLimits(
        max_entries_per_owner=4,
        max_bytes_per_owner=3 * 1400,
        max_bytes=10**6,
        max_entries_per_owner_per_key=2,
    )
    store = MergingValueStore(host=None, local_peer_id=None, limits=limits)  # type: ignore[arg-type]
    soon = time.time() + 3600

    def put(signer: RecordSigner, name: bytes, tag: bytes, size: int, expires: float) -> None:
        key = b"/swarmtrain/" + name
        record = signer.sign(key, b"x" * size, expires, tag=tag)
        store.put_record(key, Record(key=key, value=encode_record_set([record])))

    for i in range(4):
        put(ALICE, b"k%d" % i, b"", 10, soon)
    with pytest.raises(RecordRejected, match="quota"):
        put(ALICE, b"k9", b"", 10, soon)  # a 5th entry
    put(ALICE, b"k0", b"", 10, soon + 1)  # replacing an entry costs nothing more
    put(BOB, b"k9", b"", 1000, soon)  # others are not affected
    put(BOB, b"k9", b"t", 1000, soon)
    put(BOB, b"k8", b"", 1000, soon)
    with pytest.raises(RecordRejected, match="quota"):
        put(BOB, b"k7", b"", 1000, soon)  # over BOB's bytes, under his entries
    assert store.usage(ALICE.peer_id)[0] == 4
    store.remove(b"/swarmtrain/k1")
    put(ALICE, b"k9", b"", 10, soon)  # room again
    store.remove(b"/swarmtrain/k2")
    put(ALICE, b"k5", b"", 10, time.time() + 0.01)
    with pytest.raises(RecordRejected, match="quota"):
        put(ALICE, b"k6", b"", 10, soon)
    time.sleep(0.02)
    store.prune(time.time())  # the expired entry goes, and its share of the quota
    put(ALICE, b"k6", b"", 10, soon)
    assert store.usage(ALICE.peer_id)[0] == 4
    assert store.bytes_held == sum(store.usage(s.peer_id)[1] for s in (ALICE, BOB))


def test_a_full_key_keeps_its_oldest_owners_and_a_flood_of_fresh_identities_cannot_evict_them() -> (
    None
):
    """Issue 19 point 3: 1,100 throwaway identities written into one round's key filled it (a
    key holds 1,024 entries) and every honest store there failed. Now the identities this store
    met last are the ones left out."""
    from libp2p.kad_dht.pb.kademlia_pb2 import Record

    from p2p.dht.store import MergingValueStore

    store = MergingValueStore(host=None, local_peer_id=None)  # type: ignore[arg-type]
    soon = time.time() + 3600
    key = b"/swarmtrain/run/r/round/7"
    honest = [RecordSigner(bytes([i]) * 32) for i in range(1, 4)]
    # The honest members have stored something here before (their progress records).
    for signer in honest:
        old = b"/swarmtrain/run/r/progress"
        store.put_record(
            old, Record(key=old, value=encode_record_set([signer.sign(old, b"p", soon)]))
        )
    flood = [RecordSigner((i + 1000).to_bytes(2, "big") * 16) for i in range(1100)]
    for start in range(0, len(flood), 500):
        batch = [s.sign(key, b"declaration", soon) for s in flood[start : start + 500]]
        store.put_record(key, Record(key=key, value=encode_record_set(batch)))
    assert len(store.records(key, time.time())) == MAX_SUBKEYS
    for signer in honest:  # each honest store succeeds and stays
        store.put_record(
            key, Record(key=key, value=encode_record_set([signer.sign(key, b"me", soon)]))
        )
    held = store.records(key, time.time())
    assert len(held) == MAX_SUBKEYS
    assert all(signer.peer_id in held for signer in honest)
    assert store.evicted_young == 1100 + 3 - MAX_SUBKEYS
    served = store.get(key)
    assert served is not None and len(decode_record_set(served.value)) == MAX_SUBKEYS


def test_one_owner_holds_at_most_its_cap_of_a_key_and_later_owners_still_fit() -> None:
    """Issue 19 point 3: one identity seen early wrote 1,024 subkeys into a round's key; being
    the oldest owner there it kept them all and pushed out the members' later declarations.
    Now it holds one entry there (the cap of every run key but the audit records)."""
    from libp2p.kad_dht.pb.kademlia_pb2 import Record

    from p2p.dht.store import MergingValueStore

    store = MergingValueStore(host=None, local_peer_id=None)  # type: ignore[arg-type]
    soon = time.time() + 3600
    key = b"/swarmtrain/run/r/round/7"
    attacker = RecordSigner(b"\xaa" * 32)

    def put(key: bytes, records: list[SignedRecord]) -> None:
        store.put_record(key, Record(key=key, value=encode_record_set(records)))

    put(key, [attacker.sign(key, b"first", soon)])  # seen here before anyone else
    put(key, [attacker.sign(key, b"d", soon, tag=b"%d" % i) for i in range(1024)])
    held = store.records(key, time.time())
    assert list(held) == [attacker.peer_id]  # what it held stays; the new subkeys are left out
    assert store.over_key_cap == 1024
    put(key, [attacker.sign(key, b"newer", soon + 1)])  # a fresher entry replaces its own
    assert store.records(key, time.time())[attacker.peer_id].value == b"newer"
    honest = [RecordSigner(bytes([i]) * 32) for i in range(1, 4)]
    for signer in honest:
        put(key, [signer.sign(key, b"declaration", soon)])
    held = store.records(key, time.time())
    assert sorted(held) == sorted([attacker.peer_id, *(s.peer_id for s in honest)])
    assert store.usage(attacker.peer_id)[0] == 1
    # Audit records: a member splits its record over up to 64 tagged values (one per part it
    # reduced, of a round audited up to 64 parts). At 256 each, 4 identities aged in advance
    # filled a round's audit key; now 4 of them leave room for every member of the round.
    audits = b"/swarmtrain/run/r/aggregate/7"
    aged = [attacker, *(RecordSigner(bytes([0xB0 + i]) * 32) for i in range(3))]
    for signer in aged:
        put(audits, [signer.sign(audits, b"a", soon, tag=b"a%d" % i) for i in range(300)])
    kept = store.records(audits, time.time())
    written = {attacker.subkey(b"a%d" % i) for i in range(300)}
    assert sorted(s for s in kept if s in written) == sorted(written)[:64]
    assert len(kept) == 4 * 64 and store.over_key_cap == 1024 + 4 * (300 - 64)
    members = [RecordSigner(bytes([0xC0 + i]) * 32) for i in range(12)]
    for signer in members:  # a verified group's members, each its record's 64 values
        put(audits, [signer.sign(audits, b"a", soon, tag=b"a%d" % i) for i in range(64)])
    assert len(store.records(audits, time.time())) == 16 * 64 == MAX_SUBKEYS
    # A reader caps what a replica answers the same way, preferring what it holds itself.
    answer = {
        r.subkey: r for r in (attacker.sign(key, b"x", soon, tag=b"%d" % i) for i in range(5))
    }
    mine = {attacker.subkey(b"3"): answer[attacker.subkey(b"3")]}
    assert list(store.cap_owners(key, answer, held=mine)) == [attacker.subkey(b"3")]


def test_every_run_key_takes_one_entry_per_owner_but_the_audit_records_a_split_record() -> None:
    """The caps ``p2p.dht.store`` applies (plain data there) against what the run's writers
    need: one subkey per peer everywhere, and ``split_record``'s values under aggregate keys."""
    import dataclasses as dc

    from p2p.dht.kademlia import dht_key
    from p2p.dht.store import StorageLimits
    from swarm.averaging.audit import (
        MAX_AUDIT_VALUES,
        MAX_AUDITED_PARTS,
        AuditRecord,
        PartAudit,
        audit_values,
        split_record,
    )
    from swarmtrain import keys

    limits = StorageLimits()
    single = [
        keys.round_key("r", 3).decode(),
        keys.round_key("r", 3, 1).decode(),
        keys.state_key("r", 3),
        keys.progress_key("r"),
        keys.join_key("r", 3),
        keys.starts_key("r"),
        keys.admissions_key("r"),
        keys.verify_key("r", 3),
        keys.verdicts_key("r"),
        keys.audits_key("r"),
        keys.servers_key("r"),
        keys.trainers_key("r"),
        "addrs/12D3KooW",
    ]
    assert [limits.entries_per_owner(dht_key(k)) for k in single] == [1] * len(single)
    assert limits.entries_per_owner(dht_key(keys.aggregate_key("r", 3))) == MAX_AUDIT_VALUES
    # Each value holds at least one claim: a member that reduced every part of an audited round
    # (MAX_AUDITED_PARTS), claims too big to pair up, takes one value each, the most an honest
    # writer needs; all of them are published.
    inputs = tuple((bytes([i]) * 38, 1.0, bytes(32), bytes(64)) for i in range(60))
    claim = PartAudit(0, 0, 1, inputs, bytes(32))
    parts = tuple(dc.replace(claim, part=p) for p in range(MAX_AUDITED_PARTS))
    record = AuditRecord(1, b"g", (), parts)
    assert len(split_record(record)) == len(audit_values(record)) == MAX_AUDITED_PARTS
    # A round past the audit's parts (none drawn) publishes only what the DHT keeps.
    more = tuple(dc.replace(claim, part=p) for p in range(2 * MAX_AUDITED_PARTS))
    values = audit_values(dc.replace(record, audits=more))
    assert values == split_record(dc.replace(record, audits=more))[:MAX_AUDIT_VALUES]
