"""Long-lived services against many strangers: real relay and coordinator processes keep accepting
connections after thousands have come and gone, refuse a port another service holds, close
streams that send nothing or a trickle, and count bad input instead of echoing it to the log."""

from __future__ import annotations

import contextlib
import math
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import multiaddr
import pytest
import trio
import varint
from libp2p.abc import INetStream
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.kad_dht.pb.kademlia_pb2 import Message as KadMessage
from libp2p.peer.id import ID
from libp2p.utils.varint import read_varint_prefixed_bytes_limited
from peerproc import SWARMTRAIN, PeerProcess, python_argv, start_relay
from rpc_peer import ECHO, Echo

from p2p import (
    Dht,
    Host,
    HostConfig,
    NodeConfig,
    Reachability,
    RecordSigner,
    call_unary,
    dht_key,
    open_host,
    open_node,
)
from p2p.bulk.control import Offer, encode_control
from p2p.bulk.frames import DEFAULT_FRAME_BYTES
from p2p.dht.records import encode_record_set
from p2p.node import BULK_PROBE_PROTOCOL, PING_PROTOCOL, PingReply, PingRequest
from p2p.wire import FRAME_HEADER, frame


@pytest.fixture
def relay_at(tmp_path: Path) -> Iterator[tuple[PeerProcess, str]]:
    """A real `swarmtrain relay` and its join address."""
    relay, addr = start_relay(tmp_path / "relay.key")
    try:
        yield relay, addr
    finally:
        relay.stop()


def _peer_id(addr: str) -> ID:
    return ID.from_base58(multiaddr.Multiaddr(addr).value_for_protocol("p2p"))


async def _connect_and_leave(host: Host, peer_id: ID, addr: str, times: int) -> None:
    network = host.libp2p.get_network()
    for i in range(times):
        try:
            await host.connect(peer_id, [multiaddr.Multiaddr(addr)])
        except Exception as exc:
            raise AssertionError(f"connection {i + 1} of {times} refused: {exc}") from exc
        await network.close_peer(peer_id)


async def test_slots_of_closed_connections_come_back() -> None:
    # A limit of 2 open at once: 0.8.1 refused the 3rd connection even after the first two closed.
    proc = PeerProcess(python_argv("tests/rpc_peer.py", "--max-connections", "2"))
    try:
        addr = proc.wait_line(timeout_s=30)
        peer_id = _peer_id(addr)
        with trio.fail_after(60):
            async with open_host(HostConfig(create_new_key_pair())) as host:
                await _connect_and_leave(host, peer_id, addr, 8)
                await host.connect(peer_id, [multiaddr.Multiaddr(addr)])
                reply = await call_unary(host, peer_id, ECHO, Echo(b"x"), Echo, deadline_s=10)
                assert reply.payload == b"x"
    finally:
        proc.stop()


async def test_a_relay_accepts_a_thousand_connections_one_after_the_other(
    relay_at: tuple[PeerProcess, str],
) -> None:
    # 8 clients, 125 connections each, each closed before the next: never more than 8 open at
    # once, 1,000 in all against a limit of 257 (0.8.1 refused everything after the 257th).
    relay, addr = relay_at
    peer_id = _peer_id(addr)
    with trio.fail_after(100):
        async with trio.open_nursery() as nursery:
            for _ in range(8):
                nursery.start_soon(_client, peer_id, addr, 125)
        async with open_host(HostConfig(create_new_key_pair())) as host:
            await host.connect(peer_id, [multiaddr.Multiaddr(addr)])
            reply = await call_unary(
                host, peer_id, PING_PROTOCOL, PingRequest(b"12345678"), PingReply, deadline_s=10
            )
            assert reply.nonce == b"12345678"
    assert relay.proc.poll() is None


async def _client(peer_id: ID, addr: str, times: int) -> None:
    async with open_host(HostConfig(create_new_key_pair())) as host:
        await _connect_and_leave(host, peer_id, addr, times)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("command", ["relay", "coordinator"])
