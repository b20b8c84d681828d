"""Auditable aggregation: what a reducer says it summed, and a referee's recomputation of a part.

With exact (lossless) averaging, a reduced part is a pure function of its inputs
(``allreduce.reduce_part``: contributors' slices and weights, summed in sorted peer order in
float64). So a reducer can commit to a part by publishing, per part it reduced, each input's
SHA-256 with its weight and the output's SHA-256 (``PartAudit``, from ``audits_of`` after the
round). A referee that fetches the slices from their contributors checks them against the input
hashes and recomputes the part (``recheck``):

* inputs match, output differs: the reducer cheated (its sum is wrong);
* an input's claimed hash carries no valid signature of its contributor: the reducer claims to
  have summed something nobody sent (every slice travels with its sender's Ed25519 signature over
  ``proof_message``: run, round, group, part, weight, slice hash, and the reducer checked it on
  receipt);
* a contributor serves the referee a slice other than the one it signed: that contributor lies.

``audited`` draws which parts a referee checks: SHA-256 of (run, round, group, part) under a
rate, so every member knows which results to wait for. ``encode_audits``/``decode_audits`` are
a member's published ``AuditRecord``, a ``p2p`` wire message (code 132, its ``PartAudit`` claims
nested as code 131): sizes bounded, every field checked when it is built, so a writer cannot
publish what readers refuse, and a malformed value is one ``RemoteProtocolError`` (the record is
ignored: ``decode_audits`` returns None).

Pure: no IO.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

import numpy as np

from p2p import LocalProtocolError, Message, RemoteProtocolError, decode, encode, message
from swarm.averaging.allreduce import AllReduce, reduce_part

log = logging.getLogger(__name__)

MAX_AUDIT_RECORD_BYTES = 15872  # under p2p.dht.records.MAX_VALUE_BYTES (16 KiB)
MAX_PARTS = 256
# Parts per round the audit covers: a member's record lists every part's reducer (~40 bytes) and
# each of its own parts' inputs (~150 bytes each, a signature included): under 15.5 KiB with 64
# members.
MAX_AUDITED_PARTS = 64
# Values a member publishes for one round's record (``audit_values``): one per claim at most
# (``split_record``), and a member claims only parts it reduced, so an audited round needs at
# most MAX_AUDITED_PARTS. The DHT holds no more of one owner under a round's audit key
# (``p2p.dht.store.MULTI_ENTRY_KEY_FAMILIES``): a few identities cannot fill its 1,024 subkeys.
MAX_AUDIT_VALUES = MAX_AUDITED_PARTS
MAX_INPUTS = 256
_SLICE_TAG = b"swarmtrain/slice/1"
_PROOF_TAG = b"swarmtrain/slice-proof/1"
MAX_PROOF_BYTES = 128
MAX_PEER_ID_BYTES = 64
DIGEST_BYTES = 32


def proof_message(
    run_id: str, round_number: int, group_id: bytes, part: int, weight: float, digest: bytes
) -> bytes:
    """What a contributor signs for its slice of ``part``: a reducer cannot claim to have summed
    other bytes, or another weight, from it without this signature."""
    return b"".join(
        [
            _PROOF_TAG,
            len(run_id).to_bytes(4, "little"),
            run_id.encode(),
            round_number.to_bytes(8, "little"),
            len(group_id).to_bytes(4, "little"),
            group_id,
            part.to_bytes(4, "little"),
            np.float64(weight).tobytes(),
            digest,
        ]
    )


def slice_hash(values: np.ndarray) -> bytes:
    """SHA-256 of a float32 slice's little-endian bytes (tagged)."""
    data = np.ascontiguousarray(values, dtype="<f4")
    return hashlib.sha256(_SLICE_TAG + memoryview(data).cast("B")).digest()


