"""Dial-back reachability checks (``/swarmtrain/dialback/1``): the server and the client.

On request the server dials the asker's addresses from a *throwaway host* (new key, new socket,
new source port), so the answer says whether a stranger can reach the asker. 0.8.1's AutoNAT
answers over the existing connection and always says reachable (DESIGN.md). The decisions live in
``p2p.nat.reachability`` (sans-IO); ``p2p.nat.traversal.NatService`` serves and asks through these
functions.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import multiaddr
import trio
from libp2p import new_host
from libp2p.abc import INetStream, INetwork
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.network.config import ConnectionConfig
from libp2p.peer.id import ID

from p2p.errors import P2PError
from p2p.host import Host, is_relayed
from p2p.nat.reachability import (
    DIALBACK_PROTOCOL,
    DialBackRequest,
    DialBackResponse,
    HelperReport,
    report_from_response,
    select_dialback_targets,
)
from p2p.rpc import RpcErrorReply, RpcStream, call_unary

log = logging.getLogger(__name__)


async def ask_for_dialbacks(
    host: Host, helpers: Sequence[ID], candidates: tuple[str, ...], *, deadline_s: float
) -> list[HelperReport]:
    """Ask each helper (concurrently) to dial us back at ``candidates``; one report per helper,
    in the order they came back. Never raises for a helper's failure: its report has the error."""
    reports: list[HelperReport] = []

    async def ask(helper: ID) -> None:
        try:
            response = await call_unary(
                host,
                helper,
                DIALBACK_PROTOCOL,
                DialBackRequest(candidates),
                DialBackResponse,
                deadline_s=deadline_s,
            )
        except P2PError as exc:
            reports.append(HelperReport(helper.to_base58(), error=str(exc)))
            return
        reports.append(report_from_response(helper.to_base58(), response))

    async with trio.open_nursery() as nursery:
        for helper in dict.fromkeys(helpers):
            if helper != host.peer_id:
                nursery.start_soon(ask, helper)
    return reports


async def serve_dialback(stream: INetStream, slots: trio.Semaphore, dial_timeout_s: float) -> None:
    """Answer one dial-back request: dial the asker at the addresses it named on the IP we see it
    at (at most ``slots`` requests dialing at once), and report what answered."""
    rpc = RpcStream(stream)
    request = await rpc.receive(DialBackRequest)
    observed_ip = _remote_ip(stream)
    if observed_ip is None:
        # Over a relayed connection we cannot see the asker's address, so there is no IP we
        # may safely dial (anti-amplification: only ever dial the IP we see).
        log.info("dial-back for %s refused: asked over a relayed connection", rpc.peer_id)
        await rpc.send(RpcErrorReply("no_observed_ip", "ask over a direct connection"))
        await rpc.close()
        return
    targets = select_dialback_targets(request.addrs, observed_ip)
    async with slots:
        results = await dial_back(rpc.peer_id, targets, timeout_s=dial_timeout_s)
    # The asker's verdict says only "private" or "public"; the helper's log says why: the
    # ports it was asked for (a wrong one, an observed source port, points at the asker's
    # candidates) and how each dial went (refused: nothing listens; no answer: filtered).
    log.info(
        "dial-back for %s seen at %s: asked for %d address(es); %s",
        rpc.peer_id,
        observed_ip,
        len(request.addrs),
        "; ".join(f"{t} {err or 'ok'}" for t, err in results) or "nothing to dial on that IP",
    )
    await rpc.send(
        DialBackResponse(
            observed_ip,
            tuple(t for t, _ in results),
            tuple(err == "" for _, err in results),
            tuple(err for _, err in results),
        )
    )
    await rpc.close()


def _remote_ip(stream: INetStream) -> str | None:
    if is_relayed(stream.muxed_conn):
        return None
    try:
        remote = stream.get_remote_address()
    except Exception:
        remote = None
    if remote:
        return str(remote[0])
    return None


async def dial_back(
    peer_id: ID, targets: Sequence[str], *, timeout_s: float
) -> list[tuple[str, str]]:
    """Dial ``peer_id`` at each target from a throwaway host (fresh key and sockets, so nothing
    is reused from existing connections); ``[(target, "" if it answered else why not)]``.
    Each dial is bounded by ``timeout_s``; the whole call by about that much."""
    if not targets:
        return []
    results: dict[str, str] = {}
    probe = new_host(
        key_pair=create_new_key_pair(),
        connection_config=ConnectionConfig(max_connections_per_peer=1, dial_timeout=timeout_s),
    )

    async def dial_one(target: str) -> None:
        results[target] = f"no answer in {timeout_s} s"
        with trio.move_on_after(timeout_s):
            try:
                await probe.get_network().dial_addr(multiaddr.Multiaddr(target), peer_id)
                results[target] = ""
            except Exception as exc:
                results[target] = describe_dial_error(exc)

    with trio.move_on_after(timeout_s + 2.0):
        async with probe.run([]):
            async with trio.open_nursery() as nursery:
                for target in targets:
                    nursery.start_soon(dial_one, target)
            # Leaving run() stops the probe's tasks but leaves its connection open at the asker,
            # which counts it connected until a keep-alive fails: its identify push and stream
            # openers would wait on a host that is gone (3 s at every public node's start).
            await _close_probe_connection(probe.get_network(), peer_id)
    return [(t, results.get(t, "not dialed")) for t in targets]


async def _close_probe_connection(network: INetwork, peer_id: ID) -> None:
    """Close the probe's connection to ``peer_id``; return once its socket is closed, within
    1 s. 0.8.1's ``close_peer`` then pauses twice for 0.1 s (its muxer's and its connection's
    sleeps that let handlers see the close) on a host about to be thrown away: every dial-back
    answer, and so every public node's start, waited those 0.2 s."""
    closed = [
        event
        for conn in network.get_connections(peer_id)
        if isinstance(event := getattr(conn.muxed_conn, "event_closed", None), trio.Event)
    ]
    with trio.move_on_after(1.0):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(network.close_peer, peer_id)
            for event in closed:
                await event.wait()
            if closed:
                nursery.cancel_scope.cancel()


def describe_dial_error(exc: BaseException) -> str:
    """Why a dial failed, in words an operator can act on: the root cause, which 0.8.1 wraps in
    a ``SwarmException`` that only says "fail to open connection to peer …".

    ``ConnectionRefusedError: Connection refused`` means nothing listens on that port (a wrong
    port, a stopped peer); a timeout (reported by the caller) means a NAT or firewall dropped the
    dial; anything else names the exception type only: its message may quote bytes that whoever
    answered at that address sent, and those go into no log or reply of ours.
    """
    root = exc
    for _ in range(32):  # a chain is a few links long; never follow a cycle forever
        if isinstance(root, BaseExceptionGroup) and root.exceptions:
            root = root.exceptions[0]
        elif root.__cause__ is not None:
            root = root.__cause__
        elif root.__context__ is not None and not root.__suppress_context__:
            root = root.__context__
        else:
            break
    if isinstance(root, OSError) and root.errno:
        why = f"{type(root).__name__}: {os.strerror(root.errno)}"
    else:
        why = type(root).__name__
    return why if root is exc else f"{why} (in {type(exc).__name__})"
