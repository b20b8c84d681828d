from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from p2p.errors import IdentityError
from p2p.identity import load_or_create_identity, peer_id_of


def test_created_with_mode_0600_and_stable_across_loads(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "identity.key"
    first = load_or_create_identity(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert peer_id_of(load_or_create_identity(path)) == peer_id_of(first)
    assert str(peer_id_of(first)).startswith("12D3KooW")  # Ed25519 identity multihash


def test_readable_by_others_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "identity.key"
    load_or_create_identity(path)
    os.chmod(path, 0o644)
    with pytest.raises(IdentityError, match="readable by others"):
        load_or_create_identity(path)


def test_garbage_and_wrong_key_types_are_refused(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    garbage = tmp_path / "garbage.key"
    garbage.write_bytes(b"not a key")
    os.chmod(garbage, 0o600)
    with pytest.raises(IdentityError, match="not a PEM"):
        load_or_create_identity(garbage)

    ecdsa = tmp_path / "ecdsa.key"
    ecdsa.write_bytes(
        ec.generate_private_key(ec.SECP256R1()).private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    os.chmod(ecdsa, 0o600)
    with pytest.raises(IdentityError, match="expected Ed25519"):
        load_or_create_identity(ecdsa)


def test_an_identity_made_with_work_carries_it_and_is_never_overwritten(tmp_path: Path) -> None:
    from p2p.identity import MAX_WORK_BITS, create_identity, identity_work

    path = tmp_path / "worked.key"
    made = create_identity(path, 8)
    peer = peer_id_of(made)
    assert identity_work(peer.to_bytes()) >= 8
    assert peer_id_of(load_or_create_identity(path)) == peer  # an ordinary identity file
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    with pytest.raises(IdentityError, match="exists"):
        create_identity(path, 8)
    with pytest.raises(IdentityError, match="work bits"):
        create_identity(tmp_path / "other.key", MAX_WORK_BITS + 1)
    # The work is the leading zero bits of a hash of the id: checked the slow way here.
    import hashlib

    digest = hashlib.sha256(b"swarmtrain/identity-work/1" + peer.to_bytes()).digest()
    assert (
        digest[0] == 0
        and identity_work(peer.to_bytes()) == 256 - int.from_bytes(digest, "big").bit_length()
    )