@message(131, max_bytes=MAX_AUDIT_RECORD_BYTES)
class PartAudit(Message):
    """A reducer's claim about one part: its range, each input (peer, weight, slice hash, the
    peer's signature over them) in sorted peer order, and the output's hash. Raises
    ``ValueError`` when a field is out of range."""

    part: int
    start: int
    stop: int
    inputs: tuple[tuple[bytes, float, bytes, bytes], ...]
    output: bytes

    def __post_init__(self) -> None:
        if not (self.part >= 0 and 0 <= self.start <= self.stop):
            raise ValueError("a part audit needs part >= 0 and 0 <= start <= stop")
        if not 0 < len(self.inputs) <= MAX_INPUTS:
            raise ValueError(f"a part audit lists 1..{MAX_INPUTS} inputs, not {len(self.inputs)}")
        for peer, weight, digest, proof in self.inputs:
            _check_peer(peer)
            if not (math.isfinite(weight) and weight > 0):
                raise ValueError("an input's weight must be positive and finite")
            if len(digest) != DIGEST_BYTES or len(proof) > MAX_PROOF_BYTES:
                raise ValueError("an input's hash or signature has a bad length")
        if len(self.output) != DIGEST_BYTES:
            raise ValueError(f"the output hash must be {DIGEST_BYTES} bytes")


MAX_SLICE_DISPUTES = 16


@message(134, max_bytes=MAX_AUDIT_RECORD_BYTES)
class SliceDispute(Message):
    """Evidence that ``peer`` sent a slice of ``part`` (``[start, stop)`` of the vector) other
    than its task's: the weight and slice hash it signed, and its signature over them
    (``proof_message``). A verifier, which re-executed the peer's task and so knows its
    pseudo-gradient bit for bit, publishes one for a referee to rule on. Raises ``ValueError``
    when a field is out of range."""

    part: int
    start: int
    stop: int
    peer: bytes
    weight: float
    digest: bytes
    proof: bytes

    def __post_init__(self) -> None:
        if not (self.part >= 0 and 0 <= self.start <= self.stop):
            raise ValueError("a slice dispute needs part >= 0 and 0 <= start <= stop")
        _check_peer(self.peer)
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise ValueError("a slice dispute's weight must be positive and finite")
        if len(self.digest) != DIGEST_BYTES or len(self.proof) > MAX_PROOF_BYTES:
            raise ValueError("a slice dispute's hash or signature has a bad length")


def misbound(record: AuditRecord, peer: bytes, expected: np.ndarray) -> list[SliceDispute]:
    """The inputs from ``peer`` that ``record``'s claims list with another hash than that of
    ``expected``'s range (the whole vector ``peer`` owes the round), as disputes carrying the
    claim's signed evidence: the slices ``peer`` signed that are not what it owes; and the
    slices of ``peer``'s that ``record``'s reducer refused (its ``slice_disputes``: they did not
    match what ``peer`` committed) and that are not what it owes."""
    out = [
        d
        for d in record.slice_disputes
        if d.peer == peer
        and d.stop <= len(expected)
        and d.digest != slice_hash(expected[d.start : d.stop])
    ]
    for audit in record.audits:
        if audit.stop > len(expected):
            continue  # another layout than ours: nothing we can say about it
        for q, weight, digest, proof in audit.inputs:
            if q == peer and digest != slice_hash(expected[audit.start : audit.stop]):
                out.append(
                    SliceDispute(audit.part, audit.start, audit.stop, q, weight, digest, proof)
                )
    return out


def audits_of(
    machine: AllReduce,
    proofs: Mapping[tuple[int, bytes], bytes],
    digests: Mapping[tuple[int, bytes], bytes] | None = None,
) -> list[PartAudit]:
    """The parts ``machine`` reduced itself over the round's final contributor set (call after
    it finished; the driver must have averaged losslessly, so a part's held values are the
    reduction itself), with each input's signature from ``proofs[(part, peer)]`` and its hash
    from ``digests`` (the driver hashed the slices it checked; any other is hashed here)."""
    digests = digests or {}
    members = frozenset(machine.members)
    out = []
    for p, over in sorted(machine.reduced_here.items()):
        held = machine.held[p]
        if held is None or held[1] != over or over != members:
            continue  # re-reduced elsewhere over another set: not what we hold
        _, start, stop = machine.parts[p]
        inputs = tuple(
            (
                q,
                machine.weights[q],
                digests.get((p, q)) or slice_hash(machine.raw[p][q]),
                proofs.get((p, q), b""),
            )
            for q in sorted(over)
        )
        out.append(PartAudit(p, start, stop, inputs, slice_hash(held[0])))
    return out


