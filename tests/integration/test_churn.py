"""A short churn soak (``python -m bench.churn``) with real processes: nodes SIGKILLed and started
at random while a swarm trains on loopback, the swarm still averaging with one state, and no
process left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from peerproc import ROOT


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue  # exited meanwhile
        if text in cmdline:
            found.append(f"{entry.name}: {cmdline[:160]}")
    return found


def test_a_minute_of_churn_keeps_averaging_with_one_state_and_leaves_no_process(
    tmp_path: Path,
) -> None:
    # Seed 3 draws a join and a kill at the first step (both draws below 0.6 and 0.4), so a
    # slow start-up on a loaded box still leaves churn; 3 of at most 4 nodes start, so a join
    # needs no kill first.
    argv = [
        sys.executable, "-m", "bench.churn", "--peers", "4", "--initial", "3", "--minutes", "1",
        "--seed", "3", "--step-s", "5", "--inner-steps", "5", "--workdir", str(tmp_path),
    ]  # fmt: skip
    bench = subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        stdout, stderr = bench.communicate(timeout=95)
    except subprocess.TimeoutExpired:
        bench.send_signal(signal.SIGTERM)  # the bench kills its nodes on SIGTERM
        stdout, stderr = bench.communicate(timeout=30)
        raise AssertionError(
            f"bench.churn ran past 95 s: {stdout[-3000:]} {stderr[-3000:]}"
        ) from None
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    assert bench.returncode == 0, stderr[-3000:]
    result = json.loads(stdout.strip().splitlines()[-1])
    table = stdout[-4000:]
    assert result["bench"] == "churn" and result["round_deadline_s"] == 34.0, result
    assert result["rounds"] > 0 and result["joins"] > 0 and result["kills"] > 0, table
    assert result["syncs"] > 0, table  # a joiner downloaded the swarm's state and trained on
    assert result["hash_disagreements"] == 0, table
    assert result["exits"] == [], table  # no node ended by itself (a crash)
    # Every node and the coordinator are gone: none names the soak's work directory.
    assert _processes_mentioning(str(tmp_path)) == []
