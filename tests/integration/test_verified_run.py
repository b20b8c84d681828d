"""A verified DiLoCo run with a cheater, as real processes: caught, left out, banned; the honest
peers train on.

Three volunteers and a coordinator on loopback, ``verify.rate = 1`` (every task from round 1 on is
re-executed by a second peer, every part of every all-reduce audited) and a small model (of the
default architecture, or a tiny Llama for the cheater) so RepOps rounds take a second.

* A cheating trainer tampers with one operator's output (one bit) at one inner step of its task
  in round 1, consistently, as a cheater who committed would. Its verifier's commitment differs,
  the coordinator plays the dispute game and names it; the honest peers leave its contribution
  out of round 1 and it stops banned; ``swarmtrain status`` shows the verdict.
* A lying reducer adds 1.0 to the first value of the part it reduces in round 1 (and claims
  that output). The coordinator's audit recomputes the part from the contributors' slices and
  finds it wrong: round 1 fails on every peer, the reducer is banned, the others go on.
"""

from __future__ import annotations

import json
from pathlib import Path

from peerproc import PeerProcess
from runproc import node, round_lines, start_coordinator, status_json, wait_exit

SMALL_VERIFIED = {
    "d_model": "32",
    "n_layers": "1",
    "n_heads": "2",
    "context": "32",
    "sequence_length": "32",
    "rate": "1.0",
    "timeout_s": "30.0",
}
CHEAT_ROUND, CHEAT_STEP, CHEAT_OP = 1, 2, 10  # record 10 of a step is a linear layer's output
# A tiny Llama (``[model] kind = "transformers"``, built from this config on every peer): its
# tasks are dispatch traces, disputed down to one aten operator (issue 23).
LLAMA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
         "max_position_embeddings": 32}  # fmt: skip
LLAMA_TABLE = ", ".join(f"{key} = {json.dumps(value)}" for key, value in LLAMA.items())
LLAMA_EDITS = (
    ('kind = "default"', 'kind = "transformers"'),
    ('config = ""', f"config = {{ {LLAMA_TABLE} }}"),
)


# Record 210 of the tiny Llama's step is a linear layer's output (its 10th ``aten.mm``, under
# torch 2.13 and this transformers; a record that is no operator fails the cheater's task).
LLAMA_CHEAT_OP = 210

ROUNDS = 4


def _run(
    tmp_path: Path,
    *cheat: str,
    edits: tuple[tuple[str, str], ...] = (),
    settings: dict[str, str] = SMALL_VERIFIED,
) -> tuple[PeerProcess, str, list[PeerProcess], PeerProcess]:
    """Coordinator, two honest nodes and one started with ``cheat``; waits for every node's
    exit (the cheater's: status 3, banned)."""
    coordinator, join = start_coordinator(
        tmp_path,
        rounds=ROUNDS,
        inner_steps=4,
        matchmaking_timeout_s=6.0,
        settings=settings,
        edits=edits,
    )
    honest = [node(join, tmp_path / f"n{i}") for i in range(2)]
    cheater = node(join, tmp_path / "cheater", *cheat)
    try:
        assert wait_exit(cheater, 90) == 3, cheater.stderr[-3000:]
        for peer in honest:
            assert wait_exit(peer, 60) == 0, peer.stderr[-3000:]
    except BaseException:
        for peer in [*honest, cheater, coordinator]:
            peer.stop()
        raise
    return coordinator, join, honest, cheater


def _summary(path: Path) -> dict:
    return json.loads((path / "summary.json").read_text())


