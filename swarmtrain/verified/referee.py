"""The coordinator's referee for a verified run (``verify.rate > 0``).

It watches the claims peers publish under ``run/<id>/verify/<r>`` (``swarmtrain.verified.plan``).
When another peer's claim about a task differs from the owner's, it plays the Verde dispute game
between the two (``verify.dispute.game`` through ``verify.dispute.driver``): bisection over the
task's steps, then over the divergent step's operators, then one operator recomputed with RepOps
(a graph operator of the default model, or an aten operator of any other model's dispatch trace:
``swarmtrain.verified.task.recompute_of``; either way from the inputs the providers send, so the
referee builds no model). The task is rebuilt from the spec: the start state hash most of the
round's peers computed from, the owner's data shard of that round, H steps. The ruling goes into
the coordinator's signed record under ``run/<id>/verdicts``, which volunteers read before
averaging: the loser's contribution is left out of the round and the loser is banned from the
run.

It also audits aggregations (issue 5, point 9): after a verified round, every member publishes
a ``swarm.AuditRecord`` under ``run/<id>/aggregate/<r>`` (each part's reducer; for the parts it
reduced, each input's hash and weight and the output's hash). For every part drawn at the run's
rate (``swarm.audited``) the referee fetches the inputs from their contributors (the averager's
slice protocol, which serves the coordinator only), checks them against the reducer's claims and
recomputes the sum (``swarm.recheck``). The ruling goes into the signed list under
``run/<id>/audits``, which members wait for before applying the round: a wrong sum fails the
round everywhere and bans the reducer (a verdict with ``op_name`` "aggregation"), as does a
reducer that published no claim about a drawn part within half the verify timeout. A member may
also dispute a part (``AuditRecord.disputed``: it does so when the reducer's claim lists an
input from it that is not its slice); disputed parts are audited whether drawn or not.

One dispute or audit at a time, each bounded by deadlines; a round is watched until peers
publish claims two rounds later.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import trio

import swarm
from diloco import Corpus, load_stdlib_corpus
from p2p import (
    Node,
    P2PError,
    PeerID,
    call_stream,
    call_unary,
    subkey_values,
    verify_peer_signature,
)
from swarmtrain.config import RunConfig
from swarmtrain.keys import aggregate_key, audits_key, verdicts_key, verify_key
from swarmtrain.verified.binding import (
    STATE_PROTOCOL,
    ParamRange,
    TaskStateAnswer,
    TaskStateQuery,
    covering,
    param_ranges,
    rule_slice,
)
from swarmtrain.verified.plan import (
    AGGREGATION,
    SLICE,
    VERDICTS_TTL_S,
    AuditResult,
    RoundClaims,
    Verdict,
    disputes,
    encode_audit_results,
    encode_verdicts,
    majority_start,
)
from swarmtrain.verified.task import (
    DATA_LABELS,
    TaskData,
    param_layout,
    recompute_of,
    same_program_every_step,
    task_data,
)
from verify import TaskSpec, tensor_hash
from verify.dispute import Referee, RefereeConfig, run_referee

log = logging.getLogger(__name__)

POLL_S = 1.0
WATCH_ROUNDS = 3  # rounds read per poll, from the oldest still watched
REACH_TIMEOUT_S = 10.0
SLICE_TIMEOUT_S = 15.0
T = TypeVar("T")


class RefereeService:
    def __init__(
        self, node: Node, config: RunConfig, run_seed: int, emit: Callable[[str], None]
    ) -> None:
        self.node = node
        self.config = config
        self.run_seed = run_seed
        self.emit = emit
        self.verdicts: list[Verdict] = []
        self.audit_results: list[AuditResult] = []
        self._audited: set[tuple[int, bytes, int]] = set()
        self._first_seen: dict[tuple[int, bytes], float] = {}
        self._refereed: set[tuple[int, bytes, bytes]] = set()
        self._slices_ruled: set[tuple[int, bytes, int, bytes]] = set()
        self._corpus: Corpus | None = None
        self._ranges: list[ParamRange] | None = None
        self._oldest = 0

    async def run(self) -> None:
        """Referee every difference, until cancelled."""
        while True:
            newest = self._oldest
            for r in range(self._oldest, self._oldest + WATCH_ROUNDS):
                records = await self._read(
                    verify_key(self.config.run.id, r), RoundClaims.from_bytes
                )
                if not records:
                    continue
                newest = r
                for owner, other in disputes(records):
                    if (r, owner, other) not in self._refereed:
                        self._refereed.add((r, owner, other))
                        start = majority_start(records.values())
                        assert start is not None
                        await self.referee(r, owner, other, start)
            for r in range(max(0, self._oldest - 1), self._oldest + WATCH_ROUNDS):
                await self._audit_round(r)
            # Peers of round r + 2 have settled round r: nothing about it can still matter.
            self._oldest = max(self._oldest, newest - 1)
            await trio.sleep(POLL_S)

    async def referee(self, r: int, owner: bytes, other: bytes, start: bytes) -> list[Verdict]:
        """Play the dispute over (round r, owner)'s task between ``owner`` (party 0) and
        ``other`` (party 1); publish and return the verdicts (one per cheater named)."""
        names = str(PeerID(owner))[-8:], str(PeerID(other))[-8:]
        self.emit(f"round {r}: task of {names[0]} disputed by {names[1]}; refereeing")
        data = await trio.to_thread.run_sync(self._task, r, owner)
        spec = TaskSpec(start, data.seed, len(data.batches))

        def data_leaf(index: int, label: str, attrs: bytes) -> bytes | None:
            if label not in DATA_LABELS or not 0 <= index < len(data.batches):
                return None
            return tensor_hash(data.batches[index][DATA_LABELS[label]])

        answer_s = max(5.0, self.config.verify.timeout_s / 4)
        referee = Referee(
            spec,
            recompute_of(self.config),
            leaf_oracle=data_leaf,
            config=RefereeConfig(
                answer_s, same_program_every_step=same_program_every_step(self.config)
            ),
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

    def _task(self, r: int, owner: bytes) -> TaskData:
        """The task's data: its parameters only matter to the providers (the referee checks the
        start state by its hash, and recomputes one operator from the inputs they send)."""
        if self._corpus is None:
            self._corpus = load_stdlib_corpus()
        return task_data(self.config, self._corpus, self.run_seed, r, owner)

    def _param_ranges(self) -> list[ParamRange]:
        """Where each parameter lies in the averaged vector (built once: a dispatched run's
        model is made from the spec for it)."""
        if self._ranges is None:
            self._ranges = param_ranges(param_layout(self.config))
        return self._ranges

    async def _audit_round(self, r: int) -> None:
        """Audit the drawn parts of every group of round ``r`` whose records are in."""
        values = await self._read_all(aggregate_key(self.config.run.id, r), swarm.decode_audits)
        groups = swarm.records_by_group(values, r)
        grace_s = self.config.verify.timeout_s / 2
        for gid, members in sorted(groups.items()):
            for accuser, record in sorted(members.items()):
                for dispute in record.slice_disputes:
                    key = (r, gid, dispute.part, dispute.peer)
                    if key not in self._slices_ruled:
                        self._slices_ruled.add(key)
                        await self._rule_slice(r, gid, accuser, dispute)
            seen = self._first_seen.setdefault((r, gid), trio.current_time())
            votes = Counter(rec.reducers for rec in members.values())
            reducers = max(votes, key=lambda v: (votes[v], v))
            for p, reducer in enumerate(reducers):
                key = (r, gid, p)
                if key in self._audited:
                    continue
                rate, n = self.config.verify.rate, len(reducers)
                drawn = swarm.audited(self.config.run.id, r, gid, p, rate, n)
                if not drawn and not any(p in rec.disputed for rec in members.values()):
                    continue
                own = members.get(reducer)
                claim = next((a for a in own.audits if a.part == p), None) if own else None
                if claim is None:
                    if trio.current_time() - seen < grace_s:
                        continue
                    # Owed for a drawn part only: a disputed part of a round too big to audit
                    # may have no claim through no fault of its reducer.
                    why = f"the reducer published no claim about part {p}"
                    ok = False if drawn else None
                    result = AuditResult(r, gid, p, reducer, ok, why, reducer if drawn else None)
                else:
                    result = await self._recheck(r, gid, reducer, claim)
                self._audited.add(key)
                await self._rule(result)

    async def _rule_slice(
        self, r: int, gid: bytes, accuser: bytes, dispute: swarm.SliceDispute
    ) -> None:
        """Rule on ``accuser``'s claim that ``dispute.peer`` signed a slice other than its task's
        pseudo-gradient (``swarmtrain.verified.binding``): ban whichever of them lied."""
        owner, names = dispute.peer, (str(PeerID(dispute.peer))[-8:], str(PeerID(accuser))[-8:])
        signed = swarm.proof_message(
            self.config.run.id, r, gid, dispute.part, dispute.weight, dispute.digest
        )
        if not verify_peer_signature(owner, signed, dispute.proof):
            log.info("round %d: a slice dispute by %s carries no valid signature", r, names[1])
            return
        claims = await self._read(verify_key(self.config.run.id, r), RoundClaims.from_bytes)
        own, theirs = claims.get(owner), claims.get(accuser)
        committed = None if own is None else own.claims.get(owner)
        if committed is None or theirs is None or theirs.claims.get(owner) != committed:
            log.info("round %d: slice dispute on %s without an agreed commitment", r, names[0])
            return
        self.emit(f"round {r}: {names[1]} disputes the slice of {names[0]} in part {dispute.part}")
        data = await trio.to_thread.run_sync(self._task, r, owner)
        spec = TaskSpec(own.start_state_hash, data.seed, len(data.batches))
        ranges = await trio.to_thread.run_sync(self._param_ranges)
        asked = [p.name for p in covering(ranges, dispute.start, dispute.stop)]
        answers: list[TaskStateAnswer] = []
        with trio.move_on_after(SLICE_TIMEOUT_S):
            try:
                await self.node.reach(PeerID(accuser))
                for step in (0, spec.steps):
                    query = TaskStateQuery(spec.task_id, step, asked)
                    answers.append(
                        await call_unary(
                            self.node.host,
                            PeerID(accuser),
                            STATE_PROTOCOL,
                            query,
                            TaskStateAnswer,
                            deadline_s=SLICE_TIMEOUT_S,
                        )
                    )
            except Exception as exc:  # P2PError, a refusal, libp2p's own stream errors
                log.info("round %d: no task state from %s: %s", r, names[1], exc)
        if len(answers) != 2:
            self.emit(
                f"round {r}: slice dispute on {names[0]} not ruled: its accuser did not answer"
            )
            return
        ruling = await trio.to_thread.run_sync(
            rule_slice, dispute, ranges, *answers, spec.start_state_hash, committed.final_state_hash
        )
        if ruling.guilty is None:
            self.emit(f"round {r}: slice dispute on {names[0]} not ruled: {ruling.reason}")
            return
        cheater = owner if ruling.guilty else accuser
        verdict = Verdict(r, owner, accuser, cheater, None, dispute.part, SLICE, ruling.reason)
        self.emit(
            f"round {r}: verdict on the slice of {names[0]}: cheater "
            f"{str(PeerID(cheater))[-8:]}: {ruling.reason}"
        )
        self.verdicts.append(verdict)
        await self._publish()

    async def _recheck(
        self, r: int, gid: bytes, reducer: bytes, claim: swarm.PartAudit
    ) -> AuditResult:
        slices: dict[bytes, np.ndarray] = {}

        async def fetch(peer: bytes) -> None:
            found = await self._fetch_slice(peer, r, gid, claim)
            if found is not None:
                slices[peer] = found

        def signed(peer: bytes, weight: float, digest: bytes, proof: bytes) -> bool:
            message = swarm.proof_message(self.config.run.id, r, gid, claim.part, weight, digest)
            return verify_peer_signature(peer, message, proof)

        async with trio.open_nursery() as nursery:
            for peer, *_ in claim.inputs:
                nursery.start_soon(fetch, peer)
        ruling = await trio.to_thread.run_sync(swarm.recheck, claim, slices, signed)
        cheater = None
        if ruling.ok is False:
            cheater = ruling.contributor if ruling.contributor is not None else reducer
        return AuditResult(r, gid, claim.part, reducer, ruling.ok, ruling.reason, cheater)

    async def _fetch_slice(
        self, peer: bytes, r: int, gid: bytes, claim: swarm.PartAudit
    ) -> np.ndarray | None:
        length = claim.stop - claim.start
        if length == 0:
            return np.zeros(0, np.float32)
        request = swarm.SliceRequest(r, gid, claim.start, claim.stop)
        with trio.move_on_after(SLICE_TIMEOUT_S):
            try:
                await self.node.reach(PeerID(peer))
                items = await call_stream(
                    self.node.host,
                    PeerID(peer),
                    swarm.SLICE_PROTOCOL,
                    request,
                    (),
                    deadline_s=SLICE_TIMEOUT_S,
                    max_tensor_bytes=4 * length,
                )
            except Exception as exc:  # P2PError, and libp2p's own stream errors
                log.info("no slice of part %d from %s: %s", claim.part, PeerID(peer), exc)
                return None
            ok = len(items) == 1 and isinstance(items[0], np.ndarray)
            if ok and items[0].dtype == np.float32 and items[0].shape == (length,):
                return items[0]
            log.info("a malformed slice of part %d from %s", claim.part, PeerID(peer))
        return None

    async def _rule(self, result: AuditResult) -> None:
        reducer = str(PeerID(result.reducer))[-8:]
        outcome = {True: "correct", False: "WRONG", None: "not attributable"}[result.ok]
        line = (
            f"round {result.round}: audit of part {result.part} reduced by {reducer}: "
            f"{outcome} ({result.reason})"
        )
        if result.ok:
            log.info("%s", line)  # every round's routine: the log, not the console
        else:
            self.emit(line)
        self.audit_results.append(result)
        if result.cheater is not None:
            ruling = Verdict(
                result.round,
                result.reducer,
                result.reducer,
                result.cheater,
                None,
                result.part,
                AGGREGATION,
                result.reason,
            )
            self.verdicts.append(ruling)
            await self._publish()
        await self._store(audits_key(self.config.run.id), encode_audit_results(self.audit_results))

    async def _publish(self) -> None:
        await self._store(verdicts_key(self.config.run.id), encode_verdicts(self.verdicts))

    async def _store(self, key: str, data: bytes) -> None:
        try:
            await self.node.dht.store(key, data, time.time() + VERDICTS_TTL_S)
        except P2PError as exc:
            log.warning("could not publish %s: %s", key, exc)

    async def _read(self, key: str, decode: Callable[[bytes], T | None]) -> dict[bytes, T]:
        """``{signer: decoded value}`` of ``key``'s records (one per signer); malformed values
        skipped."""
        return dict(await self._read_all(key, decode))

    async def _read_all(
        self, key: str, decode: Callable[[bytes], T | None]
    ) -> list[tuple[bytes, T]]:
        """``(signer, decoded value)`` of every record of ``key`` (a signer's tagged subkeys
        too); malformed values skipped."""
        try:
            records = await self.node.dht.get_records(key, latest=True)
        except P2PError as exc:
            log.info("could not read %s: %s", key, exc)
            return []
        out = []
        for subkey, value in sorted(subkey_values(records, now=time.time()).items()):
            decoded = decode(value)
            if decoded is not None:
                out.append((records[subkey].owner, decoded))
        return out
