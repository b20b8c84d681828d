"""Sans-IO control messages of the bulk data plane, as ``p2p.wire`` registered message types.

They travel on the libp2p stream of ``PROTOCOL`` (authenticated and encrypted by Noise, which is
why the key shares may ride in them), each as one ``p2p.wire`` frame: a 4-byte length checked
against the expected types' limit before the body is read, then ``[version, type_code, body]``.
Any malformed, unknown or oversized message is a ``RemoteProtocolError``, whose text never
copies the sender's bytes (``p2p.wire`` reports remote values by type and size).

One transfer's conversation (``p2p.bulk.link`` drives it, ``p2p.bulk.negotiate`` decides it)::

    sender                              receiver
    Offer(share, paths, size, meta)  ->
                                     <- Accept(share, mode, port or punch ports) | Reject(reason)
    [Fallback(reason) either way when the chosen data connections cannot be made]
    ... payload on the data connections or the stream ...
                                     <- Outcome(ok, reason)       (one-shot transfers only)

Every field is validated when a message is built, locally or from the wire; a message that fails
its checks raises ``LocalProtocolError`` when we build it and ``RemoteProtocolError`` when a peer
sent it. Codes 30-34 are this module's in the program-wide ``p2p.wire`` registry.
"""

from __future__ import annotations

from p2p.bulk.frames import (
    MAX_META_BYTES,
    MAX_STRIPES,
    SHARE_BYTES,
    TRANSFER_ID_BYTES,
    TransferLayout,
)
from p2p.bulk.negotiate import DataMode, SenderPaths
from p2p.errors import LocalProtocolError, RemoteProtocolError
from p2p.wire import Message, decode, encode, frame, message

# The control stream's libp2p protocol id. Version 2: the control messages became p2p.wire
# messages (version 1 spoke hand-made msgpack lists); a version-1 peer fails at protocol
# negotiation instead of misreading its first message.
PROTOCOL = "/swarmtrain/bulk/2"
# The meta that marks an offer as a channel (``p2p.bulk.channel``), never a one-shot payload.
CHANNEL_META = b"swarmtrain/bulk-channel/1"

MAX_REASON_CHARS = 256
MAX_CONTROL_BYTES = MAX_META_BYTES + 1024
# A reason of MAX_REASON_CHARS characters at 4 UTF-8 bytes each, and the envelope.
_REASON_MESSAGE_BYTES = 4 * MAX_REASON_CHARS + 64


@message(30, max_bytes=MAX_CONTROL_BYTES)
class Offer(Message):
    """The sender's proposal: what it sends, its key share and the data paths it can serve."""

    transfer_id: bytes
    total_bytes: int
    frame_bytes: int
    stripe_count: int
    share: bytes
    direct: bool
    listen_port: int  # the sender's bulk listener port, 0 if it has none
    meta: bytes
    # The sender's hole-punch port per stripe (empty: it offers no punch). Offered when the
    # libp2p connection is direct and the sender has no listener.
    punch_ports: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        TransferLayout(self.total_bytes, self.frame_bytes, self.stripe_count)
        _check_bytes("transfer_id", self.transfer_id, TRANSFER_ID_BYTES, exact=True)
        _check_bytes("share", self.share, SHARE_BYTES, exact=True)
        _check_bytes("meta", self.meta, MAX_META_BYTES)
        _check_port(self.listen_port)
        _check_punch_ports(self.punch_ports)
        if self.punch_ports and len(self.punch_ports) != self.stripe_count:
            raise LocalProtocolError("punch_ports must name one port per stripe")

    @property
    def layout(self) -> TransferLayout:
        return TransferLayout(self.total_bytes, self.frame_bytes, self.stripe_count)

    @property
    def paths(self) -> SenderPaths:
        """The offer as ``p2p.bulk.negotiate`` facts."""
        return SenderPaths(self.direct, self.listen_port, bool(self.punch_ports))


