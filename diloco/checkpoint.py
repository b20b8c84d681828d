"""Atomic per-round checkpoints of a DiLoCo peer, and resuming from the newest good one.

What a checkpoint holds: the global state (its own verified encoding, see ``diloco.state``), the
run's config fingerprint, and the inner optimizer's state dict. The inner state is saved because
DiLoCo keeps the inner optimizer's moments across rounds (as OpenDiLoCo does); a resumed peer then
continues exactly where the round boundary left it. Local progress inside a round, and local
progress kept after a failed round, is not saved: a restart counts as leaving and rejoining at the
round boundary.

Why this shape: a node can be killed at any instant, so a file is either the old one or the new
one (temporary file in the same directory, fsync, ``os.replace``, fsync of the directory), and a
bad file (truncated, flipped bits) is detected by its checksum, logged and skipped in favour of the
previous one; the last ``KEEP`` files are kept for that reason. No pickle: the optimizer state is
msgpack with tensors as (dtype, shape, raw bytes) from an allow-list.

File: ``MAGIC (8 bytes) | sha256(payload) (32 bytes) | payload (msgpack map)``.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import re
import struct
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import msgpack
import torch

from diloco.state import GlobalState

logger = logging.getLogger(__name__)

MAGIC = b"DLCCKPT1"
KEEP = 2
_NAME = re.compile(r"^diloco-(\d{10})\.ckpt$")
_TENSOR_EXT = 1
_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_PACKER = msgpack.Packer()  # use_bin_type, as packb: the same bytes


class EncodableState(Protocol):
    """What a checkpoint writes: a ``GlobalState``, or the ``diloco.store.StateStore`` a
    ``DiLoCo`` keeps it in (streamed from its files)."""

    round: int

    def encoded_size(self) -> int: ...

    def write_to(self, write: Callable[[bytes], object]) -> bytes: ...


@dataclass(frozen=True)
class Checkpoint:
    state: GlobalState
    fingerprint: str
    inner_state: dict[str, Any] | None
    path: Path


def _tensor_parts(obj: object) -> tuple[bytes, memoryview]:
    """A tensor's msgpack ext body as (its head, its raw bytes: a view of the tensor's memory
    when it is a contiguous CPU tensor). TypeError for anything else."""
    if not isinstance(obj, torch.Tensor) or obj.dtype not in _DTYPE_NAMES:
        raise TypeError(f"cannot checkpoint a {type(obj).__name__}")
    tensor = obj.detach().to("cpu").contiguous()
    flat = (
        tensor.reshape(-1).view(torch.uint8)
        if tensor.numel()
        else torch.empty(0, dtype=torch.uint8)
    )
    raw = memoryview(flat.numpy()).cast("B")
    # The body is packb([dtype, shape, raw]): a 3-array header, the two, then bin(raw).
    head = b"\x93" + _PACKER.pack(_DTYPE_NAMES[tensor.dtype]) + _PACKER.pack(list(tensor.shape))
    return head + _bin_header(len(raw)), raw


def _bin_header(length: int) -> bytes:
    """msgpack's header of a ``length``-byte bin, in its shortest form (as ``packb`` writes)."""
    if length < 1 << 8:
        return struct.pack(">BB", 0xC4, length)
    if length < 1 << 16:
        return struct.pack(">BH", 0xC5, length)
    return struct.pack(">BI", 0xC6, length)


def _ext_header(code: int, length: int) -> bytes:
    """msgpack's header of a ``length``-byte ext of type ``code``, shortest form."""
    fixed = {1: 0xD4, 2: 0xD5, 4: 0xD6, 8: 0xD7, 16: 0xD8}.get(length)
    if fixed is not None:
        return struct.pack(">Bb", fixed, code)
    if length < 1 << 8:
        return struct.pack(">BBb", 0xC7, length, code)
    if length < 1 << 16:
        return struct.pack(">BHb", 0xC8, length, code)
    return struct.pack(">BIb", 0xC9, length, code)


def _pack(obj: object, write: Callable[[bytes | memoryview], object]) -> None:
    """msgpack of ``obj`` (msgpack types, tensors as ext ``_TENSOR_EXT``) handed to ``write``
    piece by piece, the same bytes ``packb`` would make, without building them in memory: an
    optimizer state of a 100M-parameter model is 800 MB."""
    if isinstance(obj, dict):
        write(_PACKER.pack_map_header(len(obj)))
        for key, value in obj.items():
            _pack(key, write)
            _pack(value, write)
    elif isinstance(obj, list | tuple):
        write(_PACKER.pack_array_header(len(obj)))
        for item in obj:
            _pack(item, write)
    elif isinstance(obj, torch.Tensor):
        head, raw = _tensor_parts(obj)
        write(_ext_header(_TENSOR_EXT, len(head) + len(raw)) + head)
        write(raw)
    else:
        write(_PACKER.pack(obj))  # TypeError for what msgpack cannot pack


