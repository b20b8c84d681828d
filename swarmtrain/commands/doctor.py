"""``swarmtrain doctor``: what a volunteer with trouble runs.

Reports our peer id, listen and observed addresses, reachability and how it was decided, the relay
slots we hold, our bulk data listener (a public peer opens one), and for each ``--ping`` peer
(found through the DHT) whether we reached it, directly or through a relay, and the round-trip
time. Without ``--join`` it starts a relay in this process on loopback and checks against that,
so the whole stack runs on a machine with no network; the report then says that reachability
from the internet was not judged (a loopback helper dials anyone back). A ``--join`` peer that
cannot be reached still gives a report: the failure, and what to check.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field, replace

import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID

from p2p import (
    HostConfig,
    NodeConfig,
    P2PError,
    PingResult,
    join_addr,
    open_node,
    upnp_status,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DoctorOptions:
    listen: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",)
    join: tuple[str, ...] = ()
    ping: tuple[str, ...] = ()
    linger_s: float = 0.0
    # Bytes sent over the bulk data plane to each pinged peer (0: skip the throughput check).
    bulk_bytes: int = 4 << 20
    upnp: bool = False


@dataclass
class DoctorReport:
    peer_id: str
    listen_addrs: list[str]
    observed_addrs: list[str] = field(default_factory=list)
    reachability: str = "unknown"
    reachability_how: str = ""
    relays: list[str] = field(default_factory=list)
    # "IP:PORT" of our bulk data listener (opened only when public), None without one.
    bulk_listener: str | None = None
    pings: list[PingResult] = field(default_factory=list)
    joined: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    hints: list[str] = field(default_factory=list)
    upnp: dict[str, object] = field(default_factory=dict)
    # No --join: only a loopback relay in this process was asked (``reachability`` says so).
    loopback_only: bool = False

    @property
    def ok(self) -> bool:
        return not self.problems and all(p.ok for p in self.pings)

    def to_json(self) -> dict[str, object]:
        return {
            "peer_id": self.peer_id,
            "listen_addrs": self.listen_addrs,
            "observed_addrs": self.observed_addrs,
            "reachability": self.reachability,
            "reachability_how": self.reachability_how,
            "relays": self.relays,
            "bulk_listener": self.bulk_listener,
            "joined": self.joined,
            "pings": [p.to_json() for p in self.pings],
            "problems": self.problems,
            "hints": self.hints,
            "upnp": self.upnp,
            "loopback_only": self.loopback_only,
        }


def format_report(report: DoctorReport) -> str:
    lines = [
        f"peer id       {report.peer_id}",
        *(f"listening     {a}" for a in report.listen_addrs),
        *(f"observed as   {a}" for a in report.observed_addrs),
        f"reachability  {report.reachability}"
        + (f" ({report.reachability_how})" if report.reachability_how else ""),
        *(f"relay slot    {r}" for r in report.relays),
        f"bulk listener {report.bulk_listener or 'none (bulk transfers dial out)'}",
        *(
            [f"upnp          external ip {report.upnp.get('external_ip') or 'none (no gateway)'}"]
            if report.upnp.get("enabled")
            else []
        ),
        *(f"joined via    {j}" for j in report.joined),
    ]
    for p in report.pings:
        if p.ok:
            how = "direct" if p.direct else "relayed"
            bulk = "" if p.bulk is None else f", bulk {p.bulk.mib_per_s:.0f} MiB/s ({p.bulk.mode})"
            lines.append(f"ping          {p.peer_id}: ok, {how}, {p.rtt_ms:.2f} ms{bulk}")
        else:
            lines.append(f"ping          {p.peer_id}: FAILED: {p.error}")
    lines.extend(f"problem       {text}" for text in report.problems)
    lines.extend(f"hint          {text}" for text in report.hints)
    if not report.ok:
        result = "problems found"
    elif report.loopback_only:
        result = "loopback self-test passed (reachability from the internet not checked)"
    else:
        result = "all checks passed"
    lines.append(f"result        {result}")
    return "\n".join(lines)


def _unreachable_report(
    key_pair: KeyPair, options: DoctorOptions, join: Sequence[str], exc: P2PError
) -> DoctorReport:
    """The report when no ``--join`` peer answered: nothing else could be checked."""
    return DoctorReport(
        peer_id=str(ID.from_pubkey(key_pair.public_key)),
        listen_addrs=list(options.listen),
        reachability="not checked",
        reachability_how="no --join peer could be reached",
        joined=[],
        problems=[f"--join: {exc}"],
        hints=[
            "check the address: the IP or name, the port, and the /p2p/<peer id> exactly as "
            "the coordinator or relay printed it",
            "check that the coordinator or relay is running, and that its port is open to us "
            "(a firewall on either side may drop outbound TCP to it)",
        ],
    )


def _address_mismatch_hints(listen: Sequence[str], observed_ips: Sequence[str]) -> list[str]:
    """A host with several public addresses sends from its first one; helpers dial back only the
    address they see us at, so listening on another one looks private from outside."""
    listen_ips = {a.split("/")[2] for a in listen if a.startswith("/ip4/")}
    specific = {x for x in listen_ips if x != "0.0.0.0"}
    hints = []
    for ip in observed_ips:
        if specific and ip not in specific and not any(_behind_nat(x) for x in specific):
            hints.append(
                f"we listen on {', '.join(sorted(specific))} but peers see us at {ip}: "
                f"outbound traffic leaves from another address; listen on {ip} or 0.0.0.0"
            )
    return hints


_NAT_RANGES = [
    ipaddress.ip_network(n)
    for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "127.0.0.0/8")
]


def _behind_nat(ip: str) -> bool:
    """A LAN, carrier-grade NAT or loopback address: being seen elsewhere is expected."""
    addr = ipaddress.ip_address(ip)
    return any(addr in net for net in _NAT_RANGES)


async def run_doctor(
    key_pair: KeyPair,
    options: DoctorOptions,
    emit: Callable[[DoctorReport], None] | None = None,
) -> DoctorReport:
    """Run the checks; ``emit`` gets the report before lingering (so a caller can print it)."""
    async with AsyncExitStack() as stack:
        join = list(options.join)
        ping = list(options.ping)
        if not join:
            log.info("no --join given: starting a relay in this process on loopback")
            local = await stack.enter_async_context(
                open_node(
                    NodeConfig(
                        HostConfig(create_new_key_pair(), listen_addrs=("/ip4/127.0.0.1/tcp/0",)),
                        role="relay",
                    )
                )
            )
            join = [join_addr(local)]
            ping = ping or [str(local.host.peer_id)]
        try:
            node = await stack.enter_async_context(
                open_node(
                    NodeConfig(
                        HostConfig(key_pair, listen_addrs=options.listen, enable_upnp=options.upnp),
                        bootstrap=tuple(join),
                    )
                )
            )
        except P2PError as exc:
            report = _unreachable_report(key_pair, options, join, exc)
            if emit is not None:
                emit(report)
            return report
        verdict = node.reachability
        report = DoctorReport(
            peer_id=str(node.host.peer_id),
            listen_addrs=[str(a) for a in node.host.addrs()],
            observed_addrs=[str(a) for a in node.observed_addrs()],
            reachability=verdict.status.value,
            reachability_how=verdict.reason,
            relays=[str(a) for a in node.relay_addrs()],
            bulk_listener=(
                None
                if node.bulk_listener is None
                else f"{node.bulk_listener.host}:{node.bulk_listener.port}"
            ),
            joined=join,
            upnp=upnp_status(node.host),
            loopback_only=not options.join,
        )
        if report.loopback_only:
            report.reachability = "not checked"
            report.reachability_how = (
                "no --join: only a relay in this process on loopback was asked, which reaches "
                "anyone; give --join <a relay or coordinator address> to learn whether peers on "
                "the internet can reach us"
            )
        if verdict.status.value == "private":
            if not report.relays:
                report.problems.append(
                    "private and no relay slot: other peers cannot reach us (is the relay up?)"
                )
            if not options.upnp:
                report.hints.append(
                    "behind a NAT: peers reach us through a relay or a hole punch; if your "
                    "router supports UPnP, --upnp may make us directly reachable"
                )
            report.hints.extend(_address_mismatch_hints(options.listen, verdict.observed_ips))
        for text in ping:
            try:
                peer_id = ID.from_base58(text)
            except Exception:
                report.pings.append(PingResult(text, False, None, None, "not a peer id"))
                continue
            result = await node.ping(peer_id)
            if not result.ok:
                log.warning("could not reach %s: %s", text, result.error)
            elif options.bulk_bytes > 0:
                try:
                    result = replace(
                        result, bulk=await node.measure_bulk(peer_id, options.bulk_bytes)
                    )
                except P2PError as exc:
                    result = replace(result, ok=False, error=f"bulk transfer failed: {exc}")
            if not result.ok:  # the JSON's problems say what the text's FAILED line says
                report.problems.append(f"--ping {text}: {result.error}")
            report.pings.append(result)
        if emit is not None:
            emit(report)
        if options.linger_s > 0:
            log.info("staying online for %.0f s so others can reach us", options.linger_s)
            await trio.sleep(options.linger_s)
        return report
