"""Sans-IO core of a butterfly all-reduce: one group, one round.

Theory of operation
-------------------
The vector is cut into contiguous parts, one per peer, sized by bandwidth (``partition``). Each
peer sends the slice of its local vector for part ``p`` to p's reducer (reduce-scatter), the
reducer averages the slices (``reduce_part``) and sends the reduced part to everyone (all-gather).
The machine never sends bytes: it returns actions (``SendPart``, ``SendReduced``, ...) for a driver.

Rules (all derived from facts every survivor sees; nothing is negotiated):

1. *Determinism.* A reduced part is a pure function of (part, contributor set): slices are summed
   in sorted peer-id order in float64, divided by the total weight, cast to float32 (the default
   ``aggregation``, "mean"; a robust rule of ``swarm.averaging.aggregation`` is as deterministic).
   Any peer that reduces a part over a set produces the same bytes, so a reduced part may be
   forwarded.
2. *Reducers.* Part p's reducer is the first alive peer of the chain that starts at p's owner and
   walks the sorted peer list cyclically. When it is lost, every survivor (finished or not) sends
   the new reducer first the reduced part p if it holds one, then its own slice of p (one FIFO
   stream per pair, so the forward arrives first). Each peer keeps its local vector, so any part
   can be rebuilt from survivors' slices alone.
3. *One contributor set.* ``members`` is the set this peer aims for; it only shrinks. A reducer
   settles its part once it holds every alive peer's slice: a reduced part it holds over exactly
   ``members`` (its own, or forwarded) is sent as is; otherwise a member whose slice never came
   (it was lost first) is excluded and the part is reduced over ``members``. Every reduced part
   carries its set, and a peer missing from a set was excluded, so whoever sees the part excludes
   it too. Sets shrink to one; a part reduced over a larger set is re-reduced.
4. *Lost is not excluded.* A lost peer whose slices already reached every reducer stays in the
   set: a survivor may have finished with it, and rule 2 forwards that peer's parts to whoever
   still needs them. It is excluded only when some reducer lacks its slice, and then no one can
   have finished with it (the part that lacks it was never reduced over it).
5. *Bad input drops the sender, never crashes the machine*: a slice or reduced part of the wrong
   length, dtype or shape, with NaN/inf values, a duplicate slice, malformed contributors, an index
   outside the round, a weight that changes. ``DropPeer(peer, reason)`` records why; the peer
   leaves ``alive`` and ``members``. A peer that sees itself excluded fails rather than return a
   partial mean.
6. *Finish* when every part is held over exactly ``members``. A finished peer still answers
   ``PeerLost`` (rule 2 forwarding and reducing parts reassigned to it), so the driver keeps it
   serving the round until the round's deadline.
7. *Not alone.* In a group of two or more, a round whose set shrank to this peer alone fails
   instead of finishing: its own vector back is no average (every other peer was lost or refused
   it: it was frozen, or cut off), so the round has nothing to give.
8. *Deadline.* The machine owns the round's ``deadline``, on the clock of the ``now`` it is
   given: a call at or past it fails an unfinished round (``DeadlineReached`` is the driver's
   timer firing, so the machine hears of it even when no message comes). A finished round
   ignores it.

The module runs past 400 lines because the events, actions and rules of one protocol belong in
one file (h11 ``_state.py``'s rule).

Events from non-members raise ``RemoteProtocolError`` and change nothing. After ``FAILED``
every call raises ``LocalProtocolError``. After ``DONE``, network events are ignored (late copies
are normal).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from p2p import LocalProtocolError, RemoteProtocolError
from swarm.averaging.aggregation import AGGREGATIONS, aggregate, reduce_part

__all__ = [
    "AllReduce",
    "AllReduceState",
    "DeadlineReached",
    "DropPeer",
    "Encoded",
    "Fail",
    "Finish",
    "PartReceived",
    "PeerLost",
    "PeerMisbehaved",
    "ReducedPartReceived",
    "SendPart",
    "SendReduced",
    "all_finite",
    "is_view_at",
    "partition",
    "reduce_part",
]

Contributors = tuple[tuple[bytes, float], ...]


def partition(
    numel: int,
    peers_sorted: Sequence[bytes],
    bandwidths: Sequence[int],
    chunks: int = 1,
    align: int = 1,
) -> list[tuple[bytes, int, int]]:
    """Cut ``range(numel)`` into contiguous parts proportional to integer bandwidths.

    Peer i's range ends at ``numel * cumsum(bw)[i] // sum(bw)``: integer arithmetic, so every peer
    computes the same boundaries. Each range is cut again into ``chunks`` near-equal parts, so a
    reducer can reduce and send its first chunk while later ones still arrive. Returns
    ``[(peer, start, stop), ...]``: peer i's chunks are parts ``i * chunks ... i * chunks +
    chunks - 1``, in ``peers_sorted`` order; parts may be empty. ``align``: every boundary is
    rounded down to a multiple of it (the vector's end excepted), so each part is whole leaves of
    a committed contribution (``swarm.averaging.commitment``). Raises ``LocalProtocolError`` on
    unsorted/duplicate peers, non-positive bandwidths, chunks or align.
    """
    if numel < 0 or len(peers_sorted) == 0 or len(peers_sorted) != len(bandwidths):
        raise LocalProtocolError("partition needs numel >= 0 and one bandwidth per peer")
    if list(peers_sorted) != sorted(set(peers_sorted)):
        raise LocalProtocolError("peers must be sorted and unique")
    if any(not isinstance(b, int) or isinstance(b, bool) or b <= 0 for b in bandwidths):
        raise LocalProtocolError("bandwidths must be positive integers")
    if not isinstance(chunks, int) or chunks < 1:
        raise LocalProtocolError("chunks must be a positive integer")
    if not isinstance(align, int) or align < 1:
        raise LocalProtocolError("align must be a positive integer")

    def aligned(at: int) -> int:
        return at if at == numel else at // align * align

    total = sum(bandwidths)
    parts, cumulative, start = [], 0, 0
    for peer, bandwidth in zip(peers_sorted, bandwidths, strict=True):
        cumulative += bandwidth
        stop = aligned(numel * cumulative // total)
        for k in range(chunks):
            parts.append(
                (
                    peer,
                    aligned(start + (stop - start) * k // chunks),
                    aligned(start + (stop - start) * (k + 1) // chunks),
                )
            )
        start = stop
    return parts


# ---- events (facts) ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Encoded:
    """A peer's slice kept as its wire bytes (a lossy codec's: int8 is a quarter of the float32
    values) instead of its values, for a machine given ``decode``: it decodes them each time it
    reduces the part. The driver made sure they decode (to finite float32 of the part's
    length) before handing them in; the machine then trusts them as it trusts checked
    values."""

    payload: bytes


@dataclass(frozen=True, slots=True)
class PartReceived:
    """``sender``'s raw slice of part ``part_index`` with its weight (reduce-scatter input):
    its values, or with a machine given ``decode`` its ``Encoded`` bytes."""

    sender: bytes
    part_index: int
    data: np.ndarray | Encoded
    weight: float


@dataclass(frozen=True, slots=True)
class ReducedPartReceived:
    """A reduced part from ``reducer``, reduced over ``contributors`` ((peer, weight), sorted)."""

    reducer: bytes
    part_index: int
    data: np.ndarray
    contributors: Contributors


@dataclass(frozen=True, slots=True)
class PeerLost:
    """The driver lost ``peer`` (stream reset, timeout, left)."""

    peer: bytes


@dataclass(frozen=True, slots=True)
class PeerMisbehaved:
    """The driver caught ``peer`` breaking the wire protocol (``reason`` says how)."""

    peer: bytes
    reason: str


@dataclass(frozen=True, slots=True)
class DeadlineReached:
    """The driver's timer for the round's deadline fired: nothing else to tell than ``now``
    (rule 8; a timer that fires early changes nothing)."""


# ---- actions (orders) --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SendPart:
    """Send ``local[start:stop]`` and our weight to ``peer`` as part ``part_index``."""

    peer: bytes
    part_index: int
    start: int
    stop: int


@dataclass(frozen=True, slots=True)
class SendReduced:
    """Send this reduced part (exactly these bytes and contributors) to ``peer``."""

    peer: bytes
    part_index: int
    data: np.ndarray
    contributors: Contributors


@dataclass(frozen=True, slots=True)
class DropPeer:
    """``peer`` is excluded from this round; log ``reason`` (and count it)."""

    peer: bytes
    reason: str


@dataclass(frozen=True, slots=True)
class Finish:
    """The round is done: ``result`` is the weighted mean over ``contributors``."""

    result: np.ndarray
    contributors: Contributors


@dataclass(frozen=True, slots=True)
class Fail:
    """The round failed on this peer; ``reason`` says why."""

    reason: str


Event = PartReceived | ReducedPartReceived | PeerLost | PeerMisbehaved | DeadlineReached
Action = SendPart | SendReduced | DropPeer | Finish | Fail


class AllReduceState(enum.Enum):
    SCATTERING = "SCATTERING"  # some part we reduce has no reduced version yet
    GATHERING = "GATHERING"  # our parts are reduced; waiting for the others'
    DONE = "DONE"
    FAILED = "FAILED"


def _finite_float32(data: object, length: int) -> str | None:
    """Why ``data`` is not a 1-D float32 array of ``length`` finite values, or None if it is."""
    if not isinstance(data, np.ndarray) or data.dtype != np.float32 or data.ndim != 1:
        return "data is not a 1-D float32 array"
    if len(data) != length:
        return f"length {len(data)} != {length}"
    if not all_finite(data):
        return "NaN or inf values"
    return None


_FINITE_BLOCK = 1 << 16


def all_finite(data: np.ndarray) -> bool:
    """No NaN or inf in the 1-D ``data``: ``np.isfinite(data).all()`` block by block into a
    small buffer, not a full-size boolean temporary (fresh memory the kernel must zero, and a
    second pass)."""
    flags = np.empty(min(len(data), _FINITE_BLOCK), np.bool_)
    for start in range(0, len(data), _FINITE_BLOCK):
        block = data[start : start + _FINITE_BLOCK]
        np.isfinite(block, out=flags[: len(block)])
        if not flags[: len(block)].all():
            return False
    return True


def is_view_at(piece: np.ndarray, vector: np.ndarray, start: int) -> bool:
    """``piece`` is ``vector[start:start + len(piece)]`` itself (same memory, not a copy)."""
    # Same address and stride within one live process means the same bytes.
    address = vector.ctypes.data + start * vector.itemsize
    return piece.ctypes.data == address and piece.strides == vector.strides


def _hashable(value: object) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _good_weight(weight: object, bounds: tuple[float, float] = (0.0, math.inf)) -> bool:
    return (
        isinstance(weight, int | float)
        and math.isfinite(weight)
        and weight > 0
        and bounds[0] <= weight <= bounds[1]
    )


class AllReduce:
    """One peer's view of one all-reduce round. See the module docstring for the rules.

    ``finalize(part_index, reduced)``, if given, maps each part this peer reduces to the values
    it holds and sends (the driver's encode-then-decode for a lossy codec); it must be a pure
    function of its arguments and return a float32 array of the same length.

    ``out``, if given, receives the result (``Finish.result`` is ``out``). The driver may hand in
    reduced parts that already are views of their place in ``out`` (received there), which are
    then not copied; it must not write to a place whose view the machine holds.

    ``allocate(length)``, if given, supplies the float32 array each part this peer reduces is
    written to (for example a ``swarm.averaging.buffers.BufferPool``'s ``take``); it must return an
    array nothing else is using.

    ``deadline`` and every ``now`` are on one clock, the driver's (rule 8); ``math.inf``: none.

    ``weight_bounds``: the weights the run allows, ``(low, high)``; a peer declaring another is
    dropped (a weight is a claim of work done: one inflated weight would outweigh every honest
    contribution, issue 19). A verified run fixes it (low == high); ours must be inside too.

    ``check_slice(sender, start, values)``, if given, may refuse a peer's raw slice with a reason
    (a pure function of its arguments): a verified run's verifier knows, bit for bit, what the
    owner of a task it re-executed must send, and drops an owner that sends anything else.
    ``align``: part boundaries on its multiples (``partition``; every peer must use the same).
    ``aggregation``: the rule each part this peer reduces is computed with (one of
    ``swarm.averaging.aggregation.AGGREGATIONS``; every peer of the group must use the same).

    ``own(part_index)``, if given, is our slice of that part as the other peers decode it (a
    lossy codec's round trip of ``local``'s slice), asked for each time this peer reduces the
    part; it must be a pure function of the index. Without it ``local``'s slice is used as it
    is. Why: a round trip of the whole vector up front is a vector-sized copy held through the
    round, where one part's worth exists only while that part is reduced; and a driver that
    keeps our slices' wire bytes may then let the result land in ``local`` (``out``), which
    the machine never reads values from.

    ``decode(payload, start, stop)``, if given, turns a slice of ``[start, stop)`` handed in
    ``Encoded`` back into its values (a pure function of its arguments, e.g. the round's
    ``payload.Layout.decode``), when this peer reduces the part: a received slice then costs
    its wire bytes for the whole round and its values only while reduced.

    ``start(now)`` then ``handle(event, now)``; both return a list of actions. They raise
    ``RemoteProtocolError`` for an event naming a non-member (nothing changes) and
    ``LocalProtocolError`` for an unknown event, a second ``start`` or any call after ``FAILED``.
    Any other exception is a bug.
    """

    def __init__(
        self,
        me: bytes,
        peers: Sequence[bytes],
        bandwidths: Sequence[int],
        local: np.ndarray,
        weight: float,
        deadline: float,
        finalize: Callable[[int, np.ndarray], np.ndarray] | None = None,
        chunks: int = 1,
        out: np.ndarray | None = None,
        allocate: Callable[[int], np.ndarray] | None = None,
        weight_bounds: tuple[float, float] = (0.0, math.inf),
        check_slice: Callable[[bytes, int, np.ndarray], str | None] | None = None,
        aggregation: str = "mean",
        own: Callable[[int], np.ndarray] | None = None,
        decode: Callable[[bytes, int, int], np.ndarray] | None = None,
        align: int = 1,
    ) -> None:
        if aggregation not in AGGREGATIONS:
            raise LocalProtocolError(f"aggregation must be one of {AGGREGATIONS}: {aggregation!r}")
        self.aggregation = aggregation
        self.peers: tuple[bytes, ...] = tuple(sorted(set(peers)))
        self._peer_set = frozenset(self.peers)
        if me not in self.peers or len(self.peers) != len(peers):
            raise LocalProtocolError("peers must be unique and include me")
        if _finite_float32(local, len(local) if isinstance(local, np.ndarray) else -1):
            raise LocalProtocolError("local vector must be 1-D finite float32")
        self.weight_bounds = weight_bounds
        self.check_slice = check_slice
        if not _good_weight(weight, weight_bounds):
            raise LocalProtocolError(f"weight must be positive, finite and in {weight_bounds}")
        order = sorted(range(len(peers)), key=lambda i: peers[i])
        self.chunks = chunks
        self.parts = partition(
            len(local), self.peers, [bandwidths[i] for i in order], chunks, align
        )
        self.me = me
        self.local = local
        self.weight = float(weight)
        self.deadline = deadline
        self.state = AllReduceState.SCATTERING
        self.alive: set[bytes] = set(self.peers)  # may still send and reduce; only shrinks
        # _skip[i] == i while peers[i] is alive, else a later index to look from (cyclic):
        # finding a chain's head skips runs of lost peers in near-constant time.
        self._index = {peer: i for i, peer in enumerate(self.peers)}
        self._skip = list(range(len(self.peers)))
        self.members: set[bytes] = set(self.peers)  # the contributor set we aim for; only shrinks
        self.weights: dict[bytes, float] = {me: self.weight}
        # raw[p][peer]: peer's slice of part p; kept so that part p can be re-reduced (ours is
        # ``local``'s view, whose values count only without ``own``; others' may be ``Encoded``)
        self.raw: list[dict[bytes, np.ndarray | Encoded]] = [{} for _ in self.parts]
        for index, (_, start, stop) in enumerate(self.parts):
            self.raw[index][me] = local[start:stop]
        self.held: list[tuple[np.ndarray, frozenset[bytes]] | None] = [None] * len(self.parts)
        self.sent: list[frozenset[bytes] | None] = [None] * len(self.parts)  # what we broadcast
        self.reducer_of: list[bytes] = [self._chain_head(p) for p in range(len(self.parts))]
        # Indices kept so that one event costs what it touches, not O(parts): the parts each
        # peer reduces, and the parts settled (held over exactly ``members``).
        self._parts_of: dict[bytes, list[int]] = {}
        for p, reducer in enumerate(self.reducer_of):
            self._parts_of.setdefault(reducer, []).append(p)
        self._settled_parts: set[int] = set()
        # Contributor lists already checked (a broadcast's list is the same for every part).
        self._checked_lists: set[Contributors] = set()
        # Parts this peer reduced itself, and over which set: what it can be audited for.
        self.reduced_here: dict[int, frozenset[bytes]] = {}
        # Slices ``check_slice`` refused, sender -> (part, weight): evidence a caller may report.
        self.refused: dict[bytes, tuple[int, float]] = {}
        self.started = False
        # A lossy wire codec: the reducer must hold what everyone else decodes, not its own
        # float32 mean, or its result would differ from theirs in the dropped bits.
        self._finalize = finalize
        self._own = own
        self._decode = decode
        if out is not None and (
            not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.shape != local.shape
        ):
            raise LocalProtocolError("out must be a float32 array shaped like local")
        self._out = out
        self._allocate = allocate

    # -- public ----------------------------------------------------------------------------------

    def start(self, now: float) -> list[Action]:
        """Send our slices to their reducers. Call once, before ``handle``."""
        self._check_live()
        if self.started:
            raise LocalProtocolError("already started")
        self.started = True
        if now >= self.deadline:
            return self._fail("deadline reached before the round started")
        actions: list[Action] = [
            SendPart(reducer, p, *self.parts[p][1:])
            for p, reducer in enumerate(self.reducer_of)
            if reducer != self.me
        ]
        return actions + self._progress()

    def handle(self, event: Event, now: float) -> list[Action]:
        """Apply one fact; return the actions it calls for (errors: see the class docstring)."""
        self._check_live()
        if not self.started:
            raise LocalProtocolError("handle before start")
        expired = now >= self.deadline and self.state is not AllReduceState.DONE
        if isinstance(event, DeadlineReached):
            return self._expire() if expired else []  # a finished round stands
        peer = self._peer_of(event)
        if peer not in self._peer_set:
            raise RemoteProtocolError(f"event from a peer outside the group: {peer!r}")
        if expired:
            return self._expire()
        if peer not in self.alive:
            return []  # late messages from lost or dropped peers are normal
        if isinstance(event, PeerLost):
            return self._remove({peer: "lost"}, contributor_too=False)
        if isinstance(event, PeerMisbehaved):
            # After DONE our result stands; the peer then only stops being served, like a lost one.
            done = self.state is AllReduceState.DONE
            return self._remove({peer: event.reason}, contributor_too=not done)
        if self.state is AllReduceState.DONE:
            return []  # late copies after we finished
        if isinstance(event, PartReceived):
            reason = self._check_part(event)
            if reason:
                return self._remove({peer: reason})
            self.raw[event.part_index][peer] = event.data
            self.weights[peer] = float(event.weight)
            return self._progress()
        reason = self._check_reduced(event)
        if reason:
            return self._remove({peer: reason})
        contributors = frozenset(p for p, _ in event.contributors)
        if not contributors <= self.members:
            return []  # reduced before the sender learned of an exclusion; a newer one follows
        for p, w in event.contributors:
            self.weights.setdefault(p, w)
        held = self.held[event.part_index]
        if held is None or contributors != held[1]:
            self._hold(event.part_index, (event.data, contributors))
        outsiders = {p: "excluded by another peer" for p in self.members - contributors}
        return self._remove(outsiders) if outsiders else self._progress()

    @property
    def max_orders_per_peer(self) -> int:
        """The most ``SendPart`` and ``SendReduced`` this machine orders to one peer in a round
        (a driver's queue bound): with P parts and N peers, at most P at ``start``; 2 per part
        when that peer becomes its reducer, which happens once per part since reducers only
        move down their chain; and one per broadcast of a part we reduce, at most N per part,
        since each is over a smaller set than the one before."""
        return len(self.parts) * (len(self.peers) + 3)

    # -- rules -----------------------------------------------------------------------------------

    def _chain_head(self, part_index: int) -> bytes:
        """Part p's reducer: the first alive peer from p's owner on, cyclic in sorted order."""
        skip = self._skip
        root = part_index // self.chunks
        while skip[root] != root:  # ends: we are alive
            root = skip[root]
        i = part_index // self.chunks
        while skip[i] != root:
            skip[i], i = root, skip[i]
        return self.peers[root]

    def _check_part(self, event: PartReceived) -> str | None:
        if not 0 <= event.part_index < len(self.parts):
            return f"part index {event.part_index} out of range"
        _, start, stop = self.parts[event.part_index]
        if event.sender in self.raw[event.part_index]:
            return f"duplicate slice of part {event.part_index}"
        if not _good_weight(event.weight):
            return "weight not positive and finite"
        if not _good_weight(event.weight, self.weight_bounds):
            low, high = self.weight_bounds
            return f"weight {event.weight:g} outside the run's bounds [{low:g}, {high:g}]"
        if self.weights.get(event.sender, event.weight) != event.weight:
            return "weight changed within the round"
        data = event.data
        if isinstance(data, Encoded) and self._decode is not None:
            if self.check_slice is None:
                return None  # the driver checked that it decodes
            data = self._decode(data.payload, start, stop)
        why = _finite_float32(data, stop - start)
        if not why and self.check_slice is not None:
            assert isinstance(data, np.ndarray)
            why = self.check_slice(event.sender, start, data)
            if why:
                self.refused[event.sender] = (event.part_index, float(event.weight))
        return f"part {event.part_index}: {why}" if why else None

    def _check_reduced(self, event: ReducedPartReceived) -> str | None:
        p = event.part_index
        if not 0 <= p < len(self.parts):
            return f"reduced part index {p} out of range"
        entries = event.contributors
        if not isinstance(entries, tuple) or not entries:
            return "empty contributor list"
        # A list that passed once passes again: the checks below read only constants and weights
        # first set from a passed list, never changed.
        if not (_hashable(entries) and entries in self._checked_lists):
            ids = [e[0] for e in entries if isinstance(e, tuple) and len(e) == 2]
            known = self._peer_set.issuperset(ids)
            if len(ids) != len(entries) or ids != sorted(set(ids)) or not known:
                return f"contributors of part {p} malformed or not in the group"
            for peer, weight in entries:
                if (
                    not _good_weight(weight, self.weight_bounds)
                    or self.weights.get(peer, weight) != weight
                ):
                    return f"weight of {peer!r} invalid or inconsistent"
            if _hashable(entries):
                self._checked_lists.add(entries)
        _, start, stop = self.parts[p]
        why = _finite_float32(event.data, stop - start)
        return f"reduced part {p}: {why}" if why else None

    def _remove(self, reasons: dict[bytes, str], contributor_too: bool = True) -> list[Action]:
        """Take peers out of ``alive`` (and of ``members`` unless merely lost); reassign parts.

        A lost peer stays a member: its slices may already be in parts others hold. A reducer
        drops it from ``members`` only when it lacks its slice (``_progress``).
        """
        if self.me in reasons:
            return self._fail(f"excluded from the round: {reasons[self.me]}")
        actions: list[Action] = []
        shrunk = False
        for peer, reason in sorted(reasons.items()):
            if peer in self.alive or (contributor_too and peer in self.members):
                actions.append(DropPeer(peer, reason))
            if peer in self.alive:
                self.alive.discard(peer)
                index = self._index[peer]
                self._skip[index] = (index + 1) % len(self.peers)
            if contributor_too and peer in self.members:
                self.members.discard(peer)
                shrunk = True
        if shrunk:
            self._recount_settled()
        # Only the parts of a reducer that left alive move: a chain's head only changes when it
        # is removed (peers before it on the chain were already gone).
        moved = sorted(
            p for peer in reasons if peer not in self.alive for p in self._parts_of.pop(peer, ())
        )
        for p in moved:
            head = self._chain_head(p)
            self._parts_of.setdefault(head, []).append(p)
            if head == self.reducer_of[p]:
                continue
            self.reducer_of[p] = head
            self.sent[p] = None
            if head != self.me:
                # forward what we hold first (FIFO), so the new reducer sees it before our slice
                held = self.held[p]
                if held is not None:
                    listed = self._contributors(held[1])
                    actions.append(SendReduced(head, p, held[0], listed))
                actions.append(SendPart(head, p, *self.parts[p][1:]))
        return actions + self._progress()

    def _progress(self) -> list[Action]:
        actions: list[Action] = []
        mine = self._parts_of.get(self.me, [])
        mine.sort()  # parts in index order, as a scan of all parts would take them
        for p in mine:
            held = self.held[p]
            if held is None or held[1] != self.members:
                if not self.alive <= self.raw[p].keys():
                    continue  # an alive peer's slice (sent after any forward it holds) is due
                missing = self.members - self.raw[p].keys()  # lost before their slice came
                if missing:
                    return actions + self._remove(dict.fromkeys(missing, "lost before sending"))
                contributions = {q: (self._values(p, q), self.weights[q]) for q in self.members}
                _, start, stop = self.parts[p]
                into = None if self._allocate is None else self._allocate(stop - start)
                reduced = aggregate(self.aggregation, contributions, into)
                if self._finalize is not None:
                    reduced = self._finalize(p, reduced)
                held = (reduced, frozenset(self.members))
                self._hold(p, held)
                self.reduced_here[p] = held[1]
            if self.sent[p] != held[1]:
                self.sent[p] = held[1]
                listed = self._contributors(held[1])
                targets = sorted(self.alive - {self.me})
                actions += [SendReduced(q, p, held[0], listed) for q in targets]
        mine_settled = all(self._settled(p) and self.sent[p] is not None for p in mine)
        if self.state is AllReduceState.DONE:
            pass  # a finished peer still serves parts reassigned to it, and finishes once
        elif len(self._settled_parts) == len(self.parts) and mine_settled:
            if len(self.peers) > 1 and self.members == {self.me}:
                return actions + self._fail("every other peer of the round was lost")  # rule 7
            self.state = AllReduceState.DONE
            actions.append(Finish(self._assemble(), self._contributors(self.members)))
        elif mine_settled:
            self.state = AllReduceState.GATHERING
        else:
            self.state = AllReduceState.SCATTERING
        return actions

    def _values(self, p: int, peer: bytes) -> np.ndarray:
        """``peer``'s slice of part ``p`` as values: ours through ``own`` when given, an
        ``Encoded`` one decoded (for this reduction only)."""
        if peer == self.me and self._own is not None:
            return self._own(p)
        data = self.raw[p][peer]
        if isinstance(data, Encoded):
            assert self._decode is not None  # ``_check_part`` refuses them otherwise
            _, start, stop = self.parts[p]
            return self._decode(data.payload, start, stop)
        return data

    def _assemble(self) -> np.ndarray:
        """The result vector: ``out`` (else a new one) with every held part in its place. A
        part the driver already received into its place in ``out`` is not copied again."""
        result = self._out if self._out is not None else np.empty_like(self.local)
        for (_, start, stop), entry in zip(self.parts, self.held, strict=True):
            assert entry is not None  # every part is settled before DONE
            if not is_view_at(entry[0], result, start):
                result[start:stop] = entry[0]
        return result

    def _expire(self) -> list[Action]:
        return self._fail(f"deadline reached; parts not settled: {self._unsettled()}")

    def _settled(self, p: int) -> bool:
        return p in self._settled_parts

    def _hold(self, p: int, entry: tuple[np.ndarray, frozenset[bytes]]) -> None:
        self.held[p] = entry
        if entry[1] == self.members:
            self._settled_parts.add(p)
        else:
            self._settled_parts.discard(p)

    def _recount_settled(self) -> None:
        members = self.members
        self._settled_parts = {
            p for p, held in enumerate(self.held) if held is not None and held[1] == members
        }

    def _unsettled(self) -> list[int]:
        return [p for p in range(len(self.parts)) if not self._settled(p)]

    def _contributors(self, peers: set[bytes] | frozenset[bytes]) -> Contributors:
        return tuple((peer, self.weights[peer]) for peer in sorted(peers))

    def _fail(self, reason: str) -> list[Action]:
        self.state = AllReduceState.FAILED
        return [Fail(reason)]

    def _check_live(self) -> None:
        if self.state is AllReduceState.FAILED:
            raise LocalProtocolError("the round failed; this machine refuses further calls")

    @staticmethod
    def _peer_of(event: object) -> bytes:
        if isinstance(event, PeerLost | PeerMisbehaved):
            return event.peer
        if isinstance(event, PartReceived):
            return event.sender
        if isinstance(event, ReducedPartReceived):
            return event.reducer
        raise LocalProtocolError(f"unknown event {type(event).__name__}")
