"""The coordinator's referee for a verified run (``verify.rate > 0``).

It watches the claims peers publish under ``run/<id>/verify/<r>`` (``swarmtrain.verify_plan``).
When another peer's claim about a task differs from the owner's, it plays the Verde dispute game
between the two (``verify.dispute`` through ``verify.dispute_driver``): bisection over the task's
steps, then over the divergent step's operators, then one operator recomputed with RepOps. The
task is rebuilt from the spec: the start state hash most of the round's peers computed from, the
owner's data shard of that round, H steps. The ruling goes into the coordinator's signed record
under ``run/<id>/verdicts``, which volunteers read before averaging: the loser's contribution is
left out of the round and the loser is banned from the run.

One dispute at a time, each bounded by the referee's per-answer deadline; a round is watched
until peers publish claims two rounds later.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import trio

from diloco import Corpus, load_stdlib_corpus
from p2p import Node, P2PError, PeerID, subkey_values
from swarmtrain.runspec import RunConfig
from swarmtrain.verified_task import DATA_LABELS, Task, make_task, model_shape
from swarmtrain.verify_plan import (
    VERDICTS_TTL_S,
    RoundClaims,
    Verdict,
    disputes,
    encode_verdicts,
    majority_start,
    verdicts_key,
    verify_key,
)
from verify.commit import TaskSpec
from verify.dispute import Referee, RefereeConfig
from verify.dispute_driver import run_referee
from verify.repops import init_params, run_op
from verify.trace import tensor_hash

log = logging.getLogger(__name__)

POLL_S = 1.0
WATCH_ROUNDS = 3  # rounds read per poll, from the oldest still watched
REACH_TIMEOUT_S = 10.0


class RefereeService:
    def __init__(
        self, node: Node, config: RunConfig, run_seed: int, emit: Callable[[str], None]
    ) -> None:
        self.node = node
        self.config = config
        self.run_seed = run_seed
        self.emit = emit
        self.verdicts: list[Verdict] = []
        self._refereed: set[tuple[int, bytes, bytes]] = set()
        self._corpus: Corpus | None = None
        self._oldest = 0

    async def run(self) -> None:
        """Referee every difference, until cancelled."""
        while True:
            newest = self._oldest
            for r in range(self._oldest, self._oldest + WATCH_ROUNDS):
                records = await self._read_claims(r)
                if not records:
                    continue
                newest = r
                for owner, other in disputes(records):
                    if (r, owner, other) not in self._refereed:
                        self._refereed.add((r, owner, other))
                        start = majority_start(records.values())
                        assert start is not None
                        await self.referee(r, owner, other, start)
            # Peers of round r + 2 have settled round r: nothing about it can still matter.
            self._oldest = max(self._oldest, newest - 1)
            await trio.sleep(POLL_S)

    async def referee(self, r: int, owner: bytes, other: bytes, start: bytes) -> list[Verdict]:
        """Play the dispute over (round r, owner)'s task between ``owner`` (party 0) and
        ``other`` (party 1); publish and return the verdicts (one per cheater named)."""
        names = str(PeerID(owner))[-8:], str(PeerID(other))[-8:]
        self.emit(f"round {r}: task of {names[0]} disputed by {names[1]}; refereeing")
        task = await trio.to_thread.run_sync(self._task, r, owner)
        spec = TaskSpec(start, task.spec.data_seed, task.spec.steps)

        def data_leaf(index: int, label: str, attrs: bytes) -> bytes | None:
            if label not in DATA_LABELS:
                return None
            return tensor_hash(task.step.batch(index)[DATA_LABELS[label]])

        answer_s = max(5.0, self.config.verify_timeout_s / 4)
        referee = Referee(
            spec,
            run_op,
            leaf_oracle=data_leaf,
            config=RefereeConfig(answer_s, same_program_every_step=True),
        )
        peers = (PeerID(owner), PeerID(other))
        for peer in peers:
            with trio.move_on_after(REACH_TIMEOUT_S):
                try:
                    await self.node.reach(peer)
                except P2PError as exc:  # the game names the silent one
                    log.info("could not reach %s for the dispute: %s", peer, exc)
        outcome = await run_referee(self.node.host, peers, referee)
        v = outcome.verdict
        parties = (owner, other)
        cheaters = [parties[i] for i in v.cheaters] or [None]
        ruled = [
            Verdict(r, owner, other, c, v.step, v.op, v.op_name or "", v.reason) for c in cheaters
        ]
        for verdict in ruled:
            who = "nobody" if verdict.cheater is None else str(PeerID(verdict.cheater))[-8:]
            self.emit(
                f"round {r}: verdict on the task of {names[0]}: cheater {who} (step {v.step}, "
                f"operator {v.op} {v.op_name}) after {v.rounds} rounds, {outcome.bytes_exchanged}"
                f" bytes, {outcome.referee_compute_s:.3f} s of referee compute: {v.reason}"
            )
        self.verdicts += ruled
        await self._publish()
        return ruled

    def _task(self, r: int, owner: bytes) -> Task:
        if self._corpus is None:
            self._corpus = load_stdlib_corpus()
        # The task's data and shape; its parameters only matter to the providers (the referee
        # checks the start state by its hash), so any of the right shape will do here.
        params = init_params(model_shape(self.config))
        return make_task(self.config, self._corpus, self.run_seed, r, owner, params)

    async def _publish(self) -> None:
        data = encode_verdicts(self.verdicts)
        try:
            await self.node.dht.store(
                verdicts_key(self.config.run_id), data, time.time() + VERDICTS_TTL_S
            )
        except P2PError as exc:
            log.warning("could not publish the verdicts: %s", exc)

    async def _read_claims(self, r: int) -> dict[bytes, RoundClaims]:
        try:
            records = await self.node.dht.get_records(
                verify_key(self.config.run_id, r), latest=True
            )
        except P2PError as exc:
            log.info("could not read round %d's commitments: %s", r, exc)
            return {}
        out = {}
        for subkey, value in subkey_values(records, now=time.time()).items():
            claims = RoundClaims.from_bytes(value)
            if claims is not None:
                out[records[subkey].owner] = claims
        return out
