"""Reachability by dial-back: the decisions, without sockets (sans-IO).

Theory of operation. A peer P asks helper peers H1..Hn (over its existing connection to each) to
dial P's announced addresses over a *fresh* connection from a throwaway host. Only a dial that a
stranger can make proves that P is reachable: py-libp2p 0.8.1's AutoNAT answers over the existing
connection and so always says "reachable" (DESIGN.md).

Rules, all here so they can be tested without a network:

- ``select_dialback_targets`` (helper side): dial only addresses on the IP the helper observes P
  at, so a helper can never be used to send traffic at a third party (the AutoNAT spec's
  anti-amplification rule). For every requested TCP port on another IP (a private listen address),
  also try that port on the observed IP: port-preserving NATs and plain public hosts answer there.
- ``decide_reachability`` (asking side): ``PUBLIC`` once at least ``min_confirmations`` distinct
  helpers completed a dial; ``PRIVATE`` when at least one helper answered and every dial every
  helper made failed; ``UNKNOWN`` when no helper answered (nobody to ask, helpers unreachable or
  refusing). A verdict names the helpers and the addresses that worked, so ``doctor`` can say how
  it decided.

This module imports no trio, libp2p, socket, time or random.
"""

from __future__ import annotations

import enum
import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from p2p.wire import Message, message

DIALBACK_PROTOCOL = "/swarmtrain/dialback/1"
MAX_DIALBACK_ADDRS = 8
MAX_ADDR_CHARS = 200


class Reachability(enum.Enum):
    PUBLIC = "public"
    PRIVATE = "private"
    UNKNOWN = "unknown"


# --------------------------------------------------------------------------- wire


@message(60, max_bytes=4096)
class DialBackRequest(Message):
    """Please dial me at these addresses (multiaddr strings, without ``/p2p/``)."""

    addrs: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(self.addrs) > MAX_DIALBACK_ADDRS:
            raise ValueError(f"at most {MAX_DIALBACK_ADDRS} addresses")
        if any(len(a) > MAX_ADDR_CHARS for a in self.addrs):
            raise ValueError("address too long")


@message(61, max_bytes=8192)
class DialBackResponse(Message):
    """What the helper dialed, what it saw us as, and how each dial went."""

    observed_ip: str
    dialed: tuple[str, ...]
    ok: tuple[bool, ...]
    errors: tuple[str, ...]

    def __post_init__(self) -> None:
        if not len(self.dialed) == len(self.ok) == len(self.errors):
            raise ValueError("dialed, ok and errors must have the same length")
        if len(self.dialed) > 2 * MAX_DIALBACK_ADDRS:
            raise ValueError("too many dial results")


# --------------------------------------------------------------------------- addresses


@dataclass(frozen=True, slots=True)
class TcpAddr:
    ip: str
    port: int

    def multiaddr(self) -> str:
        return f"/ip4/{self.ip}/tcp/{self.port}"


def parse_tcp_addr(addr: str) -> TcpAddr | None:
    """``/ip4/A.B.C.D/tcp/P[/...]`` -> TcpAddr; anything else (relay, ip6, dns, garbage) -> None."""
    parts = addr.split("/")
    if len(parts) < 5 or parts[0] != "" or parts[1] != "ip4" or parts[3] != "tcp":
        return None
    if "p2p-circuit" in parts:
        return None
    try:
        ip = ipaddress.IPv4Address(parts[2])
        port = int(parts[4])
    except ValueError:
        return None
    if not 0 < port < 65536:
        return None
    return TcpAddr(str(ip), port)


def is_dialable_ip(ip: str, *, allow_loopback: bool = False) -> bool:
    """Unspecified, multicast and link-local addresses are never worth dialing back; loopback
    only between peers on one machine (the helper saw the asker on loopback)."""
    try:
        addr = ipaddress.IPv4Address(ip)
    except ValueError:
        return False
    if addr.is_loopback:
        return allow_loopback
    return not (addr.is_unspecified or addr.is_multicast or addr.is_link_local)


def dialback_candidates(
    listen_addrs: Iterable[str], observed_addrs: Iterable[str]
) -> tuple[str, ...]:
    """The addresses a peer asks helpers to dial: its TCP listen and observed addresses, one per
    TCP port, without ``/p2p/`` suffixes, at most ``MAX_DIALBACK_ADDRS``. Listen addresses come
    first (the helper derives port predictions from them).

    Wildcard listen addresses (0.0.0.0) must be expanded to interface addresses by the caller:
    one is dropped here, and with it the only address that names our listen port (an observed
    address carries the source port of an outbound connection, where nothing listens).
    """
    by_port: dict[int, str] = {}
    for addr in (*listen_addrs, *observed_addrs):
        tcp = parse_tcp_addr(addr)
        # Loopback too: the helper dials only the IP it sees us at, so a loopback address is
        # only ever used by a helper on this same machine.
        if tcp is not None and is_dialable_ip(tcp.ip, allow_loopback=True):
            # One per port: a helper dials every port on the IP it sees us at, whatever IP we
            # name, so a second address with the same port (a host with many interfaces) would
            # only take a place a distinct port may need.
            by_port.setdefault(tcp.port, tcp.multiaddr())
    return tuple(by_port.values())[:MAX_DIALBACK_ADDRS]


