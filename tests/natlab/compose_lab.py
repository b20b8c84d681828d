"""Run a ``docker-compose.yml`` without Docker: every service in its own network namespace.

No Docker engine runs on the machines that test this project, so ``test_compose.py`` takes the
compose file and the Dockerfile at face value and rebuilds what ``docker compose up`` would:

- each network is a Linux bridge (all bridges live in one extra namespace, ``<prefix>net``, the
  stand-in for the Docker host), each service a namespace with one veth per network, named
  ``eth0``, ``eth1``... in the order the service lists them, at the service's fixed address;
  ``network_mode: none`` is a namespace with only loopback. As in Docker, nothing routes between
  two networks unless a service does (the NAT routers);
- ``sysctls`` are set in the service's namespace, as Docker sets them in the container's;
- the process is the image's ENTRYPOINT (or the service's ``entrypoint``) followed by the
  service's ``command``, run as is: ``$$`` becomes ``$`` (Compose's escape) and nothing else is
  rewritten. What differs outside the image is supplied around the command, not by editing it:
  ``PATH`` starts with a directory of links named like the Dockerfile's ``COPY ... /usr/local/
  bin/NAME`` targets (to the repository's files) and with this interpreter's ``bin`` (where
  ``swarmtrain`` and ``python`` are installed); the working directory is a per-service directory
  standing for ``working_dir``, in which every volume is a link to a host directory (named
  volumes) or to the repository file (bind mounts). That is why the compose file must mount every
  volume under ``working_dir`` and use relative paths: ``ComposeError`` otherwise;
- ``environment`` and the Dockerfile's ``ENV`` are the process's environment, plus ``PATH`` and
  a ``HOME`` inside the work directory;
- start order follows ``depends_on``: ``service_started``, ``service_healthy`` (the service's own
  ``healthcheck`` command, run in its namespace and working directory, at its interval, until it
  passes or fails ``retries`` times in a row) and ``service_completed_successfully``;
- stopping sends each service's ``stop_signal`` (SIGTERM by default), waits 10 s as Docker does,
  then kills; ``down`` kills whatever else lives in our namespaces, by PID, and deletes them.

Not mirrored (documented in docs/compose.md): ``:ro`` (the link is writable), ``cap_add`` (we are
root), ``init``, Docker's own gateway on each network (``<subnet>.1``: nothing here needs the
host or the internet, and the services that route choose their own default route), driver
options, DNS names (the file uses addresses).
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import yaml

STOP_GRACE_S = 10.0  # docker stop's default before SIGKILL
IP_TIMEOUT_S = 10.0


class ComposeError(ValueError):
    """The compose file uses something this lab cannot mirror, or a service failed to start."""


# -- the compose file -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Healthcheck:
    argv: list[str]
    interval_s: float = 30.0
    timeout_s: float = 30.0
    retries: int = 3
    start_period_s: float = 0.0


@dataclass(frozen=True)
class Mount:
    kind: str  # "volume" or "bind"
    source: str  # volume name, or a host path (bind), absolute
    target: str  # path in the container


@dataclass(frozen=True)
class Service:
    name: str
    command: list[str] | None
    entrypoint: list[str] | None
    environment: dict[str, str]
    networks: dict[str, str]  # network name -> fixed IPv4 address, in the order listed
    isolated: bool  # network_mode: none
    mounts: list[Mount]
    working_dir: str | None
    depends_on: dict[str, str]  # service -> condition
    healthcheck: Healthcheck | None
    sysctls: dict[str, str]
    stop_signal: signal.Signals


@dataclass(frozen=True)
class Compose:
    path: Path
    services: dict[str, Service]
    networks: dict[str, ipaddress.IPv4Network]
    volumes: tuple[str, ...]

    def start_order(self) -> list[str]:
        """Services in an order where each comes after what it depends on (file order kept)."""
        order: list[str] = []
        visiting: set[str] = set()

        def visit(name: str) -> None:
            if name in order:
                return
            if name in visiting:
                raise ComposeError(f"depends_on cycle through {name}")
            visiting.add(name)
            for dep in self.services[name].depends_on:
                visit(dep)
            visiting.discard(name)
            order.append(name)

        for name in self.services:
            visit(name)
        return order


_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|us|ns|h|m|s)")
_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def _duration(value: Any, key: str) -> float:
    """Compose durations: ``1s``, ``1m30s``, ``500ms`` (a bare number is seconds here)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    text = str(value).strip()
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ComposeError(f"{key}: not a duration: {value!r}")
    return sum(float(n) * _UNITS[u] for n, u in parts)


