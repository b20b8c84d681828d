"""When a NATed peer (re-)reserves its relay slots: the rule, without I/O.

A private peer is reachable only through the relays that hold a reservation for it (circuit relay
v2). A relay forgets a reservation when its TTL runs out, when it restarts (the table lives in
memory), and it cannot use one without our connection to it (it cannot dial us). py-libp2p 0.8.1's
client refreshes 30 s before expiry and does nothing else: with a TTL under 30 s it refreshes in a
busy loop, a failed refresh is retried in a busy loop until the reservation expires and is then
dropped for good, and a relay that restarted answers ``NO_RESERVATION`` for us until the next
scheduled refresh, up to an hour later (seen in the NAT lab: ``Relay connection failed with status
204``). ``ReservationKeeper`` replaces that loop.

Theory of operation. Each relay we want a slot on is in one state:

- ``WANTED``: a reservation is due at ``due_at`` (at once when added, lost or expired);
- ``RESERVING``: the driver is asking the relay (``due()`` handed it out); ``reserved`` or
  ``failed`` ends it;
- ``HELD``: the relay granted a slot for ``ttl_s``; it is asked again at ``refresh_fraction`` of
  the TTL, and at the latest after ``max_refresh_interval_s``: that RESERVE is also the cheap
  self-check, since asking a relay that forgot us (restarted, or expired us on its own clock)
  makes it hold us again, in one round trip on the open connection;
- ``DORMANT``: ``max_attempts`` attempts in a row failed; asked again only every
  ``dormant_retry_s``, or at once when a connection to the relay appears (it came back).

Losing the connection to a relay (``observe_connection(relay, False)``) makes a held slot useless
(the relay cannot reach us), so the relay is ``WANTED`` again after ``retry_initial_s``; failures
back off exponentially up to ``retry_max_s``. A reply the relay sends with a TTL that has passed
(its clock is ahead) is treated as ``min_refresh_interval_s``, which also keeps a relay granting
tiny TTLs from being asked in a loop.

No trio, clock or libp2p here: ``now`` is any monotonic clock in seconds; relays are any
hashable key.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class SlotState(enum.Enum):
    WANTED = "wanted"
    RESERVING = "reserving"
    HELD = "held"
    DORMANT = "dormant"


@dataclass(frozen=True)
class ReservationPolicy:
    refresh_fraction: float = 2 / 3
    # The self-check: a held slot is re-asked at least this often, whatever its TTL.
    max_refresh_interval_s: float = 600.0
    min_refresh_interval_s: float = 1.0
    retry_initial_s: float = 1.0
    retry_max_s: float = 60.0
    max_attempts: int = 8
    dormant_retry_s: float = 600.0

    def __post_init__(self) -> None:
        if not 0.0 < self.refresh_fraction < 1.0:
            raise ValueError(f"refresh_fraction {self.refresh_fraction} is not in (0, 1)")
        if not 0.0 < self.min_refresh_interval_s <= self.max_refresh_interval_s:
            raise ValueError("need 0 < min_refresh_interval_s <= max_refresh_interval_s")
        if not 0.0 < self.retry_initial_s <= self.retry_max_s:
            raise ValueError("need 0 < retry_initial_s <= retry_max_s")
        if self.max_attempts < 1 or self.dormant_retry_s <= 0:
            raise ValueError("need max_attempts >= 1 and dormant_retry_s > 0")

    def backoff_s(self, failures: int) -> float:
        """The wait after the ``failures``-th failure in a row (1-based)."""
        return min(self.retry_max_s, self.retry_initial_s * 2.0 ** min(failures - 1, 30))

    def refresh_after_s(self, ttl_s: float) -> float:
        return min(
            self.max_refresh_interval_s,
            max(self.min_refresh_interval_s, ttl_s * self.refresh_fraction),
        )


@dataclass
class Slot:
    state: SlotState
    due_at: float
    failures: int = 0  # in a row; a reservation resets it
    expires_at: float | None = None  # while HELD: when the relay's TTL runs out (our clock)
    last_error: str = ""
    connected: bool | None = None  # as last observed; None: not observed yet


@dataclass(frozen=True)
class KeeperStatistics:
    held: int
    wanted: int
    dormant: int
    reservations: int  # granted replies, first ones and refreshes
    failures: int
    losses: int  # held slots given up: connection closed or TTL passed without a refresh


@dataclass
class ReservationKeeper(Generic[K]):
    """Which relays to ask for a reservation, and when. See the module docstring."""

    policy: ReservationPolicy = field(default_factory=ReservationPolicy)
    _slots: dict[K, Slot] = field(default_factory=dict)
    _reservations: int = 0
    _failures: int = 0
    _losses: int = 0

    # ------------------------------------------------------------------ events

    def want(self, relay: K, now: float) -> None:
        """Keep a slot on ``relay`` from now on (due at once unless already known)."""
        if relay not in self._slots:
            self._slots[relay] = Slot(SlotState.WANTED, now)

    def begin(self, relay: K, now: float) -> bool:
        """Keep ``relay`` and ask it now, outside ``due`` (the first reservation, which the
        caller awaits). False when an attempt on it is already running."""
        self.want(relay, now)
        slot = self._slots[relay]
        if slot.state is SlotState.RESERVING:
            return False
        slot.state = SlotState.RESERVING
        return True

    def reserved(self, relay: K, ttl_s: float, now: float) -> None:
        """The relay granted (or refreshed) a slot valid for ``ttl_s`` from ``now``."""
        slot = self._slot(relay)
        ttl_s = max(ttl_s, self.policy.min_refresh_interval_s)
        slot.state = SlotState.HELD
        slot.failures = 0
        slot.expires_at = now + ttl_s
        slot.due_at = now + self.policy.refresh_after_s(ttl_s)
        slot.last_error = ""
        self._reservations += 1

    def failed(self, relay: K, now: float, reason: str) -> None:
        """An attempt on ``relay`` failed (refused, unreachable, timed out). A slot still within
        its TTL stays usable until then; the retry comes after the backoff."""
        slot = self._slot(relay)
        slot.failures += 1
        slot.last_error = reason
        self._failures += 1
        if slot.failures >= self.policy.max_attempts:
            slot.state = SlotState.DORMANT
            slot.due_at = now + self.policy.dormant_retry_s
        else:
            slot.state = SlotState.HELD if self._still_valid(slot, now) else SlotState.WANTED
            slot.due_at = now + self.policy.backoff_s(slot.failures)
        if slot.state is not SlotState.HELD:
            slot.expires_at = None

    def observe_connection(self, relay: K, connected: bool, now: float) -> None:
        """Whether we have a connection to ``relay`` now; only a change counts. When it closes,
        a held slot is useless (the relay cannot reach us) and a relay that restarted has
        forgotten us: reserve again. When one appears to a ``DORMANT`` relay (it came back),
        ask it once at once instead of waiting out ``dormant_retry_s``."""
        slot = self._slots.get(relay)
        if slot is None or slot.connected == connected:
            return
        slot.connected = connected
        if slot.state is SlotState.RESERVING:
            # A refresh in flight on a held slot: the slot is lost all the same, and the attempt
            # (on a new connection, to a relay that may have forgotten us) makes it again.
            if not connected and slot.expires_at is not None:
                self._losses += 1
                slot.expires_at = None
            return
        if not connected and slot.state is SlotState.HELD:
            self._losses += 1
            slot.state = SlotState.WANTED
            slot.expires_at = None
            slot.due_at = now + self.policy.backoff_s(slot.failures + 1)
        elif connected and slot.state is SlotState.DORMANT:
            slot.state = SlotState.WANTED
            slot.due_at = now

    # ------------------------------------------------------------------ orders

    def due(self, now: float) -> list[K]:
        """The relays to ask now; each is ``RESERVING`` until ``reserved`` or ``failed``.
        A held slot whose TTL passed without a refresh counts as lost first."""
        out = []
        for relay, slot in self._slots.items():
            if slot.state is SlotState.HELD and not self._still_valid(slot, now):
                self._losses += 1
                slot.state = SlotState.WANTED
                slot.expires_at = None
            if slot.state is not SlotState.RESERVING and slot.due_at <= now:
                slot.state = SlotState.RESERVING
                out.append(relay)
        return out

    def next_due(self) -> float | None:
        """When ``due`` will next hand out a relay (None: nothing is waiting)."""
        times = [s.due_at for s in self._slots.values() if s.state is not SlotState.RESERVING]
        return min(times, default=None)

    # ------------------------------------------------------------------ queries

    def held(self, now: float) -> list[K]:
        """Relays whose slot for us is valid now, as far as we know."""
        return [
            r
            for r, s in self._slots.items()
            if s.expires_at is not None and self._still_valid(s, now)
        ]

    def slot(self, relay: K) -> Slot | None:
        return self._slots.get(relay)

    def statistics(self) -> KeeperStatistics:
        states = [s.state for s in self._slots.values()]
        return KeeperStatistics(
            held=states.count(SlotState.HELD),
            wanted=states.count(SlotState.WANTED) + states.count(SlotState.RESERVING),
            dormant=states.count(SlotState.DORMANT),
            reservations=self._reservations,
            failures=self._failures,
            losses=self._losses,
        )

    def _slot(self, relay: K) -> Slot:
        slot = self._slots.get(relay)
        if slot is None:
            raise KeyError(f"relay {relay!r} is not kept (call want() first)")
        return slot

    @staticmethod
    def _still_valid(slot: Slot, now: float) -> bool:
        return slot.expires_at is not None and now < slot.expires_at
