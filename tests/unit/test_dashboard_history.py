"""The dashboard's model (``swarmtrain.dashboard.history``, pure): records in, ``/api/run.json``
out. No trio, no sockets: readings are built by hand as the coordinator's driver builds them."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from libp2p.crypto.ed25519 import create_new_key_pair

from p2p import PeerID
from swarmtrain.dashboard.history import JSON_VERSION, Reading, RunHistory, RunInfo
from swarmtrain.membership.progress import SILENT_AFTER_S, Progress, member_list
from swarmtrain.pipeline.progress import TrainerProgress
from swarmtrain.verified.plan import Verdict

MIB = 1 << 20
A, B, C = (str(PeerID.from_pubkey(create_new_key_pair().public_key)) for _ in range(3))
INFO = RunInfo("run-x", "ab" * 32, "12D3KooWcoordinator", rounds=10)


def _record(
    peer: str,
    r: int,
    *,
    loss: float = 3.0,
    state: bytes = b"s",
    contributed: int | None = None,
    at: float = 1000.0,
    reach: str = "public",
    members: tuple[str, ...] = (A, B),
    ok: bool = True,
) -> Progress:
    """A peer's record after round ``r``: 1 MiB sent and 2 MiB received per contribution."""
    done = r + 1 if contributed is None else contributed
    return Progress(
        peer, r, ok, state.ljust(32, b"\0"), loss, 500.0, len(members), done * MIB,
        2 * done * MIB, done, at, reach, member_list(members) if ok else b"",
    )  # fmt: skip


def test_rounds_build_the_loss_throughput_and_bytes_series() -> None:
    history = RunHistory(INFO)
    history.observe(Reading(1000.0, progress=(_record(A, 0, loss=4.0), _record(B, 0, loss=3.0))))
    # Re-reading the same round (no peer has moved on) changes nothing.
    history.observe(Reading(1001.0, progress=(_record(A, 0, loss=4.0), _record(B, 0, loss=3.0))))
    history.observe(Reading(1002.0, progress=(_record(A, 1, loss=2.0), _record(B, 0, loss=3.0))))
    history.observe(Reading(1003.0, progress=(_record(A, 1, loss=2.0), _record(B, 1, loss=1.0))))
    doc = history.to_json(now=1003.5)
    assert doc["series"] == [
        {
            "round": 0, "peers": 2, "loss": 3.5, "throughput": 1000.0,
            "bytes_sent": 2 * MIB, "bytes_received": 4 * MIB, "states": 1,
        },
        {
            "round": 1, "peers": 2, "loss": 1.5, "throughput": 1000.0,
            "bytes_sent": 2 * MIB, "bytes_received": 4 * MIB, "states": 1,
        },
    ]  # fmt: skip
    assert doc["round"] == 1
    assert doc["updated_at"] == 1003.0 and doc["error"] is None
    assert json.loads(json.dumps(doc, allow_nan=False)) == doc


def test_a_run_document_names_the_run_and_every_peer_row() -> None:
    history = RunHistory(INFO)
    records = (
        _record(A, 4, at=995.0, reach="public"),
        _record(B, 4, at=990.0, reach="private"),
        _record(C, 1, at=1000.0 - SILENT_AFTER_S - 1, members=(C,)),
    )
    history.observe(Reading(1000.0, progress=records, links={A: "direct", B: "relayed"}))
    doc = history.to_json(now=1000.0)
    assert doc["version"] == JSON_VERSION
    assert (doc["run_id"], doc["spec_hash"], doc["coordinator"]) == (
        "run-x", "ab" * 32, "12D3KooWcoordinator",
    )  # fmt: skip
    assert (doc["kind"], doc["rounds"], doc["throughput_unit"]) == ("diloco", 10, "tokens/s")
    assert doc["round"] == 4  # the silent peer's old round is not the run's
    rows = {row["peer_id"]: row for row in doc["peers"]}
    assert rows[A]["reach"] == "direct" and rows[A]["link"] == "direct"
    assert rows[B]["reach"] == "relayed" and rows[B]["link"] == "relayed"
    assert rows[C]["link"] is None and rows[C]["silent"] is True
    assert rows[A]["last_seen_s"] == 5.0 and rows[A]["silent"] is False
    assert rows[A]["state_hash"] == b"s".ljust(32, b"\0").hex()
    assert rows[A]["bytes_sent"] == 5 * MIB  # the peer's total, as published
    assert doc["agreed"] == {"round": 4, "state_hash": rows[A]["state_hash"], "holders": 2}
    assert (doc["stages"], doc["verdicts"], doc["banned"]) == ([], [], [])


