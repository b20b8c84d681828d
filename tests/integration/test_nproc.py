"""``swarmtrain node --nproc-per-node 2`` with real processes on 127.0.0.1: a 2-peer swarm where
one node's inner phase is data parallel over 2 gloo ranks. The node's ranks end every phase on
the same bytes (their digests of parameters and AdamW state, gathered by rank 0 into the
node's summary), the two peers agree on the state hash every round, and the spawned rank leaves
with its node (no orphan). Small settings (H=4, batch 4) keep it short on a 2-core machine;
every wait is bounded."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from runproc import ROUND_LINE, node, start_coordinator, wait_exit

from diloco import inner_batches, load_stdlib_corpus
from swarmtrain.config import RunConfig, run_seed_of
from swarmtrain.training.inner_step import accumulate, inner_optimizer, set_lr
from swarmtrain.training.ranks import LocalRanks
from swarmtrain.training.workload import build_model, with_data_fingerprint

pytestmark = pytest.mark.timeout(150)

RANK_READY = re.compile(r"rank 1 .*: ready \(pid (\d+),")
SETTINGS = {"min_peers": "2", "batch_size": "4", "sequence_length": "32"}


def _gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_a_two_rank_node_and_a_plain_one_agree_every_round(tmp_path: Path) -> None:
    coordinator, join = start_coordinator(tmp_path, rounds=3, inner_steps=4, settings=SETTINGS)
    try:
        ranked = node(join, tmp_path / "a", "--nproc-per-node", "2")
        plain = node(join, tmp_path / "b")
        for peer in (ranked, plain):
            assert wait_exit(peer, 120) == 0, peer.stderr[-3000:]
    finally:
        coordinator.stop()
    summaries = [json.loads((tmp_path / n / "summary.json").read_text()) for n in "ab"]
    two, one = summaries
    assert two["nproc_per_node"] == 2 and one["nproc_per_node"] == 1
    assert two["ranks_agree"] is True, two
    assert len(two["rank_digests"]) == 2 and len(set(two["rank_digests"])) == 1, two
    assert two["state_hash"] == one["state_hash"], summaries
    for peer, summary in zip((ranked, plain), summaries, strict=True):
        assert summary["rounds_contributed"] == 3, (summary, peer.lines)
        rounds = [s for s in peer.lines if ROUND_LINE.match(s)]
        assert len(rounds) == 3 and all("peers 2" in s and "agree yes (2/2)" in s for s in rounds)
        assert "Traceback" not in peer.stderr, peer.stderr[-3000:]
    assert "2 local ranks (cpu): this process is rank 0, the peer" in ranked.lines
    # The rank process ended with its node.
    found = RANK_READY.search(ranked.stderr)
    assert found is not None, ranked.stderr[-3000:]
    assert _gone(int(found.group(1)), 10)


def test_ctrl_c_or_a_killed_node_ends_its_rank_and_a_restart_resumes_with_its_ranks(
    tmp_path: Path,
) -> None:
    """A terminal's Ctrl+C reaches the node's whole process group mid-run: the node leaves as
    it does alone (exit status 130, no traceback) and so does its rank. Restarted on its state
    directory, the node resumes from its checkpoint (its AdamW state goes to its new rank),
    meets the swarm again and agrees with it. A rank killed stops its node with one line naming
    it; a node SIGKILLed (its rank gets no word) loses its rank within seconds."""
    coordinator, join = start_coordinator(tmp_path, rounds=50, inner_steps=4, settings=SETTINGS)
    ranked = restarted = killed = None
    plain = node(join, tmp_path / "b")
    try:
        ranked = node(join, tmp_path / "a", "--nproc-per-node", "2")
        ranked.wait_line(lambda s: s.startswith("round 1 "), timeout_s=90)
        rank = RANK_READY.search(ranked.stderr)
        assert rank is not None, ranked.stderr[-3000:]
        os.killpg(ranked.proc.pid, signal.SIGINT)
        assert wait_exit(ranked, 30) == 130, ranked.stderr[-3000:]
        assert "Traceback" not in ranked.stderr, ranked.stderr[-3000:]
        assert _gone(int(rank.group(1)), 10)

        restarted = node(join, tmp_path / "a", "--nproc-per-node", "2")
        resumed = restarted.wait_line(lambda s: s.startswith("node "), timeout_s=60)
        assert "resumed from checkpoint at round" in resumed, resumed
        line = restarted.wait_line(
            lambda s: ROUND_LINE.match(s) and "agree yes (2/2)" in s, timeout_s=60
        )
        assert "peers 2" in line, line
        assert "ranks take our inner optimizer state" in restarted.stderr
        assert "hold different bytes" not in restarted.stderr, restarted.stderr[-3000:]
        rank = RANK_READY.search(restarted.stderr)
        assert rank is not None, restarted.stderr[-3000:]
        os.kill(int(rank.group(1)), signal.SIGKILL)  # a rank dies: its node stops, naming it
        assert wait_exit(restarted, 30) == 1, restarted.stderr[-3000:]
        errors = [e for e in restarted.stderr.splitlines() if e.startswith("swarmtrain node:")]
        assert errors == [
            "swarmtrain node: --nproc-per-node: rank 1 exited with status -9 (its log is above)"
        ], restarted.stderr[-3000:]

        killed = node(join, tmp_path / "a", "--nproc-per-node", "2")
        killed.wait_stderr("local ranks joined", timeout_s=60)
        rank = RANK_READY.search(killed.stderr)
        assert rank is not None, killed.stderr[-3000:]
        killed.proc.kill()  # rank 0 alone: its rank hears nothing from it
        assert _gone(int(rank.group(1)), 10)
    finally:
        for proc in (ranked, restarted, killed, plain):
            if proc is not None:
                proc.stop()
        coordinator.stop()


def test_two_ranks_step_as_one_process_with_their_joint_batch_and_take_a_resumed_state() -> None:
    """``LocalRanks`` driven as the node's loop drives it, against one process: DDP's averaged
    gradient over the two shards is the gradient of the node's whole draw (B=2 per rank, 4 in
    all), so rank 0's parameters follow the single process's within float error; rank 0's
    AdamW state from before (a resumed checkpoint) reaches the other rank, whose digests agree
    at the end of each phase; ``close`` ends the rank."""
    config = with_data_fingerprint(
        RunConfig().replace(
            run={"id": "ddp", "rounds": 2},
            model={"d_model": 32, "n_layers": 1, "n_heads": 2, "context": 16},
            training={"inner_steps": 3, "batch_size": 2, "sequence_length": 16},
        )
    )
    training, corpus = config.training, load_stdlib_corpus()
    draw = {"run_seed": run_seed_of("ddp"), "peer_id": b"peer", "steps": 3, "context": 16}

    def resumed() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = build_model(config)
        optimizer = inner_optimizer(model, training)
        accumulate(model, [next(iter(inner_batches(corpus, round=9, batch_size=4, **draw)))],
                   training)  # fmt: skip
        optimizer.step()  # the state a checkpoint would give back
        optimizer.zero_grad()
        return model, optimizer

    def phase(model: torch.nn.Module, optimizer: torch.optim.Optimizer, round: int,
              ranks: LocalRanks | None) -> None:  # fmt: skip
        if ranks is not None:
            ranks.begin_phase(round, 3)
        shard = ranks.shard if ranks is not None else (0, 1)
        batches = inner_batches(corpus, round=round, batch_size=4 // shard[1], shard=shard, **draw)
        for step, batch in enumerate(batches):
            set_lr(optimizer, training, round * 3 + step, 2 * 3)
            loss, _ = accumulate(model, [batch], training, ranks.ddp if ranks else None)
            if ranks is not None:
                ranks.mean_loss(loss)
            optimizer.step()
            optimizer.zero_grad()

    alone, alone_optimizer = resumed()
    model, optimizer = resumed()
    ranks = LocalRanks(config, b"peer", 2, torch.device("cpu"), threads=1)
    try:
        ranks.connect(model, optimizer)
        for round in range(2):
            phase(alone, alone_optimizer, round, None)
            phase(model, optimizer, round, ranks)
        assert ranks.digests.agree is True and ranks.digests.phases == 2, ranks.digests
    finally:
        ranks.close()
    assert not any(proc.is_alive() for proc in ranks._procs)
    for mine, theirs in zip(model.parameters(), alone.parameters(), strict=True):
        assert torch.allclose(mine, theirs, atol=1e-5), (mine - theirs).abs().max()


def test_an_fsdp_node_and_a_plain_one_agree_every_round_and_learn(tmp_path: Path) -> None:
    """``--fsdp``: the node's 2 ranks shard the model (FSDP2); each phase starts from the
    node's DiLoCo model, ends in the gathered parameters, and the round's state is the same
    bytes as the plain peer's; the ranks agree on the gathered parameters and the loss falls."""
    # Without outer momentum: at full Nesterov momentum from round 0 the outer step of a
    # 3-round run overshoots (docs/diloco_tuning.md), and round 2's loss once ended above round
    # 0's in CI (4.80, 3.61, 5.13); this test is about the sharding, not the outer optimizer.
    settings = {**SETTINGS, "outer_momentum": "0"}
    coordinator, join = start_coordinator(tmp_path, rounds=3, inner_steps=4, settings=settings)
    try:
        sharded = node(join, tmp_path / "a", "--nproc-per-node", "2", "--fsdp")
        plain = node(join, tmp_path / "b")
        for peer in (sharded, plain):
            assert wait_exit(peer, 120) == 0, peer.stderr[-3000:]
    finally:
        coordinator.stop()
    two, one = [json.loads((tmp_path / n / "summary.json").read_text()) for n in "ab"]
    assert two["nproc_per_node"] == 2 and two["ranks_agree"] is True, two
    assert len(two["rank_digests"]) == 2 and len(set(two["rank_digests"])) == 1, two
    assert two["state_hash"] == one["state_hash"], (two, one)
    for peer, summary in ((sharded, two), (plain, one)):
        assert summary["rounds_contributed"] == 3, (summary, peer.lines)
        rounds = [s for s in peer.lines if ROUND_LINE.match(s)]
        assert len(rounds) == 3 and all("peers 2" in s and "agree yes (2/2)" in s for s in rounds)
        assert "Traceback" not in peer.stderr, peer.stderr[-3000:]
        losses = summary["round_losses"]
        assert losses["2"] < losses["0"] - 0.1, losses
    assert "2 local ranks (cpu), sharding the model (FSDP2): this process is rank 0, the peer" in (
        sharded.lines
    )