def _unescape(text: str, key: str) -> str:
    """Compose interpolation: ``$$`` is a literal ``$``. Variables (``$X``, ``${X}``) depend on
    the caller's environment; the file must not need any, so they are refused."""
    out: list[str] = []
    i = 0
    while i < len(text):
        if text[i] == "$":
            if text[i + 1 : i + 2] == "$":
                out.append("$")
                i += 2
                continue
            raise ComposeError(f"{key}: variable interpolation is not supported: {text!r}")
        out.append(text[i])
        i += 1
    return "".join(out)


def _argv(value: Any, key: str) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return shlex.split(_unescape(value, key))  # Compose splits a string command like a shell
    if isinstance(value, list):
        return [_unescape(str(v), key) for v in value]
    raise ComposeError(f"{key}: expected a string or a list, got {value!r}")


def _mapping(value: Any, key: str) -> dict[str, str]:
    """``{K: V}`` or ``["K=V"]`` (environment, sysctls)."""
    if value is None:
        return {}
    if isinstance(value, dict):
        return {str(k): _unescape(str(v), key) for k, v in value.items()}
    if isinstance(value, list):
        pairs = [str(item).split("=", 1) for item in value]
        if any(len(p) != 2 for p in pairs):
            raise ComposeError(f"{key}: expected KEY=VALUE items, got {value!r}")
        return {k: _unescape(v, key) for k, v in pairs}
    raise ComposeError(f"{key}: expected a mapping or a list, got {value!r}")


def _healthcheck(value: Any, key: str) -> Healthcheck | None:
    if value is None or value.get("disable"):
        return None
    test = value.get("test")
    if isinstance(test, str):
        argv = ["sh", "-c", _unescape(test, key)]
    elif isinstance(test, list) and test and test[0] == "CMD":
        argv = [_unescape(str(v), key) for v in test[1:]]
    elif isinstance(test, list) and len(test) == 2 and test[0] == "CMD-SHELL":
        argv = ["sh", "-c", _unescape(str(test[1]), key)]
    elif isinstance(test, list) and test == ["NONE"]:
        return None
    else:
        raise ComposeError(f"{key}.test: expected CMD or CMD-SHELL, got {test!r}")
    return Healthcheck(
        argv,
        interval_s=_duration(value.get("interval", "30s"), f"{key}.interval"),
        timeout_s=_duration(value.get("timeout", "30s"), f"{key}.timeout"),
        retries=int(value.get("retries", 3)),
        start_period_s=_duration(value.get("start_period", "0s"), f"{key}.start_period"),
    )


def _mounts(value: Any, key: str, base: Path, volumes: tuple[str, ...]) -> list[Mount]:
    mounts: list[Mount] = []
    for item in value or []:
        if isinstance(item, str):
            source, target, *_mode = item.split(":")
            kind = "bind" if source.startswith((".", "/", "~")) else "volume"
        elif isinstance(item, dict):
            kind, source, target = item.get("type", "volume"), item["source"], item["target"]
        else:
            raise ComposeError(f"{key}: cannot read volume {item!r}")
        if kind == "bind":
            source = str((base / os.path.expanduser(source)).resolve())
        elif kind == "volume":
            if source not in volumes:
                raise ComposeError(f"{key}: volume {source!r} is not declared under volumes:")
        else:
            raise ComposeError(f"{key}: volume type {kind!r} is not supported")
        mounts.append(Mount(kind, source, target))
    return mounts


def _networks(value: Any, key: str) -> dict[str, str]:
    if isinstance(value, list):
        raise ComposeError(f"{key}: give every service a fixed ipv4_address on each network")
    networks: dict[str, str] = {}
    for name, body in (value or {}).items():
        address = (body or {}).get("ipv4_address")
        if not address:
            raise ComposeError(f"{key}.{name}: no ipv4_address (the lab needs fixed addresses)")
        networks[str(name)] = str(address)
    return networks