def test_each_peer_says_whether_its_state_is_its_rounds_agreed_one() -> None:
    history = RunHistory(INFO)
    members = (A, B, C)
    records = (
        _record(A, 2, members=members),
        _record(B, 2, members=members),
        _record(C, 2, state=b"drifted", members=members),
    )
    history.observe(Reading(1000.0, progress=records))
    rows = {row["peer_id"]: row for row in history.to_json(1000.0)["peers"]}
    assert (rows[A]["agrees"], rows[B]["agrees"], rows[C]["agrees"]) == (True, True, False)
    assert history.series()[-1]["states"] == 2
    failed = RunHistory(INFO)
    failed.observe(Reading(1000.0, progress=(_record(A, 3, ok=False),)))
    assert failed.to_json(1000.0)["peers"][0]["agrees"] is None  # no agreed state at round 3


def test_a_forged_record_far_ahead_is_an_unagreed_claim_not_the_runs_round() -> None:
    """Issue 19: the run's round was the newest any live record claimed; one forged record
    made it the liar's. Now it is the state a joiner adopts (``plan.candidates``)."""
    liar = str(PeerID.from_pubkey(create_new_key_pair().public_key))
    members = (A, B, C)
    honest = [_record(p, 4, members=members) for p in members]
    ahead = _record(liar, INFO.rounds - 1, state=b"forged", members=(liar,))
    far = _record(liar, 10**6, state=b"forged", members=(liar,))
    history = RunHistory(INFO)
    history.observe(Reading(1000.0, progress=(*honest, ahead)))
    history.observe(Reading(1001.0, progress=(*honest, far)))
    doc = history.to_json(1001.0)
    assert doc["round"] == 4 and doc["agreed"]["round"] == 4 and doc["agreed"]["holders"] == 3
    assert doc["unagreed"] == [{"round": 10**6, "peers": 1}]
    rows = {row["peer_id"]: row for row in doc["peers"]}
    assert rows[liar]["agrees"] is None and rows[A]["agrees"] is True
    # A round past the schedule never enters the curves (nor evicts real rounds from them).
    assert [row["round"] for row in doc["series"]] == [4, INFO.rounds - 1]


def test_bytes_of_a_round_are_known_only_from_the_same_peers_previous_contribution() -> None:
    history = RunHistory(INFO)
    history.observe(Reading(1.0, progress=(_record(A, 0), _record(B, 3))))  # B: seen late
    history.observe(Reading(2.0, progress=(_record(A, 1), _record(B, 4))))
    history.observe(Reading(3.0, progress=(_record(A, 4), _record(B, 5, ok=False, contributed=5))))
    sent = {row["round"]: row["bytes_sent"] for row in history.series()}
    # Round 0 is A's first contribution: its totals are the round's.
    assert (sent[0], sent[1]) == (MIB, MIB)
    # B was first seen at round 3 with 4 contributions behind it: that round is unknown.
    assert sent[3] is None
    # Round 4: B's step from round 3 counts; A's jump from round 1 (rounds 2, 3 unseen) does not.
    assert sent[4] == MIB
    assert sent[5] == 0  # a failed round adds nothing to the totals


