"""The loopback all-reduce bench end to end on a tiny vector: its workers subclass the averager,
so a change of the averager's internals can break the bench while every test of swarm passes
(it did once: a new argument of ``Averager._form_group``). Not a measurement."""

from __future__ import annotations

import json
import subprocess
import sys

from peerproc import ROOT


def test_the_allreduce_bench_runs_and_reports_bit_identical_results() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.allreduce", "--peers", "2", "--numel", "10000",
         "--rounds", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=110, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["bit_identical"] is True and summary["wire_bytes"] > 0, summary


def test_the_soak_bench_runs_a_relay_and_a_coordinator_through_connections() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.soak", "--connections", "40", "--minutes", "1",
         "--clients", "4", "--report-s", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=110, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["bench"] == "soak" and summary["targets_alive"], summary
    assert summary["connections"] >= 40 and summary["failed"] == 0, summary