@dataclass(frozen=True)
class Ruling:
    """``ok`` True: the output is the reduction of the claimed inputs. False: someone cheated:
    ``contributor`` (it serves other bytes than it signed), else the reducer. None: cannot tell
    (a contributor did not serve its slice)."""

    ok: bool | None
    reason: str
    contributor: bytes | None = None


ProofCheck = Callable[[bytes, float, bytes, bytes], bool]  # (peer, weight, digest, proof)


def recheck(audit: PartAudit, slices: Mapping[bytes, np.ndarray], valid: ProofCheck) -> Ruling:
    """The referee's ruling on one part, from each contributor's slice as it serves it and
    ``valid(peer, weight, digest, proof)`` (the signature check of ``proof_message``)."""
    contributions = {}
    for peer, weight, digest, proof in audit.inputs:
        if not valid(peer, weight, digest, proof):
            return Ruling(False, f"part {audit.part}: an input {peer.hex()[-8:]} never signed")
        values = slices.get(peer)
        if values is None:
            return Ruling(None, f"part {audit.part}: no slice from {peer.hex()[-8:]}")
        if len(values) != audit.stop - audit.start or slice_hash(values) != digest:
            why = f"part {audit.part}: {peer.hex()[-8:]} serves other bytes than it signed"
            return Ruling(False, why, contributor=peer)
        contributions[peer] = (np.asarray(values, np.float32), weight)
    if slice_hash(reduce_part(contributions)) != audit.output:
        return Ruling(False, f"part {audit.part}: the output is not the mean of its inputs")
    return Ruling(True, f"part {audit.part}: output recomputed, equal")


def audited(
    run_id: str, round_number: int, group_id: bytes, part: int, rate: float, parts: int
) -> bool:
    """Whether a referee audits ``part`` of this round's group (probability ``rate``), which has
    ``parts`` parts in all. A round of more than ``MAX_AUDITED_PARTS`` parts is not audited: a
    member's record (every part's reducer, and its claims) would outgrow one DHT value."""
    if rate <= 0 or parts > MAX_AUDITED_PARTS:
        return False
    digest = hashlib.sha256(
        b"swarmtrain/audit/select"
        + len(run_id).to_bytes(4, "little")
        + run_id.encode()
        + round_number.to_bytes(8, "little")
        + group_id
        + part.to_bytes(4, "little")
    ).digest()
    return int.from_bytes(digest[:8], "little") < rate * 2**64


@message(132, max_bytes=MAX_AUDIT_RECORD_BYTES)
class AuditRecord(Message):
    """What a member publishes after a round: the round, its group, every part's reducer (as
    this member saw the round end), its claims about the parts it reduced itself, and the parts
    it disputes (asks a referee to audit, drawn or not). Raises ``ValueError`` when a field is
    out of range."""

    round: int
    group_id: bytes
    reducers: tuple[bytes, ...]
    audits: tuple[PartAudit, ...]
    disputed: tuple[int, ...] = ()
    # Slices that a member says are not what they owe: as their sender's task's verifier, or as
    # a reducer that refused them against their sender's committed contribution (issue 19).
    slice_disputes: tuple[SliceDispute, ...] = ()

    def __post_init__(self) -> None:
        if self.round < 0:
            raise ValueError("round must be >= 0")
        if max(len(self.reducers), len(self.audits), len(self.disputed)) > MAX_PARTS:
            raise ValueError(f"reducers, claims and disputes are at most {MAX_PARTS} each")
        if len(self.slice_disputes) > MAX_SLICE_DISPUTES:
            raise ValueError(f"a record carries at most {MAX_SLICE_DISPUTES} slice disputes")
        for reducer in self.reducers:
            _check_peer(reducer)
        if any(p < 0 for p in self.disputed):
            raise ValueError("a disputed part must be >= 0")


def _check_peer(peer: bytes) -> None:
    if not 0 < len(peer) <= MAX_PEER_ID_BYTES:
        raise ValueError(f"a peer id must be 1..{MAX_PEER_ID_BYTES} bytes")


