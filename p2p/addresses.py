"""What a user types as a peer's address or id, checked before anything dials: one line that
names the part that is wrong (the IP, the port, the peer id, the transport) instead of the
multiaddr parser's message or a dial that fails later with "no bootstrap peer could be reached".
"""

from __future__ import annotations

import multiaddr
from libp2p.peer.id import ID

# A peer id's bytes are a multihash: identity (0x00, then the length) for keys that fit, such as
# Ed25519's; SHA-256 (0x12, 32 bytes) for larger ones such as RSA's.
_IDENTITY, _SHA256 = 0x00, 0x12
_UNSUPPORTED = {"udp", "quic", "quic-v1", "webtransport", "webrtc", "webrtc-direct", "ws", "wss"}


def peer_id_problem(text: str) -> str | None:
    """Why ``text`` is not a peer id (a truncated copy, a typo), or None."""
    try:
        raw = ID.from_base58(text).to_bytes()
    except Exception:
        return f"{text!r} is not a peer id (base58, like 12D3KooW… or Qm…)"
    whole = (raw[:1] == bytes([_IDENTITY]) and len(raw) >= 2 and raw[1] == len(raw) - 2) or (
        raw[:2] == bytes([_SHA256, 32]) and len(raw) == 34
    )
    if not whole or len(raw) < 34:
        return f"{text!r} is not a peer id (cut short or mistyped? copy it whole)"
    return None


def join_address_problem(text: str) -> str | None:
    """Why ``text`` cannot be joined through (the ``/…/p2p/<peer id>`` address a coordinator or
    relay prints), or None."""
    try:
        address = multiaddr.Multiaddr(text)
    except Exception as exc:
        return _parse_problem(text, str(exc))
    names = [p.name for p in address.protocols()]
    if "p2p" not in names:
        return "it must end in /p2p/<peer id> (copy the whole address the coordinator printed)"
    unsupported = sorted(_UNSUPPORTED.intersection(names))
    if unsupported:
        return f"/{unsupported[0]} addresses are not supported here: use the peer's /tcp/ address"
    return peer_id_problem(address.value_for_protocol("p2p"))


def listen_address_problem(text: str) -> str | None:
    """Why ``text`` is not an address to listen on or announce (``/ip4/IP/tcp/PORT``), or
    None."""
    try:
        multiaddr.Multiaddr(text)
    except Exception as exc:
        return _parse_problem(text, str(exc), suffix="", example="/ip4/0.0.0.0/tcp/4001")
    return None


def _parse_problem(
    text: str,
    message: str,
    suffix: str = "/p2p/<peer id>",
    example: str = "/ip4/203.0.113.7/tcp/4001/p2p/12D3KooW…",
) -> str:
    parts = text.split("/")
    if not text.startswith("/"):
        host, _, port = text.rpartition(":")
        if host and port.isdigit():
            host = host.strip("[]")
            family = "ip6" if ":" in host else "ip4"
            return f"a multiaddr is written /{family}/{host}/tcp/{port}{suffix}, not host:port"
        return f"not a multiaddr (for example {example})"
    for proto, value in zip(parts[1::2], parts[2::2], strict=False):
        if proto in ("ip4", "ip6") and f"'{value}' is not IPv" in message:
            return f"{value} is not an {proto[:2].upper()}v{proto[2]} address"
        if proto in ("tcp", "udp") and not (value.isdigit() and 0 < int(value) < 65536):
            return f"port {value} is not a port (1..65535)"
        if proto == "p2p" and (problem := peer_id_problem(value)) is not None:
            return problem
    return f"not a multiaddr ({message.split(' (string:')[0]})"