async def test_a_second_service_on_a_busy_port_is_refused(
    command: str, tmp_path: os.PathLike[str]
) -> None:
    listen = f"/ip4/127.0.0.1/tcp/{_free_port()}"
    args = [*SWARMTRAIN, command, "--listen", listen]
    first = PeerProcess([*args, "--identity", os.path.join(tmp_path, "a.key")])
    try:
        line = await first.wait_line_async(lambda text: "/p2p/" in text, timeout_s=60)
        join = next(word for word in line.split() if word.startswith(listen))
        second = await trio.to_thread.run_sync(
            lambda: subprocess.run(
                [*args, "--identity", os.path.join(tmp_path, "b.key")],
                capture_output=True,
                text=True,
                timeout=60,
            )
        )
        assert second.returncode == 1, (second.stdout, second.stderr[-2000:])
        assert (
            f"address already in use: {listen} (another swarmtrain relay or coordinator?)"
            in second.stderr
        ), second.stderr[-2000:]
        assert "/p2p/" not in second.stdout  # it never announced itself
        # The first still serves every connection to its port.
        with trio.fail_after(30):
            async with open_host(HostConfig(create_new_key_pair())) as host:
                for _ in range(3):
                    await _connect_and_leave(host, _peer_id(join), join, 1)
                await host.connect(_peer_id(join), [multiaddr.Multiaddr(join)])
                reply = await call_unary(
                    host, _peer_id(join), PING_PROTOCOL, PingRequest(b"x"), PingReply, deadline_s=10
                )
                assert reply.nonce == b"x"
        assert first.proc.poll() is None
    finally:
        first.stop()


CONTROL_PROTOCOLS = [
    "/swarmtrain/ping/1",
    "/swarmtrain/runspec/1",
    "/swarmtrain/dialback/1",
    "/ipfs/kad/1.0.0",
]


@pytest.fixture
def coordinator(tmp_path: os.PathLike[str]) -> Iterator[tuple[PeerProcess, str]]:
    proc = PeerProcess(
        [
            *SWARMTRAIN,
            "coordinator",
            "--identity",
            os.path.join(tmp_path, "c.key"),
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
            "--read-timeout",
            "2",
        ]
    )
    try:
        line = proc.wait_line(lambda text: "/p2p/" in text, timeout_s=60)
        yield proc, next(word for word in line.split() if "/p2p/" in word)
    finally:
        proc.stop()


async def _closed_within(
    stream: INetStream, seconds: float, trickle_s: float | None, prefix: bytes
) -> float:
    """Seconds until the server ends ``stream`` (inf if not within ``seconds``); with
    ``trickle_s``, a plausible length ``prefix`` and then one byte of its body every
    ``trickle_s``."""
    start = trio.current_time()
    with trio.move_on_after(seconds):
        async with trio.open_nursery() as nursery:
            if trickle_s is not None:

                async def trickle() -> None:
                    with contextlib.suppress(Exception):
                        await stream.write(prefix)
                        while True:
                            await trio.sleep(trickle_s)
                            await stream.write(b"\x00")

                nursery.start_soon(trickle)
            with contextlib.suppress(Exception):
                while await stream.read(4096):
                    pass
            nursery.cancel_scope.cancel()
            return trio.current_time() - start
    return math.inf


@pytest.mark.parametrize("trickle", [False, True], ids=["idle", "trickle"])
async def test_a_stream_that_sends_nothing_or_a_trickle_is_closed_by_its_deadline(
    coordinator: tuple[PeerProcess, str], trickle: bool
) -> None:
    proc, join = coordinator
    peer_id = _peer_id(join)
    with trio.fail_after(60):
        async with open_host(HostConfig(create_new_key_pair())) as host:
            await host.connect(peer_id, [multiaddr.Multiaddr(join)])
            streams = [await host.open_stream(peer_id, p) for p in CONTROL_PROTOCOLS]
            waited: dict[str, float] = {}

            async def watch(protocol: str, stream: INetStream) -> None:
                # 64 bytes announced, in our frames' 4-byte prefix or Kad's varint.
                prefix = b"\x40" if "kad" in protocol else FRAME_HEADER.pack(64)
                waited[protocol] = await _closed_within(
                    stream, 12, 1.0 if trickle else None, prefix
                )

            async with trio.open_nursery() as nursery:
                for protocol, stream in zip(CONTROL_PROTOCOLS, streams, strict=True):
                    nursery.start_soon(watch, protocol, stream)
            # 2 s deadline: closed within it plus scheduling slack, never left open.
            assert all(seconds < 8 for seconds in waited.values()), waited
            reply = await call_unary(
                host, peer_id, PING_PROTOCOL, PingRequest(b"after"), PingReply, deadline_s=10
            )
            assert reply.nonce == b"after"
    assert proc.proc.poll() is None


