"""``--dashboard-port`` and ``--dashboard-host``, and the listening socket they name.

The socket is bound before the coordinator's trio loop starts (``DashboardOptions.listen``), as
``--metrics-port``'s server is: a busy port is one line naming the flag and exit status 1, not a
traceback from inside the server. It binds 127.0.0.1 unless ``--dashboard-host`` says otherwise:
the page names the run's peers and their addresses' kinds, which is the operator's to publish.
"""

from __future__ import annotations

import argparse
import socket
from dataclasses import dataclass

DEFAULT_HOST = "127.0.0.1"


@dataclass(frozen=True)
class DashboardListener:
    """A bound, listening socket and the page's URL; ``Dashboard`` serves on it."""

    sock: socket.socket
    url: str


@dataclass(frozen=True)
class DashboardOptions:
    port: int  # 0: a free port (the URL is printed)
    host: str = DEFAULT_HOST

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--dashboard-port must be 0-65535, got {self.port}")

    def listen(self) -> DashboardListener:
        """Bind and listen. Raises ValueError naming the flag (busy port, unknown host)."""
        try:
            family, kind, proto, _, address = socket.getaddrinfo(
                self.host, self.port, type=socket.SOCK_STREAM
            )[0]
        except socket.gaierror as exc:
            raise ValueError(f"--dashboard-host {self.host}: {exc.strerror or exc}") from exc
        sock = socket.socket(family, kind, proto)
        try:
            # A restarted coordinator rebinds at once (TIME_WAIT); no SO_REUSEPORT, so a second
            # process on the same port fails here instead of sharing it.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            sock.listen(128)
        except OSError as exc:
            sock.close()
            raise ValueError(
                f"--dashboard-port {self.port} on {self.host}: {exc.strerror or exc}"
            ) from exc
        host, port = sock.getsockname()[:2]
        host = f"[{host}]" if ":" in host else host
        return DashboardListener(sock, f"http://{host}:{port}/")


def add_dashboard_arguments(parser: argparse.ArgumentParser, *, host: bool = True) -> None:
    """``--dashboard-port`` (and ``--dashboard-host`` unless ``host`` is False: ``swarmtrain
    local`` serves on loopback only)."""
    parser.add_argument(
        "--dashboard-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve a live web dashboard of the run at http://HOST:PORT/ and its data at "
        "/api/run.json (0: a free port; the URL is printed) [off]",
    )
    if host:
        parser.add_argument(
            "--dashboard-host",
            default=DEFAULT_HOST,
            metavar="HOST",
            help="address the dashboard binds, e.g. 0.0.0.0 to show it to other machines (it "
            f"names the run's peers) [{DEFAULT_HOST}]",
        )


def options_from(args: argparse.Namespace) -> DashboardOptions | None:
    """The parsed flags; None when the dashboard is off. ValueError for a port out of range."""
    if getattr(args, "dashboard_port", None) is None:
        return None
    return DashboardOptions(args.dashboard_port, getattr(args, "dashboard_host", DEFAULT_HOST))