def _depends_on(value: Any) -> dict[str, str]:
    if isinstance(value, list):
        return {str(name): "service_started" for name in value}
    return {
        str(name): (body or {}).get("condition", "service_started")
        for name, body in (value or {}).items()
    }


def load_compose(path: Path) -> Compose:
    """Parse the file (YAML anchors and ``<<`` merges as PyYAML reads them) into the parts this
    lab mirrors. Raises ComposeError naming what it cannot mirror."""
    data = yaml.safe_load(path.read_text())
    volumes = tuple(str(v) for v in (data.get("volumes") or {}))
    networks: dict[str, ipaddress.IPv4Network] = {}
    for name, body in (data.get("networks") or {}).items():
        try:
            subnet = body["ipam"]["config"][0]["subnet"]
        except (KeyError, IndexError, TypeError):
            raise ComposeError(f"networks.{name}: no ipam subnet") from None
        networks[str(name)] = ipaddress.IPv4Network(subnet)
    services: dict[str, Service] = {}
    for name, body in (data.get("services") or {}).items():
        key = f"services.{name}"
        mode = body.get("network_mode")
        if mode not in (None, "none"):
            raise ComposeError(f"{key}.network_mode: {mode!r} is not supported")
        service = Service(
            name=str(name),
            command=_argv(body.get("command"), f"{key}.command"),
            entrypoint=_argv(body.get("entrypoint"), f"{key}.entrypoint"),
            environment=_mapping(body.get("environment"), f"{key}.environment"),
            networks=_networks(body.get("networks"), f"{key}.networks"),
            isolated=mode == "none",
            mounts=_mounts(body.get("volumes"), f"{key}.volumes", path.parent, volumes),
            working_dir=body.get("working_dir"),
            depends_on=_depends_on(body.get("depends_on")),
            healthcheck=_healthcheck(body.get("healthcheck"), f"{key}.healthcheck"),
            sysctls=_mapping(body.get("sysctls"), f"{key}.sysctls"),
            stop_signal=signal.Signals[body.get("stop_signal", "SIGTERM")],
        )
        for net, address in service.networks.items():
            if net not in networks:
                raise ComposeError(f"{key}.networks: {net!r} is not declared under networks:")
            if ipaddress.IPv4Address(address) not in networks[net]:
                raise ComposeError(f"{key}.networks.{net}: {address} is outside {networks[net]}")
        for dep in service.depends_on:
            if dep not in data["services"]:
                raise ComposeError(f"{key}.depends_on: no service {dep!r}")
        services[service.name] = service
    return Compose(path, services, networks, volumes)


# -- the Dockerfile -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Image:
    """What the lab needs from the Dockerfile (its last stage): how the image starts a process."""

    entrypoint: list[str]
    cmd: list[str]
    env: dict[str, str]
    workdir: str
    # /usr/local/bin/NAME -> the repository file the Dockerfile copies there
    binaries: dict[str, Path] = field(default_factory=dict)
    copied: tuple[str, ...] = ()  # every COPY source, relative to the build context


def _instructions(text: str) -> Iterator[tuple[str, str]]:
    logical = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            logical += line[:-1] + " "
            continue
        logical += line
        word, _, rest = logical.partition(" ")
        yield word.upper(), rest.strip()
        logical = ""


def load_dockerfile(path: Path) -> Image:
    entrypoint: list[str] = []
    cmd: list[str] = []
    env: dict[str, str] = {}
    workdir = "/"
    binaries: dict[str, Path] = {}
    copied: list[str] = []
    for word, rest in _instructions(path.read_text()):
        if word == "FROM":  # a new stage starts from scratch
            entrypoint, cmd, env, workdir, binaries, copied = [], [], {}, "/", {}, []
        elif word in ("ENTRYPOINT", "CMD"):
            value = json.loads(rest) if rest.startswith("[") else ["/bin/sh", "-c", rest]
            if word == "ENTRYPOINT":
                entrypoint = value
            else:
                cmd = value
        elif word == "ENV":
            for item in shlex.split(rest):
                k, sep, v = item.partition("=")
                if not sep:
                    raise ComposeError(f"{path}: write ENV as KEY=VALUE: {rest!r}")
                env[k] = v
        elif word == "WORKDIR":
            workdir = str(Path(workdir) / rest)
        elif word == "COPY" and not rest.startswith("--"):
            *sources, target = shlex.split(rest)
            copied += sources
            if len(sources) == 1 and target.startswith("/usr/local/bin/"):
                binaries[target] = (path.parent / sources[0]).resolve()
    if not entrypoint and not cmd:
        raise ComposeError(f"{path}: no ENTRYPOINT or CMD")
    return Image(entrypoint, cmd, env, workdir, binaries, tuple(copied))


