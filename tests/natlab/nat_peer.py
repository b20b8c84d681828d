"""A real swarmtrain host process for the NAT lab, driven over stdin/stdout (JSON lines).

    python nat_peer.py --listen /ip4/IP/tcp/PORT [--relay-hop] [--join RELAY_MULTIADDR]

Started, it joins the relay (``--join``), asks it for a dial-back to learn its reachability,
reserves a relay slot when private, and prints one ``ready`` line:

    {"event": "ready", "peer_id", "join", "listen_addrs", "observed_addrs", "reachability",
     "relays"}

Then it serves (echo RPC, dial-back, relay hop with ``--relay-hop``) and obeys commands on stdin,
one JSON object per line, answering each with one line:

    {"cmd": "reachability", "helpers": [PEER_ID, ...]}   -> {"event": "reachability", ...}
    {"cmd": "ping", "peer_id": ID, "addrs": [MULTIADDR]} -> {"event": "ping", "peer_id", "ok",
                    "direct", "kind", "rtt_ms", "server_kind", "server_connection", "error"}

``kind`` and ``server_connection`` are ``connection_kind`` at our end and at the server's
(direct, punched or relayed); ``server_kind`` is the server's stream's path (direct or relayed).

End of stdin ends the process (exit 0). This drives ``p2p.nat.traversal`` directly; ``swarmtrain
doctor`` covers the one-shot version of the same checks.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any

import multiaddr
import trio
from libp2p.abc import INetStream
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr

from p2p.errors import P2PError
from p2p.host import HostConfig, connection_kind, is_direct_kind, open_host
from p2p.nat.traversal import (
    NatConfig,
    NatService,
    advertised_addrs,
    establish,
    observed_addrs,
    stream_kind,
)
from p2p.rpc import RpcStream, call_unary
from p2p.wire import Message, message

ECHO_PROTOCOL = "/swarmtrain/natlab/echo/1"
log = logging.getLogger("nat_peer")


@message(9100, max_bytes=1024)
class Echo(Message):
    payload: bytes


@message(9101, max_bytes=1024)
class EchoReply(Message):
    payload: bytes
    server_kind: str  # how the server's end of the stream came in: "direct" or "relayed"
    server_connection: str  # the server's connection_kind of us: "direct", "punched", "relayed"


def emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


async def lines(stream: trio.abc.ReceiveStream) -> Any:
    buffer = b""
    while True:
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            if line.strip():
                yield line
        chunk = await stream.receive_some(65536)
        if not chunk:
            return
        buffer += chunk


async def main(args: argparse.Namespace) -> None:
    config = HostConfig(
        key_pair=create_new_key_pair(), listen_addrs=(args.listen,), dial_timeout_s=10.0
    )
    nat_config = NatConfig(relay_hop=args.relay_hop, holepunch_timeout_s=args.holepunch_timeout)
    async with open_host(config) as host, trio.open_nursery() as nursery:
        nat = NatService(host, nat_config)
        await nursery.start(nat.run)

        async def echo(stream: INetStream) -> None:
            rpc = RpcStream(stream)
            request = await rpc.receive(Echo)
            kind = host.connection_kind(stream.muxed_conn.peer_id)
            await rpc.send(EchoReply(request.payload, stream_kind(stream), str(kind)))
            await rpc.close()

        host.set_handler(ECHO_PROTOCOL, echo)
        join = f"{args.listen}/p2p/{host.peer_id.to_base58()}"
        verdict = None
        if args.join:
            relay = info_from_p2p_addr(multiaddr.Multiaddr(args.join))
            await host.connect(relay.peer_id, relay.addrs)
            verdict = await establish(nat, [relay])
        emit(
            event="ready",
            peer_id=host.peer_id.to_base58(),
            join=join,
            listen_addrs=[str(a) for a in host.addrs()],
            observed_addrs=[str(a) for a in observed_addrs(host.libp2p)],
            reachability=verdict.to_json() if verdict else None,
            relays=[str(a) for a in nat.circuit_addrs()],
            advertised=[str(a) for a in advertised_addrs(host, nat)],
        )
        stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
        async for line in lines(stdin):
            command = json.loads(line)
            if command["cmd"] == "reachability":
                helpers = [ID.from_base58(h) for h in command["helpers"]]
                verdict = await nat.check_reachability(helpers)
                emit(event="reachability", **verdict.to_json())
            elif command["cmd"] == "ping":
                emit(event="ping", **await ping(host, nat, command))
            else:
                emit(event="error", error=f"unknown command {command['cmd']!r}")
        nursery.cancel_scope.cancel()


async def ping(host: Any, nat: NatService, command: dict[str, Any]) -> dict[str, Any]:
    peer_id = ID.from_base58(command["peer_id"])
    addrs = [multiaddr.Multiaddr(a) for a in command["addrs"]]
    result: dict[str, Any] = {"peer_id": command["peer_id"], "ok": False, "direct": False}
    started = time.monotonic()
    try:
        await nat.connect(peer_id, addrs)
        result["connect_s"] = round(time.monotonic() - started, 3)
        sent = os.urandom(16)
        t0 = trio.current_time()
        reply = await call_unary(host, peer_id, ECHO_PROTOCOL, Echo(sent), EchoReply, deadline_s=10)
        result["rtt_ms"] = round((trio.current_time() - t0) * 1000, 2)
        result["ok"] = reply.payload == sent
        result["server_kind"] = reply.server_kind
        result["server_connection"] = reply.server_connection
    except P2PError as exc:
        result["error"] = str(exc)
    kind = connection_kind(host, peer_id)
    result["kind"] = kind
    result["direct"] = is_direct_kind(kind)
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", required=True)
    parser.add_argument("--join")
    parser.add_argument("--relay-hop", action="store_true")
    parser.add_argument("--holepunch-timeout", type=float, default=8.0)
    parser.add_argument("--log-level", default=os.environ.get("NAT_PEER_LOG_LEVEL", "WARNING"))
    parsed = parser.parse_args()
    logging.basicConfig(
        level=logging.WARNING,
        stream=sys.stderr,
        format="%(relativeCreated)6d %(name)s %(levelname)s %(message)s",
    )
    for name in ("p2p", "nat_peer", "libp2p.relay"):
        logging.getLogger(name).setLevel(parsed.log_level)
    trio.run(main, parsed)
