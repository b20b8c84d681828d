"""Dial-back reachability decisions, without sockets."""

from __future__ import annotations

import ast
import contextlib
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2p.errors import RemoteProtocolError
from p2p.nat.dialback import describe_dial_error
from p2p.nat.reachability import (
    MAX_DIALBACK_ADDRS,
    DialBackRequest,
    DialBackResponse,
    DialOutcome,
    HelperReport,
    Reachability,
    decide_reachability,
    dialback_candidates,
    parse_tcp_addr,
    report_from_response,
    select_dialback_targets,
)
from p2p.wire import decode, encode

OK = DialOutcome("/ip4/198.51.100.3/tcp/4001", True)
FAIL = DialOutcome("/ip4/203.0.113.2/tcp/4001", False, "timeout")


def test_no_helpers_is_unknown() -> None:
    verdict = decide_reachability([])
    assert verdict.status is Reachability.UNKNOWN
    assert "no helper" in verdict.reason


def test_one_successful_dial_is_public() -> None:
    verdict = decide_reachability([HelperReport("relay", (FAIL, OK), "198.51.100.3")])
    assert verdict.status is Reachability.PUBLIC
    assert verdict.confirmed_addrs == (OK.addr,)
    assert verdict.helpers_answered == ("relay",)


def test_all_dials_failed_is_private() -> None:
    verdict = decide_reachability([HelperReport("relay", (FAIL,), "203.0.113.2")])
    assert verdict.status is Reachability.PRIVATE
    assert "203.0.113.2" in verdict.reason


def test_helper_errors_only_is_unknown() -> None:
    verdict = decide_reachability([HelperReport("relay", error="timed out")])
    assert verdict.status is Reachability.UNKNOWN
    assert "timed out" in verdict.reason


def test_nothing_dialed_is_unknown_not_private() -> None:
    verdict = decide_reachability([HelperReport("relay", (), "203.0.113.2")])
    assert verdict.status is Reachability.UNKNOWN


def test_public_needs_enough_distinct_helpers() -> None:
    reports = [HelperReport("h1", (OK,)), HelperReport("h1", (OK,)), HelperReport("h2", (FAIL,))]
    assert decide_reachability(reports, min_confirmations=2).status is Reachability.UNKNOWN
    reports.append(HelperReport("h3", (OK,)))
    assert decide_reachability(reports, min_confirmations=2).status is Reachability.PUBLIC


def test_errored_helper_does_not_count_as_answer() -> None:
    reports = [HelperReport("h1", error="refused"), HelperReport("h2", (FAIL,))]
    verdict = decide_reachability(reports)
    assert verdict.status is Reachability.PRIVATE
    assert verdict.helpers_asked == ("h1", "h2")
    assert verdict.helpers_answered == ("h2",)


def test_min_confirmations_validated() -> None:
    with pytest.raises(ValueError):
        decide_reachability([], min_confirmations=0)


@given(
    st.lists(
        st.builds(
            HelperReport,
            helper=st.sampled_from(["h1", "h2", "h3"]),
            outcomes=st.lists(
                st.builds(
                    DialOutcome, addr=st.sampled_from(["/ip4/1.1.1.1/tcp/1", "x"]), ok=st.booleans()
                ),
                max_size=3,
            ).map(tuple),
            error=st.sampled_from(["", "", "timeout"]),
        ),
        max_size=6,
    )
)
def test_verdict_invariants(reports: list[HelperReport]) -> None:
    verdict = decide_reachability(reports)
    any_ok = any(o.ok for r in reports if not r.error for o in r.outcomes)
    assert (verdict.status is Reachability.PUBLIC) == any_ok
    if verdict.status is Reachability.PRIVATE:
        assert verdict.helpers_answered and not verdict.confirmed_addrs
    assert set(verdict.helpers_answered) <= set(verdict.helpers_asked)
    assert verdict.to_json()["status"] == verdict.status.value


# --------------------------------------------------------------------------- addresses


def test_parse_tcp_addr() -> None:
    assert parse_tcp_addr("/ip4/1.2.3.4/tcp/5/p2p/Qm").multiaddr() == "/ip4/1.2.3.4/tcp/5"
    for bad in [
        "",
        "/ip6/::1/tcp/1",
        "/ip4/1.2.3/tcp/1",
        "/ip4/1.2.3.4/udp/1",
        "/ip4/1.2.3.4/tcp/0",
        "/ip4/1.2.3.4/tcp/x",
        "/ip4/1.2.3.4/tcp/1/p2p-circuit",
    ]:
        assert parse_tcp_addr(bad) is None, bad


def test_candidates_drop_undialable_and_dedupe() -> None:
    got = dialback_candidates(
        ["/ip4/0.0.0.0/tcp/1", "/ip4/127.0.0.1/tcp/2", "/ip4/192.168.1.10/tcp/4001/p2p/Qm"],
        ["/ip4/203.0.113.2/tcp/5555", "/ip4/192.168.1.10/tcp/4001"],
    )
    assert got == (
        "/ip4/127.0.0.1/tcp/2",
        "/ip4/192.168.1.10/tcp/4001",
        "/ip4/203.0.113.2/tcp/5555",
    )


