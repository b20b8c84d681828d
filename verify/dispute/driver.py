"""Trio drivers of the dispute game over p2p: the referee's loop and the providers' handlers.

One libp2p protocol per query type (``dispute_wire.QUERY_TYPES``) and one stream per query, through
``p2p.call_unary``: the request and the answer are single frames whose length is checked against
the answer type's limit before the body is read (an operator opening, the only one with tensors,
may be up to ``OP_OPEN_BYTES``; every other answer a few KiB). The referee asks both providers of a
round at once, each call under the machine's deadline. What comes back becomes one event:

    answer decoded             -> Answered(party, answer)    (the machine verifies it)
    call past the deadline     -> Timeout(party)
    error reply, bad or oversized bytes, stream broken, peer unreachable -> Failed(party, why)

The driver makes no protocol decision; as soon as the machine finishes it cancels the round's
other call. Providers answer in a worker thread (recomputing a step is torch or numpy work) so the
host's event loop keeps serving.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import trio

from p2p import (
    Host,
    Message,
    P2PError,
    PeerID,
    RemoteError,
    RemoteProtocolError,
    RpcTimeout,
    call_unary,
    encode,
    serve_unary,
)
from verify.dispute.game import Answered, Event, Failed, Finish, Query, Referee, Timeout, Verdict
from verify.dispute.provider import Provider
from verify.dispute.wire import ANSWER_TYPES, QUERY_TYPES

log = logging.getLogger(__name__)
FRAME_HEADER_BYTES = 4


@dataclass(frozen=True)
class DisputeOutcome:
    verdict: Verdict
    bytes_exchanged: int  # request and answer frames, both providers, all rounds
    seconds: float
    referee_compute_s: float  # the machine's own work: proof checks and the one operator


class Answers(Protocol):
    """What answers queries: a ``Provider``, or a registry of them keyed by task id."""

    def answer(self, query: Message) -> Message: ...


def serve_provider(
    host: Host,
    provider: Provider | Answers,
    limiter: trio.CapacityLimiter | None = None,
    allowed: Callable[[PeerID], bool] | None = None,
) -> None:
    """Answer the referee's queries about ``provider``'s task on ``host``.

    One answer at a time by default: ``Provider`` keeps one recomputed step, which two threads
    recomputing different steps would race on (and each would cost a step of compute anyway).
    ``allowed(peer)`` False refuses the query (an opening costs a step of compute: only the
    run's referee should get to ask for one).
    """
    limiter = limiter or trio.CapacityLimiter(1)
    for query_type, protocol in QUERY_TYPES.items():

        async def handle(peer: PeerID, request: Message) -> Message:
            if allowed is not None and not allowed(peer):
                raise RemoteProtocolError("only the run's referee asks dispute queries")
            log.debug("dispute query %s from %s", type(request).__name__, peer)
            return await trio.to_thread.run_sync(provider.answer, request, limiter=limiter)

        serve_unary(host, protocol, query_type, handle)


async def run_referee(
    host: Host, providers: tuple[PeerID, PeerID], referee: Referee
) -> DisputeOutcome:
    """Play the dispute between ``providers`` (parties 0 and 1) to its verdict.

    Connections to the providers must already be open (or dialable through the peerstore).
    Never raises for a provider's failure: that is a verdict. Cancellation stops the dispute.
    """
    started = time.perf_counter()
    compute_s = 0.0
    total_bytes = 0

    def feed(event: Event) -> list:
        nonlocal compute_s
        t0 = time.perf_counter()
        try:
            return referee.handle(event, trio.current_time())
        finally:
            compute_s += time.perf_counter() - t0

    actions = referee.start(trio.current_time())
    while True:
        finished = [a for a in actions if isinstance(a, Finish)]
        if finished:
            return DisputeOutcome(
                finished[0].verdict, total_bytes, time.perf_counter() - started, compute_s
            )
        queries = [a for a in actions if isinstance(a, Query)]
        send, receive = trio.open_memory_channel[tuple[Event, int]](len(queries))
        actions = []
        async with trio.open_nursery() as nursery:
            for query in queries:
                nursery.start_soon(
                    _ask, host, providers[query.party], query, referee.deadline, send.clone()
                )
            send.close()
            async for event, nbytes in receive:
                total_bytes += nbytes
                actions += feed(event)
                if any(isinstance(a, Finish) for a in actions):
                    nursery.cancel_scope.cancel()
                    break


async def _ask(
    host: Host,
    peer: PeerID,
    query: Query,
    deadline: float,
    events: trio.MemorySendChannel[tuple[Event, int]],
) -> None:
    request = query.request
    nbytes = len(encode(request)) + FRAME_HEADER_BYTES
    event: Event
    async with events:
        try:
            answer = await call_unary(
                host,
                peer,
                QUERY_TYPES[type(request)],
                request,
                ANSWER_TYPES[type(request)],
                deadline_s=max(0.0, deadline - trio.current_time()),
            )
            nbytes += len(encode(answer)) + FRAME_HEADER_BYTES
            event = Answered(query.party, answer)
        except RpcTimeout:
            event = Timeout(query.party)
        except RemoteError as exc:
            event = Failed(query.party, f"provider refused: {exc}")
        except P2PError as exc:  # bad bytes, over the limit, stream broken, unreachable
            event = Failed(query.party, f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # libp2p's own stream errors are not all P2PError
            event = Failed(query.party, f"{type(exc).__name__}: {exc}")
        await events.send((event, nbytes))
