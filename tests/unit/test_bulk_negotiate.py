"""The bulk data plane's mode choice, no sockets: what a sender offers, what a receiver chooses,
what the sender accepts as an answer, and where a failure leads."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2p.bulk.negotiate import (
    PREFERENCE,
    DataMode,
    ReceiverPaths,
    SenderPaths,
    check_reply,
    choose_mode,
    offer_paths,
    offered_modes,
    receiver_modes,
    settled_mode,
)
from p2p.errors import RemoteProtocolError

LISTENER = 4001
RELAYED_OFFER = SenderPaths(direct=False)


def test_a_sender_offers_its_listener_only_over_a_direct_connection() -> None:
    assert offer_paths(direct=True, listener_port=LISTENER, remote_ip_known=True) == SenderPaths(
        True, LISTENER, punch=False
    )
    assert offer_paths(direct=False, listener_port=LISTENER, remote_ip_known=True) == SenderPaths(
        False, 0, punch=False
    )


def test_a_sender_offers_a_punch_only_when_direct_without_a_listener_and_with_an_ip() -> None:
    assert offer_paths(direct=True, listener_port=0, remote_ip_known=True).punch
    assert not offer_paths(direct=True, listener_port=0, remote_ip_known=False).punch
    assert not offer_paths(direct=False, listener_port=0, remote_ip_known=True).punch
    assert not offer_paths(direct=True, listener_port=LISTENER, remote_ip_known=True).punch


@pytest.mark.parametrize(
    ("offer", "receiver", "mode"),
    [
        # The receiver's listener wins over everything the sender offers.
        (SenderPaths(True, LISTENER), ReceiverPaths(True, LISTENER + 1), DataMode.DIAL_RECEIVER),
        (SenderPaths(True, 0, punch=True), ReceiverPaths(True, LISTENER), DataMode.DIAL_RECEIVER),
        # No listener here: dial the sender's.
        (SenderPaths(True, LISTENER), ReceiverPaths(True, 0), DataMode.DIAL_SENDER),
        # Neither listens: punch.
        (SenderPaths(True, 0, punch=True), ReceiverPaths(True, 0), DataMode.PUNCH),
        # Nothing direct on offer: the stream.
        (SenderPaths(True, 0), ReceiverPaths(True, 0), DataMode.STREAM),
        # Relayed, as either side sees it: the stream, whatever listeners there are.
        (RELAYED_OFFER, ReceiverPaths(True, LISTENER), DataMode.STREAM),
        (SenderPaths(True, LISTENER), ReceiverPaths(False, LISTENER), DataMode.STREAM),
        # Without the sender's IP the receiver can neither dial nor punch.
        (SenderPaths(True, LISTENER), ReceiverPaths(True, 0, False), DataMode.STREAM),
        (SenderPaths(True, 0, punch=True), ReceiverPaths(True, 0, False), DataMode.STREAM),
        # ... but the sender can still dial its listener.
        (SenderPaths(True, 0), ReceiverPaths(True, LISTENER, False), DataMode.DIAL_RECEIVER),
    ],
)
def test_the_receiver_chooses_by_preference(
    offer: SenderPaths, receiver: ReceiverPaths, mode: DataMode
) -> None:
    assert choose_mode(offer, receiver) is mode


def test_punch_ports_that_would_not_bind_fall_back_to_the_stream() -> None:
    offer, receiver = SenderPaths(True, 0, punch=True), ReceiverPaths(True, 0)
    assert choose_mode(offer, receiver) is DataMode.PUNCH
    assert choose_mode(offer, receiver, failed=(DataMode.PUNCH,)) is DataMode.STREAM


def test_a_failed_mode_moves_the_choice_down_the_list() -> None:
    offer, receiver = SenderPaths(True, LISTENER), ReceiverPaths(True, LISTENER)
    assert choose_mode(offer, receiver, failed=[DataMode.DIAL_RECEIVER]) is DataMode.DIAL_SENDER
    every = [DataMode.DIAL_RECEIVER, DataMode.DIAL_SENDER, DataMode.STREAM]
    assert choose_mode(offer, receiver, failed=every) is DataMode.STREAM  # always possible


def test_a_data_connection_that_fails_after_the_accept_settles_on_the_stream() -> None:
    for mode in DataMode:
        assert settled_mode(mode, connected=True) is mode
        assert settled_mode(mode, connected=False) is DataMode.STREAM


def test_the_sender_refuses_a_mode_it_did_not_offer() -> None:
    with pytest.raises(RemoteProtocolError, match="DIAL_SENDER"):
        check_reply(SenderPaths(True, 0), DataMode.DIAL_SENDER, stripe_count=1, reply_punch_ports=0)
    with pytest.raises(RemoteProtocolError, match="PUNCH"):
        check_reply(
            SenderPaths(True, LISTENER), DataMode.PUNCH, stripe_count=1, reply_punch_ports=1
        )
    with pytest.raises(RemoteProtocolError, match="DIAL_RECEIVER"):
        check_reply(RELAYED_OFFER, DataMode.DIAL_RECEIVER, stripe_count=1, reply_punch_ports=0)
    with pytest.raises(RemoteProtocolError, match="port per stripe"):
        check_reply(
            SenderPaths(True, 0, punch=True), DataMode.PUNCH, stripe_count=3, reply_punch_ports=2
        )
    check_reply(
        SenderPaths(True, 0, punch=True), DataMode.PUNCH, stripe_count=3, reply_punch_ports=3
    )
    check_reply(RELAYED_OFFER, DataMode.STREAM, stripe_count=1, reply_punch_ports=0)


sender_paths = st.builds(SenderPaths, st.booleans(), st.sampled_from([0, LISTENER]), st.booleans())
receiver_paths = st.builds(
    ReceiverPaths, st.booleans(), st.sampled_from([0, LISTENER + 1]), st.booleans()
)


@given(sender_paths, receiver_paths, st.sets(st.sampled_from(list(DataMode))))
def test_every_choice_is_legal_for_both_sides(
    offer: SenderPaths, receiver: ReceiverPaths, failed: set[DataMode]
) -> None:
    """Whatever the facts: the receiver's choice is one the sender accepts (both run the same
    rules), one the receiver can serve, never one that failed unless it is the stream, and the
    best such one."""
    mode = choose_mode(offer, receiver, failed)
    check_reply(offer, mode, stripe_count=2, reply_punch_ports=2 if mode is DataMode.PUNCH else 0)
    assert mode in receiver_modes(receiver)
    assert mode is DataMode.STREAM or mode not in failed
    possible = offered_modes(offer) & receiver_modes(receiver) - failed
    better = PREFERENCE[: PREFERENCE.index(mode)]
    assert not possible.intersection(better)


@given(st.booleans(), st.sampled_from([0, LISTENER]), st.booleans(), receiver_paths)
def test_an_offer_made_by_the_rules_never_yields_an_illegal_reply(
    direct: bool, listener_port: int, ip_known: bool, receiver: ReceiverPaths
) -> None:
    offer = offer_paths(direct=direct, listener_port=listener_port, remote_ip_known=ip_known)
    mode = choose_mode(offer, receiver)
    if not direct:
        assert mode is DataMode.STREAM  # a relayed connection carries the payload itself
    check_reply(offer, mode, stripe_count=1, reply_punch_ports=1 if mode is DataMode.PUNCH else 0)
