"""Doctor's plain-words hint for a host seen at another address than it listens on."""

from __future__ import annotations

from swarmtrain.commands.doctor import _address_mismatch_hints


def test_second_public_address_gets_a_hint_naming_both() -> None:
    (hint,) = _address_mismatch_hints(["/ip4/198.51.100.2/tcp/4001"], ["198.51.100.1"])
    assert "listen on 198.51.100.2" in hint and "see us at 198.51.100.1" in hint


def test_nat_wildcard_and_matching_addresses_get_none() -> None:
    assert _address_mismatch_hints(["/ip4/192.168.1.10/tcp/4001"], ["203.0.113.2"]) == []
    assert _address_mismatch_hints(["/ip4/0.0.0.0/tcp/4001"], ["203.0.113.2"]) == []
    assert _address_mismatch_hints(["/ip4/198.51.100.1/tcp/4001"], ["198.51.100.1"]) == []
