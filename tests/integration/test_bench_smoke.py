"""The loopback all-reduce bench end to end on a tiny vector: its workers subclass the averager,
so a change of the averager's internals can break the bench while every test of swarm passes
(it did once: a new argument of ``Averager._form_group``). Not a measurement."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
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
    # Through a pipe, progress is plain lines (bench/progress.py), all before the JSON line.
    lines = done.stdout.splitlines()
    assert lines[0].startswith("phase: starting a relay and 2 workers ("), lines[:3]
    assert any(line.startswith("phase: checking the results") for line in lines), lines
    assert not any("\x1b[" in line for line in lines), lines


def test_the_sparse_allreduce_bench_checks_the_exact_mean_and_counts_the_information() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.allreduce", "--peers", "2", "--numel", "10000",
         "--rounds", "1", "--compression", "sparse", "--sparse-chunk", "256",
         "--sparse-density", "0.05"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    # The bench's own recomputation of the mean of the decoded sparse vectors, bit for bit.
    assert summary["bit_identical"] is True and summary["max_abs_err"] == 0.0, summary
    # 2 peers: each receives the other's entries (I) through the gathering exchange, which moves
    # (N-1)/N x (1 + N) = 1.5 encoded vectors a peer; the encoding is within 10% of I.
    encoded, information = summary["sparse_encoded_bytes"], summary["sparse_info_bytes"]
    assert information < encoded < 1.1 * information, summary
    # The minimum counts the round's parts, whose bounds cut a chunk short: close to I.
    minimum = summary["sparse_info_min_bytes"]
    assert minimum == pytest.approx(information, rel=0.05), summary
    assert summary["bytes_received"] == pytest.approx(1.5 * encoded, rel=0.05), summary
    fraction = summary["sparse_info_fraction"]
    assert fraction == pytest.approx(minimum / summary["bytes_received"], rel=1e-3), summary
    assert summary["dense_f32_ratio"] > 20, summary


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


def test_the_memory_bench_measures_each_nodes_peak_rss_at_a_tiny_size() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.memory", "--params", "1M", "--peers", "2", "--rounds", "1",
         "--inner-steps", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=110, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    for key in ("params", "peak_rss_bytes", "rss_over_param_bytes", "round_s"):
        assert summary[key] > 0, summary
    assert 0.9e6 < summary["params"] < 1.1e6 and summary["state_hashes_agree"], summary
    # A node holds at least its parameters and AdamW's two moments, and more than an idle
    # interpreter; at 1M parameters the interpreter and torch are most of it.
    assert summary["rss_over_param_bytes"] > 3, summary
    assert summary["peak_rss_bytes"] > summary["baseline_rss_bytes"], summary
    assert summary["rss_over_param_bytes"] == round(
        summary["peak_rss_bytes"] / summary["param_bytes"], 3
    )
    assert len(summary["nodes"]) == 2 and "peak RSS" in done.stdout


def test_the_byzantine_bench_runs_every_rule_against_an_attacker_at_a_tiny_size() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.byzantine", "--workers", "3", "--steps", "4",
         "--inner-steps", "2", "--batch", "2", "--context", "32", "--eval-batches", "1",
         "--attacks", "scaled"],
        cwd=ROOT, capture_output=True, text=True, timeout=110, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    for key in ("honest_loss", "mean_attacked_loss", "robust_attacked_loss", "robust_honest_loss"):
        assert 0 < summary[key] < 10, summary
    assert summary["robust_rule"] in ("centered_clip", "trimmed_mean"), summary
    assert set(summary["losses"]["mean"]) == {"none", "scaled"}, summary
    # Ten times the opposite of a pseudo-gradient hurts the mean even after two rounds.
    assert summary["mean_attacked_loss"] > summary["honest_loss"], summary
    assert "held-out loss" in done.stdout
    # Every run's rounds in one task: a line per tenth of them, the last one at all of them.
    tenths = [line.split()[1] for line in done.stdout.splitlines() if "byzantine:" in line]
    assert tenths and len(set(tenths[-1].split("/"))) == 1, done.stdout
