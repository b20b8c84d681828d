"""``swarmtrain local`` and ``swarmtrain node`` as a user runs them: real processes on loopback.

Small settings (H=10 inner steps) keep each test well under two minutes on a 2-core machine;
the default model and corpus are the real ones. Every wait is bounded and keyed on the lines the
processes print, never on sleeps. (A node SIGKILLed mid-round, and a node joining mid-run, are
in ``test_elastic.py``, on one running swarm.)
"""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import numpy as np
from peerproc import SWARMTRAIN
from runproc import node, start_coordinator, wait_exit

INNER_STEPS = "10"


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


def test_overlapped_int8_rounds_with_error_feedback_train_and_agree(tmp_path: Path) -> None:
    """``[training] overlap`` and ``error_feedback`` with ``[swarm] compression = "int8"``,
    streaming two fragments: each round's averaging (of one fragment, the other training on)
    runs behind the next inner phase, every tensor travels as int8 and what the codec dropped
    is carried into the next round; the three peers still end each round bit-identical (issue
    20's "overlap and fragments in a real 3-peer run with agreeing state hashes"), the loss
    falls, and each round line says how long training waited for its averaging."""
    run_toml = tmp_path / "run.toml"
    run_toml.write_text(
        "[training]\noverlap = true\nerror_feedback = true\nfragments = 2\n"
        '[swarm]\ncompression = "int8"\n'
    )
    summary_path = tmp_path / "local.json"
    command = [
        *SWARMTRAIN, "local", "--config", str(run_toml), "--peers", "3", "--rounds", "3",
        "--inner-steps", INNER_STEPS, "--json", str(summary_path),
    ]  # fmt: skip
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    assert summary["state_hashes_agree"] is True
    assert summary["loss_last"] < summary["loss_first"], summary
    for index in range(3):
        lines = [line for line in result.stdout.splitlines() if line.startswith(f"[{index}] round")]
        # Round r's averaging is reported at the end of phase r + 1 (the last one after it).
        assert "averaging while round 1 trains" in lines[0], lines
        averaged = [line for line in lines if "agree yes (3/3)" in line]
        assert [line.split()[2] for line in averaged] == ["0", "1", "2"], lines
        assert all("averaging exposed" in line for line in averaged), lines


