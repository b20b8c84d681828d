"""Survivors and joiners meet again across NATs (issue 16), with the product's own processes.

The scenario an operator ran: a coordinator on the public segment (it is the run's relay too),
two volunteers that average a few rounds, one of them SIGKILLed mid-run, and a new volunteer that
joins. Before issue 16 the survivor failed every later round alone, and the joiner found the dead
peer as the agreed state's only holder, fell back to a fresh round 0 and trained a second,
diverging run beside the first. Now the joiner takes the state from the live survivor and both
average from the joiner's first rounds on, ending on one state hash.

Two placements (natlab.sh topology: pub and c public; a behind a port-restricted cone NAT, b
behind a symmetric one): survivor behind the cone NAT and a public joiner (the issue's run), and
a public survivor with a joiner behind the cone NAT. The victim is behind the symmetric NAT both
times. Volunteers run on the default command line (no ``--listen``) except the public survivor
and joiner, whose address is given as an operator of a public host would.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

# tests/ is on the path (pyproject's pythonpath): its folders are namespace packages.
from integration.runproc import run_toml

if TYPE_CHECKING:
    from tests.natlab.conftest import LabProcess

pytestmark = pytest.mark.natlab

SWARMTRAIN = (sys.executable, "-m", "swarmtrain.cli")
COORDINATOR_LISTEN = "/ip4/198.51.100.1/tcp/4001"
PUBLIC_LISTEN = {"c": "/ip4/198.51.100.3/tcp/4001"}
JOIN_COMMAND = "swarmtrain node --join "
ROUND = re.compile(r"^round (\d+) ")
ROUNDS = 8
# The whole run, start to last exit, on a loaded 2-core box (about 50-70 s on a quiet one).
RUN_DEADLINE_S = 105.0


class Lines:
    """A lab process's stdout lines, kept as they are read (``LabProcess`` hands each out once)."""

    def __init__(self, proc: LabProcess) -> None:
        self.proc = proc
        self.seen: list[str] = []

    def until(self, match: Callable[[str], bool], deadline: float) -> str:
        while True:
            line = self.proc.read_line(deadline - time.monotonic())
            self.seen.append(line)
            if match(line):
                return line

    def drain(self, deadline: float) -> None:
        """Read to the end of stdout (the process exited) within the deadline."""
        try:
            while True:
                self.seen.append(self.proc.read_line(deadline - time.monotonic()))
        except AssertionError as exc:  # exited: what we want; a deadline: the caller's wait says
            if "exited" not in str(exc):
                seen = "\n".join(self.seen[-15:])
                raise AssertionError(f"{exc}\n--- its stdout (last 15 lines) ---\n{seen}") from None

    def rounds(self) -> dict[int, str]:
        return {int(m.group(1)): s for s in self.seen if (m := ROUND.match(s))}


def _spec(tmp_path: Path) -> Path:
    """``swarmtrain init``'s run.toml, shortened: 8 rounds of 5 steps of a smaller model."""
    config = tmp_path / "run.toml"
    shorter = {"rounds": ROUNDS, "inner_steps": 5, "d_model": 64, "n_layers": 2,
               "matchmaking_timeout_s": 4.0}  # fmt: skip
    config.write_text(run_toml(shorter))
    return config


def _node(run_in: Callable[..., LabProcess], tmp_path: Path, ns: str, join: str) -> Lines:
    state = tmp_path / f"node-{ns}"
    state.mkdir()
    argv = [*SWARMTRAIN, "node", "--join", join, "--state-dir", str(state), "--threads", "1"]
    argv += ["--identity", str(state / "node.key"), "--json", str(state / "summary.json")]
    if ns in PUBLIC_LISTEN:
        argv += ["--listen", PUBLIC_LISTEN[ns]]
    return Lines(run_in(f"node-{ns}", ns, *argv))


@pytest.mark.parametrize(
    ("survivor", "joiner"),
    [("a", "c"), ("c", "a")],
    ids=["cone-survivor-public-joiner", "public-survivor-cone-joiner"],
)
def test_a_joiner_meets_the_survivor_of_a_killed_peer(
    lab: Callable[..., None],
    run_in: Callable[..., LabProcess],
    tmp_path: Path,
    survivor: str,
    joiner: str,
) -> None:
    started = time.monotonic()
    deadline = started + RUN_DEADLINE_S
    lab(nat1="prc", nat2="sym")
    config = _spec(tmp_path)
    coordinator = Lines(
        run_in(
            "coordinator", "pub", *SWARMTRAIN, "coordinator", "--config", str(config),
            "--identity", str(tmp_path / "coordinator.key"), "--listen", COORDINATOR_LISTEN,
        )
    )  # fmt: skip
    join = coordinator.until(lambda s: s.startswith(JOIN_COMMAND), deadline)
    join = join[len(JOIN_COMMAND) :].split()[0]

    survivor_node = _node(run_in, tmp_path, survivor, join)
    victim = _node(run_in, tmp_path, "b", join)
    # They average twice, so both hold the agreed state; then the victim dies mid-run.
    averaged = re.compile(r"^round 1 .*agree yes \(2/2\)")
    victim.until(lambda s: averaged.match(s) is not None, deadline)
    victim.proc.proc.kill()
    killed_at = time.monotonic() - started
    joined = _node(run_in, tmp_path, joiner, join)

    for node in (survivor_node, joined):
        node.drain(deadline)
        assert node.proc.wait(max(1.0, deadline - time.monotonic())) == 0, node.proc.tail()
    summaries = {
        ns: json.loads((tmp_path / f"node-{ns}" / "summary.json").read_text())
        for ns in (survivor, joiner)
    }
    print(f"victim killed at {killed_at:.1f} s; done in {time.monotonic() - started:.1f} s")
    rounds = joined.rounds()
    logs = "\n".join([*joined.seen[-12:], "---", *survivor_node.seen[-12:]])
    print(logs)  # shown on failure, or with -s
    assert rounds, logs
    first = min(rounds)
    # The joiner started from the survivor's state, not from a fresh round 0 of its own.
    assert first >= 2, logs
    assert summaries[joiner]["last_round"] == ROUNDS - 1, logs
    # It averaged with the survivor in every round after its first two.
    contributed = [r for r, s in rounds.items() if "agree yes (2/2)" in s]
    assert set(range(first + 2, ROUNDS)) <= set(contributed), logs
    assert summaries[joiner]["state_hash"] == summaries[survivor]["state_hash"], logs
    assert summaries[survivor]["rounds_contributed"] >= 2 + len(range(first + 2, ROUNDS)), logs
