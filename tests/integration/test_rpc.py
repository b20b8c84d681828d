"""RPC against a real peer process: 64 MiB both ways intact, failing handlers and hostile bytes
leave the peer serving, each rejection is logged with its reason, connection limits hold."""

from __future__ import annotations

import contextlib
import hashlib
import struct
from collections.abc import AsyncIterator

import msgpack
import multiaddr
import numpy as np
import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from peerproc import PeerProcess, python_argv
from rpc_peer import ECHO, FAIL, TENSOR, UPLOAD, Digest, Echo, TensorRequest, make_tensor

from p2p import Host, HostConfig, RemoteError, RpcStream, call_stream, call_unary, open_host
from p2p.wire import PROTOCOL_VERSION, frame


@pytest.fixture
def peer() -> AsyncIterator[tuple[PeerProcess, multiaddr.Multiaddr]]:
    proc = PeerProcess(python_argv("tests/rpc_peer.py"))
    try:
        line = proc.wait_line(timeout_s=30)
        yield proc, multiaddr.Multiaddr(line)
    finally:
        proc.stop()


def _peer_id(addr: multiaddr.Multiaddr) -> ID:
    return ID.from_base58(addr.value_for_protocol("p2p"))


class _Client:
    def __init__(self, addr: multiaddr.Multiaddr) -> None:
        self.addr = addr
        self.peer_id = _peer_id(addr)

    async def __aenter__(self) -> Host:
        self._cm = open_host(HostConfig(create_new_key_pair()))
        host = await self._cm.__aenter__()
        await host.connect(self.peer_id, [self.addr])
        return host

    async def __aexit__(self, *exc: object) -> None:
        await self._cm.__aexit__(*exc)


async def _echo_works(host: Host, peer_id: ID) -> None:
    reply = await call_unary(host, peer_id, ECHO, Echo(b"still here"), Echo, deadline_s=10)
    assert reply.payload == b"still here"


async def test_unary_and_64_mib_each_way(peer: tuple[PeerProcess, multiaddr.Multiaddr]) -> None:
    _, addr = peer
    with trio.fail_after(90):
        async with _Client(addr) as host:
            await _echo_works(host, _peer_id(addr))
            elements = 16 << 20  # 64 MiB of float32
            items = await call_stream(
                host, _peer_id(addr), TENSOR, TensorRequest(elements, 7), (Digest,), deadline_s=60
            )
            digest, array = items
            assert isinstance(digest, Digest) and isinstance(array, np.ndarray)
            assert array.dtype == np.float32 and array.shape == (elements,)
            assert hashlib.sha256(array.tobytes()).digest() == digest.sha256

            sent = make_tensor(elements, 11)
            stream = await host.open_stream(_peer_id(addr), UPLOAD)
            rpc = RpcStream(stream)
            await rpc.send_tensor(sent)
            reply = await rpc.receive(Digest)
            assert reply.nbytes == sent.nbytes
            assert reply.sha256 == hashlib.sha256(sent.tobytes()).digest()


async def test_failing_handler_leaves_host_serving(
    peer: tuple[PeerProcess, multiaddr.Multiaddr],
) -> None:
    proc, addr = peer
    with trio.fail_after(30):
        async with _Client(addr) as host:
            for _ in range(3):
                with pytest.raises(RemoteError) as info:
                    await call_unary(host, _peer_id(addr), FAIL, Echo(b"x"), Echo, deadline_s=10)
                assert info.value.code == "internal"
                assert "always fails" in info.value.message
                await _echo_works(host, _peer_id(addr))
    assert proc.proc.poll() is None
    stderr = await trio.to_thread.run_sync(
        lambda: proc.wait_stderr("this handler always fails", timeout_s=10)
    )
    assert "this handler always fails" in stderr


HOSTILE = {
    "garbage": (b"\x00\x00\x00\x05" + b"\xc1\xc1\xc1\xc1\xc1", "undecodable"),
    "truncated": (frame(msgpack.packb([PROTOCOL_VERSION, 9100, [b"abc"]]))[:-2], "short"),
    "huge length prefix": (struct.pack(">I", 0xFFFFFFF0), "exceeds limit"),
    "unknown type": (frame(msgpack.packb([PROTOCOL_VERSION, 31337, []])), "unknown message"),
    "wrong version": (frame(msgpack.packb([99, 9100, [b"x"]])), "version"),
    "wrong schema": (frame(msgpack.packb([PROTOCOL_VERSION, 9100, [42]])), "expected bytes"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
async def test_hostile_bytes_are_rejected_and_logged(
    peer: tuple[PeerProcess, multiaddr.Multiaddr], case: str
) -> None:
    proc, addr = peer
    payload, reason = HOSTILE[case]
    with trio.fail_after(30):
        async with _Client(addr) as host:
            stream = await host.open_stream(_peer_id(addr), ECHO)
            await stream.write(payload)
            await stream.close()  # half-close: a truncated message now ends early
            answer = b""
            with trio.move_on_after(10):
                try:
                    while chunk := await stream.read(4096):
                        answer += chunk
                except Exception:
                    pass  # reset or EOF: both are acceptable ways to refuse
            if answer:
                assert b"bad_request" in answer
            await _echo_works(host, _peer_id(addr))
    assert proc.proc.poll() is None
    stderr = await trio.to_thread.run_sync(
        lambda: proc.wait_stderr("rejected", reason, timeout_s=10)
    )
    assert "rejected" in stderr and reason in stderr, stderr[-2000:]


async def test_connection_limit_holds() -> None:
    proc = PeerProcess(python_argv("tests/rpc_peer.py", "--max-connections", "2"))
    try:
        addr = multiaddr.Multiaddr(proc.wait_line(timeout_s=30))
        with trio.fail_after(60):
            async with (
                _Client(addr) as h1,
                _Client(addr) as h2,
                open_host(HostConfig(create_new_key_pair())) as h3,
                open_host(HostConfig(create_new_key_pair())) as h4,
            ):
                await _echo_works(h1, _peer_id(addr))
                await _echo_works(h2, _peer_id(addr))
                refused = 0
                for extra in (h3, h4):
                    try:
                        await extra.connect(_peer_id(addr), [addr])
                        await _echo_works(extra, _peer_id(addr))
                    except Exception:
                        refused += 1
                assert refused == 2
                await _echo_works(h1, _peer_id(addr))
    finally:
        proc.stop()


@pytest.mark.parametrize("protocol", ["/ipfs/id/push/1.0.0", "/ipfs/ping/1.0.0"])
async def test_garbage_on_libp2p_own_protocols_leaves_host_serving(
    peer: tuple[PeerProcess, multiaddr.Multiaddr], protocol: str
) -> None:
    proc, addr = peer
    with trio.fail_after(30):
        async with _Client(addr) as host:
            for payload in (b"\xff" * 64, struct.pack(">I", 0xFFFFFFFF), b"\x80" * 12):
                stream = await host.open_stream(_peer_id(addr), protocol)
                await stream.write(payload)
                with contextlib.suppress(Exception):
                    await stream.close()
            await _echo_works(host, _peer_id(addr))
    assert proc.proc.poll() is None