# -- the lab --------------------------------------------------------------------------------------


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


class ServiceProcess:
    """A service's main process in its namespace; stdout and stderr go to one log file."""

    def __init__(
        self, service: Service, argv: list[str], env: dict[str, str], cwd: Path, log: Path
    ) -> None:
        self.service = service
        self.log_path = log
        self._log: IO[bytes] = log.open("wb")
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            # Its own session: a Ctrl+C at the test's terminal reaches pytest, which stops us.
            start_new_session=True,
        )

    def tail(self, lines: int = 30) -> str:
        if not self._log.closed:
            self._log.flush()
        text = self.log_path.read_text(errors="replace").splitlines()
        return f"--- {self.service.name} (last {lines} lines) ---\n" + "\n".join(text[-lines:])

    def request_stop(self) -> None:
        if self.proc.poll() is None:
            # `ip netns exec` and the entrypoint exec the command, so this pid is the command.
            self.proc.send_signal(self.service.stop_signal)

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        self.request_stop()
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):  # it may exit just now
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=5)
        self._log.close()


class ComposeLab:
    """The compose file's topology in namespaces named ``<prefix><service>`` (plus
    ``<prefix>net`` for the bridges). Use as a context manager: ``down`` always runs."""

    def __init__(
        self, compose: Compose, image: Image, workdir: Path, prefix: str, tool_bin: Path
    ) -> None:
        self.compose = compose
        self.image = image
        self.workdir = workdir
        self.prefix = prefix
        self.tool_bin = tool_bin
        self.processes: dict[str, ServiceProcess] = {}
        self._namespaces: list[str] = []
        self._healthy: set[str] = set()

    # namespaces and links

    def namespace(self, service: str) -> str:
        return self.prefix + service

    def __enter__(self) -> ComposeLab:
        try:
            self._build()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.down()

    def _add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self._namespaces.append(name)  # before anything else can fail: down() deletes it
        _ip("-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        hub = self.prefix + "net"
        self._add_namespace(hub)
        bridges = {net: f"br{i}" for i, net in enumerate(self.compose.networks)}
        for bridge in bridges.values():
            _ip("-n", hub, "link", "add", bridge, "type", "bridge")
            _ip("-n", hub, "link", "set", bridge, "up")
        for s_index, service in enumerate(self.compose.services.values()):
            ns = self.namespace(service.name)
            self._add_namespace(ns)
            for n_index, (net, address) in enumerate(service.networks.items()):
                eth, port = f"eth{n_index}", f"s{s_index}n{n_index}"
                _ip("link", "add", "name", eth, "netns", ns, "type", "veth",
                    "peer", "name", port, "netns", hub)  # fmt: skip
                _ip("-n", hub, "link", "set", port, "master", bridges[net], "up")
                prefixlen = self.compose.networks[net].prefixlen
                _ip("-n", ns, "addr", "add", f"{address}/{prefixlen}", "dev", eth)
                _ip("-n", ns, "link", "set", eth, "up")
            for key, value in service.sysctls.items():
                done = subprocess.run(
                    ["ip", "netns", "exec", ns, "sysctl", "-qw", f"{key}={value}"],
                    capture_output=True, text=True, timeout=IP_TIMEOUT_S,
                )  # fmt: skip
                if done.returncode != 0:
                    raise RuntimeError(f"{service.name}: sysctl {key}: {done.stderr.strip()}")
            self._prepare_filesystem(service)
        self._prepare_binaries()

    # files and processes

    def _service_dir(self, service: Service) -> Path:
        return self.workdir / "services" / service.name

    def _prepare_filesystem(self, service: Service) -> None:
        root = self._service_dir(service)
        root.mkdir(parents=True)
        workdir = Path(service.working_dir or self.image.workdir)
        for mount in service.mounts:
            target = Path(mount.target)
            if not target.is_relative_to(workdir) or target == workdir:
                raise ComposeError(
                    f"services.{service.name}.volumes: {mount.target} is not under working_dir "
                    f"{workdir} (the lab links volumes into the working directory)"
                )
            if mount.kind == "volume":
                source = self.workdir / "volumes" / mount.source
                source.mkdir(parents=True, exist_ok=True)
            else:
                source = Path(mount.source)
                if not source.exists():
                    raise ComposeError(f"services.{service.name}.volumes: no {source}")
            link = root / target.relative_to(workdir)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(source)

    def _prepare_binaries(self) -> None:
        bin_dir = self.workdir / "bin"
        bin_dir.mkdir()
        for target, source in self.image.binaries.items():
            (bin_dir / Path(target).name).symlink_to(source)

    def _env(self, service: Service) -> dict[str, str]:
        path = [str(self.workdir / "bin"), str(self.tool_bin)]
        path += ["/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"]
        return {
            "HOME": str(self.workdir / "home" / service.name),
            "LANG": "C.UTF-8",
            **{k: v for k, v in self.image.env.items() if k != "PATH"},
            **service.environment,
            "PATH": os.pathsep.join(path),
        }

    def _argv(self, argv: list[str]) -> list[str]:
        """An absolute path to a file the Dockerfile copies is that file here."""
        if argv and argv[0] in self.image.binaries:
            return [str(self.image.binaries[argv[0]]), *argv[1:]]
        return argv

    def start(self, name: str) -> ServiceProcess:
        """Docker's rule: the service's entrypoint replaces the image's, and then the image's
        CMD is dropped; otherwise the command follows the image's ENTRYPOINT."""
        service = self.compose.services[name]
        if service.entrypoint is not None:
            argv = service.entrypoint + (service.command or [])
        else:
            argv = self.image.entrypoint + (
                service.command if service.command is not None else self.image.cmd
            )
        env = self._env(service)
        Path(env["HOME"]).mkdir(parents=True, exist_ok=True)
        (self.workdir / "logs").mkdir(exist_ok=True)
        process = ServiceProcess(
            service,
            ["ip", "netns", "exec", self.namespace(name), *self._argv(argv)],
            env,
            self._service_dir(service),
            self.workdir / "logs" / f"{name}.log",
        )
        self.processes[name] = process
        return process

    def exec(
        self, name: str, argv: list[str], timeout_s: float
    ) -> subprocess.CompletedProcess[str]:
        """``docker compose exec``: a command in the service's namespace, directory and env."""
        service = self.compose.services[name]
        return subprocess.run(
            ["ip", "netns", "exec", self.namespace(name), *self._argv(argv)],
            capture_output=True,
            text=True,
            env=self._env(service),
            cwd=self._service_dir(service),
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
        )

    def service_path(self, name: str, relative: str) -> Path:
        """Where a path relative to the service's working directory lives on this host."""
        return self._service_dir(self.compose.services[name]) / relative

    # start order

    def up(self) -> None:
        """Start every service in dependency order, waiting for each dependency's condition
        first, as ``docker compose up`` does. Raises ComposeError when one is not met."""
        done: set[tuple[str, str]] = set()
        for name in self.compose.start_order():
            for dep, condition in self.compose.services[name].depends_on.items():
                if (dep, condition) not in done:
                    self._wait_condition(dep, condition)
                    done.add((dep, condition))
            self.start(name)

    def _wait_condition(self, name: str, condition: str) -> None:
        process = self.processes[name]
        if condition == "service_started":
            return
        if condition == "service_completed_successfully":
            try:
                code = process.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                raise ComposeError(f"{name} did not complete\n{process.tail()}") from None
            if code != 0:
                raise ComposeError(f"{name} exited with status {code}\n{process.tail()}")
            return
        if condition == "service_healthy":
            self._wait_healthy(name)
            return
        raise ComposeError(f"depends_on condition {condition!r} is not supported")

    def _wait_healthy(self, name: str) -> None:
        if name in self._healthy:
            return
        process = self.processes[name]
        check = process.service.healthcheck
        if check is None:
            raise ComposeError(f"{name}: service_healthy needs a healthcheck")
        started = time.monotonic()
        failures = 0
        last = ""
        while True:
            time.sleep(check.interval_s)  # Docker runs the first check one interval after start
            if process.proc.poll() is not None:
                raise ComposeError(
                    f"{name} exited ({process.proc.returncode}) before it was healthy\n"
                    f"{process.tail()}"
                )
            try:
                result = self.exec(name, check.argv, check.timeout_s)
                ok, last = result.returncode == 0, (result.stdout + result.stderr).strip()
            except subprocess.TimeoutExpired:
                ok, last = False, f"healthcheck timed out after {check.timeout_s} s"
            if ok:
                self._healthy.add(name)
                return
            if time.monotonic() - started >= check.start_period_s:
                failures += 1
                if failures >= check.retries:
                    raise ComposeError(
                        f"{name} is unhealthy after {failures} checks: {last}\n{process.tail()}"
                    )

    # teardown

    def down(self) -> None:
        """Stop every service (stop_signal, then kill), kill anything else in our namespaces
        by PID, delete the namespaces. Safe to call twice."""
        processes = list(self.processes.values())
        for process in processes:
            process.request_stop()
        deadline = time.monotonic() + STOP_GRACE_S
        for process in processes:
            process.stop(grace_s=max(0.0, deadline - time.monotonic()))
        self.processes.clear()
        for ns in reversed(self._namespaces):
            _kill_namespace(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=IP_TIMEOUT_S)
        self._namespaces.clear()


def _kill_namespace(ns: str) -> None:
    """SIGKILL what still runs in a namespace of ours (a router's sleep, say), by PID."""
    done = subprocess.run(
        ["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=IP_TIMEOUT_S
    )
    for pid in done.stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def reap_stale(stem: str) -> list[str]:
    """Delete namespaces named ``<stem><pid>-...`` whose pytest process is gone (killed before
    its teardown ran), with whatever still runs in them. Returns the names deleted."""
    listing = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, timeout=IP_TIMEOUT_S
    )
    pattern = re.compile(rf"^{re.escape(stem)}(\d+)-\S*")
    deleted: list[str] = []
    for line in listing.stdout.splitlines():
        match = pattern.match(line.strip())
        if match is None or Path(f"/proc/{match.group(1)}").exists():
            continue
        ns = match.group(0)
        _kill_namespace(ns)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=IP_TIMEOUT_S)
        deleted.append(ns)
    return deleted