async def test_a_kad_stream_kept_after_its_answer_is_closed_quietly(
    coordinator: tuple[PeerProcess, str],
) -> None:
    # A client that pools its Kad streams (ours does, so do others) leaves one idle after each
    # answer: past the read deadline the server ends it like a closed stream, not as a rejection
    # (every pooled stream was one WARNING line before).
    proc, join = coordinator
    peer_id = _peer_id(join)
    request = KadMessage(type=KadMessage.MessageType.FIND_NODE, key=peer_id.to_bytes())
    body = request.SerializeToString()
    with trio.fail_after(60):
        async with open_host(HostConfig(create_new_key_pair())) as host:
            await host.connect(peer_id, [multiaddr.Multiaddr(join)])
            stream = await host.open_stream(peer_id, "/ipfs/kad/1.0.0")
            await stream.write(varint.encode(len(body)) + body)
            answer = await read_varint_prefixed_bytes_limited(stream, 1 << 20)
            assert KadMessage.FromString(answer).type == KadMessage.MessageType.FIND_NODE
            # 2 s deadline: ended within it plus scheduling slack.
            assert await _closed_within(stream, 12, None, b"") < 8
            await trio.sleep(0.5)  # the server logs before it resets; give the pipe a moment
            assert "kad/1.0.0 deadline" not in proc.stderr, proc.stderr[-2000:]
            # A stream that never sent a request is a rejection (and is logged).
            silent = await host.open_stream(peer_id, "/ipfs/kad/1.0.0")
            assert await _closed_within(silent, 12, None, b"") < 8
            with trio.move_on_after(5):
                while "kad/1.0.0 deadline" not in proc.stderr:
                    await trio.sleep(0.1)
            assert "kad/1.0.0 deadline" in proc.stderr, proc.stderr[-2000:]


async def test_a_flood_of_bad_input_is_counted_not_echoed(
    coordinator: tuple[PeerProcess, str],
) -> None:
    proc, join = coordinator
    peer_id = _peer_id(join)
    echo_me = b"\xa5" * 17_000  # 17 KiB that a decode error would once quote whole

    async def bad_inputs(host: Host, count: int) -> None:
        for i in range(count):
            stream = await host.open_stream(peer_id, "/swarmtrain/runspec/1")
            body = echo_me if i % 2 else b"\xc1" * 32
            with contextlib.suppress(Exception):
                await stream.write(frame(body))
                await stream.close()
                while await stream.read(4096):
                    pass

    with trio.fail_after(100):
        async with open_host(HostConfig(create_new_key_pair())) as host:
            await host.connect(peer_id, [multiaddr.Multiaddr(join)])
            async with trio.open_nursery() as nursery:
                for _ in range(4):
                    nursery.start_soon(bad_inputs, host, 100)
            reply = await call_unary(
                host, peer_id, PING_PROTOCOL, PingRequest(b"alive"), PingReply, deadline_s=10
            )
            assert reply.nonce == b"alive"
        client = str(host.peer_id)
    stderr = await trio.to_thread.run_sync(lambda: proc.wait_stderr("rejected", timeout_s=10))
    lines = [line for line in stderr.splitlines() if client in line]
    assert 1 <= len(lines) <= 3, stderr[-3000:]  # 400 rejections, one line (a minute's window)
    assert max(len(line) for line in stderr.splitlines()) < 400
    assert "\\xa5\\xa5\\xa5\\xa5" not in stderr and "a5a5a5a5" not in stderr
    assert proc.proc.poll() is None


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


async def test_dht_storage_refuses_endless_records_and_one_identitys_flood(
    relay_at: tuple[PeerProcess, str],
) -> None:
    relay, addr = relay_at
    relay_id = _peer_id(addr)
    with trio.fail_after(100):
        async with open_host(HostConfig(create_new_key_pair())) as host:
            await host.connect(relay_id, [multiaddr.Multiaddr(addr)])
            dht = Dht(host)
            attacker, honest = RecordSigner(os.urandom(32)), RecordSigner(os.urandom(32))
            now = time.time()

            async def put(signer: RecordSigner, name: str, values: list[bytes], expires: float):
                key = dht_key(name)
                records = [
                    signer.sign(key, value, expires, tag=b"%d" % i)
                    for i, value in enumerate(values)
                ]
                return await dht.put_raw(relay_id, key, encode_record_set(records))

            assert await put(honest, "ok", [b"v"], now + 600)
            assert not await put(attacker, "forever", [b"v"], now + 100 * 365 * 86400)
            assert not await put(attacker, "forever", [b"v"], 1e300)
            rss_before = _rss_mib(relay.proc.pid)
            # 100 keys x 32 subkeys x 15 KiB = 47 MiB offered by one identity (under audit-record
            # keys: elsewhere an owner holds one entry per key).
            accepted = 0
            for i in range(100):
                name = f"run/fill/aggregate/{i}"
                if await put(attacker, name, [os.urandom(15 << 10)] * 32, now + 600):
                    accepted += 1
            assert 0 < accepted * 32 * 15 * 1024 <= 8 << 20, accepted
            assert await put(honest, "still-ok", [b"v"], now + 600)
            growth = _rss_mib(relay.proc.pid) - rss_before
            assert growth < 48, growth
    assert relay.proc.poll() is None