def test_a_cheating_peer_is_caught_excluded_and_banned_while_the_others_train_on(
    tmp_path: Path,
) -> None:
    """On a tiny Llama: its tasks are dispatch traces, disputed down to one aten operator. The
    default model's hand-written graph goes through the same game in the joiner's test below
    (and in tests/integration/test_dispute_cli.py)."""
    rounds = ROUNDS
    op = LLAMA_CHEAT_OP
    edits = LLAMA_EDITS
    cheat = f"{CHEAT_ROUND}:{CHEAT_STEP}:{op}"
    coordinator, join, honest, cheater = _run(tmp_path, "--cheat", cheat, edits=edits)
    peers = [*honest, cheater]
    try:
        cheater_id = _summary(tmp_path / "cheater")["peer_id"]
        summaries = [_summary(tmp_path / f"n{i}") for i in (0, 1)]

        # The cheater: named at the round and operator it tampered with, and stopped.
        banned = next(line for line in cheater.lines if line.startswith("this peer was banned"))
        assert f"round {CHEAT_ROUND}, step {CHEAT_STEP}, operator {op}" in banned, banned
        assert sorted(round_lines(cheater)) == [0], cheater.lines

        # The honest peers: round 0 with all three, from round 1 on the two of them, every round
        # applied with agreeing state hashes, and the verdict shown.
        for peer, summary in zip(honest, summaries, strict=True):
            lines = round_lines(peer)
            assert sorted(lines) == list(range(rounds)), peer.lines
            assert "peers 3" in lines[0], lines[0]
            for r in range(1, rounds):
                assert "peers 2" in lines[r] and "agree yes (2/2)" in lines[r], lines[r]
            # Round 1: the cheater's task left out, the other two agreed with their verifiers
            # (the cheater re-executed one of them honestly); then each verifies the other.
            assert lines[1].endswith(" verified 2/3 excluded 1 audited 2/2"), lines[1]
            assert lines[2].endswith(" verified 2/2 audited 2/2"), lines[2]
            assert summary["rounds_contributed"] == rounds and summary["banned"] == ""
            assert any(
                line.startswith("verdict: peer " + cheater_id[-8:]) for line in peer.lines
            ), peer.lines
            # After the ban the two honest peers verify each other, and agree.
            assert "round 2: 2 of 2 verified tasks agree" in peer.stderr, peer.stderr[-3000:]
        assert summaries[0]["state_hash"] == summaries[1]["state_hash"]
        assert summaries[0]["loss_last"] < summaries[0]["loss_first"]

        # The coordinator refereed once and named the cheater.
        ruled = [line for line in coordinator.lines if "verdict on the task of" in line]
        assert len(ruled) == 1 and f"cheater {cheater_id[-8:]}" in ruled[0], coordinator.lines

        report = status_json(join)
        assert report["banned"] == [cheater_id], report
        (verdict,) = report["verdicts"]
        assert verdict["cheater"] == cheater_id and verdict["round"] == CHEAT_ROUND
        assert (verdict["step"], verdict["op"]) == (CHEAT_STEP, op), verdict
    finally:
        for peer in peers:
            peer.stop()
        coordinator.stop()


def test_a_reducer_whose_sum_is_wrong_fails_the_round_everywhere_and_is_banned(
    tmp_path: Path,
) -> None:
    """With ``grad_clip``: the default model's clipped tasks are dispatch traces (its graph has
    no clip), re-executed and agreeing bit for bit on every peer."""
    clipped = {**SMALL_VERIFIED, "grad_clip": "0.5"}
    coordinator, join, honest, cheater = _run(tmp_path, "--cheat-reduce", "1", settings=clipped)
    try:
        cheater_id = _summary(tmp_path / "cheater")["peer_id"]
        summaries = [_summary(tmp_path / f"n{i}") for i in (0, 1)]
        banned = next(line for line in cheater.lines if line.startswith("this peer was banned"))
        assert "round 1, part " in banned and "of the all-reduce (reduced wrong)" in banned

        for peer, summary in zip(honest, summaries, strict=True):
            lines = round_lines(peer)
            assert sorted(lines) == list(range(ROUNDS)), peer.lines
            # Every part of round 0 audited and equal; round 1's wrong part fails the round
            # before its outer step; then the two honest peers go on without the reducer.
            assert "peers 3" in lines[0] and lines[0].endswith(" audited 3/3"), lines[0]
            assert "FAILED (round 1: the referee found part" in lines[1], lines[1]
            assert cheater_id[-8:] in lines[1], lines[1]
            for r in (2, 3):
                assert "peers 2" in lines[r] and "agree yes (2/2)" in lines[r], lines[r]
                assert lines[r].endswith(" audited 2/2"), lines[r]
            assert summary["rounds_contributed"] == ROUNDS - 1 and summary["rounds_failed"] == 1
        assert summaries[0]["state_hash"] == summaries[1]["state_hash"]

        wrong = [line for line in coordinator.lines if "WRONG" in line]
        assert len(wrong) == 1 and f"reduced by {cheater_id[-8:]}" in wrong[0], coordinator.lines
        report = status_json(join)
        assert report["banned"] == [cheater_id], report
        (verdict,) = report["verdicts"]
        assert verdict["op_name"] == "aggregation" and verdict["round"] == 1, verdict
    finally:
        for peer in [*honest, cheater, coordinator]:
            peer.stop()