def split_record(record: AuditRecord) -> list[bytes]:
    """``record`` encoded as one value, or as several (each with the reducers and disputed parts,
    and a share of the claims) when one would outgrow a DHT value: a member that took over lost
    peers' parts may claim many. Raises ValueError only if a single claim is too big."""
    try:
        return [encode_audits(record)]
    except ValueError:
        if len(record.audits) <= 1:
            raise
    half = len(record.audits) // 2
    return [
        *split_record(replace(record, audits=record.audits[:half])),
        *split_record(replace(record, audits=record.audits[half:])),
    ]


def audit_values(record: AuditRecord) -> list[bytes]:
    """What a member publishes of ``record``: ``split_record``'s values, at most
    ``MAX_AUDIT_VALUES`` (the DHT keeps no more of one owner). Only a round of more than
    ``MAX_AUDITED_PARTS`` parts, where no part is drawn, can need more: its later claims are
    left out. Raises ValueError only if a single claim is too big."""
    values = split_record(record)
    if len(values) > MAX_AUDIT_VALUES:
        log.info(
            "round %d: %d audit values, publishing the first %d (the later claims left out)",
            record.round, len(values), MAX_AUDIT_VALUES,
        )  # fmt: skip
    return values[:MAX_AUDIT_VALUES]


def merge_records(records: Sequence[AuditRecord]) -> AuditRecord | None:
    """One member's values (``split_record``) joined again: claims by part, disputes united.
    None when they disagree on the round or group."""
    if not records:
        return None
    first = records[0]
    if any(r.round != first.round or r.group_id != first.group_id for r in records):
        return None
    claims = {a.part: a for r in records for a in r.audits}
    disputed = sorted({p for r in records for p in r.disputed})
    return AuditRecord(
        first.round,
        first.group_id,
        first.reducers,
        tuple(claims.values()),
        tuple(disputed),
        slice_disputes([d for r in records for d in r.slice_disputes]),
    )


def slice_disputes(disputes: Iterable[SliceDispute]) -> tuple[SliceDispute, ...]:
    """What one record carries of ``disputes``: one per (part, peer), in that order, at most
    ``MAX_SLICE_DISPUTES``."""
    by_key = {(d.part, d.peer): d for d in disputes}
    return tuple(by_key[k] for k in sorted(by_key))[:MAX_SLICE_DISPUTES]


K = TypeVar("K")


def records_by_group(
    values: Iterable[tuple[K, AuditRecord]], round_number: int
) -> dict[bytes, dict[K, AuditRecord]]:
    """A read of a round's records, ``(member, record)``, as group id -> member -> its record
    (each member's values merged: ``split_record``); other rounds' records are left out."""
    split: dict[tuple[bytes, K], list[AuditRecord]] = {}
    for member, record in values:
        if record.round == round_number:
            split.setdefault((record.group_id, member), []).append(record)
    groups: dict[bytes, dict[K, AuditRecord]] = {}
    for (group_id, member), records in split.items():
        merged = merge_records(records)
        if merged is not None:
            groups.setdefault(group_id, {})[member] = merged
    return groups


def contested(record: AuditRecord, me: bytes, mine: Sequence[bytes]) -> list[int]:
    """Parts whose claim in ``record`` lists an input from ``me`` whose hash is not that of our
    slice (``mine[part]``): the reducer says it summed something we did not send."""
    out = []
    for audit in record.audits:
        for peer, _, digest, _ in audit.inputs:
            if peer == me and 0 <= audit.part < len(mine) and digest != mine[audit.part]:
                out.append(audit.part)
    return out


def encode_audits(record: AuditRecord) -> bytes:
    """Raises ValueError when over the record limit (``split_record`` then splits it)."""
    try:
        return encode(record)
    except LocalProtocolError as exc:
        raise ValueError(f"{len(record.audits)} part audits are over the limit: {exc}") from None


def decode_audits(data: bytes) -> AuditRecord | None:
    """The record, or None when it is malformed (``RemoteProtocolError``, logged; one over
    the record's size limit is refused by ``decode`` before any byte is parsed)."""
    try:
        return decode(data, AuditRecord)
    except RemoteProtocolError as exc:
        log.debug("audit record ignored: %s", exc)
        return None