def main(argv: list[str] | None = None) -> int:
    """``docker compose up`` without Docker, for a developer (root): bring the file's services up
    in namespaces and follow their logs until the named services exit (or Ctrl+C)."""
    root = Path(__file__).resolve().parents[2]
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--file", type=Path, default=root / "docker-compose.yml")
    parser.add_argument("--dockerfile", type=Path, default=root / "Dockerfile")
    parser.add_argument("--until-exit", nargs="*", default=[], metavar="SERVICE")
    args = parser.parse_args(argv)
    compose, image = load_compose(args.file), load_dockerfile(args.dockerfile)
    reap_stale("stc")
    with (
        tempfile.TemporaryDirectory(prefix="compose-lab-") as workdir,
        ComposeLab(
            compose, image, Path(workdir), f"stc{os.getpid()}-", Path(sys.executable).parent
        ) as lab,
    ):
        lab.up()
        offsets: dict[str, int] = {}
        try:
            while True:
                for name, process in lab.processes.items():
                    data = process.log_path.read_bytes()[offsets.get(name, 0) :]
                    data = data[: data.rfind(b"\n") + 1]  # whole lines only
                    offsets[name] = offsets.get(name, 0) + len(data)
                    for line in data.decode(errors="replace").splitlines():
                        print(f"{name:>16} | {line}", flush=True)
                if args.until_exit and all(
                    lab.processes[s].proc.poll() is not None for s in args.until_exit
                ):
                    return max(lab.processes[s].proc.returncode for s in args.until_exit)
                time.sleep(0.5)
        except KeyboardInterrupt:
            return 130


if __name__ == "__main__":
    raise SystemExit(main())
