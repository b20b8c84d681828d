"""Sans-IO core of a hierarchical all-reduce: one round of many peers on a grid (``grid``).

Theory of operation
-------------------
Peers sit in rows (contiguous runs of the sorted peer ids); the vector is cut into columns, and
each column into one sub-part per row. Column c of row k has a *head*: the first alive peer of
row k from the row's c-th peer on, cyclic within the row (the flat ``AllReduce``'s reducer chain,
inside one row).

1. *Scatter in rows.* Each peer sends its slice of column c to its row's head of c (raw float32,
   with its weight).
2. *A chain of partial sums down the rows.* For each sub-part, the head of (row 0, c) sums its
   row's slices in sorted peer order into a float64 accumulator and sends it to the head of
   (row 1, c), which adds its own row's slices in sorted order, and so on. The last row's head,
   once it holds its column's whole sum, tells its row (``Ready``); once every column of the
   last row is Ready under the same exclusions (the *barrier*), it divides by the total weight
   (summed in sorted order) and casts to float32. This is, value for value, the flat
   all-reduce's ``reduce_part``: one float64 sum in sorted peer order over every contributor,
   then one division. So the result is bit-identical to the flat all-reduce's over the same
   contributors. Sub-parts pipeline the chain.
3. *Gather.* The reduced sub-parts travel back up the chain (last row to row 0); each head, once
   it holds its whole column, sends it to its row. Every peer ends with every column. A column
   that a peer heads only because its head was lost goes through relays (``_gather``): about
   sqrt(n) row mates, each forwarding the exact bytes to its run of the row, so the successor
   does not send a second whole broadcast (that made the busiest peer send 3-7x the vector
   under churn).

*Codecs.* In a lossy round (the run's int8 or fp16 ``compression``) ``local`` is our vector as
the others decode it, and each slice travels as the bytes it was decoded from
(``RawPart.payload``): a head sums, in float64 as above, exactly what the flat reducer would
have decoded. The chain stays float64. The last row's head encodes each reduced sub-part once,
as it divides it (``finalize``, as the flat reducer's), and keeps the decoding as its values;
the sub-parts go up the chain and the columns out to the rows as those very bytes
(``Reduced.payload``, ``Gathered.payloads``), never encoded again (an int8 encoding of decoded
values need not give the same bytes), so every survivor decodes the same bytes into the same
values.

Per peer: connections to its row and to the column chain's two neighbours, ``O(row)``; bytes
sent about ``2 (row - 1) / row`` of the (coded) vector plus ``8 / (columns x bytes per value)``
of it for the float64 chain (int8: ``8 / columns`` of the int8 vector), plus ``1 / columns`` for
the successor's copy of the head's own slice; a column taken over adds its chain share and
``sqrt(row) / columns`` (its relays), a relay ``sqrt(row) / columns`` (its run).

Losses (every rule from facts the peer sees; nothing is negotiated):

* *Exclusions only grow.* ``excluded`` is the set of peers left out of the sum; every item carries
  the exclusions it was computed under (an accumulator at row k: those in rows <= k), and a peer
  that receives an item naming an exclusion it did not know adopts it. An item computed under
  fewer exclusions than the receiver knows is stale and ignored (a newer one follows: whoever
  computed it learns the exclusion the same way). A peer that sees itself excluded fails.
* *Lost is not excluded* (as in ``allreduce`` rule 4): a head excludes a row member only when it
  must compute an accumulator, lacks that member's slice, and the member is lost. A head sends
  its own slice of each column it heads to its *successor* (the next alive peer of its row,
  who heads the column if it is lost), and a last-row head whose sum holds a lost row mate's
  slice sends the sum there too: a head lost after its scatter stays a contributor.
* *One gather.* No column is divided before the barrier, so an exclusion found in any chain
  reaches every column while only partial sums (from the excluded peer's row down) are redone;
  without it, each exclusion found after some columns were gathered meant gathering every
  column again (at 217 peers a frozen head's exclusion came after the first gather and the
  second one missed the deadline). A Ready counts only while its sender heads the column.
* *A lost head's roles move* to the next alive peer of its row. Its row mates send the new head
  the column they hold (if gathered) and then their slice; the new head announces itself
  (``Takeover``) to the heads above and below it in the column's chain, which send it what they
  hold from that role (accumulators, reduced sub-parts), then what they owe it, then
  ``Handover``. Only after every announced neighbour's ``Handover`` does the new head compute:
  a partial sum or reduced sub-part that reached any of them is reused, not recomputed, so a
  lost head whose contribution already went down the chain stays a contributor.
* *A relay lost* before it forwarded a column is replaced: the head sends that column to the
  relay's run directly (a copy that arrives twice is the same bytes, stored again).
* *Finish* when every column is held under exactly ``excluded``; a finished peer keeps serving
  (forwarding, relaying, answering takeovers) until the driver ends the round: at the deadline,
  or once its row and the rows above and below it hold their results (nobody else sends it an
  item or a ``Takeover``).
* *Deadline* as in ``allreduce`` rule 8.

What this machine does not cover: a lost head whose neighbours in the chain are lost at the same
time may leave a column that only a dead peer held; peers then miss it and fail at the deadline
(a failure, never a wrong result: no peer computes a sum without a slice it needs).

Events: ``ItemReceived``, ``allreduce.PeerLost``, ``allreduce.DeadlineReached``. Actions:
``SendItem``, ``allreduce.Finish``, ``allreduce.Fail``. Events naming a non-member raise
``RemoteProtocolError``; calls after ``FAILED`` raise ``LocalProtocolError``.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from p2p import LocalProtocolError, RemoteProtocolError
from swarm.averaging.allreduce import (
    DeadlineReached,
    DropPeer,
    Fail,
    Finish,
    PeerLost,
    all_finite,
)
from swarm.averaging.grid import GridPlan

__all__ = [
    "Accumulated",
    "Excluded",
    "Gathered",
    "GridAllReduce",
    "GridState",
    "Handover",
    "ItemReceived",
    "RawPart",
    "Ready",
    "Reduced",
    "SendItem",
    "Takeover",
]

Tag = frozenset[bytes]


@dataclass(frozen=True, slots=True)
class RawPart:
    """A peer's own slice of ``column`` (float32, as its head decodes it) and its weight: to its
    row's head. ``payload``: its wire bytes under the round's codec (None: lossless)."""

    column: int
    data: np.ndarray
    weight: float
    payload: bytes | None = None


@dataclass(frozen=True, slots=True)
class Accumulated:
    """The float64 partial sum of sub-part ``(column, sub)`` over rows ``0..row``, without
    ``excluded``: from the head of ``(row, column)`` to the head of ``(row + 1, column)``."""

    column: int
    sub: int
    row: int
    excluded: Tag
    data: np.ndarray


@dataclass(frozen=True, slots=True)
class Reduced:
    """Sub-part ``(column, sub)`` of the result (float32) over everyone but ``excluded``;
    ``payload``: the bytes the last row's head encoded it as (``data`` is their decoding), or
    None in a lossless round."""

    column: int
    sub: int
    excluded: Tag
    data: np.ndarray
    payload: bytes | None = None


@dataclass(frozen=True, slots=True)
class Gathered:
    """Column ``column`` of the result (float32) over everyone but ``excluded``; the receiver
    sends the same bytes on to each row mate in ``forward`` (a relay: ``_gather``).
    ``payloads``: its sub-parts' ``Reduced.payload`` bytes, one per row (None: lossless)."""

    column: int
    excluded: Tag
    data: np.ndarray
    forward: tuple[bytes, ...] = ()
    payloads: tuple[bytes, ...] | None = None


