"""The node runs what the benchmark runs: two real node processes training a run spec over the
swarm, and ``bench.diloco --config`` training the same spec in one process with the nodes' peer
ids, give the same loss in every round and the same final state, bit for bit (issue 18), with
float16 inner steps through the gradient scaler.

Exact averaging (``[swarm] compression = "none"``) and one torch thread on both sides: then the
swarm's all-reduce (float64 in sorted peer order) and the bench's ``LocalAverage`` compute the
same mean, and every other step is the same code on the same batches."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from runproc import node, start_coordinator, wait_exit

from p2p import load_or_create_identity, peer_id_of

ROUNDS = 3
INNER_STEPS = 5


def test_two_nodes_and_bench_diloco_on_one_spec_give_the_same_loss_curve_and_state(
    tmp_path: Path,
) -> None:
    state_dirs = [tmp_path / f"node{k}" for k in range(2)]
    peer_ids = []
    for state_dir in state_dirs:
        state_dir.mkdir()
        peer_ids.append(str(peer_id_of(load_or_create_identity(state_dir / "identity.key"))))
    coordinator, join = start_coordinator(
        tmp_path,
        ROUNDS,
        INNER_STEPS,
        settings={
            "id": '"same-curve"',
            "min_peers": "2",
            "compression": '"none"',
            "lr_schedule": '"cosine"',
            "outer_momentum_warmup": "2",
            # float16 autocast: the loss scaler's scale and unscale on both sides, then the clip.
            "precision": '"fp16"',
            "grad_clip": "1.0",
        },
    )
    try:
        nodes = [node(join, state_dir) for state_dir in state_dirs]
        try:
            for peer in nodes:
                assert wait_exit(peer, 100) == 0, peer.stderr[-3000:]
        finally:
            for peer in nodes:
                peer.stop()
    finally:
        coordinator.stop()
    summaries = [json.loads((d / "summary.json").read_text()) for d in state_dirs]
    for summary in summaries:
        assert summary["rounds_contributed"] == ROUNDS, summary

    command = [
        sys.executable, "-m", "bench.diloco", "--config", str(tmp_path / "run.toml"),
        "--peer-ids", ",".join(peer_ids),
    ]  # fmt: skip
    bench = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=100,
        cwd=Path(__file__).resolve().parents[2],
        check=False,
    )
    assert bench.returncode == 0, bench.stderr[-3000:]
    result = json.loads(bench.stdout.strip().splitlines()[-1])
    for peer_id, summary in zip(peer_ids, summaries, strict=True):
        node_curve = [summary["round_losses"][str(r)] for r in range(ROUNDS)]
        assert node_curve == result["round_losses"][peer_id], (node_curve, result)
        assert summary["state_hash"] == result["state_hash"]
    # Training happened: the final state's held-out loss is well below a uniform guess over
    # bytes (ln 256 = 5.55). Not the last round's inner loss against the first's: over 3 rounds
    # of 5 steps the outer step into round 2 can overshoot, and a CI run's round 2 averaged 5.81
    # and 5.28 against 4.72 in round 0 while its final state scored 3.50 (bench.diloco --config
    # reproduced it exactly).
    assert result["eval_loss"] < math.log(256) - 1.0, result
    assert len(set(result["round_losses"][peer_ids[0]])) == ROUNDS  # not a curve of constants
