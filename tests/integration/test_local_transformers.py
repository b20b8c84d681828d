"""Issue 18 end to end, as a user runs it: ``swarmtrain local --config run.toml`` trains a tiny
Llama-style ``transformers`` model built from a config.json (nothing downloaded) on a local jsonl
file through a tokenizer trained here; and a node whose copy of the data differs from the spec's
refuses before training. Real processes on loopback; every wait is bounded."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
from peerproc import SWARMTRAIN, PeerProcess
from runproc import JOIN_COMMAND, node, wait_exit
from tiny_lm import DOCUMENTS, TINY_LLAMA, train_tokenizer, write_jsonl


def write_run(base: Path, *, relative: bool, tokenizer: bool = True) -> Path:
    """The README's example under ``base``: mine/data/a.jsonl, mine/tokenizer/tokenizer.json,
    mine/model/config.json and mine/run.toml, whose data paths are relative to ``base`` (where
    the processes then run) or absolute."""
    mine = base / "mine"
    for name in ("data", "tokenizer", "model"):
        (mine / name).mkdir(parents=True)
    write_jsonl(mine / "data" / "a.jsonl")
    train_tokenizer(mine / "tokenizer")
    (mine / "model" / "config.json").write_text(json.dumps(TINY_LLAMA))
    prefix = "mine" if relative else str(mine)
    tokenizer_line = f'tokenizer = "{prefix}/tokenizer"' if tokenizer else ""
    (mine / "run.toml").write_text(
        f"""
[model]
kind = "transformers"
config = "model/config.json"

[data]
kind = "text"
paths = ["{prefix}/data/*.jsonl"]
field = "text"
{tokenizer_line}

[training]
batch_size = 8
sequence_length = 32
"""
    )
    return mine / "run.toml"


@pytest.mark.timeout(170)
def test_local_trains_a_tiny_llama_from_config_on_jsonl_with_a_local_tokenizer(
    tmp_path: Path,
) -> None:
    run_toml = write_run(tmp_path, relative=True)
    workdir = tmp_path / "work"
    summary_path = tmp_path / "local.json"
    result = subprocess.run(
        [
            *SWARMTRAIN, "local", "--config", str(run_toml), "--peers", "3", "--rounds", "3",
            "--inner-steps", "8", "--workdir", str(workdir), "--json", str(summary_path),
            "--timeout", "150",
        ],
        capture_output=True, text=True, timeout=165, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    assert summary["rounds"] == 3 and summary["peers"] == 3
    assert summary["loss_last"] < summary["loss_first"], summary
    assert summary["state_hashes_agree"] is True
    assert 0 < summary["eval_loss"] < math.log(TINY_LLAMA["vocab_size"])  # below uniform
    assert summary["state_dirs"] == [str(workdir / f"node{i}") for i in range(3)]
    assert all(any(Path(d).glob("diloco-*.ckpt")) for d in summary["state_dirs"])
    out = result.stdout
    assert "model transformers, data text (fingerprint " in out
    for index in range(3):
        assert f"[{index}] model transformers: " in out, out[-3000:]
        lines = [line for line in out.splitlines() if line.startswith(f"[{index}] round")]
        assert len(lines) == 3, out[-3000:]
        # Every round, all three peers averaged and their state hashes agreed.
        assert all("peers 3" in line and "agree yes (3/3)" in line for line in lines), lines
    # The trained model out: a folder transformers loads, with the held-out loss the node had.
    exported = subprocess.run(
        [*SWARMTRAIN, "export", "--state-dir", summary["state_dirs"][0], "--out", "export"],
        capture_output=True, text=True, timeout=60, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert exported.returncode == 0, exported.stderr[-2000:]
    assert "after round 2 " in exported.stdout, exported.stdout
    from transformers import AutoModelForCausalLM

    from diloco import CausalLM, eval_batches, evaluate, load_text_corpus

    lm = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    corpus = load_text_corpus(
        [str(tmp_path / "mine/data/*.jsonl")],
        field="text",
        tokenizer=str(tmp_path / "export" / "tokenizer.json"),
    )
    model = CausalLM(lm, context=TINY_LLAMA["max_position_embeddings"], vocab_size=lm.vocab_size)
    held_out = evaluate(model, eval_batches(corpus, batches=4, context=32))
    assert held_out == pytest.approx(summary["eval_loss"], abs=1e-4), (held_out, summary)


@pytest.mark.timeout(100)
def test_a_node_whose_data_differs_from_the_spec_refuses_before_training(tmp_path: Path) -> None:
    run_toml = write_run(tmp_path, relative=False, tokenizer=False)
    coordinator = PeerProcess(
        [
            *SWARMTRAIN, "coordinator", "--config", str(run_toml), "--identity",
            str(tmp_path / "coordinator.key"), "--listen", "/ip4/127.0.0.1/tcp/0",
        ]
    )  # fmt: skip
    try:
        line = coordinator.wait_line(lambda s: s.startswith(JOIN_COMMAND), timeout_s=60)
        join = line[len(JOIN_COMMAND) :].strip()
        signed = coordinator.lines[0].split("(fingerprint ")[1].split(")")[0]
        # This node's copy of the data lost a document after the coordinator signed the spec.
        write_jsonl(tmp_path / "mine" / "data" / "a.jsonl", DOCUMENTS[:-1])
        peer = node(join, tmp_path / "node")
        try:
            assert wait_exit(peer, 60) == 1
        finally:
            peer.stop()
    finally:
        coordinator.stop()
    errors = [e for e in peer.stderr.splitlines() if e.startswith("swarmtrain node:")]
    assert len(errors) == 1, peer.stderr[-2000:]
    assert errors[0].startswith("swarmtrain node: data.fingerprint: this node's data (text: ")
    assert signed[:16] in errors[0]
    assert not any(line.startswith("round ") for line in peer.lines)
    assert not list((tmp_path / "node").glob("diloco-*.ckpt"))
