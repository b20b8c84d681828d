"""Typed, versioned, size-limited msgpack messages and the frames that carry them.

A message on the wire is ``msgpack([PROTOCOL_VERSION, type_code, body])`` where ``body`` is the
positional list of the dataclass's fields (positional lists give canonical bytes, which signing
needs). Every message type is a frozen dataclass registered once under a unique code; a duplicate
code fails at import, an unknown code or version is a ``RemoteProtocolError``.

A frame is a 4-byte big-endian length followed by that many bytes. The length is checked against
the reader's limit *before* any body byte is read or buffered, so a peer announcing 4 GiB costs us
four bytes. ``FrameDecoder`` is the sans-IO half (bytes in, frames out); ``read_frame`` /
``write_frame`` drive it over anything with ``read(n)`` / ``write(data)``.

Field schemas are the dataclass annotations, checked on decode: ``int``, ``float``, ``str``,
``bytes``, ``bool``, an ``enum.IntEnum`` (sent as its value), ``X | None``,
``list[X]``/``tuple[X, ...]``, a fixed-length ``tuple[X, Y]``, ``dict[str, X]`` and another
registered message type (sent as its body, without envelope: a DHT value that is a list of
records nests them). Types may add their own invariants in
``__post_init__`` (raising ``ValueError`` or ``LocalProtocolError``), which decode reports as a
``RemoteProtocolError`` too: one function turns every decode failure into that one error. A
rejection names a remote value by its type and size, never by its bytes (issue 15: one 17 KiB
input made a 60,000-character log line).
"""

from __future__ import annotations

import dataclasses
import enum
import struct
import types
import typing
from collections.abc import Callable
from typing import Any, ClassVar, Protocol, TypeVar

import msgpack

from p2p.errors import LocalProtocolError, RemoteProtocolError, StreamEnded

PROTOCOL_VERSION = 1
FRAME_HEADER = struct.Struct(">I")
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024

M = TypeVar("M", bound="Message")
_REGISTRY: dict[int, type[Message]] = {}


class Message:
    """Base of every wire message. Subclasses are frozen dataclasses made with ``@message``."""

    TYPE_CODE: ClassVar[int]
    MAX_BYTES: ClassVar[int] = DEFAULT_MAX_MESSAGE_BYTES
    _FIELDS: ClassVar[tuple[tuple[str, Any], ...]]
    _NESTED: ClassVar[tuple[bool, ...]]  # per field: does its schema hold a message type?

    def to_wire(self) -> list[Any]:
        return [
            _plain(getattr(self, name)) if nested else getattr(self, name)
            for (name, _), nested in zip(self._FIELDS, self._NESTED, strict=True)
        ]

    @classmethod
    def from_wire(cls: type[M], body: Any) -> M:
        if not isinstance(body, list) or len(body) != len(cls._FIELDS):
            raise RemoteProtocolError(f"{cls.__name__}: body must be a list of {len(cls._FIELDS)}")
        values = [
            _check(value, hint, f"{cls.__name__}.{name}")
            for value, (name, hint) in zip(body, cls._FIELDS, strict=True)
        ]
        try:
            return cls(*values)
        except (ValueError, TypeError, LocalProtocolError) as exc:
            raise RemoteProtocolError(f"{cls.__name__}: {exc}") from exc


def message(
    code: int, *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
) -> Callable[[type[M]], type[M]]:
    """Register a frozen dataclass as the wire message ``code`` (unique across the program)."""

    def register(cls: type[M]) -> type[M]:
        if not issubclass(cls, Message):
            raise LocalProtocolError(f"{cls.__name__} must subclass p2p.wire.Message")
        if not dataclasses.is_dataclass(cls):
            cls = dataclasses.dataclass(frozen=True, slots=True)(cls)
        if code in _REGISTRY:
            raise LocalProtocolError(
                f"message code {code} used by {_REGISTRY[code].__name__} and {cls.__name__}"
            )
        hints = typing.get_type_hints(cls)
        cls._FIELDS = tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls))
        cls._NESTED = tuple(_holds_message(hint) for _, hint in cls._FIELDS)
        cls.TYPE_CODE = code
        cls.MAX_BYTES = max_bytes
        _REGISTRY[code] = cls
        return cls

    return register


def registered_types() -> dict[int, type[Message]]:
    return dict(_REGISTRY)


def _holds_message(hint: Any) -> bool:
    if isinstance(hint, type) and issubclass(hint, Message):
        return True
    return any(_holds_message(arg) for arg in typing.get_args(hint))


