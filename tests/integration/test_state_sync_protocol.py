"""``/swarmtrain/state/1`` over real nodes on loopback (in one process, trio): ranges from two
sources, a source without the state refused and resumed elsewhere, bad requests refused, and a
peer sending garbage costs one stream, never the serving node."""

from __future__ import annotations

import hashlib
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from p2p import HostConfig, Node, NodeConfig, RpcStream, join_addr, open_node
from swarmtrain.membership.state_sync import (
    PROTOCOL,
    StateRangeRefused,
    StateRangeRequest,
    StateServer,
    StoredState,
    download_state,
    node_fetcher,
)
from swarmtrain.membership.state_sync_plan import MIN_PIECE_BYTES

RUN = "sync-test"
LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)


def _state(size: int) -> tuple[bytes, bytes]:
    body = os.urandom(size - 32)
    digest = hashlib.sha256(body).digest()
    return body + digest, digest


@asynccontextmanager
async def _node(bootstrap: tuple[str, ...] = ()) -> AsyncIterator[Node]:
    role = "peer" if bootstrap else "relay"
    config = NodeConfig(
        HostConfig(create_new_key_pair(), listen_addrs=LOOPBACK), role=role, bootstrap=bootstrap
    )
    async with open_node(config) as node:
        yield node


async def test_ranges_from_two_sources_refusals_and_garbage(tmp_path: Path) -> None:
    data, digest = _state(4 * MIN_PIECE_BYTES + 12345)
    # The second source serves from a file that holds the state among other bytes, as a node
    # serves its checkpoint; a file whose range is not the state is refused when opened.
    stored = tmp_path / "checkpoint"
    stored.write_bytes(b"head" * 25 + data + b"tail")
    with pytest.raises(ValueError, match="does not hold the state"):
        StoredState(stored, 99, len(data), digest)
    async with _node() as first:
        join = (join_addr(first),)
        async with _node(join) as second, _node(join) as third, _node(join) as client:
            servers = [StateServer(node, RUN) for node in (first, second, third)]
            for server in servers:
                server.install()
            servers[0].offer(digest, data)
            servers[1].offer(digest, StoredState(stored, 100, len(data), digest))
            # (the third never held this state)
            peers = [first.host.peer_id, second.host.peer_id, third.host.peer_id]

            with trio.fail_after(60):
                got = await download_state(
                    node_fetcher(client, RUN, digest),
                    digest,
                    len(data),
                    peers,
                    piece_bytes=MIN_PIECE_BYTES,
                )
            assert bytes(got.data) == data
            # Ranges came from both holders; the third refused and was dropped, its range resumed.
            assert set(got.pieces_by_source) == {str(peers[0]), str(peers[1])}
            assert "no such state" in got.failures[str(peers[2])]
            assert sum(got.pieces_by_source.values()) == len(got.data) // MIN_PIECE_BYTES + 1

            # A range past the end, or another run, is refused with a reason.
            for request, reason in (
                (StateRangeRequest(RUN, digest, len(data) - 10, 20), "beyond the state"),
                (StateRangeRequest("other", digest, 0, 10), "not serving run"),
            ):
                stream = await client.host.open_stream(first.host.peer_id, PROTOCOL)
                rpc = RpcStream(stream)
                await rpc.send(request)
                with trio.fail_after(10):
                    reply = await rpc.receive(StateRangeRefused)
                assert reason in reply.reason
                await rpc.close()

            # Garbage (a 4 GiB frame header, then noise) costs that stream only.
            stream = await client.host.open_stream(first.host.peer_id, PROTOCOL)
            await stream.write(b"\xff\xff\xff\xff" + os.urandom(64))
            ended = False
            with trio.move_on_after(10):
                try:
                    ended = await stream.read(1) == b""
                except Exception:  # StreamEOF / StreamReset: the server dropped the stream
                    ended = True
            assert ended  # refused at once (the frame limit is checked before any body byte)
            with trio.fail_after(60):
                again = await download_state(
                    node_fetcher(client, RUN, digest), digest, len(data), [peers[0]]
                )
            assert bytes(again.data) == data