def test_a_tokens_run_from_a_run_toml_in_a_subfolder_trains_and_agrees(tmp_path: Path) -> None:
    """``[data] kind = "tokens"``: two pre-tokenized files (uint16 ids, read mapped as one
    stream) named relative to a run.toml in a subfolder, the command run from its parent; a
    small default model, 2 peers, 2 rounds: the paths resolve, the loss falls, states agree."""
    sub = tmp_path / "sub"
    (sub / "data").mkdir(parents=True)
    text = b"the quick brown fox jumps over the lazy dog; " * 300
    ids = np.frombuffer(text, dtype=np.uint8).astype("<u2")
    ids[: len(ids) // 3].tofile(sub / "data" / "a.bin")
    ids[len(ids) // 3 :].tofile(sub / "data" / "b.bin")
    (sub / "run.toml").write_text(
        '[data]\nkind = "tokens"\npaths = ["data/*.bin"]\n'
        "[model]\nd_model = 32\nn_layers = 1\nn_heads = 2\ncontext = 32\n"
        "[training]\nbatch_size = 4\nsequence_length = 32\ninner_lr = 0.01\n"
    )
    summary_path = tmp_path / "local.json"
    command = [
        *SWARMTRAIN, "local", "--config", "sub/run.toml", "--peers", "2", "--rounds", "2",
        "--inner-steps", "4", "--json", str(summary_path),
    ]  # fmt: skip
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=90, check=False, cwd=tmp_path
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "warning" not in result.stderr, result.stderr[-2000:]
    summary = json.loads(summary_path.read_text())
    assert summary["state_hashes_agree"] is True and summary["rounds"] == 2
    assert summary["loss_last"] < summary["loss_first"], summary
    train_tokens = len(ids) - len(ids) // 20
    for index in range(2):
        assert f"[{index}] model default: " in result.stdout, result.stdout[-3000:]
        assert f"data tokens: {train_tokens:,} training tokens" in result.stdout
        rounds = [s for s in result.stdout.splitlines() if s.startswith(f"[{index}] round")]
        assert len(rounds) == 2 and all("agree yes (2/2)" in s for s in rounds), rounds


def test_scheduled_rounds_of_expected_peers_train_and_agree(tmp_path: Path) -> None:
    """``[swarm] expected_peers``: every node matches by the schedule a large swarm uses
    (a declaration window of at least 5 s on the round's keys, then a grace for the reads)
    instead of waiting for the peers it knows; three peers still agree every round."""
    run_toml = tmp_path / "run.toml"
    run_toml.write_text("[swarm]\nexpected_peers = 3\n")
    summary_path = tmp_path / "local.json"
    command = [
        *SWARMTRAIN, "local", "--config", str(run_toml), "--peers", "3", "--rounds", "2",
        "--inner-steps", "5", "--json", str(summary_path),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=110, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    assert summary["state_hashes_agree"] is True and summary["rounds"] == 2
    assert summary["loss_last"] < summary["loss_first"], summary
    for index, node_summary in enumerate(summary["nodes"]):
        lines = result.stdout.splitlines()
        assert any(
            line.startswith(f"[{index}] node")
            and "rounds scheduled for about 3 peers over 1 key(s), window 5 s" in line
            for line in lines
        ), result.stdout
        rounds = [line for line in lines if line.startswith(f"[{index}] round")]
        assert len(rounds) == 2 and all("agree yes (3/3)" in line for line in rounds), rounds
        # Each round waited out the window and its grace: the schedule ran, not the small
        # swarm's rule (which closes as soon as the peers it knows have declared).
        assert node_summary["averaging_exposed_s"] >= 2 * 6.5, node_summary


def test_ctrl_c_then_restart_resumes_from_the_checkpoint_skipping_a_corrupt_one(
    tmp_path: Path,
) -> None:
    """Ctrl+C leaves cleanly with the round boundary's checkpoint on disk; the restart detects
    the newest checkpoint is corrupt, says so, resumes from the one before, then catches up with
    the swarm (which went on without it) by downloading the agreed state, and agrees with it.
    The spec has more rounds than the test needs: it stops everyone with Ctrl+C once checked."""
    coordinator, join = start_coordinator(tmp_path, rounds=50, inner_steps=10)
    state = tmp_path / "b"
    others = [node(join, tmp_path / "a"), node(join, tmp_path / "c")]
    stopped = node(join, state)
    restarted = None
    try:
        stopped.wait_line(lambda line: line.startswith("round 1 "), timeout_s=90)
        stopped.proc.send_signal(signal.SIGINT)
        assert wait_exit(stopped, 20) == 130
        assert "Traceback" not in stopped.stderr, stopped.stderr[-3000:]
        assert "stopped; checkpoints of finished rounds are in" in stopped.stderr
        checkpoints = sorted(state.glob("diloco-*.ckpt"))
        assert [p.name for p in checkpoints] == ["diloco-0000000001.ckpt", "diloco-0000000002.ckpt"]
        newest = checkpoints[-1]
        data = bytearray(newest.read_bytes())
        data[len(data) // 2] ^= 0xFF  # one flipped byte in the middle of the parameters
        newest.write_bytes(bytes(data))

        restarted = node(join, state)
        resumed = restarted.wait_line(lambda line: line.startswith("node "), timeout_s=60)
        assert "resumed from checkpoint at round 1" in resumed, resumed
        synced = restarted.wait_line(lambda line: line.startswith("synced to round "), timeout_s=90)
        k = int(synced.split()[3])
        line = restarted.wait_line(lambda s: s.startswith(f"round {k} "), timeout_s=60)
        assert "peers 3" in line and "agree yes (3/3)" in line, (line, restarted.stderr[-3000:])
        theirs = others[0].wait_line(lambda s: s.startswith(f"round {k} "), timeout_s=30)
        assert line.split(" state ")[1][:12] == theirs.split(" state ")[1][:12], (line, theirs)
        assert f"checkpoint {newest} is unusable, skipping it: checksum mismatch" in (
            restarted.stderr
        ), restarted.stderr[-3000:]
        for proc in (restarted, *others):
            assert proc.stop(timeout_s=20) == 130, proc.stderr[-3000:]
            assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    finally:
        for proc in (stopped, *others, restarted):
            if proc is not None:
                proc.stop()
        coordinator.stop()