def test_two_sharded_ranks_step_as_one_process_with_their_joint_batch() -> None:
    """``--fsdp``'s ``ShardedGroup`` driven as the node's loop drives it, against one process
    on the node's whole draw: the blocks and root sharded across 2 ranks, gradients
    accumulated over 2 batches (unreduced until the last) then reduce-scattered and clipped by
    the whole model's norm, AdamW over the shards, started from a resumed checkpoint's AdamW
    state (scattered into the shards); the gathered parameters and AdamW state (what DiLoCo's
    checkpoint carries) follow the single process's within float error."""
    config = with_data_fingerprint(
        RunConfig().replace(
            run={"id": "fsdp", "rounds": 2},
            model={"d_model": 32, "n_layers": 2, "n_heads": 2, "context": 16},
            training={"inner_steps": 3, "batch_size": 2, "sequence_length": 16,
                      "grad_clip": 0.5, "grad_accumulation": 2},
        )
    )  # fmt: skip
    training, corpus = config.training, load_stdlib_corpus()
    draw = {"run_seed": run_seed_of("fsdp"), "peer_id": b"peer", "steps": 6, "context": 16}

    def resumed() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = build_model(config)
        optimizer = inner_optimizer(model, training)
        accumulate(model, [inner_batches(corpus, round=9, batch_size=4, **draw)[0]], training)
        optimizer.step()  # the state a checkpoint would give back
        optimizer.zero_grad()
        return model, optimizer

    alone, alone_optimizer = resumed()
    plain, plain_optimizer = resumed()
    ranks = LocalRanks(config, b"peer", 2, torch.device("cpu"), threads=1, fsdp=True)
    try:
        ranks.connect(plain, plain_optimizer)
        for round in range(2):
            whole = inner_batches(corpus, round=round, batch_size=4, **draw)
            mine = inner_batches(corpus, round=round, batch_size=2, shard=ranks.shard, **draw)
            ranks.begin_sharded_phase(round, 3, plain, plain_optimizer)
            assert not plain_optimizer.state  # the shards hold it now
            for step in range(3):
                set_lr(alone_optimizer, training, round * 3 + step, 6)
                accumulate(alone, whole[2 * step : 2 * step + 2], training)
                alone_optimizer.step()
                alone_optimizer.zero_grad()
                set_lr(ranks.sharded.optimizer, training, round * 3 + step, 6)
                loss, _ = ranks.sharded.step(mine[2 * step : 2 * step + 2])
                ranks.mean_loss(loss)
            local = torch.empty(sum(p.numel() for p in plain.parameters()))
            ranks.end_sharded_phase(local, plain, plain_optimizer)
            torch.nn.utils.vector_to_parameters(local, plain.parameters())
            for mine_p, theirs in zip(plain.parameters(), alone.parameters(), strict=True):
                ours, its = plain_optimizer.state[mine_p], alone_optimizer.state[theirs]
                assert float(ours["step"]) == float(its["step"]) == 4 + 3 * round
                for key in ("exp_avg", "exp_avg_sq"):
                    assert torch.allclose(ours[key], its[key], atol=1e-6), key
            if round == 0:
                plain_optimizer.state.clear()  # the node's loop, after the round's checkpoint
        assert ranks.digests.agree is True and ranks.digests.phases == 2, ranks.digests
    finally:
        ranks.close()
    assert not any(proc.is_alive() for proc in ranks._procs)
    for mine_p, theirs in zip(plain.parameters(), alone.parameters(), strict=True):
        assert torch.allclose(mine_p, theirs, atol=1e-5), (mine_p - theirs).abs().max()