@message(31, max_bytes=256)
class Accept(Message):
    """The receiver's answer: its key share and the data mode it chose."""

    share: bytes
    mode: DataMode
    listen_port: int  # the receiver's bulk listener port with DIAL_RECEIVER, else 0
    # The receiver's hole-punch port per stripe with PUNCH, else empty. (The sender checks the
    # count against its offer: an Accept alone does not know the stripe count.)
    punch_ports: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _check_bytes("share", self.share, SHARE_BYTES, exact=True)
        if not isinstance(self.mode, DataMode):
            raise LocalProtocolError("mode must be a DataMode")
        _check_port(self.listen_port)
        _check_punch_ports(self.punch_ports)
        if (self.mode is DataMode.DIAL_RECEIVER) != (self.listen_port != 0):
            raise LocalProtocolError("listen_port is set exactly when mode is DIAL_RECEIVER")
        if (self.mode is DataMode.PUNCH) != bool(self.punch_ports):
            raise LocalProtocolError("punch_ports are set exactly when mode is PUNCH")


@message(32, max_bytes=_REASON_MESSAGE_BYTES)
class Reject(Message):
    """The receiver refuses the offer, and says why."""

    reason: str

    def __post_init__(self) -> None:
        _check_reason(self.reason)


@message(33, max_bytes=_REASON_MESSAGE_BYTES)
class Fallback(Message):
    """The dialing side could not connect: both switch to ``DataMode.STREAM``."""

    reason: str

    def __post_init__(self) -> None:
        _check_reason(self.reason)


@message(34, max_bytes=_REASON_MESSAGE_BYTES)
class Outcome(Message):
    """The receiver's verdict after the last byte: ``ok`` or why not."""

    ok: bool
    reason: str = ""

    def __post_init__(self) -> None:
        _check_reason(self.reason)


ControlMessage = Offer | Accept | Reject | Fallback | Outcome
CONTROL_TYPES: tuple[type[Message], ...] = (Offer, Accept, Reject, Fallback, Outcome)


def encode_control(msg: ControlMessage) -> bytes:
    """One control message as a ``p2p.wire`` frame (length prefix included)."""
    return frame(encode(msg))


def decode_control(payload: bytes, *expected: type[Message]) -> ControlMessage:
    """Decode one control frame's payload (without its prefix), of one of the ``expected``
    types (default: any control message). Any malformation, an oversized payload or another
    type is a ``RemoteProtocolError``, and nothing else escapes."""
    if len(payload) > MAX_CONTROL_BYTES:
        raise RemoteProtocolError("control message too long")
    return decode(payload, *(expected or CONTROL_TYPES))  # type: ignore[return-value]


def control_limit(*expected: type[Message]) -> int:
    """The largest frame any of the ``expected`` control types (default: all) may take: the
    limit a reader checks the length prefix against before reading the body."""
    return max(t.MAX_BYTES for t in expected or CONTROL_TYPES)


def brief_reason(text: str) -> str:
    """``text`` cut to what a ``Reject``, ``Fallback`` or ``Outcome`` may carry."""
    return text[:200]


def _check_reason(reason: str) -> None:
    if not isinstance(reason, str) or len(reason) > MAX_REASON_CHARS:
        raise LocalProtocolError("reason must be a string of at most 256 characters")


def _check_bytes(name: str, value: object, size: int, *, exact: bool = False) -> None:
    if not isinstance(value, bytes):
        raise LocalProtocolError(f"{name} must be bytes")
    if (len(value) != size) if exact else (len(value) > size):
        raise LocalProtocolError(f"{name} has bad length {len(value)}")


def _check_port(port: object) -> None:
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise LocalProtocolError("port out of range")


def _check_punch_ports(ports: object) -> None:
    if not isinstance(ports, tuple) or len(ports) > MAX_STRIPES:
        raise LocalProtocolError(f"punch_ports must be a tuple of at most {MAX_STRIPES} ports")
    for port in ports:
        _check_port(port)
        if port == 0:
            raise LocalProtocolError("a punch port cannot be 0")
