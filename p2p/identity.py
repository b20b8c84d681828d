"""A node's long-lived Ed25519 identity, kept in a file only its owner can read.

The file holds the 32-byte Ed25519 seed in PKCS#8 PEM. It is created with mode 0600 (the key is
written to a temporary file opened with that mode, then renamed, so a crash never leaves a
half-written or world-readable key). A key file that group or others can read is refused: a
volunteer's peer id is its reputation in a run, and a leaked key lets anyone impersonate it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import stat
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID

from p2p.errors import IdentityError

_MAX_KEY_FILE_BYTES = 4096
_WORK_TAG = b"swarmtrain/identity-work/1"
MAX_WORK_BITS = 28  # 2**28 key generations: hours of one core, the most a run may ask
# An Ed25519 peer id is the identity multihash (0x00, length 36) of the protobuf PublicKey
# (type Ed25519 = 1, 32 data bytes) around the raw public key: grinding skips libp2p's objects.
_ED25519_ID_PREFIX = bytes([0x00, 0x24, 0x08, 0x01, 0x12, 0x20])


def default_identity_path() -> Path:
    """``$XDG_DATA_HOME/swarmtrain/identity.key`` (``~/.local/share/...`` by default)."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "swarmtrain" / "identity.key"


def _seed_to_keypair(seed: bytes) -> KeyPair:
    return create_new_key_pair(seed)


def load_or_create_identity(path: Path | str) -> KeyPair:
    """Load the Ed25519 key at ``path``, creating it (mode 0600) if absent.

    Raises ``IdentityError`` if the file is readable by group/others, is not a regular file, is
    too large, or does not hold an Ed25519 private key.
    """
    path = Path(path)
    if not path.exists():
        return _create(path)
    st = path.stat()
    if not stat.S_ISREG(st.st_mode):
        raise IdentityError(f"identity {path} is not a regular file")
    if st.st_mode & 0o077:
        raise IdentityError(
            f"identity {path} is readable by others (mode {stat.S_IMODE(st.st_mode):04o}); "
            f"run `chmod 600 {path}` if it was not leaked, or delete it to get a new identity"
        )
    if st.st_size > _MAX_KEY_FILE_BYTES:
        raise IdentityError(f"identity {path} is {st.st_size} bytes, not a key file")
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (ValueError, TypeError) as exc:
        raise IdentityError(f"identity {path} is not a PEM private key: {exc}") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise IdentityError(f"identity {path} holds a {type(key).__name__}, expected Ed25519")
    seed = key.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    return _seed_to_keypair(seed)


def _work(peer: bytes) -> int:
    digest = int.from_bytes(hashlib.sha256(_WORK_TAG + peer).digest(), "big")
    return 256 - digest.bit_length()


@functools.lru_cache(maxsize=65536)  # every record read checks its owner's
def identity_work(peer: bytes) -> int:
    """The proof of work a peer id carries: the leading zero bits of SHA-256(tag, id bytes).
    A run that asks for N bits (Sybil resistance, as S/Kademlia's crypto puzzle) makes each new
    identity cost about 2**N key generations, while checking one costs one hash."""
    return _work(peer)


def create_identity(path: Path | str, work_bits: int = 0) -> KeyPair:
    """A new identity at ``path`` whose peer id carries at least ``work_bits`` of work
    (``identity_work``; about ``2**work_bits`` key generations, 40 us each on one core).
    Raises ``IdentityError`` when ``path`` exists or ``work_bits`` is out of range."""
    if not 0 <= work_bits <= MAX_WORK_BITS:
        raise IdentityError(f"work bits must be 0..{MAX_WORK_BITS}, not {work_bits}")
    path = Path(path)
    if path.exists():
        raise IdentityError(f"identity {path} exists; move it away to make a new one")
    return _create(path, work_bits)


def _create(path: Path, work_bits: int = 0) -> KeyPair:
    try:
        return _write_new(path, work_bits)
    except OSError as exc:  # errno's words, on the key's name rather than its temporary file's
        # mkdir of a parent that is a file says "file exists"; opening below one, ENOTDIR.
        # With its folders made first, "no such file" means the file system takes no new files
        # there (/proc, /sys).
        if isinstance(exc, (FileExistsError, NotADirectoryError)):
            why = "a folder on the path is a file"
        elif isinstance(exc, FileNotFoundError):
            why = "nothing can be made there"
        else:
            why = (exc.strerror or "").lower()
        raise IdentityError(f"cannot create identity {path}: {why}") from None


def _write_new(path: Path, work_bits: int) -> KeyPair:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    while True:
        key = Ed25519PrivateKey.generate()
        raw = key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        if work_bits == 0 or _work(_ED25519_ID_PREFIX + raw) >= work_bits:
            break
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
            f.flush()
            os.fsync(f.fileno())
        # O_EXCL on the final name would race with a concurrent creator; link() does not
        # overwrite, so the first writer wins and everyone loads the same key.
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return load_or_create_identity(path)


def peer_id_of(key_pair: KeyPair) -> ID:
    return ID.from_pubkey(key_pair.public_key)
