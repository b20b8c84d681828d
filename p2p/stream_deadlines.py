"""A read deadline on every inbound stream, libp2p's own protocols included.

py-libp2p 0.8.1's handlers (Kademlia, identify, ping, the relay's hop) and a plain ``read`` of
ours wait for input as long as the peer likes: a stream opened and never written, or fed one byte
a second, stayed open for good (seen: still open after 75 s on ping, runspec, dialback and Kad).
Every inbound stream passes through the host's dispatch, which calls ``bound_reads`` before
multistream-select runs; from then on each ``read`` of that stream is bounded by the policy of the
protocol it negotiated (``stream.get_protocol()``, looked up at each read, so negotiation itself is
bounded by the control policy):

- **idle**: no byte of a new message within ``idle_s`` of our last write (or the stream's start;
  on data streams, of the last byte either way);
- **message**: a message whose first byte came must be complete, which a request/response stream
  shows by our next write, within ``message_s`` of that byte. A trickle cannot extend it: the
  deadline counts from the first byte, not the last.

Policies by protocol:

- **control** (ours: ping, runspec, dialback, verify/*; libp2p's Kad, identify, ping, DCUtR; and
  any protocol not named below): ``idle_s = message_s = control_s``. A small request, answered
  at once.
- **relay hop / stop**: the control deadlines until our first write, none after: past its
  handshake the stream is a relayed connection's byte pipe, idle as long as that connection.
- **data** (allreduce, bulk, bulk-probe, state, slice, pipeline): ``DATA_IDLE_S`` since the last
  byte, no message deadline: payloads of any size move at the link's pace, and their own round
  and transfer deadlines bound them.

A read past its deadline resets the stream and raises ``StreamDeadlineExceeded`` (a
``RemoteProtocolError``), which the host's guards count and log as a rejection. One case is no
fault: a stream that completed an exchange (we answered a request, not just the protocol
negotiation) and then stays idle is a client's pooled stream (our Kad client keeps them, so do
others); it is reset and its read returns end of stream, which every handler takes as the peer
closing it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import trio

from p2p.errors import RemoteProtocolError

DEFAULT_CONTROL_S = 10.0
DATA_IDLE_S = 300.0
DATA_PREFIXES = (
    "/swarmtrain/allreduce/",
    "/swarmtrain/bulk/",
    "/swarmtrain/bulk-probe/",
    "/swarmtrain/state/",
    "/swarmtrain/slice/",
    "/swarmtrain/pipeline/",
)
PIPE_PREFIXES = ("/libp2p/circuit/relay/",)


class StreamDeadlineExceeded(RemoteProtocolError):
    """A peer did not send what its protocol needed within the read deadline."""


@dataclass(frozen=True)
class ReadPolicy:
    idle_s: float
    message_s: float
    # True: the deadlines hold only until our first write (a handshake, then a byte pipe).
    handshake_only: bool = False


def policy_for(protocol: str | None, control_s: float) -> ReadPolicy:
    name = protocol or ""
    if name.startswith(DATA_PREFIXES):
        return ReadPolicy(DATA_IDLE_S, math.inf)
    if name.startswith(PIPE_PREFIXES):
        return ReadPolicy(control_s, control_s, handshake_only=True)
    return ReadPolicy(control_s, control_s)


class _Clock:
    """When the current message began (None: waiting for one) and when bytes last moved."""

    def __init__(self, now: float) -> None:
        self.last_activity = now
        self.message_started: float | None = None
        self.wrote = False
        # We wrote once the protocol was negotiated: an answer (negotiation's echo does not count).
        self.answered = False

    def deadline(self, policy: ReadPolicy) -> float:
        if policy.handshake_only and self.wrote:
            return math.inf
        if self.message_started is None or policy.message_s == math.inf:
            return self.last_activity + policy.idle_s
        return self.message_started + policy.message_s


def bound_reads(
    stream: Any,
    control_s: float,
    on_deadline: Callable[[Any, str], Awaitable[None]] | None = None,
) -> None:
    """Give ``stream`` (an inbound ``NetStream``) read deadlines by its negotiated protocol.
    ``on_deadline(stream, protocol)`` runs before the exception is raised (it logs and counts)."""
    read = stream.read
    write = stream.write
    clock = _Clock(trio.current_time())

    async def bounded_read(n: int | None = None) -> bytes:
        protocol = _protocol(stream)
        deadline = clock.deadline(policy_for(protocol, control_s))
        with trio.move_on_at(deadline) as scope:
            data = await read(n)
        if scope.cancelled_caught:
            pooled = clock.answered and clock.message_started is None
            if not pooled and on_deadline is not None:
                await on_deadline(stream, protocol or "negotiation")
            with trio.move_on_after(1), contextlib.suppress(Exception):
                await stream.reset()
            if pooled:
                return b""
            waited = "for a message" if clock.message_started is None else "for the rest of one"
            raise StreamDeadlineExceeded(f"read deadline passed waiting {waited}")
        if data:
            clock.last_activity = trio.current_time()
            if clock.message_started is None:
                clock.message_started = clock.last_activity
        return data

    async def tracked_write(data: bytes) -> None:
        await write(data)
        clock.last_activity = trio.current_time()
        clock.message_started = None
        clock.wrote = True
        if _protocol(stream) is not None:
            clock.answered = True

    stream.read = bounded_read
    stream.write = tracked_write


def _protocol(stream: Any) -> str | None:
    try:
        protocol = stream.get_protocol()
    except Exception:
        return None
    return None if protocol is None else str(protocol)
