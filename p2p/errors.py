"""One error family for everything p2p raises.

Handlers at a service boundary catch ``P2PError`` (or ``Exception``) and keep serving; py-libp2p
#1120 shows what happens when one sibling exception (``StreamReset``) is missed.
"""

from __future__ import annotations


class P2PError(Exception):
    """Base of every error raised by the p2p package."""


class RemoteProtocolError(P2PError):
    """The remote peer broke the protocol: garbage, oversized, truncated or unknown input."""


class StreamEnded(RemoteProtocolError):
    """The stream ended (or was reset) before the bytes we needed: the peer left or died.

    A ``RemoteProtocolError`` so that readers treating any short read as bad input keep doing so;
    callers that must tell a departed peer from a lying one catch this first.
    """


class LocalProtocolError(P2PError):
    """We tried to do something the protocol forbids (a bug on our side)."""


class RemoteError(P2PError):
    """The remote handler failed and said so; ``code`` is a short machine-readable tag."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class PeerUnreachable(P2PError):
    """No direct or relayed connection to the peer could be made. ``refused``: every address
    tried answered with an error (a closed port: the process is gone), none stayed silent."""

    def __init__(self, message: str, *, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


class AddressInUse(P2PError):
    """A listen address's port is held by another process (0.8.1 binds with SO_REUSEPORT, so
    without this check a second service would share the port's connections with the first)."""

    def __init__(self, addr: str) -> None:
        super().__init__(
            f"address already in use: {addr} (another swarmtrain relay or coordinator?)"
        )
        self.addr = addr


class IdentityError(P2PError):
    """The identity key file is missing, malformed or unsafe."""
