"""A liar for tests: joins a run and claims, in one signed progress record, a round far ahead of
the swarm with a state of its own making, which it serves to whoever asks (issue 19 point 1).

    python tests/integration/progress_forger.py --join ADDR --identity PATH

The state has the run's parameter layout (the model the spec builds), so a joiner that picks it
downloads it, checks its hash (it matches: the liar made both) and loads it; before the fix that
was every joiner. Prints ``FORGED <round> <state hash hex>`` once the record is stored, then
serves until SIGINT.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from diloco.state import GlobalState, layout_digest
from p2p import HostConfig, NodeConfig, load_or_create_identity, open_node
from swarmtrain.commands.coordinator import coordinator_of, fetch_spec
from swarmtrain.keys import progress_key
from swarmtrain.membership.progress import PROGRESS_TTL_S, Progress, member_list
from swarmtrain.membership.state_sync import StateServer
from swarmtrain.training.workload import build_model


async def main(join: str, identity: Path) -> None:
    key_pair = load_or_create_identity(identity)
    config = NodeConfig(
        HostConfig(key_pair, listen_addrs=("/ip4/127.0.0.1/tcp/0",)), bootstrap=(join,)
    )
    async with open_node(config) as node:
        spec = await fetch_spec(node, coordinator_of(join))
        run = spec.config
        model = build_model(run, 256, weights=False)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        numel = sum(p.numel() for _, p in named)
        layout = layout_digest([(n, tuple(p.shape)) for n, p in named])
        forged_round = run.run.rounds - 2  # inside the schedule, far ahead of the swarm
        state = GlobalState(forged_round + 1, torch.full((numel,), 0.5), torch.zeros(numel), layout)
        data = state.to_bytes()
        server = StateServer(node, run.run.id)
        server.install()
        server.offer(data[-32:], data)
        me = str(node.host.peer_id)
        record = Progress(
            me, forged_round, True, data[-32:], 0.01, 1e6, 1, 0, 0, forged_round + 1,
            time.time(), "public", member_list([me]),
        )  # fmt: skip
        await node.dht.store(
            progress_key(run.run.id),
            record.to_bytes(),
            time.time() + PROGRESS_TTL_S,
            version=forged_round + 1,
        )
        print(f"FORGED {forged_round} {data[-32:].hex()}", flush=True)
        await trio.sleep_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--join", required=True)
    parser.add_argument("--identity", type=Path, required=True)
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        trio.run(main, args.join, args.identity)