def _decode_tensor(code: int, data: bytes) -> torch.Tensor:
    if code != _TENSOR_EXT:
        raise ValueError(f"unknown msgpack extension {code} in checkpoint")
    dtype_name, shape, raw = msgpack.unpackb(data)
    dtype = _DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None or not isinstance(shape, list) or not isinstance(raw, bytes):
        raise ValueError("malformed tensor in checkpoint")
    if not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ValueError("malformed tensor shape in checkpoint")
    itemsize = torch.empty((), dtype=dtype).element_size()
    if len(raw) != math.prod(shape) * itemsize:
        raise ValueError("tensor data length does not match its shape in checkpoint")
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)


def _payload_head(fingerprint: str, state_size: int) -> bytes:
    """The payload's bytes before the state's encoding."""
    head = _PACKER.pack_map_header(4)
    for key, value in (("version", 1), ("fingerprint", fingerprint)):
        head += _PACKER.pack(key) + _PACKER.pack(value)
    return head + _PACKER.pack("state") + _bin_header(state_size)


def state_offset(fingerprint: str, state: EncodableState) -> int:
    """Where ``state``'s encoding (``GlobalState.to_bytes()``, ``encoded_size()`` bytes) starts
    in the checkpoint file ``save`` writes for it: the file can serve it to joiners as it is."""
    return len(MAGIC) + 32 + len(_payload_head(fingerprint, state.encoded_size()))


def _write_payload(
    state: EncodableState,
    fingerprint: str,
    inner_state: dict[str, Any] | None,
    write: Callable[[bytes | memoryview], object],
) -> None:
    """The payload (a msgpack map) to ``write``, piece by piece; the state's bytes straight from
    its tensors (``GlobalState.write_to``)."""
    if sys.byteorder != "little":
        raise RuntimeError("checkpoints assume a little-endian host")
    write(_payload_head(fingerprint, state.encoded_size()))
    state.write_to(write)
    write(_PACKER.pack("inner"))
    _pack(inner_state, write)


def encode(state: GlobalState, fingerprint: str, inner_state: dict[str, Any] | None) -> bytes:
    """The checkpoint file's bytes. The inner state holds only msgpack types and tensors of
    allowed dtypes (TypeError otherwise)."""
    pieces: list[bytes] = []
    _write_payload(state, fingerprint, inner_state, lambda piece: pieces.append(bytes(piece)))
    payload = b"".join(pieces)
    return MAGIC + hashlib.sha256(payload).digest() + payload


