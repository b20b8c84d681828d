"""One DHT peer in its own process, driven line by line over stdin/stdout by the DHT tests.

Start: ``python dht_peer.py``. When its host and DHT serve it prints one line
``READY <multiaddr ending in /p2p/ID>``; then each command line on stdin gets one JSON line on
stdout:

    join MULTIADDR                        -> {"routing_table_size": n}
    peers                                 -> {"routing_table_size": n}
    store KEY VALUE_HEX TTL_S             -> {"stored": replicas}
    store_as SEED_HEX KEY COUNT TTL_S     -> {"stored": replicas}
    get KEY                               -> {"values": {SUBKEY_HEX: VALUE_HEX}}
    forge KEY VICTIM_ID_HEX VALUE_HEX     -> {"accepted": peers, "asked": peers}
    publish_addrs TTL_S [MULTIADDR ...]   -> {"stored": replicas}
    find_addrs PEER_ID_HEX                -> {"addrs": [MULTIADDR, ...]}

``store_as`` signs ``COUNT`` entries as the identity of the 32-byte ``SEED_HEX`` (one untagged,
or tagged ``0``, ``1``, ...) and stores them in one PUT at the key's replicas.

``forge`` writes, under the victim's subkey, records signed with this peer's key (claiming the
victim as owner, and with the victim's public key copied) straight to every peer it knows,
bypassing local checks, and reports how many accepted.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time

import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from multiaddr import Multiaddr

from p2p.dht.kademlia import Dht, dht_key
from p2p.dht.records import RecordSigner, encode_record_set, peer_id_from_public_key
from p2p.host import Host, HostConfig, open_host


def _forgeries(dht: Dht, key: str, victim: bytes, value: bytes) -> list[bytes]:
    own = dht.signer.sign(dht_key(key), value, time.time() + 3600, version=2**40)
    victim_public_key = victim[len(victim) - 32 :]
    claimed = dataclasses.replace(own, subkey=victim, owner=victim)
    stolen_key = dataclasses.replace(claimed, public_key=victim_public_key)
    assert peer_id_from_public_key(victim_public_key) == victim
    # Honestly signed by its real owner, but under the victim's subkey.
    unsigned = dataclasses.replace(own, subkey=victim, signature=b"")
    resigned = dataclasses.replace(
        unsigned, signature=dht.signer._private_key.sign(unsigned.signed_payload())
    )
    return [encode_record_set([r]) for r in (claimed, stolen_key, resigned)]


async def _command(host: Host, dht: Dht, line: str) -> dict[str, object]:
    cmd, *args = line.split()
    if cmd == "join":
        size = await dht.bootstrap([info_from_p2p_addr(Multiaddr(args[0]))])
        return {"routing_table_size": size}
    if cmd == "suspect":
        dht.suspect(ID.from_base58(args[0]))
        return {"suspect": args[0]}
    if cmd == "peers":
        return {"routing_table_size": dht.statistics().routing_table_size}
    if cmd == "store":
        key, value_hex, ttl = args
        return {"stored": await dht.store(key, bytes.fromhex(value_hex), time.time() + float(ttl))}
    if cmd == "store_as":
        seed_hex, key, count, ttl = args
        signer, expires = RecordSigner(bytes.fromhex(seed_hex)), time.time() + float(ttl)
        tags = [b""] if count == "1" else [b"%d" % i for i in range(int(count))]
        records = [signer.sign(dht_key(key), b"v", expires, tag=tag) for tag in tags]
        return {"stored": await dht.store_records(key, records)}
    if cmd == "get":
        values = await dht.get(args[0])
        return {"values": {k.hex(): v.hex() for k, v in values.items()}}
    if cmd == "get_from":
        records = await dht.get_records_from(ID.from_base58(args[0]), args[1])
        if records is None:
            return {"answered": False}
        return {"answered": True, "values": {k.hex(): r.value.hex() for k, r in records.items()}}
    if cmd == "forge":
        key, victim_hex, value_hex = args
        accepted = asked = 0
        for data in _forgeries(dht, key, bytes.fromhex(victim_hex), bytes.fromhex(value_hex)):
            for peer in dht.routing_table_peers():
                asked += 1
                accepted += await dht.put_raw(peer, dht_key(key), data)
        return {"accepted": accepted, "asked": asked}
    if cmd == "publish_addrs":
        addrs = [*host.addrs(), *(Multiaddr(a) for a in args[1:])]
        return {"stored": await dht.publish_addrs(addrs, time.time() + float(args[0]))}
    if cmd == "find_addrs":
        addrs = await dht.find_addrs(ID(bytes.fromhex(args[0])))
        return {"addrs": [str(a) for a in addrs]}
    return {"error": f"unknown command {cmd!r}"}


async def main() -> None:
    config = HostConfig(key_pair=create_new_key_pair())
    async with open_host(config) as host, trio.open_nursery() as nursery:
        dht = Dht(host)
        await nursery.start(dht.run)
        print(f"READY {host.addrs()[0]}", flush=True)
        stdin = trio.wrap_file(sys.stdin)
        while line := await stdin.readline():
            if not line.strip():
                continue
            try:
                with trio.fail_after(30):
                    reply = await _command(host, dht, line)
            except Exception as exc:
                reply = {"error": repr(exc)}
            print(json.dumps(reply), flush=True)
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    trio.run(main)