def test_the_history_keeps_the_newest_rounds_within_its_bound() -> None:
    history = RunHistory(INFO, max_rounds=3)
    for r in range(6):
        history.observe(Reading(float(r), progress=(_record(A, r),)))
    assert [row["round"] for row in history.series()] == [3, 4, 5]
    with pytest.raises(ValueError, match="max_rounds"):
        RunHistory(INFO, max_rounds=0)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([A, B, C]),
            st.integers(0, 50),
            st.floats(0, 20, allow_nan=False),
            st.integers(0, 60),
            st.booleans(),
        ),
        max_size=30,
    )
)
def test_any_reading_sequence_stays_bounded_and_serializable(
    events: list[tuple[str, int, float, int, bool]],
) -> None:
    history = RunHistory(INFO, max_rounds=8)
    for i, (peer, r, loss, contributed, ok) in enumerate(events):
        record = _record(peer, r, loss=loss, contributed=contributed, ok=ok)
        history.observe(Reading(float(i), progress=(record,)))
        assert len(history.rounds) <= 8
    doc = history.to_json(now=100.0)
    json.dumps(doc, allow_nan=False)
    for row in doc["series"]:
        assert row["bytes_sent"] is None or row["bytes_sent"] >= 0


def test_a_failed_read_is_shown_and_the_last_good_one_kept() -> None:
    history = RunHistory(INFO)
    assert history.to_json(5.0)["updated_at"] is None
    history.observe(Reading(10.0, progress=(_record(A, 0),)))
    history.failed("no peer answered", 12.0)
    doc = history.to_json(13.0)
    assert doc["error"] == "no peer answered" and doc["updated_at"] == 10.0
    assert [p["peer_id"] for p in doc["peers"]] == [A]
    history.observe(Reading(14.0, progress=(_record(A, 1),)))
    assert history.to_json(15.0)["error"] is None


def test_a_pipeline_run_shows_stages_and_trainers_series() -> None:
    info = RunInfo("pipe", "cd" * 32, "12D3KooWcoordinator", rounds=3, pipeline_stages=2)
    history = RunHistory(info)
    stages = (
        {"stage": 0, "servers": 2, "relayed": 1, "capacity": 12.345, "queue": 3},
        {"stage": 1, "servers": 1, "relayed": 0, "capacity": 4.0, "queue": 0},
    )
    for r in range(2):
        trainers = {
            A: TrainerProgress(r, 5.0 - r, 8, 10.0, 0, 100.0),
            B: TrainerProgress(r, None, 0, 0.0, 1, 100.0),
        }
        history.observe(Reading(100.0 + r, trainers=trainers, stages=stages))
    doc = history.to_json(now=101.0)
    assert (doc["kind"], doc["throughput_unit"], doc["agreed"]) == ("pipeline", "samples/s", None)
    assert doc["stages"][0] == {
        "stage": 0, "servers": 2, "relayed": 1, "capacity": 12.35, "queue": 3,
    }  # fmt: skip
    assert [(row["round"], row["loss"], row["throughput"]) for row in doc["series"]] == [
        (0, 5.0, 10.0),
        (1, 4.0, 10.0),
    ]
    assert doc["series"][0]["bytes_sent"] is None
    rows = {row["peer_id"]: row for row in doc["peers"]}
    assert rows[B]["loss"] is None and rows[B]["failovers"] == 1 and rows[A]["microbatches"] == 8


def test_a_verified_run_lists_verdicts_and_marks_the_banned_peer() -> None:
    info = RunInfo("v", "ef" * 32, "12D3KooWcoordinator", rounds=3, verify_rate=0.5)
    history = RunHistory(info)
    cheater, verifier = PeerID.from_base58(A).to_bytes(), PeerID.from_base58(B).to_bytes()
    verdicts = (
        Verdict(1, cheater, verifier, cheater, 2, 10, "linear", "output differs"),
        Verdict(2, verifier, cheater, None, None, None, "", "both silent"),
    )
    history.observe(Reading(1.0, progress=(_record(A, 1), _record(B, 1)), verdicts=verdicts))
    doc = history.to_json(2.0)
    assert doc["verify_rate"] == 0.5 and doc["banned"] == [A]
    assert [v["cheater"] for v in doc["verdicts"]] == [A, None]
    assert doc["verdicts"][0] == verdicts[0].to_json()
    rows = {row["peer_id"]: row for row in doc["peers"]}
    assert rows[A]["banned"] is True and rows[B]["banned"] is False
