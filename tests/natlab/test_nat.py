"""NAT traversal across real network namespaces, each peer a real swarmtrain host process.

Topology (natlab.sh): relay on the public segment (198.51.100.1), public host c (198.51.100.3),
A behind a port-restricted cone NAT (nat1), B behind nat2 (port-restricted or symmetric).

- reachability by dial-back: public for the relay and c, private for A and B;
- every pair exchanges an RPC;
- A <-> B: direct after DCUtR when both NATs are port-restricted cones, and both ends' hosts say
  so: ``punched`` (``connection_kind``, what ``swarmtrain_connections{kind="punched"}`` counts);
  through the relay, and saying so (``relayed`` at both ends), when B's NAT is symmetric (a
  plain-socket punch fails there too, see DESIGN.md).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from tests.natlab.conftest import LabProcess

pytestmark = pytest.mark.natlab

STARTUP_S = 45.0  # interpreter + libp2p import on a 2-core box, plus a 3 s dial-back timeout
COMMAND_S = 40.0


def addrs_of(ready: dict[str, Any]) -> list[str]:
    # What the peer would publish in its DHT record (plain addresses, then circuit ones).
    return ready.get("advertised") or ready["listen_addrs"]


def ping(src: LabProcess, dst: dict[str, Any]) -> None:
    src.send({"cmd": "ping", "peer_id": dst["peer_id"], "addrs": addrs_of(dst)})


@pytest.mark.parametrize(
    ("nat2", "a_to_b"),
    [("prc", "punched"), ("sym", "relayed")],
    ids=["cone-cone-holepunch", "cone-symmetric-relayed"],
)
def test_nat_traversal(
    lab: Callable[..., None], spawn: Callable[..., LabProcess], nat2: str, a_to_b: str
) -> None:
    lab(nat1="prc", nat2=nat2)
    relay = spawn("relay", "pub", "--listen", "/ip4/198.51.100.1/tcp/4001", "--relay-hop")
    r = relay.read_json(STARTUP_S)
    assert r["event"] == "ready" and r["join"].endswith("/p2p/" + r["peer_id"])

    procs = {
        name: spawn(name, ns, "--listen", f"/ip4/{ip}/tcp/4001", "--join", r["join"])
        for name, ns, ip in [
            ("c", "c", "198.51.100.3"),
            ("a", "a", "192.168.1.10"),
            ("b", "b", "192.168.2.10"),
        ]
    }
    ready = {name: proc.read_json(STARTUP_S) for name, proc in procs.items()}
    c, a, b = ready["c"], ready["a"], ready["b"]

    # Reachability, decided by dial-backs over fresh connections (the relay helps c, A, B;
    # c helps the relay).
    relay.send({"cmd": "reachability", "helpers": [c["peer_id"]]})
    relay_verdict = relay.read_json(COMMAND_S)
    assert relay_verdict["status"] == "public", relay_verdict
    assert c["reachability"]["status"] == "public", c
    assert a["reachability"]["status"] == "private", a
    assert b["reachability"]["status"] == "private", b
    assert c["relays"] == []
    assert a["relays"] and all("/p2p-circuit/p2p/" in x for x in a["relays"] + b["relays"])

    # Every pair: A->B first, alone, so its hole punch is not racing anything else.
    ping(procs["a"], b)
    ab = procs["a"].read_json(COMMAND_S)
    print("a->b", json.dumps(ab))  # timings, shown on failure or with -s
    assert ab["ok"], (ab, procs["a"].tail(), procs["b"].tail())
    assert ab["kind"] == a_to_b, (ab, procs["a"].tail(), procs["b"].tail())
    assert ab["direct"] is (a_to_b == "punched")
    # B's host knows how it came too: it ran the punch's other end (or served over the relay).
    assert ab["server_connection"] == a_to_b, (ab, procs["a"].tail(), procs["b"].tail())
    if a_to_b == "relayed":
        # B's end agrees: the RPC came in over the relay. (After a punch, B may serve the first
        # stream on either connection, so only the relayed case pins the server's view.)
        assert ab["server_kind"] == "relayed", ab

    ping(procs["a"], c)
    ping(procs["b"], c)
    ping(procs["c"], r)
    results = [
        procs["a"].read_json(COMMAND_S),
        procs["b"].read_json(COMMAND_S),
        procs["c"].read_json(COMMAND_S),
    ]
    ping(procs["a"], r)
    ping(procs["b"], r)
    results += [procs["a"].read_json(COMMAND_S), procs["b"].read_json(COMMAND_S)]
    for result in results:
        print("ping", json.dumps(result))
        assert result["event"] == "ping" and result["ok"], result
        # Everything else involves a public peer, reachable directly.
        assert result["kind"] == "direct", result
        assert result["server_kind"] == "direct", result
        assert result["server_connection"] == "direct", result
