"""A relay restarts under a NATed peer, which takes its slot again (issue 16, point 4).

Before: a relay that restarted (same identity, same address) forgot every reservation, and a peer
behind a NAT stayed unreachable through it (``Relay connection failed with status 204``) until
0.8.1's refresher ran, 30 s before the old slot's hour was up. Now the peer reserves again once
its connection to the relay closes (``p2p.nat.reservations``), so a third peer reaches it through
the same ``/p2p-circuit`` address seconds after the relay is back.

Topology (natlab.sh): ``swarmtrain relay`` on pub, a public doctor on c (a second DHT server, so
B's address record outlives the relay's memory), B behind a symmetric NAT (reachable only
through the relay), A behind a port-restricted cone NAT pinging B after the restart. Every peer
is a real ``swarmtrain`` process.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from test_doctor import (
    REPORT_S,
    check_private,
    check_public,
    doctor,
    report_of,
    start_relay,
)

if TYPE_CHECKING:
    from tests.natlab.conftest import LabProcess

pytestmark = pytest.mark.natlab


def test_a_natted_peer_is_reachable_through_a_restarted_relay(
    lab: Callable[..., None], run_in: Callable[..., LabProcess], tmp_path: Path
) -> None:
    lab(nat1="prc", nat2="sym")
    relay, join = start_relay(run_in, tmp_path)
    relay_id = join.rsplit("/p2p/", 1)[1]
    c_proc = doctor(
        run_in, tmp_path, "c", "c", "/ip4/198.51.100.3/tcp/4001", join, [relay_id], linger=True
    )
    c = report_of(c_proc)
    check_public(c)
    (c_join,) = c["listen_addrs"]
    b_proc = doctor(
        run_in, tmp_path, "b", "b", "/ip4/192.168.2.10/tcp/4001", [join, c_join], [relay_id],
        linger=True,
    )  # fmt: skip
    b = report_of(b_proc)
    check_private(b, relay_id)

    relay.stop()  # SIGINT: the relay process exits, its reservations with it
    restarted, again = start_relay(run_in, tmp_path, "relay-restarted")
    assert again == join  # same identity, same address: B's circuit address is unchanged
    back = time.monotonic()

    a_proc = doctor(
        run_in, tmp_path, "a", "a", "/ip4/192.168.1.10/tcp/4001", [join, c_join],
        [b["peer_id"]], linger=False,
    )  # fmt: skip
    a = report_of(a_proc)
    (ping,) = a["pings"]
    assert ping["ok"] and ping["direct"] is False, (ping, a_proc.tail(), b_proc.tail())
    assert a_proc.wait(REPORT_S) == 0, a_proc.tail()
    print(f"B reached through the restarted relay {time.monotonic() - back:.1f} s after its start")
    for proc in (restarted, c_proc, b_proc):
        assert proc.proc.poll() is None, proc.tail()
