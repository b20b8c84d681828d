"""The dispute game between real processes: a referee here, two provider processes on loopback.

A cheater is named with its step and operator; a provider that goes silent mid-dispute loses
at the referee's deadline (honest providers agreeing over p2p: test_dispute_cli.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import multiaddr
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from peerproc import PeerProcess, python_argv

from p2p import HostConfig, PeerID, open_host
from verify.dispute import Referee, RefereeConfig
from verify.dispute_driver import DisputeOutcome, run_referee
from verify.toytask import ToyTask, run_op

STEPS = 6
DATA_SEED = 5  # as tests/integration/dispute_peer.py


@contextmanager
def providers(*extra: list[str]) -> Iterator[list[multiaddr.Multiaddr]]:
    procs = [
        PeerProcess(python_argv("tests/integration/dispute_peer.py", "--steps", str(STEPS), *e))
        for e in extra
    ]
    try:
        addrs = []
        for proc in procs:
            line = proc.wait_line(lambda s: s.startswith("READY "), timeout_s=30)
            addrs.append(multiaddr.Multiaddr(line.split()[1]))
        yield addrs
    finally:
        for proc in procs:
            proc.stop()


async def referee_against(addrs: list[multiaddr.Multiaddr], timeout_s: float) -> DisputeOutcome:
    from dispute_peer import toy_task

    toy, _, task = toy_task(STEPS, 2)
    referee = Referee(
        task,
        run_op,
        leaf_oracle=toy.data_leaf_hash,
        config=RefereeConfig(timeout_s, same_program_every_step=True),
    )
    async with open_host(HostConfig(create_new_key_pair())) as host:
        peers = []
        for addr in addrs:
            peer = PeerID.from_base58(addr.value_for_protocol("p2p"))
            await host.connect(peer, [addr])
            peers.append(peer)
        return await run_referee(host, (peers[0], peers[1]), referee)


def n_ops() -> int:
    toy = ToyTask(layers=2, data_seed=DATA_SEED)
    return len(toy(toy.initial_state(seed=1), 0).records) + 1


async def test_the_cheater_is_named_over_p2p() -> None:
    with providers(["--cheat-step", "3", "--cheat-op", "11"], []) as addrs:
        with trio.fail_after(40):
            outcome = await referee_against(addrs, timeout_s=15)
    v = outcome.verdict
    assert (v.cheaters, v.step, v.op, v.op_name) == ((0,), 3, 11, "matmul"), v
    assert v.ops_recomputed == 1
    assert v.rounds <= math.ceil(math.log2(STEPS)) + math.ceil(math.log2(n_ops())) + 4
    assert 0 < outcome.bytes_exchanged < 64 * 1024


async def test_a_provider_silent_mid_dispute_loses_at_its_deadline() -> None:
    with providers(
        ["--cheat-step", "1", "--cheat-op", "8"], ["--silent-on", "OpOpenQuery"]
    ) as addrs:
        with trio.fail_after(40):
            outcome = await referee_against(addrs, timeout_s=3)
    v = outcome.verdict
    assert v.cheaters == (1,) and v.reason == "no answer by the deadline", v
    assert v.step == 1 and 3 <= outcome.seconds < 30
