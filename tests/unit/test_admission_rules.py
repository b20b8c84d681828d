"""Permissioned runs (``swarmtrain.admission``): join tokens and who is admitted, without IO."""

from __future__ import annotations

from pathlib import Path

import pytest
from libp2p.crypto.ed25519 import create_new_key_pair

from p2p import PeerID, create_identity, encode, identity_work, peer_id_of
from swarmtrain.admission import (
    Admission,
    JoinToken,
    base64_token_bytes,
    make_token,
    own_problem,
    parse_token,
    token_problem,
)
from swarmtrain.config import ConfigError, RunConfig, RunSection

NOW = 1_800_000_000.0


def _peer() -> tuple[object, PeerID]:
    key_pair = create_new_key_pair()
    return key_pair, peer_id_of(key_pair)


def _config(**run: object) -> RunConfig:
    return RunConfig(run=RunSection(id="closed", **run))  # type: ignore[arg-type]


def test_a_token_admits_its_peer_to_its_run_until_it_expires() -> None:
    coordinator_key, coordinator = _peer()
    _, member = _peer()
    _, other = _peer()
    text = make_token(coordinator_key, "closed", member, NOW + 60)  # type: ignore[arg-type]
    token = parse_token(text)
    assert token_problem(token, coordinator, "closed", member.to_bytes(), NOW) is None
    assert "expired" in (
        token_problem(token, coordinator, "closed", member.to_bytes(), NOW + 61) or ""
    )
    assert "another peer" in (
        token_problem(token, coordinator, "closed", other.to_bytes(), NOW) or ""
    )
    assert "for run 'closed', not 'open'" in (
        token_problem(token, coordinator, "open", member.to_bytes(), NOW) or ""
    )
    # Signed by someone else (a member minting tokens for its friends), or altered.
    forger_key, _ = _peer()
    forged = parse_token(make_token(forger_key, "closed", member, NOW + 60))  # type: ignore[arg-type]
    assert "not signed by coordinator" in (
        token_problem(forged, coordinator, "closed", member.to_bytes(), NOW) or ""
    )
    longer = JoinToken(token.run_id, token.peer_id, token.expires_at + 1e6, token.signature)
    assert "not signed" in (
        token_problem(longer, coordinator, "closed", member.to_bytes(), NOW) or ""
    )


def test_garbage_is_not_a_token() -> None:
    for text in ("", "not base64 !!", "AAAA", "x" * 5000):
        with pytest.raises(ValueError, match="not a join token"):
            parse_token(text)


def test_an_allow_list_admits_its_peers_and_the_coordinator_only() -> None:
    _, coordinator = _peer()
    _, member = _peer()
    _, stranger = _peer()
    admission = Admission(_config(admission="allowlist", allow=(str(member),)), coordinator)
    assert admission.admits(member.to_bytes()) and admission.admits(coordinator.to_bytes())
    assert not admission.admits(stranger.to_bytes())
    values = {str(member): b"m", str(stranger): b"s", "garbage": b"g"}
    assert [owner for owner in values if admission.admits_id(owner)] == [str(member)]
    assert own_problem(admission, member, None, NOW) is None
    assert "not one of them" in (own_problem(admission, stranger, None, NOW) or "")
    # An open run admits anyone.
    assert Admission(_config(), coordinator).admits(stranger.to_bytes())


def test_a_token_run_admits_peers_whose_own_stored_token_is_valid() -> None:
    coordinator_key, coordinator = _peer()
    _, member = _peer()
    _, thief = _peer()
    admission = Admission(_config(admission="token"), coordinator)
    token = make_token(coordinator_key, "closed", member, NOW + 60)  # type: ignore[arg-type]
    # The thief stores the member's token as its own: it names another peer.
    admission.refresh(
        {str(member): base64_token_bytes(token), str(thief): base64_token_bytes(token)}, NOW
    )
    assert not admission.admits(thief.to_bytes())
    assert own_problem(admission, member, token, NOW) is None
    assert "--token" in (own_problem(admission, member, None, NOW) or "")
    assert "expired" in (own_problem(admission, member, token, NOW + 120) or "")
    assert "not a join token" in (own_problem(admission, member, "garbage", NOW) or "")
    junk = encode(JoinToken("closed", member.to_bytes(), NOW + 60, b"\x00" * 64))
    admission.refresh({str(member): junk, str(thief): b"\xff"}, NOW)
    assert not admission.admits(member.to_bytes())  # its stored token is not the coordinator's


def test_the_config_refuses_a_closed_run_nobody_can_join() -> None:
    with pytest.raises(ConfigError, match=r"run\.allow"):
        _config(admission="allowlist")
    with pytest.raises(ConfigError, match=r"run\.id"):
        RunConfig(run=RunSection(admission="token"))
    with pytest.raises(ConfigError, match=r"run\.admission"):
        _config(admission="closed")
    with pytest.raises(ConfigError, match=r"run\.allow"):
        _config(admission="allowlist", allow=("not a peer id",))


def test_identity_work_admits_only_identities_that_carry_it(tmp_path: Path) -> None:
    _, coordinator = _peer()  # the coordinator needs none: it serves the run
    poor = next(p for _, p in iter(_peer, None) if identity_work(p.to_bytes()) < 6)
    worked = peer_id_of(create_identity(tmp_path / "worked.key", 6))
    admission = Admission(_config(identity_work_bits=6), coordinator)
    assert not admission.open
    assert admission.admits(worked.to_bytes()) and admission.admits(coordinator.to_bytes())
    assert not admission.admits(poor.to_bytes())
    assert own_problem(admission, worked, None, NOW) is None
    problem = own_problem(admission, poor, None, NOW) or ""
    assert "6 bits of proof of work (run.identity_work_bits)" in problem
    assert "swarmtrain id --identity STATE_DIR/identity.key --work 6" in problem
    # Work adds to an allow-list: a listed peer without it is refused too.
    listed = Admission(
        _config(admission="allowlist", allow=(str(poor), str(worked)), identity_work_bits=6),
        coordinator,
    )
    assert listed.admits(worked.to_bytes()) and not listed.admits(poor.to_bytes())
    with pytest.raises(ConfigError, match="identity_work_bits"):
        _config(identity_work_bits=29)