def _plain(value: Any) -> Any:
    """A field value with every nested message replaced by its body (what msgpack can pack)."""
    if isinstance(value, Message):
        return value.to_wire()
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _check(value: Any, hint: Any, where: str) -> Any:
    """Validate ``value`` against a field annotation; convert msgpack lists to tuples."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check(value, arg, where)
            except RemoteProtocolError as exc:
                errors.append(str(exc))
        raise RemoteProtocolError(f"{where}: no union member matched ({'; '.join(errors)})")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise RemoteProtocolError(f"{where}: expected a list, got {type(value).__name__}")
        args = typing.get_args(hint)
        if origin is tuple and len(args) > 1 and args[-1] is not Ellipsis:  # a fixed shape
            if len(value) != len(args):
                raise RemoteProtocolError(f"{where}: expected {len(args)} items, got {len(value)}")
            return tuple(_check(v, a, f"{where}[]") for v, a in zip(value, args, strict=True))
        item = args[0] if args else Any
        checked = [_check(v, item, f"{where}[]") for v in value]
        return tuple(checked) if origin is tuple else checked
    if origin is dict:
        if not isinstance(value, dict):
            raise RemoteProtocolError(f"{where}: expected a map, got {type(value).__name__}")
        key_hint, value_hint = typing.get_args(hint)
        return {
            _check(k, key_hint, f"{where}.key"): _check(v, value_hint, f"{where}[{k!r}]")
            for k, v in value.items()
        }
    if hint is Any:
        return value
    if isinstance(hint, type) and issubclass(hint, Message):
        return hint.from_wire(value)
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RemoteProtocolError(f"{where}: expected float, got {type(value).__name__}")
        return float(value)
    if isinstance(hint, type) and issubclass(hint, enum.IntEnum):
        if type(value) is not int or value not in hint._value2member_map_:
            raise RemoteProtocolError(f"{where}: not a {hint.__name__} ({_brief(value)})")
        return hint(value)
    if hint is int and isinstance(value, bool):
        raise RemoteProtocolError(f"{where}: expected int, got bool")
    if isinstance(hint, type) and isinstance(value, hint):
        return value
    wanted = getattr(hint, "__name__", hint)
    raise RemoteProtocolError(f"{where}: expected {wanted}, got {type(value).__name__}")


def encode(msg: Message) -> bytes:
    """The bytes of one message (no frame header). Raises LocalProtocolError if over its limit."""
    data = msgpack.packb([PROTOCOL_VERSION, msg.TYPE_CODE, msg.to_wire()], use_bin_type=True)
    if len(data) > msg.MAX_BYTES:
        raise LocalProtocolError(f"{type(msg).__name__} is {len(data)} bytes > {msg.MAX_BYTES}")
    return data


def decode(data: bytes, *expected: type[M]) -> M:
    """Parse one message; with ``expected`` given, any other type is a protocol error.

    Raises ``RemoteProtocolError`` for every malformed input; no other exception escapes.
    With ``expected`` given, a value over their largest limit is refused before it is parsed.
    """
    if expected and len(data) > max(t.MAX_BYTES for t in expected):
        raise RemoteProtocolError(f"message of {len(data)} bytes is over its limit")
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises a zoo of types for garbage
        # Not ``exc`` itself: msgpack's ExtraData carries the decoded object, the sender's bytes.
        raise RemoteProtocolError(f"undecodable message ({type(exc).__name__})") from None
    if not isinstance(obj, list) or len(obj) != 3:
        raise RemoteProtocolError("message must be [version, type_code, body]")
    version, code, body = obj
    if version != PROTOCOL_VERSION:
        raise RemoteProtocolError(f"unsupported protocol version {_brief(version)}")
    cls = _REGISTRY.get(code) if isinstance(code, int) and not isinstance(code, bool) else None
    if cls is None:
        raise RemoteProtocolError(f"unknown message type {_brief(code)}")
    if expected and cls not in expected:
        names = ", ".join(t.__name__ for t in expected)
        raise RemoteProtocolError(f"unexpected message {cls.__name__}, wanted {names}")
    if len(data) > cls.MAX_BYTES:
        raise RemoteProtocolError(f"{cls.__name__} is {len(data)} bytes > {cls.MAX_BYTES}")
    return cls.from_wire(body)  # type: ignore[return-value]


def _brief(value: object) -> str:
    """A remote value for an error message without echoing it: a small int as itself, anything
    else as its type and length."""
    if type(value) is int and -(10**6) < value < 10**6:
        return str(value)
    size = len(value) if isinstance(value, str | bytes | list | dict) else None
    return type(value).__name__ + ("" if size is None else f" of length {size}")


def frame(payload: bytes) -> bytes:
    return FRAME_HEADER.pack(len(payload)) + payload


class FrameDecoder:
    """Sans-IO frame splitter: ``receive_data`` bytes in, ``next_frame`` frames out.

    ``next_frame`` returns a frame, or None when more data is needed; it raises
    ``RemoteProtocolError`` as soon as a header announces more than ``max_frame_bytes``.
    """

    def __init__(self, max_frame_bytes: int) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._buffer = bytearray()
        self._eof = False

    def receive_data(self, data: bytes) -> None:
        if self._eof:
            raise LocalProtocolError("data after end of stream")
        if not data:
            self._eof = True
            return
        self._buffer += data

    def next_frame(self) -> bytes | None:
        if len(self._buffer) < FRAME_HEADER.size:
            if self._eof and self._buffer:
                raise RemoteProtocolError("stream ended inside a frame header")
            return None
        (length,) = FRAME_HEADER.unpack_from(self._buffer)
        if length > self.max_frame_bytes:
            raise RemoteProtocolError(
                f"frame of {length} bytes exceeds limit {self.max_frame_bytes}"
            )
        end = FRAME_HEADER.size + length
        if len(self._buffer) < end:
            if self._eof:
                raise RemoteProtocolError(f"stream ended {end - len(self._buffer)} bytes short")
            return None
        payload = bytes(self._buffer[FRAME_HEADER.size : end])
        del self._buffer[:end]
        return payload


class ByteStream(Protocol):
    async def read(self, n: int | None = None) -> bytes: ...
    async def write(self, data: bytes) -> None: ...


async def read_exactly(stream: ByteStream, n: int) -> bytes:
    """Read exactly ``n`` bytes; a stream that ends early is a RemoteProtocolError."""
    parts: list[bytes] = []
    remaining = n
    while remaining:
        try:
            chunk = await stream.read(remaining)
        except Exception as exc:
            if _is_eof(exc):
                chunk = b""
            elif _broken(exc):
                raise StreamEnded(f"stream broke {remaining} of {n} bytes short: {exc}") from exc
            else:
                raise
        if not chunk:
            raise StreamEnded(f"stream ended {remaining} of {n} bytes short")
        parts.append(chunk)
        remaining -= len(chunk)
    return b"".join(parts)


def _is_eof(exc: BaseException) -> bool:
    # libp2p's NetStream.read raises StreamEOF at end of stream instead of returning b"".
    return type(exc).__name__ in {"StreamEOF", "EOFError", "IncompleteReadError"}


_BROKEN_NAMES = {"BrokenResourceError", "ClosedResourceError"}  # trio's


def _broken(exc: BaseException) -> bool:
    # A reset, closed or broken transport under the stream (libp2p raises its own families, not
    # ours): the peer left or died, which callers must be able to catch as a P2PError. Matched by
    # module and name so this module imports neither libp2p nor trio.
    return isinstance(exc, OSError) or any(
        c.__module__.split(".")[0] == "libp2p" or c.__name__ in _BROKEN_NAMES
        for c in type(exc).__mro__
    )


async def read_frame(stream: ByteStream, max_frame_bytes: int) -> bytes:
    """Read one frame; the length is checked against ``max_frame_bytes`` before the body."""
    (length,) = FRAME_HEADER.unpack(await read_exactly(stream, FRAME_HEADER.size))
    if length > max_frame_bytes:
        raise RemoteProtocolError(f"frame of {length} bytes exceeds limit {max_frame_bytes}")
    return await read_exactly(stream, length) if length else b""


async def read_frame_or_end(stream: ByteStream, max_frame_bytes: int) -> bytes | None:
    """``read_frame``, or None when the stream ends cleanly before the frame's first byte (the
    writer closed its side between frames); an end inside a frame is ``StreamEnded``."""
    try:
        first = await stream.read(FRAME_HEADER.size)
    except Exception as exc:
        if _is_eof(exc):
            return None
        if _broken(exc):
            raise StreamEnded(f"stream broke before a frame: {exc}") from exc
        raise
    if not first:
        return None
    if len(first) < FRAME_HEADER.size:
        first += await read_exactly(stream, FRAME_HEADER.size - len(first))
    (length,) = FRAME_HEADER.unpack(first)
    if length > max_frame_bytes:
        raise RemoteProtocolError(f"frame of {length} bytes exceeds limit {max_frame_bytes}")
    return await read_exactly(stream, length) if length else b""


async def write_frame(stream: ByteStream, payload: bytes) -> None:
    """Write one frame; a stream that broke under us is ``StreamEnded``."""
    try:
        await stream.write(frame(payload))
    except Exception as exc:
        if _broken(exc):
            raise StreamEnded(f"stream broke while writing: {exc}") from exc
        raise


async def send_message(stream: ByteStream, msg: Message) -> None:
    await write_frame(stream, encode(msg))


async def receive_message(stream: ByteStream, *expected: type[M]) -> M:
    """Read and decode one message of one of the ``expected`` types (their largest limit)."""
    limit = (
        max(t.MAX_BYTES for t in expected)
        if expected
        else max(t.MAX_BYTES for t in _REGISTRY.values())
    )
    return decode(await read_frame(stream, limit), *expected)
