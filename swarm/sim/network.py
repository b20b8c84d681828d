"""The simulated network: who has which link, and when a message sent now arrives.

Model (kept simple on purpose; every figure the simulator prints rests on it):

* Each peer has an uplink and a downlink rate, a one-way latency to the internet's core, and a
  NAT kind, drawn once from ``NetworkConfig``'s distributions with the simulation's seeded
  ``numpy.random.Generator``. A share of peers sit in datacenters (symmetric 1-10 Gbit/s); the
  rest are homes (uplink 10-100 Mbit/s, downlink 2-10 times that, capped at 1 Gbit/s). Rates are
  log-uniform in their range. A peer's one-way leg is uniform in ``[rtt_lo / 4, rtt_hi / 4]``, so
  a pair's round trip ``2 (leg_a + leg_b)`` spans ``rtt_s``.
* A home peer is *relayed* with probability ``relayed_share`` (no hole punch opens its NAT). A
  pair whose two ends are both relayed talks through a relay: its rate is capped at ``relay_bps``
  and each direction takes ``relay_latency_s`` more. A relayed peer dials a direct one directly.
* A message of ``size`` bytes from a to b is sent when a's uplink is free (one message at a time,
  FIFO over all its destinations: a peer's sends share its uplink), takes
  ``8 size / min(up_a, down_b[, relay])`` seconds on the wire, and arrives one pair latency after
  its last bit left. Downlinks are not serialised: several senders may fill one receiver's
  downlink at once (optimistic where many reducers send to one slow home peer at once).
  With ``uplink="shared"`` instead, the messages a peer sends in one instant (a broadcast of a
  reduced part, the scatter of its slices) share its uplink as concurrent streams do: they leave
  together, all at the end of their summed time (later than fair sharing for the smaller ones of
  a mixed batch). FIFO delivers a broadcast's first copy early and its last one late; real
  sessions send on one stream per peer at once, closer to ``shared``.
* Loss is what TCP makes of it: a lost message arrives one retransmission timeout later
  (``max(0.2 s, 2 RTT)``), and each pair's messages still arrive in order (one stream per pair;
  a late one holds back the ones behind it).
* A peer that leaves (crash or freeze) sends nothing more: messages whose last bit had not left
  its uplink by then are dropped, those already on the wire arrive. Messages to a peer that left
  are dropped.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from swarm.sim.clock import Clock


def _range(value: tuple[float, float], name: str) -> None:
    low, high = value
    if not (math.isfinite(low) and math.isfinite(high) and 0 < low <= high):
        raise ValueError(f"network.{name} must be a range 0 < low <= high, got {value!r}")


def _share(value: float, name: str, top: float = 1.0) -> None:
    if not 0.0 <= value <= top:
        raise ValueError(f"network.{name} must be in [0, {top}], got {value!r}")


UPLINKS = ("fifo", "shared")


@dataclass(frozen=True)
class NetworkConfig:
    """The distributions peers' links are drawn from (module docstring); rates in bit/s."""

    datacenter_share: float = 0.2
    home_up_bps: tuple[float, float] = (10e6, 100e6)
    home_down_factor: tuple[float, float] = (2.0, 10.0)
    home_down_max_bps: float = 1e9
    datacenter_bps: tuple[float, float] = (1e9, 10e9)
    rtt_s: tuple[float, float] = (0.010, 0.300)
    relayed_share: float = 0.2
    relay_bps: float = 20e6
    relay_latency_s: float = 0.05
    loss: float = 0.0
    uplink: str = "shared"

    def __post_init__(self) -> None:
        if self.uplink not in UPLINKS:
            raise ValueError(f"network.uplink must be one of {UPLINKS}, got {self.uplink!r}")
        for name in ("home_up_bps", "home_down_factor", "datacenter_bps", "rtt_s"):
            _range(getattr(self, name), name)
        _share(self.datacenter_share, "datacenter_share")
        _share(self.relayed_share, "relayed_share")
        _share(self.loss, "loss", top=0.5)
        for name in ("home_down_max_bps", "relay_bps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"network.{name} must be > 0")
        if not self.relay_latency_s >= 0:
            raise ValueError("network.relay_latency_s must be >= 0")


@dataclass(frozen=True, slots=True)
class PeerLink:
    """One peer's link: rates in bit/s, ``leg_s`` its one-way latency to the core."""

    up_bps: float
    down_bps: float
    leg_s: float
    relayed: bool
    datacenter: bool

    @property
    def rate_bps(self) -> float:
        """The slower direction: what a perfect all-reduce is bound by on this link."""
        return min(self.up_bps, self.down_bps)


def _log_uniform(rng: np.random.Generator, low: float, high: float) -> float:
    return float(math.exp(rng.uniform(math.log(low), math.log(high))))


def draw_link(config: NetworkConfig, rng: np.random.Generator) -> PeerLink:
    """One peer's link, drawn from ``config`` (always the same number of draws per peer)."""
    datacenter = rng.random() < config.datacenter_share
    dc_rate = _log_uniform(rng, *config.datacenter_bps)
    home_up = _log_uniform(rng, *config.home_up_bps)
    home_down = min(config.home_down_max_bps, home_up * rng.uniform(*config.home_down_factor))
    leg = rng.uniform(config.rtt_s[0] / 4, config.rtt_s[1] / 4)
    relayed = rng.random() < config.relayed_share
    if datacenter:
        return PeerLink(dc_rate, dc_rate, leg, False, True)
    return PeerLink(home_up, home_down, leg, relayed, False)


class Network:
    """Links of the peers, and message delivery on the shared ``Clock`` (module docstring).

    ``send(src, dst, size, fn, *args)`` schedules ``fn(*args)`` at the message's arrival, or
    drops it (module docstring). ``leave(peer)`` marks a peer gone from now on.
    """

    def __init__(self, clock: Clock, config: NetworkConfig, rng: np.random.Generator) -> None:
        self.clock = clock
        self.config = config
        self.rng = rng
        self.links: dict[bytes, PeerLink] = {}
        self.left_at: dict[bytes, float] = {}
        self.bytes_sent: dict[bytes, int] = {}
        self._uplink_free: dict[bytes, float] = {}
        self._last_arrival: dict[tuple[bytes, bytes], float] = {}
        self._batches: dict[
            bytes, list[tuple[bytes, float, Callable[..., Any], tuple[Any, ...]]]
        ] = {}

    def add(self, peer: bytes, link: PeerLink) -> None:
        self.links[peer] = link
        self._uplink_free[peer] = self.clock.now
        self.bytes_sent[peer] = 0

    def leave(self, peer: bytes) -> None:
        self.left_at.setdefault(peer, self.clock.now)

    def present(self, peer: bytes) -> bool:
        return peer not in self.left_at

    def relayed(self, a: bytes, b: bytes) -> bool:
        return self.links[a].relayed and self.links[b].relayed

    def latency(self, a: bytes, b: bytes) -> float:
        """One-way latency from a to b."""
        extra = self.config.relay_latency_s if self.relayed(a, b) else 0.0
        return self.links[a].leg_s + self.links[b].leg_s + extra

    def rate(self, a: bytes, b: bytes) -> float:
        """The rate of a's messages to b, bit/s."""
        rate = min(self.links[a].up_bps, self.links[b].down_bps)
        return min(rate, self.config.relay_bps) if self.relayed(a, b) else rate

    def last_arrival(self, a: bytes, b: bytes) -> float:
        """When the last message from a to b sent so far arrives (-inf: none)."""
        return self._last_arrival.get((a, b), -math.inf)

    def send(self, src: bytes, dst: bytes, size: float, fn: Callable[..., Any], *args: Any) -> None:
        if src in self.left_at:
            return
        if self.config.uplink == "fifo":
            self._transmit(src, [(dst, size, fn, args)], together=False)
            return
        batch = self._batches.get(src)
        if batch is None:
            batch = self._batches[src] = []
            self.clock.at(self.clock.now, self._flush, src)  # after this instant's sends
        batch.append((dst, size, fn, args))

    def _flush(self, src: bytes) -> None:
        batch = self._batches.pop(src)
        if src not in self.left_at:
            self._transmit(src, batch, together=True)

    def _transmit(
        self,
        src: bytes,
        messages: list[tuple[bytes, float, Callable[..., Any], tuple[Any, ...]]],
        *,
        together: bool,
    ) -> None:
        now = self.clock.now
        a = self.links[src]
        free = self._uplink_free[src]
        sent = free if free > now else now
        timed = []
        for dst, size, fn, args in messages:
            b = self.links[dst]
            rate, latency = min(a.up_bps, b.down_bps), a.leg_s + b.leg_s
            if a.relayed and b.relayed:
                rate = min(rate, self.config.relay_bps)
                latency += self.config.relay_latency_s
            sent += 8.0 * size / rate
            self.bytes_sent[src] += int(size)
            timed.append((dst, sent, latency, fn, args))
        self._uplink_free[src] = sent
        for dst, own_sent, latency, fn, args in timed:
            left_uplink = sent if together else own_sent
            arrival = left_uplink + latency
            if self.config.loss and self.rng.random() < self.config.loss:
                arrival += max(0.2, 4 * (a.leg_s + self.links[dst].leg_s))
            pair = (src, dst)
            last = self._last_arrival.get(pair)
            if last is not None and last > arrival:
                arrival = last
            self._last_arrival[pair] = arrival
            self.clock.at(arrival, self._deliver, src, dst, left_uplink, fn, args)

    def _deliver(
        self, src: bytes, dst: bytes, sent: float, fn: Callable[..., Any], args: tuple[Any, ...]
    ) -> None:
        left = self.left_at.get(src)
        if (left is not None and sent > left) or dst in self.left_at:
            return
        fn(*args)
