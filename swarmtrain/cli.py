"""``swarmtrain``: the command line.

    swarmtrain id       [--identity PATH]
    swarmtrain relay    [--identity PATH] [--listen MULTIADDR ...] [--announce MULTIADDR ...]
    swarmtrain doctor   [--identity PATH] [--listen MULTIADDR ...] [--join MULTIADDR ...]
                        [--ping PEER_ID ...] [--linger SECONDS] [--json]

Progress and problems go to stderr as log lines; results go to stdout. Ctrl+C stops cleanly
(exit status 130). A failure prints one line that names its cause and exits with status 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import trio

from p2p import IdentityError, P2PError, default_identity_path, load_or_create_identity, peer_id_of
from swarmtrain.doctor import DoctorOptions, DoctorReport, format_report, run_doctor
from swarmtrain.relay import RelayOptions, run_relay

log = logging.getLogger("swarmtrain")


def _add_common(parser: argparse.ArgumentParser, *, listen_default: str) -> None:
    parser.add_argument(
        "--identity",
        type=Path,
        default=None,
        help=f"Ed25519 key file, created (mode 0600) if absent [{default_identity_path()}]",
    )
    parser.add_argument(
        "--listen",
        action="append",
        default=None,
        metavar="MULTIADDR",
        help=f"address to listen on, repeatable [{listen_default}]",
    )
    parser.add_argument(
        "--upnp",
        action="store_true",
        help="ask the home router for a UPnP port mapping (adds about 4 s when none answers)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swarmtrain", description="Decentralized peer-to-peer training."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p_id = sub.add_parser("id", help="print the peer id of the identity (creating it if absent)")
    p_id.add_argument("--identity", type=Path, default=None)

    p_relay = sub.add_parser(
        "relay",
        help="run a public helper peer: bootstrap, DHT server, circuit relay, dial-back service",
    )
    _add_common(p_relay, listen_default="/ip4/0.0.0.0/tcp/4001")
    p_relay.add_argument(
        "--announce",
        action="append",
        default=[],
        metavar="MULTIADDR",
        help="address to advertise instead of the listen addresses (public IP, port forward)",
    )

    p_doc = sub.add_parser(
        "doctor", help="check identity, reachability, relays and connectivity to other peers"
    )
    _add_common(p_doc, listen_default="/ip4/0.0.0.0/tcp/0")
    p_doc.add_argument(
        "--join",
        action="append",
        default=[],
        metavar="MULTIADDR",
        help="a relay/bootstrap peer's address (…/p2p/ID); without it, doctor starts a relay "
        "in this process on loopback and checks against that",
    )
    p_doc.add_argument(
        "--ping", action="append", default=[], metavar="PEER_ID", help="peer to find and reach"
    )
    p_doc.add_argument(
        "--linger",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="stay online this long after the report so others can --ping us",
    )
    p_doc.add_argument(
        "--bulk-mib",
        type=float,
        default=4.0,
        metavar="MIB",
        help="send this much over the bulk data plane to each pinged peer (0: skip)",
    )
    p_doc.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
    # py-libp2p logs every failed negotiation by a stranger as an ERROR with a traceback; our own
    # layer reports what matters in plain words.
    logging.getLogger("libp2p").setLevel(logging.DEBUG if verbose else logging.CRITICAL)
    logging.getLogger("multiaddr").setLevel(logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    identity_path = args.identity or default_identity_path()
    try:
        key_pair = load_or_create_identity(identity_path)
    except (IdentityError, OSError) as exc:
        print(f"swarmtrain: identity: {exc}", file=sys.stderr)
        return 1
    if args.command == "id":
        print(peer_id_of(key_pair))
        return 0
    _setup_logging(args.verbose)
    try:
        if args.command == "relay":
            options = RelayOptions(
                listen=tuple(args.listen or ["/ip4/0.0.0.0/tcp/4001"]),
                announce=tuple(args.announce),
                upnp=args.upnp,
            )
            trio.run(run_relay, key_pair, options)
        elif args.command == "doctor":
            doctor = DoctorOptions(
                # Without --join everything happens on loopback; don't open a public port for it.
                listen=tuple(
                    args.listen or ["/ip4/0.0.0.0/tcp/0" if args.join else "/ip4/127.0.0.1/tcp/0"]
                ),
                join=tuple(args.join),
                ping=tuple(args.ping),
                linger_s=args.linger,
                bulk_bytes=int(args.bulk_mib * (1 << 20)),
                upnp=args.upnp,
            )

            def emit(report: DoctorReport) -> None:
                text = json.dumps(report.to_json()) if args.json else format_report(report)
                print(text, flush=True)

            report = trio.run(run_doctor, key_pair, doctor, emit)
            return 0 if report.ok else 1
    except KeyboardInterrupt:
        log.info("stopped")
        return 130
    except P2PError as exc:
        print(f"swarmtrain {args.command}: {exc}", file=sys.stderr)
        if getattr(args, "json", False):
            print(json.dumps({"peer_id": str(peer_id_of(key_pair)), "error": str(exc)}))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
