"""``python -m bench.sim`` in-process at a small size: its table and its last line's JSON."""

from __future__ import annotations

import json

import pytest

from bench import sim


def test_bench_sim_prints_rounds_and_one_json_line(capsys: pytest.CaptureFixture[str]) -> None:
    result = sim.main(["--peers", "6", "--rounds", "2", "--params", "1e6", "--numel", "16"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert json.loads(lines[-1]) == result
    keys = {"peers", "rounds_ok", "allreduce_over_limit", "contributed_fraction"}
    assert keys | {"max_connections_per_peer", "dht_read_bytes_per_peer_round"} <= result.keys()
    assert result["peers"] == 6 and result["rounds_ok"] == 2 and result["mismatched_groups"] == 0
    assert len([line for line in lines if line.split()[0].isdigit()]) == 2


def test_bench_sim_bad_flag_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        sim.main(["--peers", "4", "--churn", "3"])
    assert "churn must be in [0, 1]" in capsys.readouterr().err


def test_bench_sim_runs_the_hierarchical_protocol(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--peers", "9", "--rounds", "1", "--params", "1e6", "--numel", "16"]
    result = sim.main([*argv, "--protocol", "hierarchical", "--max-group-size", "3"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    assert result["rounds_ok"] == 1 and result["groups_per_round"] == 1
    # 3 columns: scatter and gather 2/3 each, the float64 chain 8/3, a reduced sub-part up and
    # the successor's copy of a head's own slice 1/3 each: 4.67 (1/columns is 0.016 at 1,000)
    assert result["contributed_fraction"] == 1.0 and 0 < result["sent_over_vector"] < 4.7


def test_bench_sim_compares_the_pipeline_with_and_without_churn(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--peers", "4", "--rounds", "1", "--params", "1e6", "--numel", "16", "--churn", "0.2"]
    pipeline = ["--pipeline-servers", "12", "--pipeline-stages", "2", "--pipeline-seconds", "60"]
    result = sim.main([*argv, *pipeline])
    lines = capsys.readouterr().out.strip().splitlines()
    assert json.loads(lines[-1]) == result
    assert len([line for line in lines if line.startswith("pipeline (")]) == 2
    churned, quiet = result["pipeline_throughput_per_s"]
    assert quiet > 0 and result["pipeline_churn_ratio"] == pytest.approx(churned / quiet, abs=2e-3)
    assert all(0 < r <= 1.02 for r in result["pipeline_over_bound"])
    # Churn-free: one run, ratio 1; the averaging figures do not depend on the pipeline.
    quiet_run = sim.main([*argv[:-2], *pipeline])
    assert quiet_run["pipeline_churn_ratio"] == 1.0
    assert sim.main([*argv[:-2], "--pipeline-servers", "0"]).keys() == quiet_run.keys() - {
        "pipeline_churn_ratio", "pipeline_throughput_per_s", "pipeline_over_bound",
        "pipeline_cpu_s",
    }  # fmt: skip
