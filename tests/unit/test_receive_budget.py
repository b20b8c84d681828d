"""The bulk receive budget: receptions at once and their bytes, per peer and in all."""

from __future__ import annotations

import pytest

from p2p.bulk.transfer import ReceiveBudget, lazy_buffer
from p2p.errors import RemoteProtocolError


def test_a_budget_refuses_past_each_limit_and_frees_on_release() -> None:
    budget = ReceiveBudget(max_bytes=100, max_transfers=3, max_bytes_per_peer=60)
    budget.reserve("a", 60)
    with pytest.raises(RemoteProtocolError, match="busy"):
        budget.reserve("a", 1)  # one transfer per peer
    budget.reserve("b", 40)
    with pytest.raises(RemoteProtocolError):
        budget.reserve("c", 1)  # 100 bytes in all
    budget.release("a", 60)
    with pytest.raises(RemoteProtocolError):
        budget.reserve("c", 61)  # over a peer's bytes
    budget.reserve("c", 10)
    budget.reserve("d", 10)
    with pytest.raises(RemoteProtocolError):
        budget.reserve("e", 1)  # 3 transfers in all
    assert (budget.transfers, budget.bytes, budget.refused) == (3, 60, 4)
    for peer, nbytes in (("b", 40), ("c", 10), ("d", 10)):
        budget.release(peer, nbytes)
    assert (budget.transfers, budget.bytes, budget._peers) == (0, 0, {})


def test_a_lazy_buffer_is_zeroed_and_writable() -> None:
    buffer = lazy_buffer(1 << 20)
    assert len(buffer) == 1 << 20 and bytes(buffer[:4]) == b"\0\0\0\0"
    buffer[10:12] = b"ab"
    assert bytes(buffer[9:13]) == b"\0ab\0"
    assert len(lazy_buffer(0)) == 0