@dataclass(frozen=True, slots=True)
class Takeover:
    """The sender is now the head of ``(row, column)`` (every peer before it there is lost)."""

    column: int
    row: int


@dataclass(frozen=True, slots=True)
class Handover:
    """The sender has sent everything it holds from the role ``(row, column)``."""

    column: int
    row: int


@dataclass(frozen=True, slots=True)
class Ready:
    """The last row's head of ``column`` holds its whole partial sum over every row, without
    ``excluded``: to the last row's other members (the barrier before the division)."""

    column: int
    excluded: Tag


@dataclass(frozen=True, slots=True)
class Excluded:
    """News: every peer of ``excluded`` is left out of the round's sum."""

    excluded: Tag


Item = RawPart | Accumulated | Reduced | Gathered | Takeover | Handover | Ready | Excluded


@dataclass(frozen=True, slots=True)
class ItemReceived:
    sender: bytes
    item: Item


@dataclass(frozen=True, slots=True)
class SendItem:
    peer: bytes
    item: Item


class GridState(enum.Enum):
    RUNNING = "RUNNING"
    DONE = "DONE"
    FAILED = "FAILED"


class GridAllReduce:
    """One peer's view of one hierarchical round (module docstring). ``start(now)``, then
    ``handle(event, now)``; both return actions."""

    def __init__(
        self,
        me: bytes,
        plan: GridPlan,
        local: np.ndarray,
        deadline: float,
        *,
        payloads: Sequence[bytes] | None = None,
        finalize: Callable[[np.ndarray, int], tuple[np.ndarray, bytes]] | None = None,
    ) -> None:
        """``local``: our vector as the others decode it. A lossy round (module docstring,
        "Codecs") also gives ``payloads``, our slice of each column as wire bytes (``local``'s
        columns are their decoding), and ``finalize(values, start)``, which encodes a reduced
        sub-part starting at ``start`` and returns its decoding and its bytes: a pure function,
        the same on every peer."""
        if me not in plan.peers:
            raise LocalProtocolError("me must be in the plan")
        if (payloads is None) != (finalize is None) or (
            payloads is not None and len(payloads) != plan.columns
        ):
            raise LocalProtocolError("a lossy round needs payloads (one per column) and finalize")
        if (
            not isinstance(local, np.ndarray)
            or local.dtype != np.float32
            or local.shape != (plan.numel,)
            or not all_finite(local)
        ):
            raise LocalProtocolError("local vector must be 1-D finite float32 of plan.numel")
        self.me, self.plan, self.local, self.deadline = me, plan, local, deadline
        self.payloads = None if payloads is None else tuple(payloads)
        self._finalize = finalize
        self.index = {peer: i for i, peer in enumerate(plan.peers)}
        self.row_index = {peer: plan.row_of(i) for i, peer in enumerate(plan.peers)}
        self.my_row = self.row_index[me]
        self.weight = plan.weights[self.index[me]]
        self.state = GridState.RUNNING
        self.started = False
        self.alive: set[bytes] = set(plan.peers)
        self.excluded: set[bytes] = set()
        self.raw: dict[int, dict[bytes, np.ndarray]] = {}  # column -> row member -> slice
        self.acc_in: dict[tuple[int, int], tuple[Tag, np.ndarray]] = {}  # from the row above
        self.acc_out: dict[tuple[int, int], tuple[Tag, np.ndarray]] = {}  # ours, or handed over
        # with their wire bytes in a lossy round (``Reduced.payload``, ``Gathered.payloads``)
        self.reduced: dict[tuple[int, int], tuple[Tag, np.ndarray, bytes | None]] = {}
        self.gathered: dict[int, tuple[Tag, np.ndarray, tuple[bytes, ...] | None]] = {}
        self.sent: dict[tuple[object, ...], tuple[bytes, Tag | None]] = {}
        self.awaiting: dict[int, set[bytes]] = {}  # column taken over -> Handover still due from
        # last row: column -> (exclusions, head) of the last Ready for it (``_barrier``)
        self.ready: dict[int, tuple[Tag, bytes]] = {}
        self._ready_version = 0
        self._told: dict[int, tuple[Tag, int]] = {}  # column -> (tag, alive count) Ready went at
        self._divided: dict[int, Tag] = {}
        self._open_key: tuple[int, int, Tag] | None = None
        self._open_now = False
        self._heads: dict[tuple[int, int], bytes | None] = {}  # (row, column) -> head, as known
        self._raw_due = True  # our slices' heads may have moved since we last sent them
        # relay -> (column, exclusions, row mates it was to forward to), for columns we
        # gathered through relays (``_gather``)
        self._relayed: dict[bytes, list[tuple[int, Tag, tuple[bytes, ...]]]] = {}
        self.mine: list[int] = self._my_columns()

    # -- public ----------------------------------------------------------------------------------

    def start(self, now: float) -> list[object]:
        self._check_live()
        if self.started:
            raise LocalProtocolError("already started")
        self.started = True
        if now >= self.deadline:
            return self._fail("deadline reached before the round started")
        return self._progress()

    def handle(self, event: object, now: float) -> list[object]:
        self._check_live()
        if not self.started:
            raise LocalProtocolError("handle before start")
        expired = now >= self.deadline and self.state is not GridState.DONE
        if isinstance(event, DeadlineReached):
            return self._fail("deadline reached") if expired else []
        if isinstance(event, PeerLost):
            peer = event.peer
        elif isinstance(event, ItemReceived):
            peer = event.sender
        else:
            raise LocalProtocolError(f"unknown event {type(event).__name__}")
        if peer not in self.index:
            raise RemoteProtocolError(f"event from a peer outside the round: {peer!r}")
        if expired:
            return self._fail("deadline reached")
        if peer not in self.alive:
            return []  # late messages from lost peers are normal
        if isinstance(event, PeerLost):
            return self._lost([peer]) + self._progress()
        return self._receive(peer, event.item)

    @property
    def contributors(self) -> tuple[tuple[bytes, float], ...]:
        plan = self.plan
        return tuple(
            (p, w) for p, w in zip(plan.peers, plan.weights, strict=True) if p not in self.excluded
        )

    # -- roles -----------------------------------------------------------------------------------

    def head(self, row: int, column: int) -> bytes | None:
        """The head of ``(row, column)``: first alive peer from the row's ``column``-th on."""
        key = (row, column)
        if key in self._heads:
            return self._heads[key]
        members = self.plan.row(row)
        n = len(members)
        found = None
        for step in range(n):
            peer = self.plan.peers[members.start + (column + step) % n]
            if peer in self.alive:
                found = peer
                break
        self._heads[key] = found
        return found

    def _successor(self) -> bytes | None:
        """The next alive peer of our row after us, cyclic: who heads our columns if we are
        lost (None alone in the row)."""
        members = self.plan.row(self.my_row)
        n, pos = len(members), self.index[self.me] - members.start
        for step in range(1, n):
            peer = self.plan.peers[members.start + (pos + step) % n]
            if peer in self.alive:
                return peer
        return None

    def _my_columns(self) -> list[int]:
        return [c for c in range(self.plan.columns) if self.head(self.my_row, c) == self.me]

    def _tag(self, row: int) -> Tag:
        """The exclusions an accumulator through ``row`` is computed under."""
        return frozenset(p for p in self.excluded if self.row_index[p] <= row)

    # -- events ----------------------------------------------------------------------------------

    def _lost(self, peers: Iterable[bytes]) -> list[object]:
        gone = [p for p in peers if p in self.alive and p != self.me]
        if not gone:
            return []
        # A head changes only when it is lost (the peers before it were already gone).
        gone_set = set(gone)
        near = set(self._near_rows())
        moved = {key: old for key, old in self._heads.items() if old in gone_set}
        for key in moved:
            del self._heads[key]
        self.alive.difference_update(gone)
        self._raw_due = True
        actions: list[object] = []
        for (k, c), old in sorted(moved.items()):
            if k not in near:
                continue
            new = self.head(k, c)
            if new == old or new is None:
                continue
            if new == self.me:
                actions += self._take_over(c)
            elif k == self.my_row and c in self.gathered:
                # forward the column first (FIFO): the new head reuses it before deciding
                tag, data, payloads = self.gathered[c]
                actions.append(SendItem(new, Gathered(c, tag, data, (), payloads)))
        for c, due in self.awaiting.items():
            for peer in list(due):
                if peer not in self.alive:
                    due.discard(peer)
                    actions += self._announce(c, due)
        tag = frozenset(self.excluded)
        for relay in gone:  # it may not have forwarded: its row mates get the column from us
            for c, relayed_tag, targets in self._relayed.pop(relay, []):
                held = self.gathered.get(c)
                if relayed_tag == tag and held is not None and held[0] == tag:
                    for peer in targets:
                        if peer in self.alive:
                            relayed = Gathered(c, tag, held[1], (), held[2])
                            actions.append(SendItem(peer, relayed))
        self.mine = self._my_columns()
        return actions

    def _near_rows(self) -> list[int]:
        return [
            k for k in (self.my_row - 1, self.my_row, self.my_row + 1) if 0 <= k < self.plan.rows
        ]

    def _columns(self) -> range:
        return range(self.plan.columns)

    def _take_over(self, column: int) -> list[object]:
        if self.plan.rows == 1:
            return []
        due: set[bytes] = set()
        self.awaiting[column] = due
        return self._announce(column, due)

    def _announce(self, column: int, due: set[bytes]) -> list[object]:
        """Tell the column's chain neighbours we head ``(my_row, column)`` now."""
        actions: list[object] = []
        for k in (self.my_row - 1, self.my_row + 1):
            if 0 <= k < self.plan.rows:
                peer = self.head(k, column)
                if peer is not None and peer != self.me and peer not in due:
                    due.add(peer)
                    actions.append(SendItem(peer, Takeover(column, self.my_row)))
        return actions

    def _receive(self, sender: bytes, item: object) -> list[object]:
        if isinstance(item, Takeover | Handover):
            if not (
                isinstance(item.row, int)
                and isinstance(item.column, int)
                and 0 <= item.row < self.plan.rows
                and 0 <= item.column < self.plan.columns
            ):
                return self._drop(sender, "takeover outside the grid")
            if isinstance(item, Handover):
                self.awaiting.get(item.column, set()).discard(sender)
                return self._progress()
            return self._answer_takeover(sender, item)
        tag = getattr(item, "excluded", None)
        if tag is not None:
            if not isinstance(tag, frozenset) or not tag <= self.index.keys():
                return self._drop(sender, "malformed exclusions")
            if self.me in tag:
                return self._fail("excluded from the round")
            spread = self._exclude(tag, sender)
        else:
            spread = []
        why = self._store(sender, item)
        if why:
            return spread + self._drop(sender, why)
        if isinstance(item, Gathered) and item.forward:  # relayed: the exact bytes we got
            spread += [
                SendItem(p, Gathered(item.column, item.excluded, item.data, (), item.payloads))
                for p in item.forward
                if p in self.alive
            ]
        return spread + self._progress()

    def _store(self, sender: bytes, item: object) -> str | None:
        plan = self.plan
        if isinstance(item, RawPart):
            c = item.column
            if not (isinstance(c, int) and 0 <= c < plan.columns):
                return "column outside the grid"
            if self.row_index[sender] != self.my_row:
                return "raw slice from outside our row"
            if item.weight != plan.weights[self.index[sender]]:
                return "weight differs from its declaration"
            start, stop = plan.part(c)
            why = _check(item.data, stop - start, np.float32)
            if not why:
                self.raw.setdefault(c, {})[sender] = item.data
            return why
        if isinstance(item, Accumulated | Reduced):
            c, j = item.column, item.sub
            if not (isinstance(c, int) and isinstance(j, int)):
                return "indices are not integers"
            if not (0 <= c < plan.columns and 0 <= j < plan.rows):
                return "sub-part outside the grid"
            start, stop = plan.sub(c, j)
            if isinstance(item, Reduced):
                why = _check(item.data, stop - start, np.float32) or self._check_payload(
                    item.payload is not None
                )
                if not why and item.excluded == self.excluded:
                    self.reduced[(c, j)] = (item.excluded, item.data, item.payload)
                return why
            why = _check(item.data, stop - start, np.float64)
            if why:
                return why
            if item.row == self.my_row - 1 and item.excluded == self._tag(item.row):
                self.acc_in[(c, j)] = (item.excluded, item.data)
            elif item.row == self.my_row and item.excluded == self._tag(item.row):
                # handed over by the row below, or a copy from our row's head (``_barrier``)
                self.acc_out[(c, j)] = (item.excluded, item.data)
            return None
        if isinstance(item, Gathered):
            c = item.column
            if not (isinstance(c, int) and 0 <= c < plan.columns):
                return "column outside the grid"
            forward = item.forward
            if not isinstance(forward, tuple) or not all(
                p in self.index and self.row_index[p] == self.my_row and p not in (self.me, sender)
                for p in forward
            ):
                return "relay to peers outside our row"
            start, stop = plan.part(c)
            payloads = item.payloads
            why = _check(item.data, stop - start, np.float32) or self._check_payload(
                payloads is not None and len(payloads) == plan.rows
            )
            if not why and item.excluded == self.excluded:
                self.gathered[c] = (item.excluded, item.data, payloads)
                for j in range(plan.rows):  # its sub-parts, for the chain's gather
                    a, b = plan.sub(c, j)
                    payload = None if payloads is None else payloads[j]
                    self.reduced[(c, j)] = (
                        item.excluded,
                        item.data[a - start : b - start],
                        payload,
                    )
            return why
        if isinstance(item, Ready):
            c = item.column
            if not (isinstance(c, int) and 0 <= c < plan.columns):
                return "column outside the grid"
            last = plan.rows - 1
            if self.row_index[sender] != last or self.my_row != last:
                return "ready from or to outside the last row"
            if item.excluded == self.excluded:
                self.ready[c] = (item.excluded, sender)
                self._ready_version += 1
            return None
        if isinstance(item, Excluded):
            return None
        return f"unknown item {type(item).__name__}"

    def _answer_takeover(self, sender: bytes, item: Takeover) -> list[object]:
        """``sender`` heads ``(item.row, item.column)``: peers before it there are lost; send it
        what we hold from that role, what we owe it, then ``Handover``."""
        members = self.plan.row(item.row)
        n, pos = len(members), self.index[sender] - members.start
        if self.index[sender] not in members or self.my_row not in (item.row - 1, item.row + 1):
            return self._drop(sender, "takeover from outside our chain")
        skipped = [self.plan.peers[members.start + (item.column + s) % n] for s in range(n)]
        skipped = skipped[: (pos - item.column) % n]
        actions = self._lost(skipped)
        c = item.column
        if self.head(self.my_row, c) == self.me:
            if item.row == self.my_row + 1:  # it is below us: the reduced sub-parts came from it
                for j in range(self.plan.rows):
                    if (c, j) in self.reduced:
                        tag, data, payload = self.reduced[(c, j)]
                        actions.append(SendItem(sender, Reduced(c, j, tag, data, payload)))
            else:  # it is above us: its accumulators came to us
                for j in range(self.plan.rows):
                    if (c, j) in self.acc_in:
                        tag, data = self.acc_in[(c, j)]
                        actions.append(SendItem(sender, Accumulated(c, j, item.row, tag, data)))
        for key in [k for k in self.sent if k[0] in ("acc", "red") and k[1] == c]:
            del self.sent[key]  # what we owe it goes again
        actions += self._progress()
        actions.append(SendItem(sender, Handover(c, item.row)))
        return actions

    # -- progress --------------------------------------------------------------------------------

    def _progress(self) -> list[object]:
        if self.state is GridState.FAILED:
            return []
        actions: list[object] = []
        plan = self.plan
        if self._raw_due:
            self._raw_due = False
            for c in self._columns():
                head = self.head(self.my_row, c)
                if head is not None and head != self.me and self._owe(("raw", c), head, None):
                    start, stop = plan.part(c)
                    piece = self.local[start:stop]
                    actions.append(SendItem(head, RawPart(c, piece, self.weight, self._own(c))))
            # Our own slice of each column we head, to the peer that heads it if we are lost:
            # a head lost before its sum went down is then still a contributor (no exclusion,
            # so no column is summed and gathered a second time).
            successor = self._successor()
            for c in self.mine:
                if successor is not None and self._owe(("backup", c), successor, None):
                    start, stop = plan.part(c)
                    piece = self.local[start:stop]
                    raw = RawPart(c, piece, self.weight, self._own(c))
                    actions.append(SendItem(successor, raw))
        # In the last row a column's division waits for every column's Ready (``_column``); a
        # second pass divides the columns seen before the last one became ready.
        was_open = self._open(frozenset(self.excluded))
        for c in self.mine:
            if self.awaiting.get(c):
                continue  # a taken-over column waits for its neighbours' handovers
            more = self._column(c, actions)
            if more is not None:
                return actions + more
        if not was_open and self._open(frozenset(self.excluded)):
            for c in self.mine:
                if not self.awaiting.get(c):
                    more = self._column(c, actions)
                    if more is not None:
                        return actions + more
        if self.state is not GridState.DONE and all(
            self._column_result(c) is not None for c in self._columns()
        ):
            self.state = GridState.DONE
            result = np.empty_like(self.local)
            for c in self._columns():
                start, stop = plan.part(c)
                result[start:stop] = self._column_result(c)
            actions.append(Finish(result, self.contributors))
        return actions

    def _column(self, c: int, actions: list[object]) -> list[object] | None:
        """Our duties as head of ``(my_row, c)``; returns the rest of the actions when an
        exclusion restarts the progress."""
        plan, k = self.plan, self.my_row
        last = k == plan.rows - 1
        tag = frozenset(self.excluded)
        for j in range(plan.rows):
            if self.reduced.get((c, j), (None,))[0] == tag:
                continue
            if not last:
                out = self.acc_out.get((c, j))
                if out is None or out[0] != self._tag(k):
                    computed = self._accumulate(c, j)
                    if isinstance(computed, list):
                        return computed
                    if computed is None:
                        continue
                    out = self.acc_out[(c, j)] = (self._tag(k), computed)
                below = self.head(k + 1, c)
                if below is not None and self._owe(("acc", c, j), below, out[0]):
                    actions.append(SendItem(below, Accumulated(c, j, k, out[0], out[1])))
                continue
            out = self.acc_out.get((c, j))
            if out is None or out[0] != tag:
                computed = self._accumulate(c, j)
                if isinstance(computed, list):
                    return computed
                if computed is not None:
                    self.acc_out[(c, j)] = (tag, computed)
        if last:
            self._barrier(c, tag, actions)
        if k > 0:
            above = self.head(k - 1, c)
            for j in range(plan.rows):
                entry = self.reduced.get((c, j))
                owed = above is not None and entry is not None and entry[0] == tag
                if owed and self._owe(("red", c, j), above, tag):  # type: ignore[arg-type]
                    _, values, payload = entry  # type: ignore[misc]
                    actions.append(SendItem(above, Reduced(c, j, tag, values, payload)))
        part = self._column_result(c)
        if part is not None:
            payloads = self.gathered[c][2]
            targets = [
                peer
                for peer in (plan.peers[i] for i in plan.row(k))
                if peer != self.me and peer in self.alive and self._owe(("col", c, peer), peer, tag)
            ]
            if targets:
                actions += self._gather(c, tag, part, payloads, targets)
        return None

    def _gather(
        self,
        c: int,
        tag: Tag,
        part: np.ndarray,
        payloads: tuple[bytes, ...] | None,
        targets: list[bytes],
    ) -> list[object]:
        """Column ``c`` to ``targets`` (row mates). The column our place in the row gives us goes
        to each directly; one we head because its head was lost goes through relays: about
        sqrt(n) row mates, each forwarding it to its run of the others. A successor heading a
        lost head's column then sends about 2 sqrt(n) / n of a column's broadcast more, not a
        second whole one (the busiest peer's bytes under churn); a relay lost before it
        forwarded is replaced by us sending its run directly (``_lost``)."""
        members = self.plan.row(self.my_row)
        if c == self.index[self.me] - members.start or len(targets) < 4:
            return [SendItem(peer, Gathered(c, tag, part, (), payloads)) for peer in targets]
        runs = math.isqrt(len(targets) - 1) + 1  # ceil(sqrt(n))
        actions: list[object] = []
        for r in range(runs):
            run = targets[len(targets) * r // runs : len(targets) * (r + 1) // runs]
            relay, rest = run[0], tuple(run[1:])
            if rest:
                self._relayed.setdefault(relay, []).append((c, tag, rest))
            actions.append(SendItem(relay, Gathered(c, tag, part, rest, payloads)))
        return actions

    def _barrier(self, c: int, tag: Tag, actions: list[object]) -> None:
        """Last row: once column ``c``'s whole sum is held under ``tag``, tell the row (Ready);
        once every column is Ready under ``tag``, divide. An exclusion found in any column's
        chain thus reaches every column before any is divided and gathered, so a column is
        gathered once, not once per exclusion that trickles in."""
        plan = self.plan
        held = self.ready.get(c) == (tag, self.me)
        if not held and all(
            self.acc_out.get((c, j), (None,))[0] == tag
            or self.reduced.get((c, j), (None,))[0] == tag  # handed over: divided already
            for j in range(plan.rows)
        ):
            self.ready[c] = (tag, self.me)
            self._ready_version += 1
            held = True
        if held and self._told.get(c) != (tag, len(self.alive)):
            self._told[c] = (tag, len(self.alive))
            for i in plan.row(self.my_row):
                peer = plan.peers[i]
                if (
                    peer != self.me
                    and peer in self.alive
                    and self._owe(("ready", c, peer), peer, tag)
                ):
                    actions.append(SendItem(peer, Ready(c, tag)))
            # A sum holding the slice of a lost row mate cannot be rebuilt from the row if we
            # are lost too: our successor keeps a copy (it heads the column then).
            successor = self._successor()
            if successor is not None and any(
                plan.peers[i] not in self.alive and plan.peers[i] not in self.excluded
                for i in plan.row(self.my_row)
            ):
                for j in range(plan.rows):
                    out = self.acc_out.get((c, j))
                    if (
                        out is not None
                        and out[0] == tag
                        and self._owe(("sum", c, j), successor, tag)
                    ):
                        actions.append(
                            SendItem(successor, Accumulated(c, j, self.my_row, tag, out[1]))
                        )
        if not self._open(tag) or self._divided.get(c) == tag:
            return
        self._divided[c] = tag
        total = 0.0
        for _, weight in self.contributors:  # sorted, as reduce_part sums them
            total += weight
        for j in range(plan.rows):
            if self.reduced.get((c, j), (None,))[0] != tag:
                out = self.acc_out.get((c, j))
                if out is not None and out[0] == tag:
                    values = (out[1] / total).astype(np.float32)
                    payload = None
                    if self._finalize is not None:  # encoded once, here (module docstring)
                        values, payload = self._finalize(values, plan.sub(c, j)[0])
                    self.reduced[(c, j)] = (tag, values, payload)

    def _open(self, tag: Tag) -> bool:
        """Whether every column is Ready under ``tag`` from its head as we know it (a lost
        head's sum is lost with it); cached until a Ready, a loss or the tag changes."""
        key = (self._ready_version, len(self.alive), tag)
        if self._open_key != key:
            last = self.plan.rows - 1
            self._open_key = key
            self._open_now = all(
                self.ready.get(column) == (tag, self.head(last, column))
                for column in self._columns()
            )
        return self._open_now

    def _accumulate(self, c: int, j: int) -> np.ndarray | list[object] | None:
        """Our row's partial sum of ``(c, j)`` on top of the row above's, in float64; None while
        an input is due; the progress's actions if a lost member had to be excluded."""
        plan, k = self.plan, self.my_row
        if k > 0:
            upstream = self.acc_in.get((c, j))
            if upstream is None or upstream[0] != self._tag(k - 1):
                return None
        slices = self.raw.setdefault(c, {})
        start, stop = plan.part(c)
        slices.setdefault(self.me, self.local[start:stop])
        members = [plan.peers[i] for i in plan.row(k) if plan.peers[i] not in self.excluded]
        missing = [p for p in members if p not in slices]
        if any(p in self.alive for p in missing):
            return None
        if missing:  # lost before their slice came: no sum anywhere holds it
            return self._exclude(missing, None) + self._progress()
        a, b = plan.sub(c, j)
        acc = upstream[1].copy() if k > 0 else np.zeros(b - a, np.float64)
        product = np.empty(b - a, np.float64)
        for peer in members:  # sorted: rows are runs of the sorted ids
            weight = plan.weights[self.index[peer]]
            np.multiply(slices[peer][a - start : b - start], weight, out=product, dtype=np.float64)
            acc += product
        return acc

    def _exclude(self, peers: Iterable[bytes], source: bytes | None) -> list[object]:
        """Add exclusions; tell the heads that need them now rather than when a column comes
        back: the chain neighbours of the columns we head, and (news from outside our row) our
        row's heads. Otherwise two columns could each wait for the other's news."""
        new = set(peers) - self.excluded
        if not new:
            return []
        self.excluded |= new
        tag = frozenset(self.excluded)
        targets: set[bytes] = set()
        for c in self.mine:
            for k in (self.my_row - 1, self.my_row + 1):
                if 0 <= k < self.plan.rows:
                    targets.add(self.head(k, c))  # type: ignore[arg-type]
        if source is None or self.row_index[source] != self.my_row:
            targets.update(self.head(self.my_row, c) for c in self._columns())  # type: ignore[misc]
        targets -= {None, self.me, source}
        return [SendItem(peer, Excluded(tag)) for peer in sorted(targets)]  # type: ignore[type-var]

    def _column_result(self, c: int) -> np.ndarray | None:
        tag = frozenset(self.excluded)
        held = self.gathered.get(c)
        if held is not None and held[0] == tag:
            return held[1]
        pieces = [self.reduced.get((c, j)) for j in range(self.plan.rows)]
        if all(p is not None and p[0] == tag for p in pieces):
            part = np.concatenate([p[1] for p in pieces])  # type: ignore[index]
            payloads = None if self._finalize is None else tuple(p[2] for p in pieces)  # type: ignore[index,misc]
            self.gathered[c] = (tag, part, payloads)
            return part
        return None

    def _own(self, c: int) -> bytes | None:
        """Our slice of column ``c`` as wire bytes (None: lossless)."""
        return None if self.payloads is None else self.payloads[c]

    def _check_payload(self, has: bool) -> str | None:
        """Why a reduced item's wire bytes do not fit the round (a lossy round's carry them)."""
        if has == (self._finalize is not None):
            return None
        return "wire bytes where the round has none" if has else "no wire bytes in a lossy round"

    def _owe(self, key: tuple[object, ...], peer: bytes, tag: Tag | None) -> bool:
        """Whether ``key`` is still to be sent to ``peer`` under ``tag`` (and mark it sent)."""
        if self.sent.get(key) == (peer, tag):
            return False
        self.sent[key] = (peer, tag)
        return True

    # -- endings ---------------------------------------------------------------------------------

    def _drop(self, peer: bytes, reason: str) -> list[object]:
        """A peer that breaks the protocol is lost to us (and excluded if its slice is due)."""
        return [DropPeer(peer, reason), *self._lost([peer]), *self._progress()]

    def _fail(self, reason: str) -> list[object]:
        self.state = GridState.FAILED
        return [Fail(reason)]

    def _check_live(self) -> None:
        if self.state is GridState.FAILED:
            raise LocalProtocolError("the round failed; this machine refuses further calls")


def _check(data: object, length: int, dtype: type) -> str | None:
    """Why ``data`` is not a 1-D ``dtype`` array of ``length`` finite values (None if it is)."""
    if not isinstance(data, np.ndarray) or data.dtype != dtype or data.shape != (length,):
        return f"not a 1-D {np.dtype(dtype).name} array of {length} values"
    finite = all_finite(data) if dtype is np.float32 else bool(np.isfinite(data).all())
    return None if finite else "NaN or inf values"
