"""What a user types as a join address or peer id (``p2p.addresses``): one line naming the part
that is wrong, before anything dials."""

from __future__ import annotations

import pytest

from p2p import join_address_problem, peer_id_problem

PEER = "12D3KooWDh93LLbCzSyn7tSqUkf2a6MEFFqVq7WXyyJXC8AFwxaY"


@pytest.mark.parametrize(
    ("address", "problem"),
    [
        (f"/ip4/300.0.0.1/tcp/4001/p2p/{PEER}", "300.0.0.1 is not an IPv4 address"),
        (f"/ip6/zz::1/tcp/4001/p2p/{PEER}", "zz::1 is not an IPv6 address"),
        (f"/ip4/127.0.0.1/tcp/99999/p2p/{PEER}", "port 99999 is not a port (1..65535)"),
        (f"/ip4/127.0.0.1/tcp/4001/p2p/{PEER[:17]}", f"'{PEER[:17]}' is not a peer id (cut"),
        (f"/ip4/127.0.0.1/udp/4001/quic-v1/p2p/{PEER}", "/quic-v1 addresses are not supported"),
        ("/ip4/127.0.0.1/tcp/4001", "it must end in /p2p/<peer id>"),
        ("127.0.0.1:4001", "is written /ip4/127.0.0.1/tcp/4001/p2p/<peer id>, not host:port"),
        ("coordinator", "not a multiaddr"),
    ],
)
def test_a_bad_join_address_is_named_by_its_wrong_part(address: str, problem: str) -> None:
    assert problem in (join_address_problem(address) or "")


def test_good_addresses_and_ids_pass() -> None:
    assert join_address_problem(f"/ip4/127.0.0.1/tcp/4001/p2p/{PEER}") is None
    assert join_address_problem(f"/ip6/::1/tcp/4001/p2p/{PEER}") is None
    rsa = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"  # a SHA-256 multihash id
    assert peer_id_problem(rsa) is None and peer_id_problem(PEER) is None
    for bad in ("notapeer", PEER[:-1], PEER + "x", "0OIl", ""):
        assert peer_id_problem(bad) is not None, bad