async def _named_by(dht: Dht, server: ID, target: ID) -> set[ID]:
    """The peers ``server`` names in its FIND_NODE answer for ``target``."""
    request = KadMessage(type=KadMessage.MessageType.FIND_NODE, key=target.to_bytes())
    response = await dht._request(server, request, fresh=True)
    assert response is not None
    return {ID(peer.id) for peer in response.closerPeers}


async def test_a_relay_hands_out_only_reachable_kad_servers(
    relay_at: tuple[PeerProcess, str],
) -> None:
    _, addr = relay_at
    relay_id = _peer_id(addr)

    def node_config(announce: tuple[str, ...] = ()) -> NodeConfig:
        host = HostConfig(create_new_key_pair(), announce_addrs=announce)
        return NodeConfig(host, bootstrap=(addr,), bulk_port=None)

    with trio.fail_after(90):
        # Private: it announces an address nobody can dial back (port 9 is closed).
        async with (
            open_node(node_config(("/ip4/127.0.0.1/tcp/9",))) as private,
            open_node(node_config()) as public,
            open_host(HostConfig(create_new_key_pair())) as client_host,
            open_host(HostConfig(create_new_key_pair())) as asker_host,
        ):
            assert private.reachability.status is Reachability.PRIVATE
            assert not private.dht.is_server and public.dht.is_server
            # A Kad client (js-libp2p's client mode, or ours) querying the relay a lot.
            client = Dht(client_host, server=False)
            await client_host.connect(relay_id, [multiaddr.Multiaddr(addr)])
            for _ in range(5):
                await _named_by(client, relay_id, client_host.peer_id)
            await private.dht.refresh()
            asker = Dht(asker_host, server=False)
            await asker_host.connect(relay_id, [multiaddr.Multiaddr(addr)])
            named: set[ID] = set()
            with trio.move_on_after(10):
                while public.host.peer_id not in named:  # it proves itself in seconds
                    await trio.sleep(0.2)
                    named = set()
                    # Their own ids (0.8.1 put a known target first in an answer, server or
                    # not) and random ones (the answer is then the relay's whole table).
                    targets = [client_host.peer_id, private.host.peer_id]
                    targets += [ID.from_pubkey(create_new_key_pair().public_key) for _ in "ab"]
                    for target in targets:
                        named |= await _named_by(asker, relay_id, target)
            assert public.host.peer_id in named
            assert client_host.peer_id not in named
            assert private.host.peer_id not in named


def _probe_offer(total_bytes: int, *, direct: bool) -> bytes:
    offer = Offer(
        os.urandom(16), total_bytes, DEFAULT_FRAME_BYTES, 1, os.urandom(32), direct, 0, b""
    )
    return encode_control(offer)


async def test_bulk_probe_offers_held_open_cost_no_memory_and_a_trickle_is_cut(
    relay_at: tuple[PeerProcess, str],
) -> None:
    relay, addr = relay_at
    relay_id = _peer_id(addr)
    with trio.fail_after(100):
        async with contextlib.AsyncExitStack() as stack:
            hosts = [
                await stack.enter_async_context(open_host(HostConfig(create_new_key_pair())))
                for _ in range(17)
            ]
            for host in hosts:
                await host.connect(relay_id, [multiaddr.Multiaddr(addr)])
            rss_before = _rss_mib(relay.proc.pid)
            # 16 peers offer 64 MiB each over their libp2p stream and send nothing more.
            streams = []
            for host in hosts[:16]:
                stream = await host.open_stream(relay_id, BULK_PROBE_PROTOCOL)
                await stream.write(_probe_offer(64 << 20, direct=False))
                streams.append(stream)
            await trio.sleep(1.5)  # let the relay act on every offer
            growth = _rss_mib(relay.proc.pid) - rss_before
            assert growth < 64, growth  # zero-filled buffers: 16 x 64 MiB = 1 GiB
            for stream in streams:
                await stream.reset()
            # A trickle: 1 MiB offered, a byte a second. The probe's progress deadline
            # (10 s + 1 MiB at 256 KiB/s) ends it, although each byte beats the idle timeout.
            stream = await hosts[16].open_stream(relay_id, BULK_PROBE_PROTOCOL)
            await stream.write(_probe_offer(1 << 20, direct=False))
            start = trio.current_time()
            with trio.move_on_after(40), contextlib.suppress(Exception):
                while True:  # until the relay ends the stream
                    with trio.move_on_after(1):
                        if not await stream.read(4096):
                            break
                    await stream.write(b"\x00")
            assert 10 <= trio.current_time() - start < 25
    stderr = await trio.to_thread.run_sync(
        lambda: relay.wait_stderr("did not arrive", timeout_s=10)
    )
    assert "1048576 bytes did not arrive within 10 s" in stderr, stderr[-2000:]
    assert relay.proc.poll() is None
