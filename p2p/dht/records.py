"""Signed DHT records: a DHT key holds a dictionary of subkeys, each written only by its owner.

Theory of operation
-------------------
A value in the DHT is not one blob that the last writer replaces: the peers of a run each publish
under the same key (membership, group declarations, addresses), so a key holds a *dictionary of
subkeys*. Every entry is a ``SignedRecord``: key, subkey, value, owner, the owner's Ed25519 public
key, an expiration time (unix seconds) and a version counter, signed by the owner over a canonical
msgpack encoding of those positional fields (hivemind ``dht/crypto.py`` signs ``astuple(record)``
the same way).

Rules, all enforced here so that storing peers and readers apply the same ones:

* A subkey is owner-bound: it is the owner's peer id, optionally followed by ``/`` and a tag. So
  nobody can write (or expire, or shadow) another peer's subkey: a forged entry fails either the
  signature, the public-key-to-peer-id derivation, or the subkey-to-owner binding.
* An entry names its DHT key and is signed over it, so it cannot be replayed under another key.
* Merging two dictionaries keeps, per subkey, the freshest valid entry: highest expiration time,
  then highest version, then (only so that merging is commutative) the larger signature bytes.
  Expired entries are dropped.
* Sizes are checked before anything is decoded; one function (``decode_record_set``) turns every
  decode failure into ``RemoteProtocolError``.

This module is sans-IO: no trio, sockets or clocks. ``now`` is always an argument.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from p2p.errors import RemoteProtocolError

RECORD_FORMAT_VERSION = 1
# Prefix of every signed payload, so a record signature can never be confused with a signature
# the same identity key makes for another protocol (libp2p peer records, Noise handshakes).
_SIGNING_DOMAIN = b"swarmtrain/dht-record/1\x00"

MAX_KEY_BYTES = 256
MAX_TAG_BYTES = 64
MAX_VALUE_BYTES = 16 * 1024
MAX_SUBKEYS = 1024
# No record outlives this (the longest an honest writer asks for is 7 days, verdicts): an
# expiration further ahead (1e300, 100 years) is refused, or it would be held and win merges
# forever. Versions need no such bound: they only order one owner's own entries.
MAX_RECORD_LIFETIME_S = 8 * 24 * 3600.0
# One encoded record: value plus the fixed fields (peer id 38, key, signature 64, numbers).
MAX_RECORD_BYTES = MAX_VALUE_BYTES + MAX_KEY_BYTES + MAX_TAG_BYTES + 256
# A stored DHT value: well under py-libp2p's MAX_RECORD_SIZE (1 MiB) for the whole protobuf.
MAX_RECORD_SET_BYTES = 512 * 1024

_ED25519_KEY_BYTES = 32
_SIGNATURE_BYTES = 64
# A libp2p peer id for an Ed25519 key is the identity multihash (0x00, length 36) of the
# protobuf PublicKey {type: Ed25519 (1), data: 32 bytes}; the key is recoverable from the id.
_ED25519_PEER_ID_PREFIX = b"\x00\x24\x08\x01\x12\x20"
PEER_ID_BYTES = len(_ED25519_PEER_ID_PREFIX) + _ED25519_KEY_BYTES
_SUBKEY_TAG_SEPARATOR = b"/"


class RecordRejected(RemoteProtocolError):
    """A record that decodes but must not be stored or believed; ``reason`` is a short tag.

    Reasons: ``unsigned``, ``bad-signature``, ``forged-owner``, ``wrong-key``, ``expired``,
    ``lifetime`` (expires beyond ``MAX_RECORD_LIFETIME_S``), ``oversized``, ``malformed``, and
    ``quota`` (a storing peer's per-owner limits, ``p2p.dht.kademlia``).
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def peer_id_from_public_key(public_key: bytes) -> bytes:
    """The libp2p peer id bytes (identity multihash) of a raw 32-byte Ed25519 public key."""
    if len(public_key) != _ED25519_KEY_BYTES:
        raise ValueError(f"an Ed25519 public key has 32 bytes, got {len(public_key)}")
    return _ED25519_PEER_ID_PREFIX + public_key


def verify_peer_signature(peer_id: bytes, message: bytes, signature: bytes) -> bool:
    """Whether ``signature`` is the Ed25519 signature over ``message`` by the key inside
    ``peer_id`` (an identity-multihash Ed25519 peer id; any other form is False)."""
    if len(peer_id) != PEER_ID_BYTES or not peer_id.startswith(_ED25519_PEER_ID_PREFIX):
        return False
    try:
        key = Ed25519PublicKey.from_public_bytes(peer_id[len(_ED25519_PEER_ID_PREFIX) :])
        key.verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True


def subkey_owner(subkey: bytes) -> bytes | None:
    """The peer id a subkey is bound to, or None if the subkey is not of an owner-bound form."""
    owner = subkey[:PEER_ID_BYTES]
    if len(owner) != PEER_ID_BYTES or not owner.startswith(_ED25519_PEER_ID_PREFIX):
        return None
    rest = subkey[PEER_ID_BYTES:]
    if rest and (not rest.startswith(_SUBKEY_TAG_SEPARATOR) or len(rest) - 1 > MAX_TAG_BYTES):
        return None
    return owner


@dataclass(frozen=True, slots=True)
class SignedRecord:
    """One owner's entry under one DHT key. Construct with ``RecordSigner.sign``."""

    key: bytes
    subkey: bytes
    value: bytes
    owner: bytes
    public_key: bytes
    expiration_time: float
    version: int
    signature: bytes

    def __post_init__(self) -> None:
        # Types only: whether the record is *valid* is validate_record's question, so that a
        # decoded forgery can still be represented and rejected with a precise reason.
        for name in ("key", "subkey", "value", "owner", "public_key", "signature"):
            if type(getattr(self, name)) is not bytes:
                raise TypeError(f"SignedRecord.{name} must be bytes")
        if type(self.expiration_time) is not float or not math.isfinite(self.expiration_time):
            raise TypeError("SignedRecord.expiration_time must be a finite float")
        if type(self.version) is not int or not 0 <= self.version < 2**63:
            raise TypeError("SignedRecord.version must be an int in [0, 2**63)")

    def signed_payload(self) -> bytes:
        """The canonical bytes the owner signs: every field but the signature, positional."""
        return _SIGNING_DOMAIN + msgpack.packb(
            [RECORD_FORMAT_VERSION, *self.to_wire()[:-1]], use_bin_type=True
        )

    def to_wire(self) -> list[Any]:
        return [
            self.key,
            self.subkey,
            self.value,
            self.owner,
            self.public_key,
            self.expiration_time,
            self.version,
            self.signature,
        ]

    @classmethod
    def from_wire(cls, obj: Any) -> SignedRecord:
        """Build from a decoded list; raises ``RemoteProtocolError`` on any shape/type error."""
        if not isinstance(obj, list) or len(obj) != 8:
            raise RecordRejected("malformed", "a record is a list of 8 fields")
        try:
            return cls(*obj)
        except TypeError as exc:
            raise RecordRejected("malformed", str(exc)) from exc

    def freshness(self) -> tuple[float, int, bytes]:
        """Sort key: the greater entry wins a merge (expiration, then version, then signature)."""
        return (self.expiration_time, self.version, self.signature)


class RecordSigner:
    """Signs records for one Ed25519 identity (the same key as the libp2p host)."""

    def __init__(self, seed: bytes) -> None:
        """``seed`` is the 32-byte Ed25519 private key, e.g. libp2p ``private_key.to_bytes()``."""
        self._private_key = Ed25519PrivateKey.from_private_bytes(seed)
        self.public_key = self._private_key.public_key().public_bytes_raw()
        self.peer_id = peer_id_from_public_key(self.public_key)

    def sign_message(self, message: bytes) -> bytes:
        """An Ed25519 signature over ``message`` (callers domain-separate it themselves), which
        anyone checks against our peer id with ``verify_peer_signature``."""
        return self._private_key.sign(message)

    def subkey(self, tag: bytes = b"") -> bytes:
        """This identity's own subkey, optionally with a tag (``peer_id/tag``)."""
        if not tag:
            return self.peer_id
        if len(tag) > MAX_TAG_BYTES:
            raise ValueError(f"subkey tag over {MAX_TAG_BYTES} bytes")
        return self.peer_id + _SUBKEY_TAG_SEPARATOR + tag

    def sign(
        self,
        key: bytes,
        value: bytes,
        expiration_time: float,
        *,
        tag: bytes = b"",
        version: int = 0,
    ) -> SignedRecord:
        """A record for ``key`` under this identity's subkey; raises ValueError if oversized."""
        if len(key) > MAX_KEY_BYTES or len(value) > MAX_VALUE_BYTES:
            raise ValueError("key or value over the record size limit")
        unsigned = SignedRecord(
            key=key,
            subkey=self.subkey(tag),
            value=value,
            owner=self.peer_id,
            public_key=self.public_key,
            expiration_time=float(expiration_time),
            version=version,
            signature=b"",
        )
        signature = self._private_key.sign(unsigned.signed_payload())
        return SignedRecord(*unsigned.to_wire()[:-1], signature)


def validate_record(record: SignedRecord, *, key: bytes, now: float) -> None:
    """Raise ``RecordRejected`` unless ``record`` is a valid, unexpired entry for ``key``."""
    if len(record.key) > MAX_KEY_BYTES or len(record.value) > MAX_VALUE_BYTES:
        raise RecordRejected("oversized")
    if record.key != key:
        raise RecordRejected("wrong-key", "record was signed for another key")
    if not record.signature:
        raise RecordRejected("unsigned")
    if len(record.public_key) != _ED25519_KEY_BYTES:
        raise RecordRejected("forged-owner", "public key is not an Ed25519 key")
    if peer_id_from_public_key(record.public_key) != record.owner:
        raise RecordRejected("forged-owner", "public key does not derive the owner peer id")
    if subkey_owner(record.subkey) != record.owner:
        raise RecordRejected("forged-owner", "subkey is not bound to the signer")
    if record.expiration_time <= now:
        raise RecordRejected("expired")
    if record.expiration_time > now + MAX_RECORD_LIFETIME_S:
        raise RecordRejected("lifetime", f"expires over {MAX_RECORD_LIFETIME_S:g} s ahead")
    if len(record.signature) != _SIGNATURE_BYTES:
        raise RecordRejected("bad-signature", "wrong length")
    try:
        Ed25519PublicKey.from_public_bytes(record.public_key).verify(
            record.signature, record.signed_payload()
        )
    except (InvalidSignature, ValueError) as exc:
        raise RecordRejected("bad-signature") from exc


def encode_record_set(records: Iterable[SignedRecord]) -> bytes:
    """The stored DHT value for a key: ``[format version, [record, ...]]`` in subkey order."""
    ordered = sorted(records, key=lambda r: r.subkey)
    if len(ordered) > MAX_SUBKEYS:
        raise ValueError(f"over {MAX_SUBKEYS} subkeys")
    data = msgpack.packb([RECORD_FORMAT_VERSION, [r.to_wire() for r in ordered]], use_bin_type=True)
    if len(data) > MAX_RECORD_SET_BYTES:
        raise ValueError("record set over the size limit")
    return data


def decode_record_set(data: bytes, *, max_bytes: int = MAX_RECORD_SET_BYTES) -> list[SignedRecord]:
    """Decode a stored DHT value into records, without validating them.

    Returns the records in their encoded order. Raises ``RemoteProtocolError`` (a
    ``RecordRejected`` with reason ``oversized`` or ``malformed``) for anything else: no other
    exception escapes for any input bytes.
    """
    if len(data) > max_bytes:
        raise RecordRejected("oversized", f"{len(data)} bytes > {max_bytes}")
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_bin_len=MAX_VALUE_BYTES,
            max_str_len=0,
            max_array_len=MAX_SUBKEYS,
            max_map_len=0,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises a zoo (ValueError, ExtraData, FormatError, ...)
        raise RecordRejected("malformed", f"{type(exc).__name__}: {exc}") from exc
    if (
        not isinstance(obj, list)
        or len(obj) != 2
        or obj[0] != RECORD_FORMAT_VERSION
        or type(obj[0]) is not int
        or not isinstance(obj[1], list)
    ):
        raise RecordRejected("malformed", "expected [version, [records]]")
    return [SignedRecord.from_wire(item) for item in obj[1]]


def merge_records(
    current: Mapping[bytes, SignedRecord], incoming: Iterable[SignedRecord], *, now: float
) -> dict[bytes, SignedRecord]:
    """Per subkey, the freshest unexpired record of ``current`` and ``incoming``.

    Both inputs must already be validated for the same key. Commutative and idempotent.
    """
    merged = {sk: r for sk, r in current.items() if r.expiration_time > now}
    for record in incoming:
        if record.expiration_time <= now:
            continue
        held = merged.get(record.subkey)
        if held is None or record.freshness() > held.freshness():
            merged[record.subkey] = record
    return merged


def valid_records(
    data: bytes, *, key: bytes, now: float, strict: bool
) -> dict[bytes, SignedRecord]:
    """Decode and validate a stored value into ``{subkey: freshest valid record}``.

    ``strict=True`` (a peer asking us to store): any invalid record rejects the whole value with
    ``RecordRejected``. ``strict=False`` (a reader): invalid or expired records are dropped
    one by one, since one bad replica must not hide the good entries it also carries.
    Malformed bytes raise ``RemoteProtocolError`` in both modes.
    """
    good: list[SignedRecord] = []
    for record in decode_record_set(data):
        try:
            validate_record(record, key=key, now=now)
        except RecordRejected:
            if strict:
                raise
            continue
        good.append(record)
    return merge_records({}, good, now=now)


def subkey_values(records: Mapping[bytes, SignedRecord], *, now: float) -> dict[bytes, bytes]:
    """What a reader sees: ``{subkey: value}`` of the unexpired records."""
    return {sk: r.value for sk, r in records.items() if r.expiration_time > now}
