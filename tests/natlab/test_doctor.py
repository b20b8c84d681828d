"""``swarmtrain relay`` and ``swarmtrain doctor``, the product itself, across the NAT lab.

Topology (natlab.sh): the relay on the public segment (pub, 198.51.100.1:4001), a second doctor
on the relay's host (198.51.100.1:4002), public host c (198.51.100.3), A behind a port-restricted
cone NAT (nat1), B behind nat2 (port-restricted cone, or symmetric). Every peer is a real
``swarmtrain`` process; each doctor gets only join addresses and finds the peers it pings through
the DHT (their signed address records, ``/p2p-circuit`` addresses included).

Order, each step waiting (with a deadline) for the previous one's JSON report, which a doctor
prints only after publishing its addresses:

1. relay (pub): its join address is its first stdout line;
2. c (public) lingers, pinging the relay;
3. B (behind nat2) lingers, pinging c and the relay; a doctor on the relay's host pings c and
   the relay and exits;
4. A (behind nat1) pings B, c and the relay and exits (status 0: every ping ok).

Checked: dial-back reachability says public for c and the relay's host, private for A and B, who
hold ``/p2p-circuit`` relay slots; every pair of relay, c, A and B exchanges an RPC (a doctor ping
is ``/swarmtrain/ping/1`` request/response); pings to public peers are direct; A -> B is direct
after DCUtR between two cone NATs, and relayed (and still ok) when B's NAT is symmetric. After
each ping doctor sends 4 MiB over the bulk data plane: to a public peer on a data connection
dialed out across the pinger's NAT; between two cone-NATed peers (A -> B after DCUtR) on a data
connection punched the same way; over a relayed connection (B symmetric) on the libp2p stream.
``test_nat.py`` also checks the *server's* view of each connection, which doctor does not report.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from tests.natlab.conftest import LabProcess

pytestmark = pytest.mark.natlab

SWARMTRAIN = (sys.executable, "-m", "swarmtrain.cli")
RELAY_LISTEN = "/ip4/198.51.100.1/tcp/4001"
# Interpreter and libp2p import (~2.5 s alone, more on a loaded 2-core box), join, dial-back (3 s
# timeout when private), relay reservation, then the pings (a failed punch costs its 8 s budget).
REPORT_S = 45.0
# Outlives the test (pytest's 120 s timeout) even on a loaded box; the fixture stops lingering
# peers with SIGINT when the test ends.
LINGER_S = 150


def start_relay(
    run_in: Callable[..., LabProcess], tmp_path: Path, name: str = "relay"
) -> tuple[LabProcess, str]:
    """``swarmtrain relay`` on pub (its key in ``tmp_path``, so a restart keeps the identity);
    returns it and its join address, its first stdout line."""
    key = str(tmp_path / "relay.key")
    relay = run_in(name, "pub", *SWARMTRAIN, "relay", "--identity", key, "--listen", RELAY_LISTEN)
    join = relay.read_line(REPORT_S)
    assert join.startswith(RELAY_LISTEN + "/p2p/12D3KooW"), (join, relay.tail())
    return relay, join


def doctor(
    run_in: Callable[..., LabProcess],
    tmp_path: Path,
    name: str,
    namespace: str,
    listen: str,
    join: str | list[str],
    ping: list[str],
    *,
    linger: bool,
) -> LabProcess:
    argv = [*SWARMTRAIN, "doctor", "--identity", str(tmp_path / f"{name}.key")]
    argv += ["--listen", listen, "--json"]
    for addr in [join] if isinstance(join, str) else join:
        argv += ["--join", addr]
    for peer_id in ping:
        argv += ["--ping", peer_id]
    if linger:
        argv += ["--linger", str(LINGER_S)]
    return run_in(name, namespace, *argv)


def report_of(proc: LabProcess) -> dict[str, Any]:
    report = proc.read_json(REPORT_S)
    print(proc.name, json.dumps(report))  # shown on failure, or with -s
    assert not report["problems"], (report, proc.tail())
    assert report["joined"], report
    return report


def check_public(report: dict[str, Any]) -> None:
    assert report["reachability"] == "public", report
    assert report["relays"] == [], report  # a public peer needs no relay slot


def check_private(report: dict[str, Any], relay_id: str) -> None:
    assert report["reachability"] == "private", report
    assert report["relays"], report
    for circuit in report["relays"]:
        assert f"/p2p/{relay_id}/p2p-circuit/p2p/{report['peer_id']}" in circuit, report


def check_pings(
    proc: LabProcess,
    report: dict[str, Any],
    expected: dict[str, bool],
    public: set[str],
) -> dict[str, dict[str, Any]]:
    """Every ping ok, in the order asked, with its expected ``direct``; the doctor's bulk probe
    after it went through (ok covers it) by the right path: a data connection dialed to a public
    peer's bulk listener, across the pinger's NAT; the libp2p stream over a relayed connection."""
    pings = {p["peer_id"]: p for p in report["pings"]}
    assert list(pings) == list(expected), report
    for peer_id, direct in expected.items():
        result = pings[peer_id]
        assert result["ok"], (result, proc.tail())
        assert result["direct"] is direct, (result, proc.tail())
        assert result["rtt_ms"] > 0, result
        if peer_id in public:
            assert result["bulk_mode"] == "dial_receiver", (result, proc.tail())
        elif not direct:
            assert result["bulk_mode"] == "stream", (result, proc.tail())
        else:
            # Two NATed peers joined by DCUtR: neither listens, so the data connection is
            # punched between them as well (TCP simultaneous open across both cone NATs).
            assert result["bulk_mode"] == "punch", (result, proc.tail())
    return pings


@pytest.mark.parametrize(
    ("nat2", "a_to_b_direct"),
    [("prc", True), ("sym", False)],
    ids=["cone-cone-holepunch", "cone-symmetric-relayed"],
)
def test_doctor_across_nats(
    lab: Callable[..., None],
    run_in: Callable[..., LabProcess],
    tmp_path: Path,
    nat2: str,
    a_to_b_direct: bool,
) -> None:
    started = time.monotonic()
    lab(nat1="prc", nat2=nat2)
    relay, join = start_relay(run_in, tmp_path)
    relay_id = join.rsplit("/p2p/", 1)[1]

    c_proc = doctor(
        run_in, tmp_path, "c", "c", "/ip4/198.51.100.3/tcp/4001", join, [relay_id], linger=True
    )
    c = report_of(c_proc)
    check_public(c)
    public = {relay_id, c["peer_id"]}
    check_pings(c_proc, c, {relay_id: True}, public)

    b_proc = doctor(
        run_in,
        tmp_path,
        "b",
        "b",
        "/ip4/192.168.2.10/tcp/4001",
        join,
        [c["peer_id"], relay_id],
        linger=True,
    )
    # The relay's host: the relay itself only prints its join address, so a doctor beside it
    # (same address, next port) reports that host's reachability. It joins through c as well, so
    # a dial-back also comes from another host, not only from the relay over loopback. (Not the
    # host's second address: outbound connections leave from the first one, and a helper only
    # ever dials back the address it sees.)
    (c_join,) = c["listen_addrs"]
    pub_proc = doctor(
        run_in,
        tmp_path,
        "pub",
        "pub",
        "/ip4/198.51.100.1/tcp/4002",
        [join, c_join],
        [relay_id, c["peer_id"]],
        linger=False,
    )
    b = report_of(b_proc)
    check_private(b, relay_id)
    check_pings(b_proc, b, {c["peer_id"]: True, relay_id: True}, public)
    pub = report_of(pub_proc)
    check_public(pub)
    check_pings(pub_proc, pub, {relay_id: True, c["peer_id"]: True}, public)
    assert pub_proc.wait(REPORT_S) == 0, pub_proc.tail()

    a_proc = doctor(
        run_in,
        tmp_path,
        "a",
        "a",
        "/ip4/192.168.1.10/tcp/4001",
        join,
        [b["peer_id"], c["peer_id"], relay_id],
        linger=False,
    )
    a = report_of(a_proc)
    check_private(a, relay_id)
    expected = {b["peer_id"]: a_to_b_direct, c["peer_id"]: True, relay_id: True}
    a_to_b = check_pings(a_proc, a, expected, public)[b["peer_id"]]
    print(
        f"a->b: direct={a_to_b['direct']} rtt={a_to_b['rtt_ms']} ms bulk={a_to_b['bulk_mode']}"
        f" {a_to_b.get('bulk_MiBps')} MiB/s"
    )
    assert a_proc.wait(REPORT_S) == 0, a_proc.tail()  # doctor's own verdict: all checks passed

    # The lingering peers are still up: nothing crashed under the others' pings.
    for proc in (relay, c_proc, b_proc):
        assert proc.proc.poll() is None, proc.tail()
    print(f"nat2={nat2}: {time.monotonic() - started:.1f} s")