def test_a_peer_that_sends_other_values_than_its_committed_task_is_dropped_and_banned(
    tmp_path: Path,
) -> None:
    """Issue 19 point 2: verification bound the task, not what the peer then sends. The cheater
    commits its round-1 task honestly (its verifier agrees) and sends 1.5 times its
    pseudo-gradient; the verifier, a reducer, knows the task's contribution bit for bit and
    drops it: round 1 is averaged by the two honest peers. The verifier hands the signed slice
    to the referee, which checks it against the task's states the verifier serves and bans the
    cheater (exit status 3) with a verdict every peer sees."""
    coordinator, join = start_coordinator(
        tmp_path, rounds=3, inner_steps=4, matchmaking_timeout_s=6.0, settings=SMALL_VERIFIED
    )
    honest = [node(join, tmp_path / f"n{i}") for i in range(2)]
    cheater = node(join, tmp_path / "cheater", "--cheat-send", "1")
    peers = [*honest, cheater]
    try:
        assert wait_exit(cheater, 100) == 3, cheater.stderr[-3000:]
        for peer in honest:
            assert wait_exit(peer, 60) == 0, peer.stderr[-3000:]
        for peer in honest:
            lines = round_lines(peer)
            assert "peers 3" in lines[0], lines
            assert "peers 2" in lines[1] and "agree yes (2/2)" in lines[1], lines[1]
        assert any(
            "its slice is not the pseudo-gradient of the task it committed" in peer.stderr
            for peer in honest
        ), [p.stderr[-2000:] for p in honest]
        banned = next(line for line in cheater.lines if line.startswith("this peer was banned"))
        assert "round 1, part" in banned and "other than its task's pseudo-gradient" in banned
        coordinator.stop()
        ruled = "verdict on the slice of"
        assert any(ruled in line for line in coordinator.lines), coordinator.lines[-20:]
        summaries = [_summary(tmp_path / d) for d in ("n0", "n1")]
        assert len({s["state_hash"] for s in summaries}) == 1, summaries
    finally:
        for peer in peers:
            peer.stop()
        coordinator.stop()


JOIN_ROUNDS = 8


def test_a_joiners_first_task_is_verified_before_it_counts(tmp_path: Path) -> None:
    """Issue 19 point 3: a peer joining a verified run mid-way is no member of its first
    round, so no assignment covered its task: its first contribution went in unverified. Now it
    traces that task, a member verifies it, and it counts only verified. This joiner cheats in
    every task: it never contributes, and it is banned at its first round."""
    coordinator, join = start_coordinator(
        tmp_path,
        rounds=JOIN_ROUNDS,
        inner_steps=8,
        matchmaking_timeout_s=6.0,
        settings=SMALL_VERIFIED,
    )
    honest = [node(join, tmp_path / f"n{i}") for i in range(2)]
    peers = list(honest)
    try:
        honest[0].wait_line(lambda line: line.startswith("round 0 "), timeout_s=60)
        joiner = node(join, tmp_path / "joiner", "--cheat", f"0:{CHEAT_STEP}:{CHEAT_OP}")
        peers.append(joiner)
        assert wait_exit(joiner, 100) == 3, (joiner.lines, joiner.stderr[-3000:])
        for peer in honest:
            assert wait_exit(peer, 60) == 0, peer.stderr[-3000:]
        banned = next(line for line in joiner.lines if line.startswith("this peer was banned"))
        assert f"step {CHEAT_STEP}, operator {CHEAT_OP}" in banned, banned
        # Left out of every round it tried (the members did not group with it).
        assert all("FAILED" in line for line in round_lines(joiner).values()), joiner.lines
        for peer in honest:
            lines = round_lines(peer)
            assert sorted(lines) == list(range(JOIN_ROUNDS)), peer.lines
            for r in range(JOIN_ROUNDS):
                assert "peers 2" in lines[r] and "agree yes (2/2)" in lines[r], lines[r]
        summaries = [_summary(tmp_path / f"n{i}") for i in (0, 1)]
        assert summaries[0]["state_hash"] == summaries[1]["state_hash"]
    finally:
        for peer in peers:
            peer.stop()
        coordinator.stop()
