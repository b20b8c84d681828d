"""``--metrics-port``: a real coordinator, nodes and relay serve Prometheus metrics, scraped over
HTTP and parsed with ``prometheus_client``'s own parser; a node's values are its round lines', and
so are the TensorBoard scalars one writes with ``--log-to``.

Small settings (3 rounds of H=5) keep the swarm test well under a minute on a 2-core machine."""

from __future__ import annotations

import re
import socket
import subprocess
import time
from pathlib import Path

from peerproc import SWARMTRAIN, PeerProcess
from runproc import metrics_url, node, round_lines, scrape, start_coordinator, wait_exit
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROUND = re.compile(
    r"^round (\d+) loss ([\d.]+) \d+ tok/s peers (\d+) sent ([\d.]+) MiB recv ([\d.]+) MiB"
)


def wait_round_line(peer: PeerProcess, r: int, timeout_s: float = 10) -> str:
    return peer.wait_line(lambda s: s.startswith(f"round {r} "), timeout_s=timeout_s)


def test_nodes_and_coordinator_serve_their_rounds_as_metrics(tmp_path: Path) -> None:
    coordinator, join = start_coordinator(
        tmp_path, rounds=3, inner_steps=5, extra=("--metrics-port", "0")
    )
    nodes: list[PeerProcess] = []
    try:
        coordinator_url = metrics_url(coordinator)
        # Node 0 also logs its rounds to TensorBoard (``--log-to``), read back at the end.
        tensorboard = ("--log-to", f"tensorboard:{tmp_path / 'tb'}")
        nodes = [
            node(join, tmp_path / f"n{i}", "--metrics-port", "0", *(tensorboard if i == 0 else ()))
            for i in range(2)
        ]
        urls = [metrics_url(n, timeout_s=60) for n in nodes]
        # Node 0 after its first round: the scrape shows the last finished round, which its
        # round line (printed right after the round is fed) names with the same numbers.
        wait_round_line(nodes[0], 0, timeout_s=60)
        values = scrape(urls[0])
        r = int(values[("swarmtrain_round", ())])
        line = wait_round_line(nodes[0], r)
        lines = {k: ROUND.match(v) for k, v in round_lines(nodes[0]).items() if k <= r}
        assert all(lines.values()), round_lines(nodes[0])
        match = lines[r]
        assert match is not None
        assert abs(values[("swarmtrain_loss", ())] - float(match.group(2))) < 5e-4, line
        assert values[("swarmtrain_round_peers", ())] == int(match.group(3)) == 2, line
        assert values[("swarmtrain_rounds_total", (("outcome", "ok"),))] == r + 1
        assert values[("swarmtrain_rounds_total", (("outcome", "failed"),))] == 0
        assert values[("swarmtrain_state_agreement", ())] == 1
        assert values[("swarmtrain_allreduce_seconds_count", ())] == r + 1
        sent_mib = sum(float(m.group(4)) for m in lines.values() if m is not None)
        recv_mib = sum(float(m.group(5)) for m in lines.values() if m is not None)
        sent = values[("swarmtrain_allreduce_sent_bytes_total", ())] / 2**20
        received = values[("swarmtrain_allreduce_received_bytes_total", ())] / 2**20
        assert sent > 0 and abs(sent - sent_mib) <= 0.005 * len(lines), (sent, lines)
        assert abs(received - recv_mib) <= 0.005 * len(lines), (received, lines)
        assert values[("swarmtrain_tokens_per_second", ())] > 0
        # The p2p node, sampled at the scrape: connected (loopback is direct), a DHT.
        assert values[("swarmtrain_connections", (("kind", "direct"),))] >= 2
        assert values[("swarmtrain_dht_routing_table_peers", ())] >= 1
        assert values[("swarmtrain_dht_request_seconds_count", (("outcome", "ok"),))] > 0
        assert values[("swarmtrain_info", (("role", "node"),))] == 1

        # The coordinator: its node and DHT, no rounds of its own.
        served = scrape(coordinator_url)
        assert served[("swarmtrain_info", (("role", "coordinator"),))] == 1
        assert served[("swarmtrain_connections", (("kind", "direct"),))] >= 2
        assert ("swarmtrain_round", ()) not in served

        for peer in nodes:
            assert wait_exit(peer, 60) == 0, peer.stderr[-3000:]
            assert len(round_lines(peer)) == 3, peer.lines
        logged = EventAccumulator(str(tmp_path / "tb"))
        logged.Reload()
        losses = [(e.step, e.value) for e in logged.Scalars("round/loss")]
        printed = sorted(round_lines(nodes[0]).items())
        assert [step for step, _ in losses] == [r for r, _ in printed], losses
        for (_, value), (_, line) in zip(losses, printed, strict=True):
            assert abs(value - float(ROUND.match(line).group(2))) < 5e-4, (value, line)  # type: ignore[union-attr]
    finally:
        for peer in nodes:
            peer.stop()
        coordinator.stop()


def test_a_relay_serves_metrics_and_a_busy_port_is_named(tmp_path: Path) -> None:
    relay = PeerProcess(
        [*SWARMTRAIN, "relay", "--identity", str(tmp_path / "relay.key"),
         "--listen", "/ip4/127.0.0.1/tcp/0", "--metrics-port", "0"]
    )  # fmt: skip
    try:
        relay.wait_line(timeout_s=30)  # the join address: the node runs
        url = metrics_url(relay)
        deadline = time.monotonic() + 10
        values = scrape(url)
        while ("swarmtrain_reachability", (("status", "unknown"),)) not in values:
            assert time.monotonic() < deadline, values
            values = scrape(url)
        assert values[("swarmtrain_info", (("role", "relay"),))] == 1
        assert values[("swarmtrain_reachability", (("status", "unknown"),))] == 1
        assert values[("swarmtrain_connections", (("kind", "relayed"),))] == 0
        assert values[("swarmtrain_connections", (("kind", "punched"),))] == 0
    finally:
        assert relay.stop() == 130
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run(
            [*SWARMTRAIN, "relay", "--identity", str(tmp_path / "relay.key"),
             "--listen", "/ip4/127.0.0.1/tcp/0", "--metrics-port", str(port)],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"swarmtrain relay: --metrics-port {port} on 127.0.0.1: Address already in use"
    ], result.stderr
