"""``swarmtrain local`` and ``swarmtrain node`` as a user runs them: real processes on loopback.

Small settings (H=10 inner steps, 2-3 rounds) keep each test well under two minutes on a
2-core machine; the default model and corpus are the real ones. Every wait is bounded and keyed
on the lines the processes print, never on sleeps.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
from pathlib import Path

from peerproc import SWARMTRAIN, PeerProcess, start_relay

INNER_STEPS = "10"
ROUND_LINE = re.compile(r"^round (\d+) ")


def _node(join: str, state_dir: Path, run_id: str, rounds: int, *extra: str) -> PeerProcess:
    return PeerProcess(
        [
            *SWARMTRAIN,
            "node",
            "--join",
            join,
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
            "--state-dir",
            str(state_dir),
            "--run-id",
            run_id,
            "--rounds",
            str(rounds),
            "--inner-steps",
            INNER_STEPS,
            "--threads",
            "1",
            "--json",
            str(state_dir / "summary.json"),
            *extra,
        ]
    )


def _rounds_printed(node: PeerProcess) -> list[int]:
    return [int(m.group(1)) for line in node.lines if (m := ROUND_LINE.match(line))]


def _wait_exit(node: PeerProcess, timeout_s: float) -> int:
    try:
        return node.proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        raise AssertionError(
            f"node still running after {timeout_s} s; stdout={node.lines[-5:]}; "
            f"stderr tail={node.stderr[-2000:]}"
        ) from None


def test_local_swarm_trains_and_agrees(tmp_path: Path) -> None:
    summary_path = tmp_path / "local.json"
    result = subprocess.run(
        [
            *SWARMTRAIN,
            "local",
            "--peers",
            "3",
            "--rounds",
            "3",
            "--inner-steps",
            INNER_STEPS,
            "--json",
            str(summary_path),
        ],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    assert summary["rounds"] == 3 and summary["peers"] == 3
    assert summary["loss_last"] < summary["loss_first"], summary
    assert summary["state_hashes_agree"] is True
    assert 0 < summary["eval_loss"] < 5.6  # 5.55 nats/byte is a uniform guess over 256 bytes
    assert summary["bytes_sent"] > 0
    # Every node printed one line per round, prefixed by its index, and saw all 3 peers agree.
    for index in range(3):
        lines = [line for line in result.stdout.splitlines() if line.startswith(f"[{index}] round")]
        assert len(lines) == 3, result.stdout
        assert all("peers 3" in line and "agree yes (3/3)" in line for line in lines), lines


def test_killed_node_does_not_stop_the_others(tmp_path: Path) -> None:
    relay, join = start_relay(tmp_path / "relay.key")
    nodes = [_node(join, tmp_path / f"n{i}", "kill", 3) for i in range(3)]
    try:
        victim = nodes[2]
        victim.wait_line(lambda line: line.startswith("round 0 "), timeout_s=60)
        victim.proc.send_signal(signal.SIGKILL)  # in round 1's inner phase: gone without a word
        victim.proc.wait(5)
        for survivor in nodes[:2]:
            assert _wait_exit(survivor, 80) == 0, survivor.stderr[-3000:]
        summaries = [json.loads((tmp_path / f"n{i}" / "summary.json").read_text()) for i in (0, 1)]
        assert summaries[0]["state_hash"] == summaries[1]["state_hash"]
        assert [s["last_round"] for s in summaries] == [2, 2]
        # The kill cost the survivors at most the round it happened in.
        assert all(s["rounds_contributed"] >= 2 for s in summaries), summaries
        last_lines = [next(ln for ln in n.lines if ln.startswith("round 2 ")) for n in nodes[:2]]
        assert all("peers 2" in ln and "agree yes (2/2)" in ln for ln in last_lines), last_lines
    finally:
        for node in nodes:
            node.stop()
        relay.stop()


def test_ctrl_c_then_restart_resumes_from_the_checkpoint(tmp_path: Path) -> None:
    relay, join = start_relay(tmp_path / "relay.key")
    state = tmp_path / "b"
    other = _node(join, tmp_path / "a", "resume", 4)
    node = _node(join, state, "resume", 4)
    restarted = None
    try:
        node.wait_line(lambda line: line.startswith("round 1 "), timeout_s=80)
        node.proc.send_signal(signal.SIGINT)
        assert _wait_exit(node, 20) == 130
        assert "Traceback" not in node.stderr, node.stderr[-3000:]
        assert sorted(p.name for p in state.glob("diloco-*.ckpt"))[-1] == "diloco-0000000002.ckpt"

        restarted = _node(join, state, "resume", 4)
        first = restarted.wait_line(index=0, timeout_s=60)
        assert "resumed from checkpoint at round 2" in first, first
        assert _wait_exit(restarted, 80) == 0, restarted.stderr[-3000:]
        assert _rounds_printed(restarted) == [2, 3], restarted.lines
        summary = json.loads((state / "summary.json").read_text())
        assert summary["first_round"] == 2 and summary["last_round"] == 3, summary
        assert _wait_exit(other, 60) == 0, other.stderr[-3000:]
    finally:
        for proc in (node, other, restarted):
            if proc is not None:
                proc.stop()
        relay.stop()
