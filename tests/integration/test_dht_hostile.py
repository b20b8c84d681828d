"""Hostile bytes on the DHT's Kademlia protocol of a real `swarmtrain relay` process: each is
refused, and the relay keeps serving joins and lookups."""

from __future__ import annotations

import contextlib
import json
import subprocess
from pathlib import Path

import multiaddr
import trio
import varint
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from peerproc import SWARMTRAIN, start_relay

from p2p import HostConfig, open_host

KAD = "/ipfs/kad/1.0.0"

HOSTILE = [
    b"\xff" * 64,  # not a varint-prefixed message at all
    varint.encode(1 << 30) + b"\x00" * 16,  # a 1 GiB length prefix
    varint.encode(20) + b"\x08\x63\x12\x10" + b"\xee" * 16,  # prefix ok, protobuf garbage
    varint.encode(200) + b"\x08\x01",  # truncated body
]


def test_kad_garbage_leaves_the_relay_serving(tmp_path: Path) -> None:
    relay, join = start_relay(tmp_path / "r")
    try:
        addr = multiaddr.Multiaddr(join)
        relay_id = ID.from_base58(addr.value_for_protocol("p2p"))

        async def attack() -> None:
            with trio.fail_after(60):
                async with open_host(HostConfig(create_new_key_pair())) as host:
                    await host.connect(relay_id, [addr])
                    for payload in HOSTILE:
                        stream = await host.open_stream(relay_id, KAD)
                        await stream.write(payload)
                        with contextlib.suppress(Exception):
                            await stream.close()
                        with trio.move_on_after(5), contextlib.suppress(Exception):
                            while await stream.read(4096):
                                pass

        trio.run(attack)
        doctor = subprocess.run(
            [*SWARMTRAIN, "doctor", "--identity", str(tmp_path / "d"), "--join", join,
             "--listen", "/ip4/127.0.0.1/tcp/0", "--ping", str(relay_id), "--json"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        report = json.loads(doctor.stdout.strip().splitlines()[-1])
        assert doctor.returncode == 0, doctor.stderr[-2000:]
        assert report["pings"][0]["ok"]
        assert relay.proc.poll() is None
    finally:
        assert relay.stop() in (0, 130), relay.stderr[-2000:]