def select_dialback_targets(
    requested: Sequence[str], observed_ip: str, *, max_targets: int = 4
) -> tuple[str, ...]:
    """Helper side: the addresses to dial for a requester seen at ``observed_ip``.

    Only ``observed_ip`` is ever dialed. A requested address on that IP is dialed as is; a
    requested port on another IP is tried on ``observed_ip`` (a port-preserving NAT maps it there,
    or the requester is public and listens on all interfaces).
    """
    if not is_dialable_ip(observed_ip, allow_loopback=True):
        return ()
    targets: dict[str, None] = {}
    for addr in requested:
        tcp = parse_tcp_addr(addr)
        if tcp is None:
            continue
        targets.setdefault(TcpAddr(observed_ip, tcp.port).multiaddr(), None)
    return tuple(targets)[:max_targets]


# --------------------------------------------------------------------------- decision


@dataclass(frozen=True, slots=True)
class DialOutcome:
    addr: str
    ok: bool
    error: str = ""


@dataclass(frozen=True, slots=True)
class HelperReport:
    """One helper's answer. ``error`` set means the helper did not answer (no outcomes)."""

    helper: str
    outcomes: tuple[DialOutcome, ...] = ()
    observed_ip: str = ""
    error: str = ""


@dataclass(frozen=True, slots=True)
class ReachabilityVerdict:
    status: Reachability
    reason: str
    helpers_asked: tuple[str, ...] = ()
    helpers_answered: tuple[str, ...] = ()
    confirmed_addrs: tuple[str, ...] = ()
    observed_ips: tuple[str, ...] = ()

    def to_json(self) -> dict[str, object]:
        return {
            "status": self.status.value,
            "reason": self.reason,
            "helpers_asked": list(self.helpers_asked),
            "helpers_answered": list(self.helpers_answered),
            "confirmed_addrs": list(self.confirmed_addrs),
            "observed_ips": list(self.observed_ips),
        }


def decide_reachability(
    reports: Sequence[HelperReport], *, min_confirmations: int = 1
) -> ReachabilityVerdict:
    """Turn dial-back reports into a verdict (rules in the module docstring)."""
    if min_confirmations < 1:
        raise ValueError("min_confirmations must be at least 1")
    asked = tuple(dict.fromkeys(r.helper for r in reports))
    answered = tuple(dict.fromkeys(r.helper for r in reports if not r.error))
    confirming = tuple(
        dict.fromkeys(r.helper for r in reports if not r.error and any(o.ok for o in r.outcomes))
    )
    confirmed = tuple(
        dict.fromkeys(o.addr for r in reports if not r.error for o in r.outcomes if o.ok)
    )
    observed = tuple(dict.fromkeys(r.observed_ip for r in reports if r.observed_ip))
    dialed = sum(len(r.outcomes) for r in reports if not r.error)

    def verdict(status: Reachability, reason: str) -> ReachabilityVerdict:
        return ReachabilityVerdict(status, reason, asked, answered, confirmed, observed)

    if not asked:
        return verdict(Reachability.UNKNOWN, "no helper peer to ask for a dial-back")
    if len(confirming) >= min_confirmations:
        return verdict(
            Reachability.PUBLIC,
            f"{len(confirming)} helper(s) dialed us back over a fresh connection at "
            + ", ".join(confirmed),
        )
    if confirming:
        return verdict(
            Reachability.UNKNOWN,
            f"only {len(confirming)} of the {min_confirmations} helpers needed could dial us back",
        )
    if not answered:
        errors = "; ".join(f"{r.helper}: {r.error}" for r in reports)
        return verdict(Reachability.UNKNOWN, f"no helper answered the dial-back request ({errors})")
    if dialed == 0:
        return verdict(
            Reachability.UNKNOWN, "helpers found no address of ours on the IP they see us at"
        )
    return verdict(
        Reachability.PRIVATE,
        f"{len(answered)} helper(s) could not dial any of {dialed} address(es) of ours "
        f"(seen at {', '.join(observed) or 'unknown IP'}): behind NAT or firewall; "
        + _failed_dials(reports),
    )


def _failed_dials(reports: Sequence[HelperReport], *, limit: int = 4) -> str:
    """What the helpers dialed and why each dial failed, bounded: the operator can tell a closed
    port (refused) from a filtered one (no answer) and see whether the port was ours."""
    failed = [o for r in reports if not r.error for o in r.outcomes if not o.ok]
    shown = [f"{_printable(o.addr)}: {_printable(o.error) or 'failed'}" for o in failed[:limit]]
    more = f"; {len(failed) - limit} more" if len(failed) > limit else ""
    return "dialed " + "; ".join(shown) + more


def _printable(text: str, limit: int = 80) -> str:
    # The helper wrote these words: into our log and report they go short and without control
    # characters.
    return "".join(c if c.isprintable() else "?" for c in text[:limit])


def report_from_response(helper: str, response: DialBackResponse) -> HelperReport:
    outcomes = tuple(
        DialOutcome(addr, ok, err)
        for addr, ok, err in zip(response.dialed, response.ok, response.errors, strict=True)
    )
    return HelperReport(helper, outcomes, response.observed_ip)
