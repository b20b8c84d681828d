"""The dispute game between real processes: a referee here, provider processes on loopback.

A cheater is named with its step and operator; a provider that goes silent mid-dispute loses at
the referee's deadline; one that announces a 2 GiB answer loses at once, on the frame header,
without the referee allocating it. (Honest providers agreeing over p2p: test_dispute_cli.py.)
The four providers start together once for the module.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import multiaddr
import pytest
import trio
from dispute_peer import toy_task
from libp2p.crypto.ed25519 import create_new_key_pair
from peerproc import PeerProcess, python_argv

from p2p import HostConfig, PeerID, open_host
from verify.dispute.driver import DisputeOutcome, run_referee
from verify.dispute.game import Referee, RefereeConfig
from verify.dispute.toytask import run_op

STEPS = 6
PROVIDERS = {
    "cheater": ["--cheat-step", "3", "--cheat-op", "11"],
    "honest": [],
    "silent": ["--silent-on", "OpOpenQuery"],
    "oversize": ["--oversize-on", "OpOpenQuery"],
}


@pytest.fixture(scope="module")
def addrs() -> Iterator[dict[str, multiaddr.Multiaddr]]:
    procs = {
        name: PeerProcess(
            python_argv("tests/integration/dispute_peer.py", "--steps", str(STEPS), *a)
        )
        for name, a in PROVIDERS.items()
    }
    try:
        found = {}
        for name, proc in procs.items():
            line = proc.wait_line(lambda s: s.startswith("READY "), timeout_s=40)
            found[name] = multiaddr.Multiaddr(line.split()[1])
        yield found
    finally:
        for proc in procs.values():
            proc.stop()


async def referee_against(
    a: multiaddr.Multiaddr, b: multiaddr.Multiaddr, timeout_s: float
) -> DisputeOutcome:
    toy, _, task = toy_task(STEPS, 2)
    config = RefereeConfig(timeout_s, same_program_every_step=True)
    referee = Referee(task, run_op, leaf_oracle=toy.data_leaf_hash, config=config)
    async with open_host(HostConfig(create_new_key_pair())) as host:
        peers = []
        for addr in (a, b):
            peer = PeerID.from_base58(addr.value_for_protocol("p2p"))
            await host.connect(peer, [addr])
            peers.append(peer)
        return await run_referee(host, (peers[0], peers[1]), referee)


def n_ops() -> int:
    toy, start, _ = toy_task(STEPS, 2)
    return len(toy(start, 0).records) + 1


async def test_the_cheater_is_named_over_p2p(addrs: dict[str, multiaddr.Multiaddr]) -> None:
    with trio.fail_after(30):
        outcome = await referee_against(addrs["cheater"], addrs["honest"], timeout_s=15)
    v = outcome.verdict
    assert (v.cheaters, v.step, v.op, v.op_name) == ((0,), 3, 11, "matmul"), v
    assert v.ops_recomputed == 1
    assert v.rounds <= math.ceil(math.log2(STEPS)) + math.ceil(math.log2(n_ops())) + 4
    assert 0 < outcome.bytes_exchanged < 64 * 1024


async def test_a_provider_silent_mid_dispute_loses_at_its_deadline(
    addrs: dict[str, multiaddr.Multiaddr],
) -> None:
    with trio.fail_after(30):
        outcome = await referee_against(addrs["cheater"], addrs["silent"], timeout_s=3)
    v = outcome.verdict
    assert v.cheaters == (1,) and v.reason == "no answer by the deadline", v
    assert v.step == 3 and 3 <= outcome.seconds < 25


async def test_an_oversized_answer_loses_on_its_header(
    addrs: dict[str, multiaddr.Multiaddr],
) -> None:
    with trio.fail_after(30):
        outcome = await referee_against(addrs["oversize"], addrs["cheater"], timeout_s=15)
    v = outcome.verdict
    assert v.cheaters == (0,) and "exceeds limit" in v.reason, v
    assert outcome.seconds < 15  # it lost on the header, not at the deadline
