"""Sans-IO mode negotiation of the bulk data plane: which data connection a transfer uses.

Nothing here touches a socket, a clock or a thread; ``p2p.bulk.link`` is the trio driver that
asks these functions and carries out their answer.

Theory of operation
-------------------
The sender offers the paths it can serve (``offer_paths``): its bulk listener's port when the
libp2p connection is direct and it runs one, else punch ports when the connection is direct and
it knows the IP to punch toward. The receiver intersects that offer with what it can do itself
and picks the first of ``PREFERENCE`` (``choose_mode``):

1. ``DIAL_RECEIVER``: the receiver has a listener, the sender dials it (the receiver's listener
   wins: it is what the receiver controls, and a listener means its reachability is public).
2. ``DIAL_SENDER``: the sender offered its listener, the receiver dials it.
3. ``PUNCH``: neither listens, both offered punch ports, both connect at once.
4. ``STREAM``: the payload rides the libp2p stream (a relayed connection, or nothing else left).

Failures feed back as facts: a mode the driver could not prepare (punch ports that would not
bind) is passed back in ``failed`` and the choice moves down the list. Once the ``Accept`` is on
the wire the choice is shared, so a data connection that cannot be made (a failed dial, a punch
that timed out, a ``Fallback`` from the peer) ends in ``STREAM`` (``settled_mode``) rather than a
second negotiation. The sender checks the receiver's answer against its own offer with
``check_reply``: a mode it did not offer is a ``RemoteProtocolError``.

Both sides run the same rules on the same facts, so neither can favour itself.
"""

from __future__ import annotations

import enum
from collections.abc import Collection
from dataclasses import dataclass

from p2p.errors import RemoteProtocolError


class DataMode(enum.IntEnum):
    """How a transfer's bytes travel (the value is its code in ``Accept``)."""

    STREAM = 0  # payload rides the libp2p stream itself (relayed, or no usable connection)
    DIAL_RECEIVER = 1  # sender dials the receiver's bulk listener
    DIAL_SENDER = 2  # receiver dials the sender's bulk listener
    PUNCH = 3  # neither listens: both connect at once between announced ports (simultaneous open)


PREFERENCE = (DataMode.DIAL_RECEIVER, DataMode.DIAL_SENDER, DataMode.PUNCH, DataMode.STREAM)


@dataclass(frozen=True, slots=True)
class SenderPaths:
    """The data paths a sender offers (the facts its ``Offer`` carries).

    ``direct``: the libp2p connection is direct (not relayed), as the sender sees it.
    ``listen_port``: the sender's bulk listener port that the receiver may dial, 0 for none.
    ``punch``: the sender bound a punch port per stripe and names them.
    """

    direct: bool
    listen_port: int = 0
    punch: bool = False


@dataclass(frozen=True, slots=True)
class ReceiverPaths:
    """What a receiver can serve: ``direct`` as the receiver sees the connection, its own
    listener's ``listen_port`` (0 for none), and whether it knows the IP the sender is reached
    on (``remote_ip_known``), without which it can neither dial the sender nor punch."""

    direct: bool
    listen_port: int = 0
    remote_ip_known: bool = True


def offer_paths(*, direct: bool, listener_port: int, remote_ip_known: bool) -> SenderPaths:
    """What the sender offers. Its listener only over a direct connection (over a relay the
    receiver could not reach it); punch ports only when direct, without a listener (a receiver
    with none would dial it instead) and with an IP to punch toward. A driver that then fails to
    bind the punch ports offers the same without ``punch``."""
    listen_port = listener_port if direct else 0
    return SenderPaths(direct, listen_port, direct and not listen_port and remote_ip_known)


def offered_modes(offer: SenderPaths) -> frozenset[DataMode]:
    """The modes an offer allows the receiver to choose."""
    modes = {DataMode.STREAM}
    if offer.direct:
        modes.add(DataMode.DIAL_RECEIVER)
        if offer.listen_port:
            modes.add(DataMode.DIAL_SENDER)
        if offer.punch:
            modes.add(DataMode.PUNCH)
    return frozenset(modes)


def receiver_modes(receiver: ReceiverPaths) -> frozenset[DataMode]:
    """The modes a receiver can serve."""
    modes = {DataMode.STREAM}
    if receiver.direct:
        if receiver.listen_port:
            modes.add(DataMode.DIAL_RECEIVER)
        if receiver.remote_ip_known:
            modes.update((DataMode.DIAL_SENDER, DataMode.PUNCH))
    return frozenset(modes)


def choose_mode(
    offer: SenderPaths, receiver: ReceiverPaths, failed: Collection[DataMode] = ()
) -> DataMode:
    """The receiver's choice for ``offer``: the first of ``PREFERENCE`` that the offer allows,
    the receiver can serve and has not ``failed`` to prepare. Always returns a mode (``STREAM``
    needs nothing, so it is always possible)."""
    possible = offered_modes(offer) & receiver_modes(receiver)
    for mode in PREFERENCE:
        if mode in possible and mode not in failed:
            return mode
    return DataMode.STREAM


def check_reply(
    offer: SenderPaths, mode: DataMode, *, stripe_count: int, reply_punch_ports: int
) -> None:
    """The sender's check of the receiver's ``Accept``: the mode must be one ``offer`` allowed,
    and a punch must name one port per stripe. Raises ``RemoteProtocolError``."""
    if mode not in offered_modes(offer):
        raise RemoteProtocolError(f"receiver chose {mode.name}, which we did not offer")
    if mode is DataMode.PUNCH and reply_punch_ports != stripe_count:
        raise RemoteProtocolError("receiver chose PUNCH without a port per stripe")


def settled_mode(chosen: DataMode, *, connected: bool) -> DataMode:
    """The mode a transfer ends up in once the chosen data connections were tried: the chosen
    one if they are up, else ``STREAM`` (both sides learned of the failure from a
    ``Fallback`` or a timeout, and the stream is the path that needs nothing more)."""
    return chosen if connected else DataMode.STREAM