def test_loopback_is_dialed_only_for_a_requester_seen_on_loopback() -> None:
    requested = ["/ip4/127.0.0.1/tcp/2", "/ip4/192.168.1.10/tcp/4001"]
    assert select_dialback_targets(requested, "127.0.0.1") == (
        "/ip4/127.0.0.1/tcp/2",
        "/ip4/127.0.0.1/tcp/4001",
    )
    # Seen on a public IP: the loopback port is only ever tried on that IP, never on loopback.
    assert all(
        t.startswith("/ip4/198.51.100.3/")
        for t in select_dialback_targets(requested, "198.51.100.3")
    )


def test_candidates_capped() -> None:
    many = [f"/ip4/10.0.0.1/tcp/{p}" for p in range(1, 50)]
    assert len(dialback_candidates(many, [])) == MAX_DIALBACK_ADDRS


def test_targets_only_on_observed_ip() -> None:
    got = select_dialback_targets(
        ["/ip4/192.168.1.10/tcp/4001", "/ip4/203.0.113.2/tcp/5555", "/ip4/8.8.8.8/tcp/4001"],
        "203.0.113.2",
    )
    assert got == ("/ip4/203.0.113.2/tcp/4001", "/ip4/203.0.113.2/tcp/5555")


def test_no_targets_for_undialable_observed_ip() -> None:
    assert select_dialback_targets(["/ip4/1.2.3.4/tcp/1"], "0.0.0.0") == ()
    assert select_dialback_targets(["/ip4/1.2.3.4/tcp/1"], "not an ip") == ()


@given(st.lists(st.text(max_size=40), max_size=20), st.ip_addresses(v=4).map(str))
def test_targets_never_leave_observed_ip(requested: list[str], ip: str) -> None:
    for target in select_dialback_targets(requested, ip):
        tcp = parse_tcp_addr(target)
        assert tcp is not None and tcp.ip == ip


# --------------------------------------------------------------------------- wire


def test_messages_round_trip() -> None:
    req = DialBackRequest(("/ip4/1.2.3.4/tcp/1",))
    assert decode(encode(req), DialBackRequest) == req
    resp = DialBackResponse("1.2.3.4", ("/ip4/1.2.3.4/tcp/1",), (True,), ("",))
    assert decode(encode(resp), DialBackResponse) == resp
    report = report_from_response("h", resp)
    assert report.outcomes == (DialOutcome("/ip4/1.2.3.4/tcp/1", True, ""),)


def test_messages_reject_bad_shapes() -> None:
    with pytest.raises(ValueError):
        DialBackRequest(tuple(f"/ip4/1.1.1.1/tcp/{i}" for i in range(1, 20)))
    with pytest.raises(ValueError):
        DialBackResponse("1.2.3.4", ("a",), (True, False), ("",))


@given(st.binary(max_size=200))
def test_garbage_is_a_remote_protocol_error(data: bytes) -> None:
    with contextlib.suppress(RemoteProtocolError):
        decode(data, DialBackRequest, DialBackResponse)


def test_decision_module_is_sans_io() -> None:
    source = Path(__file__).parents[2] / "p2p" / "nat" / "reachability.py"
    imported: set[str] = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Import):
            imported.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & {"trio", "libp2p", "socket", "time", "random", "multiaddr"}


# --------------------------------------------------------------------------- explanations


def test_candidates_name_each_port_once() -> None:
    # A wildcard listener expanded over many interfaces: one port, and a helper dials every
    # port on the IP it sees us at, so the other addresses would only crowd out distinct ports.
    interfaces = [f"/ip4/10.0.{i}.1/tcp/4001" for i in range(20)]
    got = dialback_candidates([*interfaces, "/ip4/127.0.0.1/tcp/4001"], ["/ip4/1.2.3.4/tcp/5"])
    assert got == ("/ip4/10.0.0.1/tcp/4001", "/ip4/1.2.3.4/tcp/5")


def test_private_verdict_says_what_was_dialed_and_why_in_printable_words() -> None:
    refused = DialOutcome("/ip4/198.51.100.3/tcp/4001", False, "ConnectionRefusedError: refused")
    hostile = DialOutcome("/ip4/198.51.100.3/tcp/5\n", False, "x\x1b[2J" + "y" * 500)
    verdict = decide_reachability([HelperReport("h", (refused, hostile), "198.51.100.3")])
    assert verdict.status is Reachability.PRIVATE
    assert "/ip4/198.51.100.3/tcp/4001: ConnectionRefusedError: refused" in verdict.reason
    assert verdict.reason.isprintable() and len(verdict.reason) < 500, verdict.reason


def test_dial_errors_name_the_root_cause_without_quoting_what_answered() -> None:

    refused = ConnectionRefusedError(111, "Connect call failed")
    try:
        try:
            raise OSError("all attempts failed") from ExceptionGroup("all", [refused])
        except OSError as exc:
            raise RuntimeError("fail to open connection to peer") from exc
    except RuntimeError as exc:
        error = describe_dial_error(exc)
    assert error == "ConnectionRefusedError: Connection refused (in RuntimeError)"
    try:
        raise RuntimeError("upgrade failed") from ValueError("b'HTTP/1.1 400 Bad Request'")
    except RuntimeError as exc:
        error = describe_dial_error(exc)
    assert error == "ValueError (in RuntimeError)"
