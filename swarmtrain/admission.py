"""Who may take part in a run (``[run] admission``): everyone, an allow-list, or token holders.

An open run (the default) takes anyone, which is what a public volunteer run wants and also why a
liar's new identity costs it nothing (issue 19). A permissioned run names its members:

* ``allowlist``: the spec lists their peer ids (``[run] allow``), signed with it;
* ``token``: the coordinator signs a join token per peer (``swarmtrain coordinator token --peer
  ID --expires 24h``): run id, peer id, expiry, signed with the coordinator's identity under its
  own domain. The holder starts its node with ``--token`` and stores the token as its own signed
  subkey of ``run/<id>/admissions``; every member reads that key and admits the peers whose
  token is the coordinator's, for this run and that peer, and unexpired. A token copied from its
  holder is worthless: the DHT binds a subkey to its owner's signature, and the token to its peer.

``[run] identity_work_bits`` N > 0 adds a cost to every identity, in any mode: a member's peer
id must carry N bits of proof of work (``p2p.identity_work``), so the 1,100 fresh identities a
flooder or a Sybil needs cost 1,100 x 2**N key generations instead of nothing.

Every member then ignores what non-members write under the run's keys (progress records, start
and join announcements, matchmaking declarations, state hashes) and refuses their state
downloads; a non-member is never in a group, so no all-reduce stream of its is accepted. A node
that is not admitted itself refuses to start, with one line saying why.

``Admission`` is pure (the token table is handed in: ``refresh``); the node's runtime reads the
key every ``REFRESH_S`` and before its first round.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Mapping

from libp2p.crypto.keys import KeyPair

from p2p import (
    Message,
    PeerID,
    RemoteProtocolError,
    decode,
    encode,
    identity_work,
    message,
    verify_peer_signature,
)
from swarmtrain.config import RunConfig

TOKEN_DOMAIN = b"swarmtrain/join-token/1\x00"
MAX_TOKEN_BYTES = 1024
REFRESH_S = 5.0
TOKEN_TTL_S = 600.0  # how long a stored token stays in the DHT before the node stores it again


@message(509, max_bytes=MAX_TOKEN_BYTES)
class JoinToken(Message):
    """A coordinator's permission for ``peer_id`` to take part in ``run_id`` until
    ``expires_at`` (Unix seconds), and the coordinator's signature over the rest."""

    run_id: str
    peer_id: bytes
    expires_at: float
    signature: bytes

    def signed_part(self) -> bytes:
        return TOKEN_DOMAIN + encode(JoinToken(self.run_id, self.peer_id, self.expires_at, b""))


def make_token(key_pair: KeyPair, run_id: str, peer: PeerID, expires_at: float) -> str:
    """A join token (text a volunteer passes to ``--token``), signed by ``key_pair``."""
    unsigned = JoinToken(run_id, peer.to_bytes(), float(expires_at), b"")
    signature = key_pair.private_key.sign(unsigned.signed_part())
    data = encode(JoinToken(run_id, peer.to_bytes(), float(expires_at), signature))
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def base64_token_bytes(text: str) -> bytes:
    """A token's wire bytes (what a holder stores under ``admissions_key``) from its text."""
    text = text.strip()
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def parse_token(text: str) -> JoinToken:
    """Raises ValueError for text that is not a token."""
    try:
        return decode(base64_token_bytes(text), JoinToken)
    except (ValueError, RemoteProtocolError) as exc:
        raise ValueError(f"not a join token ({exc})") from None


def token_problem(
    token: JoinToken, coordinator: PeerID, run_id: str, peer: bytes, now: float
) -> str | None:
    """Why ``token`` does not admit ``peer`` to ``run_id``, or None when it does."""
    if token.run_id != run_id:
        return f"the token is for run {token.run_id!r}, not {run_id!r}"
    if token.peer_id != peer:
        return "the token names another peer"
    if not verify_peer_signature(coordinator.to_bytes(), token.signed_part(), token.signature):
        return f"the token is not signed by coordinator {coordinator}"
    if token.expires_at <= now:
        ended = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(token.expires_at))
        return f"the token expired at {ended}"
    return None


class Admission:
    """Whether a peer is a member of the run, by its peer id's bytes."""

    def __init__(self, config: RunConfig, coordinator: PeerID) -> None:
        self.mode = config.run.admission
        self.work_bits = config.run.identity_work_bits
        self.run_id = config.run.id
        self.coordinator = coordinator
        # The coordinator serves the run (bootstrap, relay, referee): always a member.
        self._allowed = {coordinator.to_bytes()} | {
            PeerID.from_base58(p).to_bytes() for p in config.run.allow
        }
        self._coordinator = coordinator.to_bytes()
        self._tokens: dict[bytes, float] = {}  # peer -> its valid token's expiry

    @property
    def open(self) -> bool:
        """Whether everyone is admitted (no filter to install)."""
        return self.mode == "open" and self.work_bits == 0

    def admits(self, peer: bytes) -> bool:
        if peer == self._coordinator:
            return True
        if self.work_bits and identity_work(peer) < self.work_bits:
            return False
        if self.mode == "open" or peer in self._allowed:
            return True
        return self.mode == "token" and self._tokens.get(peer, 0.0) > time.time()

    def admits_id(self, peer: str) -> bool:
        """``admits`` for a base58 peer id (how the DHT reads name owners)."""
        try:
            return self.admits(PeerID.from_base58(peer).to_bytes())
        except Exception:
            return False

    def refresh(self, values: Mapping[str, bytes], now: float) -> None:
        """Take the valid tokens from a read of ``admissions_key``: ``{owner: value}``."""
        found: dict[bytes, float] = {}
        for owner, value in values.items():
            try:
                token = decode(value, JoinToken)
                peer = PeerID.from_base58(owner).to_bytes()
            except Exception:
                continue
            if token_problem(token, self.coordinator, self.run_id, peer, now) is None:
                found[peer] = token.expires_at
        self._tokens = found


def own_problem(admission: Admission, me: PeerID, token: str | None, now: float) -> str | None:
    """Why this node may not take part (the one line it exits with), or None."""
    work = identity_work(me.to_bytes())
    if work < admission.work_bits:
        return (
            f"run {admission.run_id} admits identities with {admission.work_bits} bits of proof "
            f"of work (run.identity_work_bits), and this one ({me}) has {work}: move the node's "
            f"identity.key away and make one with swarmtrain id --identity "
            f"STATE_DIR/identity.key --work {admission.work_bits}"
        )
    if admission.mode == "open":
        return None
    if admission.mode == "allowlist":
        if me.to_bytes() in admission._allowed:
            return None
        return (
            f"run {admission.run_id} admits only the peers its spec lists (run.allow), and "
            f"{me} is not one of them; ask the run's operator to add it"
        )
    if not token:
        return (
            f"run {admission.run_id} admits token holders only: start the node with --token "
            f"(the operator makes one with: swarmtrain coordinator token --peer {me})"
        )
    try:
        parsed = parse_token(token)
    except ValueError as exc:
        return f"--token: {exc}"
    why = token_problem(parsed, admission.coordinator, admission.run_id, me.to_bytes(), now)
    return None if why is None else f"--token: {why}"
