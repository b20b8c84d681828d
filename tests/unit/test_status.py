"""``swarmtrain status`` for a verified DiLoCo run: the coordinator's verdicts and the bans."""

from __future__ import annotations

from libp2p.crypto.ed25519 import create_new_key_pair

from p2p import PeerID
from swarmtrain.runspec import RunConfig, RunSpec
from swarmtrain.status import StatusReport
from swarmtrain.verify_plan import AGGREGATION, Verdict


def _peer() -> bytes:
    return PeerID.from_pubkey(create_new_key_pair().public_key).to_bytes()


def test_status_lists_task_and_aggregation_verdicts_and_the_banned_peers() -> None:
    owner, verifier, reducer = _peer(), _peer(), _peer()
    verdicts = [
        Verdict(1, owner, verifier, owner, 2, 10, "linear", "output differs from the referee's"),
        Verdict(3, reducer, reducer, reducer, None, 0, AGGREGATION, "the sum is wrong"),
        Verdict(4, verifier, owner, None, None, None, "", "both silent"),
    ]
    spec = RunSpec(RunConfig(run_id="r", verify_rate=0.5), "12D3KooWcoordinator", 1.0)
    report = StatusReport(spec, [], 1000.0, verdicts=verdicts)
    shown = report.to_json()
    assert shown["verify_rate"] == 0.5
    assert shown["banned"] == sorted([str(PeerID(owner)), str(PeerID(reducer))])
    assert [v["cheater"] for v in shown["verdicts"]] == [  # type: ignore[union-attr]
        str(PeerID(owner)),
        str(PeerID(reducer)),
        None,
    ]
    text = report.format()
    assert "verdict: round 1, step 2, operator 10 (linear): task of" in text
    assert f"{str(PeerID(owner))[-12:]} banned" in text
    assert "verdict: round 3, part 0 of the all-reduce (reduced wrong)" in text
    assert "nobody named (both silent)" in text
