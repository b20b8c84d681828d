"""A public host on the default command line (no ``--listen``: the wildcard address, a random
port) is found public, in the NAT lab, by ``swarmtrain doctor`` and by ``swarmtrain node``.

Issue 16: such a host was reported private ("1 helper(s) could not dial any of 1 address(es) of
ours"): the wildcard listen address was dropped from the dial-back request, which was left with
the address the helper had observed, the *source* port of our outbound connection, where nothing
listens. A public volunteer then opened no bulk listener and was reached only through relays.

Topology (natlab.sh): the relay or coordinator on pub (198.51.100.1), public host c
(198.51.100.3). The NATed hosts stay idle; ``test_doctor.py`` covers them.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from test_doctor import start_relay

if TYPE_CHECKING:
    from tests.natlab.conftest import LabProcess

pytestmark = pytest.mark.natlab

SWARMTRAIN = (sys.executable, "-m", "swarmtrain.cli")
PUB_LISTEN = "/ip4/198.51.100.1/tcp/4001"
# Interpreter and libp2p import (more on a loaded 2-core box), join, dial-back, relay
# reservation when private, then a ping with its bulk probe.
REPORT_S = 45.0
# A node also imports torch before it joins (seconds, more on a loaded box).
NODE_S = 90.0
LINGER_S = 150  # outlives the test; the fixture stops lingering peers with SIGINT


def test_doctor_without_listen_on_a_public_host_is_public(
    lab: Callable[..., None], run_in: Callable[..., LabProcess], tmp_path: Path
) -> None:
    started = time.monotonic()
    lab()
    relay, join = start_relay(run_in, tmp_path)
    relay_id = join.rsplit("/p2p/", 1)[1]

    # No --listen: what a volunteer types.
    c_argv = [*SWARMTRAIN, "doctor", "--identity", str(tmp_path / "c.key"), "--json"]
    c_proc = run_in("c", "c", *c_argv, "--join", join, "--linger", str(LINGER_S))
    c = c_proc.read_json(REPORT_S)
    print("c", json.dumps(c))
    assert c["reachability"] == "public", (c, c_proc.tail())
    assert c["relays"] == [], c  # a public peer needs no relay slot
    assert not c["problems"], c
    assert c["bulk_listener"], c
    port = int(c["bulk_listener"].rsplit(":", 1)[1])
    assert port > 0, c
    (c_addr,) = [a for a in c["listen_addrs"] if "/ip4/198.51.100.3/tcp/" in a]

    # The bulk listener serves strangers: a doctor on pub pings c and its 4 MiB bulk probe goes
    # over a data connection dialed to c's listener.
    pub_argv = [*SWARMTRAIN, "doctor", "--identity", str(tmp_path / "pub.key"), "--json"]
    pub_argv += ["--listen", "/ip4/198.51.100.1/tcp/4002", "--join", join, "--join", c_addr]
    pub_proc = run_in("pub", "pub", *pub_argv, "--ping", c["peer_id"], "--ping", relay_id)
    pub = pub_proc.read_json(REPORT_S)
    print("pub", json.dumps(pub))
    (to_c,) = [p for p in pub["pings"] if p["peer_id"] == c["peer_id"]]
    assert to_c["ok"] and to_c["direct"], (to_c, pub_proc.tail())
    assert to_c["bulk_mode"] == "dial_receiver", (to_c, pub_proc.tail())
    assert pub_proc.wait(REPORT_S) == 0, pub_proc.tail()
    # The helper (the relay) logs what it dialed and how each dial went.
    assert re.search(r"dial-back for \S+ seen at 198\.51\.100\.3", relay.tail(200)), relay.tail()
    print(f"doctor without --listen: {time.monotonic() - started:.1f} s")


def test_node_without_listen_on_a_public_host_is_public(
    lab: Callable[..., None], run_in: Callable[..., LabProcess], tmp_path: Path
) -> None:
    started = time.monotonic()
    lab()
    config = tmp_path / "run.toml"
    made = subprocess.run(
        [*SWARMTRAIN, "init", str(config)], capture_output=True, text=True, timeout=30
    )
    assert made.returncode == 0, made.stderr
    coordinator = run_in(
        "coordinator",
        "pub",
        *SWARMTRAIN,
        "coordinator",
        "--config",
        str(config),
        "--identity",
        str(tmp_path / "coordinator.key"),
        "--listen",
        PUB_LISTEN,
    )
    deadline = time.monotonic() + REPORT_S
    while not (line := coordinator.read_line(deadline - time.monotonic())).startswith(
        "swarmtrain node --join "
    ):
        pass
    join = line.removeprefix("swarmtrain node --join ").strip()
    assert join.startswith(PUB_LISTEN + "/p2p/"), (join, coordinator.tail())

    # No --listen: what a volunteer types. Its first stdout line (the verified run spec) comes
    # after the node joined and decided its reachability.
    node = run_in(
        "node",
        "c",
        *SWARMTRAIN,
        "node",
        "--join",
        join,
        "--state-dir",
        str(tmp_path / "node"),
        "--threads",
        "1",
    )
    first = node.read_line(NODE_S)
    assert first.startswith("run "), (first, node.tail())
    log = node.stderr_path.read_text(errors="replace")
    verdicts = re.findall(r"p2p\.nat\.traversal: reachability (\w+): (.*)", log)
    assert verdicts and verdicts[0][0] == "public", (verdicts, node.tail())
    assert "reserved a relay slot" not in log, node.tail()
    assert re.search(r"bulk listener on 0\.0\.0\.0:[1-9]\d*", log), node.tail()
    node.stop()
    print(f"node without --listen: {time.monotonic() - started:.1f} s")
