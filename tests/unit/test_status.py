"""``swarmtrain status`` for a verified DiLoCo run: the coordinator's verdicts and the bans."""

from __future__ import annotations

import msgpack
from libp2p.crypto.ed25519 import create_new_key_pair

from p2p import PeerID
from swarmtrain.commands.status import StatusReport
from swarmtrain.config import RunConfig, RunSection, VerifySection
from swarmtrain.membership.progress import Progress, member_list
from swarmtrain.runspec import RunSpec
from swarmtrain.verified.plan import AGGREGATION, Verdict


def _peer() -> bytes:
    return PeerID.from_pubkey(create_new_key_pair().public_key).to_bytes()


def test_status_lists_task_and_aggregation_verdicts_and_the_banned_peers() -> None:
    owner, verifier, reducer = _peer(), _peer(), _peer()
    verdicts = [
        Verdict(1, owner, verifier, owner, 2, 10, "linear", "output differs from the referee's"),
        Verdict(3, reducer, reducer, reducer, None, 0, AGGREGATION, "the sum is wrong"),
        Verdict(4, verifier, owner, None, None, None, "", "both silent"),
    ]
    spec = RunSpec(
        RunConfig(run=RunSection(id="r"), verify=VerifySection(rate=0.5)),
        "12D3KooWcoordinator",
        1.0,
    )
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


def _progress(peer: str, reach: str = "unknown") -> Progress:
    return Progress(peer, 3, True, bytes(32), 2.5, 100.0, 2, 1 << 20, 1 << 20, 3, 990.0, reach)


def test_status_shows_each_peers_reachability_published_or_probed() -> None:
    public, private, old, punched = (str(PeerID(_peer())) for _ in range(4))
    records = [
        _progress(public, "public"),
        _progress(private, "private"),
        _progress(punched, "private"),
        # A node that does not know its reachability publishes "unknown".
        Progress.from_bytes(old, _progress(old).to_bytes()),
    ]
    assert records[3] is not None and records[3].reach == "unknown"
    for p in records[:3]:
        assert Progress.from_bytes(p.peer_id, p.to_bytes()) == p
    spec = RunSpec(RunConfig(run=RunSection(id="r")), "12D3KooWcoordinator", 1.0)
    report = StatusReport(spec, records, 1000.0, reached={punched: "punched"})  # type: ignore[arg-type]
    shown = {n["peer_id"]: n for n in report.to_json()["nodes"]}  # type: ignore[union-attr]
    assert shown[public]["reach"] == "public" and shown[private]["reach"] == "private"
    assert shown[old]["reach"] == "unknown" and shown[punched]["reached"] == "punched"
    rows = {line[:12]: line for line in report.format().splitlines()[2:]}
    assert "direct" in rows[public[-12:]] and "relayed" in rows[private[-12:]]
    assert " ? " in rows[old[-12:]] and "punched" in rows[punched[-12:]]


def test_a_reachability_field_that_is_not_one_of_the_known_words_is_refused() -> None:
    version, code, good = msgpack.unpackb(_progress("p", "public").to_bytes())
    for bad in ["direct", "x" * 5000, 7, None]:
        assert Progress.from_bytes("p", msgpack.packb([version, code, [*good[:10], bad]])) is None
    assert Progress.from_bytes("p", msgpack.packb([version, code, [*good, "public"]])) is None
    assert Progress.from_bytes("p", msgpack.packb([version, code, good[:10]])) is None


def test_the_runs_round_is_the_state_a_joiner_adopts_and_a_forged_one_a_claim() -> None:
    """Issue 19: status showed the newest round any record claimed as the run's, so one forged
    record far ahead was "the run's round"; now it is the state a joiner would adopt."""
    honest = [str(PeerID(_peer())) for _ in range(3)]
    listed = member_list(honest)
    records = [
        Progress(p, 3, True, b"\x01" * 32, 2.5, 100.0, 3, 0, 0, 3, 990.0, "public", listed)
        for p in honest
    ]
    liar = str(PeerID(_peer()))
    forged = Progress(liar, 10**6, True, b"\x09" * 32, 0.01, 1e9, 1, 0, 0, 1, 990.0, "public",
                      member_list([liar]))  # fmt: skip
    spec = RunSpec(RunConfig(run=RunSection(id="r", rounds=10)), "12D3KooWcoordinator", 1.0)
    shown = StatusReport(spec, [*records, forged], 1000.0).to_json()
    assert (shown["round"], shown["state_hash"], shown["state_holders"]) == (3, "01" * 32, 3)
    assert (shown["loss"], shown["tokens_per_s"]) == (2.5, 300.0)  # the holders' figures
    assert shown["unagreed"] == [{"round": 10**6, "peers": 1}]
    text = StatusReport(spec, [*records, forged], 1000.0).format()
    assert text.splitlines()[0].startswith("run r (coordinator 12D3KooWcoordinator): round 3 of 10")
    assert "a claim of round 1000000 by 1 peer(s) is not agreed" in text