def decode(data: bytes, path: Path) -> Checkpoint:
    """Parse and verify a checkpoint file's bytes; ValueError on any corruption."""
    if len(data) < len(MAGIC) + 32 or data[: len(MAGIC)] != MAGIC:
        raise ValueError("not a diloco checkpoint (bad magic or too short)")
    digest, payload = data[len(MAGIC) : len(MAGIC) + 32], data[len(MAGIC) + 32 :]
    if hashlib.sha256(payload).digest() != digest:
        raise ValueError("checksum mismatch (truncated or corrupted file)")
    try:
        fields = msgpack.unpackb(payload, ext_hook=_decode_tensor, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as error:
        raise ValueError(f"undecodable payload: {error}") from error
    if not isinstance(fields, dict) or fields.get("version") != 1:
        raise ValueError("unknown checkpoint version")
    state_bytes, fingerprint, inner = (fields.get(k) for k in ("state", "fingerprint", "inner"))
    if not isinstance(state_bytes, bytes) or not isinstance(fingerprint, str):
        raise ValueError("checkpoint lacks its state or fingerprint")
    if inner is not None and not isinstance(inner, dict):
        raise ValueError("checkpoint inner optimizer state is not a map")
    return Checkpoint(GlobalState.from_bytes(state_bytes), fingerprint, inner, path)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(
    state_dir: str | os.PathLike[str],
    state: EncodableState,
    fingerprint: str,
    inner_state: dict[str, Any] | None = None,
) -> Path:
    """Write ``diloco-<round>.ckpt`` atomically, then delete all but the newest ``KEEP``.
    Returns the path. Raises OSError from the filesystem, TypeError for unencodable state."""
    directory = Path(state_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"diloco-{state.round:010d}.ckpt"
    fd, temporary = tempfile.mkstemp(prefix=".diloco-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as file:
            # Streamed: the digest's place first, the payload piece by piece (hashed as it is
            # written), then the digest; no copy of the state or the optimizer's moments.
            file.write(MAGIC + bytes(32))
            hasher = hashlib.sha256()

            def write(piece: bytes | memoryview) -> None:
                hasher.update(piece)
                file.write(piece)

            _write_payload(state, fingerprint, inner_state, write)
            file.seek(len(MAGIC))
            file.write(hasher.digest())
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    _fsync_dir(directory)
    for old in _checkpoints(directory)[KEEP:]:
        old.unlink(missing_ok=True)
    return path


def _checkpoints(directory: Path) -> list[Path]:
    """Checkpoint files, newest round first."""
    found = [p for p in directory.iterdir() if _NAME.match(p.name)] if directory.is_dir() else []
    return sorted(found, key=lambda p: p.name, reverse=True)


class StateSink(EncodableState, Protocol):
    """Where ``resume`` puts a checkpoint's state: a ``diloco.store.StateStore``."""

    def load_file(self, fd: int, offset: int) -> int: ...

    def assign(self, state: GlobalState) -> None: ...


@dataclass(frozen=True)
class Resumed:
    """A checkpoint ``resume`` loaded: its state went into the sink; ``offset`` and ``length``
    say where the state's encoding lies in ``path``."""

    path: Path
    round: int
    inner_state: dict[str, Any] | None
    offset: int
    length: int


_READ = 4 << 20  # bytes per read while verifying a checkpoint in place


def resume(state_dir: str | os.PathLike[str], fingerprint: str, sink: StateSink) -> Resumed | None:
    """``load_latest`` for a ``DiLoCo`` that keeps its state on disk: the newest checkpoint
    that verifies goes into ``sink`` without its state ever being in memory (checksums over the
    file in 4 MiB reads, then the state copied a slice at a time; only the inner optimizer's
    state is decoded). A file whose head is not the one ``fingerprint`` and the sink's size
    give (another run config or model) is decoded whole, as ``load_latest`` does, for the same
    errors. Skips and raises as ``load_latest``; None when there is no checkpoint."""
    size = sink.encoded_size()
    for path in _checkpoints(Path(state_dir)):
        try:
            found = _resume_in_place(path, fingerprint, sink, size)
            if found is None:
                checkpoint = decode(path.read_bytes(), path)
        except (OSError, ValueError) as error:
            logger.warning("checkpoint %s is unusable, skipping it: %s", path, error)
            continue
        if found is not None:
            return found
        if checkpoint.fingerprint != fingerprint:
            raise ValueError(
                f"checkpoint {path} is of run config {checkpoint.fingerprint!r}, not "
                f"{fingerprint!r}: use another state directory or the matching config"
            )
        sink.assign(checkpoint.state)  # ValueError: another layout
        offset = state_offset(fingerprint, checkpoint.state)
        return Resumed(path, checkpoint.state.round, checkpoint.inner_state, offset, size)
    return None


def _resume_in_place(path: Path, fingerprint: str, sink: StateSink, size: int) -> Resumed | None:
    """Verify ``path`` and load it into ``sink`` reading it a piece at a time; None when its
    head is not ours (``resume`` then decodes it whole). ValueError for a bad file."""
    head = _payload_head(fingerprint, size)
    offset = len(MAGIC) + 32 + len(head)
    with path.open("rb") as file:
        fd = file.fileno()
        total = os.fstat(fd).st_size
        prefix = os.pread(fd, offset, 0)
        if len(prefix) < len(MAGIC) + 32 or prefix[: len(MAGIC)] != MAGIC:
            raise ValueError("not a diloco checkpoint (bad magic or too short)")
        if prefix[len(MAGIC) + 32 :] != head or total < offset + size:
            return None
        # One pass: the file's checksum (of its payload) and the state's own digest.
        payload, state = hashlib.sha256(head), hashlib.sha256()
        state_end = offset + size - 32
        position = offset
        while position < total:
            chunk = os.pread(fd, min(_READ, total - position), position)
            if not chunk:
                raise ValueError("checksum mismatch (truncated or corrupted file)")
            payload.update(chunk)
            if position < state_end:
                state.update(memoryview(chunk)[: state_end - position])
            position += len(chunk)
        if payload.digest() != prefix[len(MAGIC) : len(MAGIC) + 32]:
            raise ValueError("checksum mismatch (truncated or corrupted file)")
        if state.digest() != os.pread(fd, 32, state_end):
            raise ValueError("state digest mismatch: the bytes are corrupt or tampered with")
        key = _PACKER.pack("inner")
        rest = os.pread(fd, total - offset - size, offset + size)
        if rest[: len(key)] != key:
            raise ValueError("checkpoint lacks its inner optimizer state")
        try:
            inner = msgpack.unpackb(
                memoryview(rest)[len(key) :], ext_hook=_decode_tensor, strict_map_key=False
            )
        except (ValueError, TypeError, msgpack.UnpackException) as error:
            raise ValueError(f"undecodable payload: {error}") from error
        del rest
        if inner is not None and not isinstance(inner, dict):
            raise ValueError("checkpoint inner optimizer state is not a map")
        round_ = sink.load_file(fd, offset)
    return Resumed(path, round_, inner, offset, size)


def load_latest(
    state_dir: str | os.PathLike[str], fingerprint: str | None = None
) -> Checkpoint | None:
    """The newest checkpoint that verifies, or None when there is none.

    A file that fails to read or verify is logged at WARNING with its reason and skipped (it is
    left on disk for inspection). Raises ValueError when the newest good checkpoint belongs to a
    different run config than ``fingerprint``: resuming it would silently train something else.
    """
    for path in _checkpoints(Path(state_dir)):
        try:
            checkpoint = decode(path.read_bytes(), path)
        except (OSError, ValueError) as error:
            logger.warning("checkpoint %s is unusable, skipping it: %s", path, error)
            continue
        if fingerprint is not None and checkpoint.fingerprint != fingerprint:
            raise ValueError(
                f"checkpoint {path} is of run config {checkpoint.fingerprint!r}, not "
                f"{fingerprint!r}: use another state directory or the matching config"
            )
        return checkpoint
    return None
