"""A volunteer's side of a verified run (``verify.rate > 0``): tasks, commitments, the gate.

Each round, before averaging:

1. ``run_tasks``: run our own task (``swarmtrain.verified.task``) traced when it is selected for
   re-execution, untraced otherwise; then every task the plan (``swarmtrain.verified.plan``) makes
   us verify, traced. Publish a ``RoundClaims`` under ``run/<id>/verify/<r>``.
2. ``settle``: read the round's claims and the coordinator's verdicts until every assignment is
   decided (``verify_plan.decide``) or ``verify.timeout_s`` passed. The owners left out and every
   banned peer are the round's exclusion set, which matchmaking ignores (``swarm.Averager``'s
   ``exclude``): a contribution that failed verification never reaches the all-reduce. Raises
   ``Banned`` when a verdict names us.
3. ``check_aggregation`` (after the all-reduce, before the outer step): publish what we reduced
   (``swarm.AuditRecord``), dispute a part whose reducer claims an input from us we did not
   send, and wait for the coordinator's audits of the drawn parts; a wrong sum fails the round.

The providers of the last two rounds stay in memory and answer the referee's dispute queries
(only the coordinator's: an operator opening costs a step of compute). Their memory is H + 1
training states per traced task.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import TypeVar

import numpy as np
import trio
from torch import nn

import swarm
from diloco import AveragingFailed, Corpus
from p2p import Message, PeerID, RemoteProtocolError, serve_unary
from swarmtrain.config import RunConfig
from swarmtrain.faults import NO_FAULTS, Faults
from swarmtrain.keys import aggregate_key, audits_key, verdicts_key, verify_key
from swarmtrain.runtime import PeerRuntime
from swarmtrain.verified.binding import (
    STATE_PROTOCOL,
    TaskStateAnswer,
    TaskStateQuery,
    answer_state,
)
from swarmtrain.verified.plan import (
    AGREE,
    CLAIMS_TTL_S,
    Assignment,
    AuditResult,
    Decision,
    RoundClaims,
    Verdict,
    assignments,
    banned,
    decide_all,
    decode_audit_results,
    decode_verdicts,
    newcomers,
    selected,
    verifier_of,
)
from swarmtrain.verified.task import (
    Task,
    check_verifiable,
    dispatched,
    make_task,
    run_fast,
    run_traced,
)
from verify import Commitment
from verify.dispute import Provider, serve_provider

log = logging.getLogger(__name__)
T = TypeVar("T")

POLL_S = 0.5
KEEP_ROUNDS = 2


class Banned(RuntimeError):
    """The coordinator's verdict named this peer as a cheater."""

    def __init__(self, verdict: Verdict) -> None:
        super().__init__(f"banned from the run: {verdict.describe()}: {verdict.reason}")
        self.verdict = verdict


@dataclass
class RoundWork:
    """Our own task's outcome: the final parameters and the loss of each step."""

    params: dict[str, np.ndarray]
    losses: list[float]


def peer_bytes(peer_id: str) -> bytes:
    return PeerID.from_base58(peer_id).to_bytes()


class Verification:
    def __init__(
        self,
        runtime: PeerRuntime,
        config: RunConfig,
        corpus: Corpus,
        run_seed: int,
        coordinator: PeerID,
        *,
        faults: Faults = NO_FAULTS,  # tests and demos only
        emit: Callable[[str], None] = lambda line: None,
        model: nn.Module | None = None,
    ) -> None:
        self.runtime = runtime
        self.config = config
        self.corpus = corpus
        self.run_seed = run_seed
        self.coordinator = coordinator
        self.faults = faults
        self.emit = emit
        self.me = runtime.peer_id.to_bytes()
        # A dispatched run's tasks each train a CPU copy of the run's model (its frozen
        # parameters and buffers as this node has them); checked at once, so a model with an
        # operator RepOps cannot run stops the node before it trains (``NotVerifiable``).
        self._model: nn.Module | None = None
        if dispatched(config):
            if model is None:
                raise ValueError("a verified run of this model needs the model")
            self._model = copy.deepcopy(model).cpu()
            check_verifiable(config, self._model)
        self.verdicts: list[Verdict] = []
        self._providers: dict[int, dict[bytes, Provider]] = {}
        self._lock = threading.Lock()
        self._excluded: dict[int, frozenset[bytes]] = {}
        self._members: dict[int, frozenset[bytes]] = {}
        self._notes: dict[int, str] = {}
        self._allowed: dict[int, frozenset[bytes]] = {}
        self._round: _OwnClaims | None = None
        # The joiners announced for a round (``Elastic.joiners``; set once the membership
        # exists): their first tasks' claims are waited for.
        self.joiners: Callable[[int], Iterable[bytes]] = lambda r: ()
        # (round, owner) -> what the owner of a task we re-executed must send: the round's
        # global parameters minus the task's final ones, flat float32 (``check_slice``).
        self._expected: dict[tuple[int, bytes], np.ndarray] = {}
        # round -> owner -> the contribution root its accepted claim committed (``slice_root``)
        self._bound: dict[int, dict[bytes, bytes]] = {}
        node = runtime.node
        assert node is not None
        runtime.call_sync(serve_provider, node.host, self, None, self._is_referee)
        runtime.call_sync(serve_unary, node.host, STATE_PROTOCOL, TaskStateQuery, self._serve_state)

    def _is_referee(self, peer: PeerID) -> bool:
        return peer == self.coordinator

    def answer(self, query: Message) -> Message:
        """Dispatch a dispute query to the provider of its task (``Provider.answer``)."""
        provider = self._provider(getattr(query, "task_id", None))
        if provider is None:
            raise ValueError("unknown task")
        return provider.answer(query)

    def _provider(self, task_id: bytes | None) -> Provider | None:
        with self._lock:
            found = [kept[task_id] for kept in self._providers.values() if task_id in kept]
        return found[0] if found else None

    async def _serve_state(self, peer: PeerID, query: TaskStateQuery) -> TaskStateAnswer:
        """A kept task's start or final tensors, for the referee ruling on a slice dispute."""
        if not self._is_referee(peer):
            raise RemoteProtocolError("only the run's referee asks for task states")
        provider = self._provider(query.task_id)
        if provider is None:
            raise RemoteProtocolError("unknown task")
        try:
            return await trio.to_thread.run_sync(answer_state, provider, query)
        except ValueError as exc:
            raise RemoteProtocolError(str(exc)) from None

    def _keep(self, round_number: int, provider: Provider) -> None:
        with self._lock:
            self._providers.setdefault(round_number, {})[provider.task.task_id] = provider
            for old in [r for r in self._providers if r <= round_number - KEEP_ROUNDS]:
                del self._providers[old]

    def round_done(self, round_number: int, ok: bool, contributors: Mapping[str, float]) -> None:
        """After a round: its contributors are the next round's members (when it succeeded)."""
        if ok:
            self._members[round_number + 1] = frozenset(peer_bytes(p) for p in contributors)
        for old in [r for r in self._members if r <= round_number]:
            del self._members[old]
        for old in [r for r in self._excluded if r <= round_number]:
            del self._excluded[old]
        for old in [r for r in self._allowed if r <= round_number]:
            del self._allowed[old]
        for old in [r for r in self._bound if r <= round_number]:
            del self._bound[old]

    def _plan(
        self, round_number: int, records: Mapping[bytes, RoundClaims] | None = None
    ) -> list[Assignment]:
        """The round's assignments; none when we do not know its members (the first round, or
        the first after we failed a round or adopted a state): then we verify nobody. With the
        round's ``records``, each newcomer that claims its own task (``plan.newcomers``) is
        assigned a verifier among the members too, selected or not."""
        members = self._members.get(round_number)
        if not members:
            return []
        run = self.config.run.id
        plan = assignments(run, round_number, members, self.config.verify.rate)
        for owner in newcomers(run, round_number, members, records or {}):
            verifier = verifier_of(run, round_number, owner, members)
            if verifier is not None:
                plan.append(Assignment(owner, verifier))
        return plan

    def run_tasks(self, round_number: int, params: dict[str, np.ndarray]) -> RoundWork:
        """Run our task and those we verify, publish our claims. ``params`` are the round's
        global parameters by name. A peer that does not know the round's members (it joined,
        or failed the last round) traces its task whether selected or not: the members take a
        newcomer's contribution only once a verifier's commitment agrees with its own."""
        r, rate = round_number, self.config.verify.rate
        own = self._task(r, self.me, params)
        claims: dict[bytes, Commitment] = {}
        tamper = self.faults.tamper_task(r)
        new_here = r > 0 and not self._members.get(r)
        roots: dict[bytes, bytes] = {}
        if new_here or selected(self.config.run.id, r, self.me, rate):
            provider = run_traced(own, tamper)
            self._keep(r, provider)
            claims[self.me] = provider.commitment
            final = provider.final_state
            # What we owe the round, committed with the task: our slices are checked against it.
            roots[self.me] = swarm.contribution_root(_pseudo_gradient(params, final))
        else:
            final = run_fast(own)
        self._expected = {k: v for k, v in self._expected.items() if k[0] >= r}
        self._round = _OwnClaims(r, params, own.spec.start_state_hash, claims, roots)
        for a in self._plan(r):
            if a.verifier == self.me:
                self._verify(a.owner)
        self._publish_claims()
        return RoundWork({n: final[n] for n in params}, own.losses)

    def _verify(self, owner: bytes) -> None:
        """Re-execute ``owner``'s task of the current round, traced; keep what it owes."""
        mine = self._round
        assert mine is not None
        provider = run_traced(self._task(mine.round, owner, mine.params))
        self._keep(mine.round, provider)
        mine.claims[owner] = provider.commitment
        owed = _pseudo_gradient(mine.params, provider.final_state)
        self._expected[(mine.round, owner)] = owed
        mine.roots[owner] = swarm.contribution_root(owed)

    def _publish_claims(self) -> None:
        mine = self._round
        assert mine is not None
        record = RoundClaims(mine.start_state_hash, dict(mine.claims), dict(mine.roots))
        key = verify_key(self.config.run.id, mine.round)
        try:
            self.runtime.store(key, record.to_bytes(), CLAIMS_TTL_S)
        except Exception as exc:  # the gate then leaves our task out: logged, not fatal
            log.warning("round %d: could not publish our commitments: %s", mine.round, exc)

    def check_slice(
        self, round_number: int, sender: bytes, start: int, values: np.ndarray
    ) -> str | None:
        """The all-reduce's check of a raw slice (``swarm.Averager.check_slice``): a task we
        re-executed binds its owner's contribution bit for bit (a verified run averages exactly,
        at a fixed weight), so an owner whose commitment agreed and who then sends other values
        is dropped from the round here, with this reason in every survivor's log (issue 19)."""
        expected = self._expected.get((round_number, sender))
        if expected is None:
            return None
        want = expected[start : start + len(values)]
        if want.view(np.uint32).tobytes() != np.ascontiguousarray(values).view(np.uint32).tobytes():
            return "its slice is not the pseudo-gradient of the task it committed"
        return None

    def slice_root(self, round_number: int, sender: bytes) -> bytes | None:
        """The contribution root ``sender`` committed for ``round_number`` with a task the gate
        accepted (``swarm.Averager.slice_root``): every reducer refuses its slices unless they
        match it, so a peer whose task passed cannot send other values in any part (issue 19).
        None: its task was not drawn, it binds nothing."""
        return self._bound.get(round_number, {}).get(sender)

    def _task(self, r: int, owner: bytes, params: dict[str, np.ndarray]) -> Task:
        return make_task(self.config, self.corpus, self.run_seed, r, owner, params, self._model)

    def settle(self, round_number: int) -> frozenset[bytes]:
        """The peers round ``round_number`` leaves out, once every assignment is decided or the
        verify timeout passed. Raises ``Banned`` when a verdict names us."""
        r = round_number
        members = self._members.get(r) or frozenset()
        # Joiners that announced this round: waited for, so a newcomer's first task (traced,
        # slower than the members' untraced ones) is verified rather than left out.
        awaited = set(self.joiners(r)) - members - {self.me} if members else set()
        deadline = time.monotonic() + self.config.verify.timeout_s

        records: dict[bytes, RoundClaims] = {}

        def look() -> tuple[list[tuple[Assignment, Decision, str]], set[bytes]]:
            nonlocal records
            self._read_verdicts()
            mine = banned(self.verdicts).get(self.me)
            if mine is not None:
                raise Banned(mine)
            records = self._read_claims(r) if members else {}
            plan = self._plan(r, records)
            own = self._round
            if own is not None and own.round == r:  # newcomers assigned to us since run_tasks
                todo = [
                    a.owner for a in plan if a.verifier == self.me and a.owner not in own.claims
                ]
                for owner in todo:
                    self._verify(owner)
                if todo:
                    self._publish_claims()
            timed_out = time.monotonic() >= deadline
            decided = decide_all(plan, records, self.verdicts, r, members, timed_out=timed_out)
            silent = set()
            if not timed_out:
                silent = awaited - {a.owner for a in plan} - set(banned(self.verdicts))
            return decided, silent

        decisions, _ = self._poll(
            look,
            lambda got: not got[1] and all(d is not Decision.WAIT for _, d, _ in got[0]),
            deadline,
        )
        plan = [a for a, _, _ in decisions]
        left_out = {a.owner for a, d, _ in decisions if d is Decision.EXCLUDE}
        bound = {}
        for a, d, _ in decisions:
            root = records[a.owner].contributions.get(a.owner) if a.owner in records else None
            if d is Decision.ACCEPT and root is not None:
                bound[a.owner] = root
        self._bound[r] = bound
        joined = {a.owner for a in plan if a.owner not in members}
        if members:
            self._allowed[r] = frozenset(members | (joined - left_out) | {self.me})
        for a, d, why in decisions:
            if why != AGREE:
                self.emit(
                    f"round {r} verification: task of {str(PeerID(a.owner))[-8:]} "
                    f"(verifier {str(PeerID(a.verifier))[-8:]}): {d.value}, {why}"
                )
        checked = sum(1 for _, _, why in decisions if why == AGREE)
        if plan:
            log.info("round %d: %d of %d verified tasks agree", r, checked, len(plan))
            self._notes[r] = f" verified {checked}/{len(plan)}" + (
                f" excluded {len(left_out)}" if left_out else ""
            )
        excluded = frozenset(left_out | set(banned(self.verdicts)))
        self._excluded[r] = excluded
        return excluded

    def check_aggregation(self, result: swarm.AveragingResult) -> None:
        """After the round's all-reduce, before its outer step: publish what we reduced
        (``swarm.AuditRecord``); dispute every part whose reducer claims an input from us that
        is not our slice; wait for the referee's audits of the round's drawn parts and of those
        we dispute. Raises diloco's ``AveragingFailed`` when the referee found a part's sum wrong
        (every member waits for the drawn parts, so all of them skip the round)."""
        r, gid, rate = result.round, bytes.fromhex(result.group_id), self.config.verify.rate
        owed = {owner: v for (k, owner), v in self._expected.items() if k == r}
        misbound = {(d.part, d.peer): d for d in result.refused if d.peer in owed}
        # Every slice we refused (``misbound`` among them), its sender's signature with it: a
        # refusal against a committed contribution is evidence its task's verifier takes to
        # the referee.
        refused = swarm.slice_disputes(result.refused)
        record = swarm.AuditRecord(
            r,
            gid,
            result.reducers,
            result.audits,
            slice_disputes=refused,
        )
        self._report_misbound(r, misbound.values())
        self._publish_audits(record)
        run = self.config.run.id
        n = len(result.parts)
        drawn = {p for p in range(n) if swarm.audited(run, r, gid, p, rate, n)}
        disputed: set[int] = set()
        deadline = time.monotonic() + self.config.verify.timeout_s

        def look() -> tuple[dict[int, AuditResult], set[int]]:
            nonlocal record
            for other in self._read_group_records(r, gid):
                new = set(swarm.contested(other, self.me, result.slice_hashes)) - disputed
                found = {
                    (d.part, d.peer): d
                    for owner, vector in owed.items()
                    for d in swarm.misbound(other, owner, vector)
                    if (d.part, d.peer) not in misbound
                }
                if new:
                    disputed.update(new)
                    self.emit(
                        f"round {r}: disputing part(s) {sorted(new)}: their reducer claims an "
                        "input from us that we did not send"
                    )
                if found:
                    misbound.update(found)
                    self._report_misbound(r, found.values())
                if new or found:
                    record = replace(
                        record,
                        disputed=tuple(sorted(disputed)),
                        slice_disputes=refused,
                    )
                    self._publish_audits(record)
            awaited = drawn | disputed
            ruled = {
                a.part: a
                for a in self._read_audit_results()
                if a.round == r and a.group_id == gid and a.part in awaited
            }
            wrong = [a for a in ruled.values() if a.sum_wrong]
            if wrong:
                a = wrong[0]
                raise AveragingFailed(
                    f"round {r}: the referee found part {a.part} reduced by "
                    f"{str(PeerID(a.reducer))[-8:]} wrong: {a.reason}"
                )
            return ruled, awaited

        ruled, awaited = self._poll(look, lambda got: len(got[0]) == len(got[1]), deadline)
        for a in ruled.values():
            if not a.ok:  # a contributor that lied to the referee is banned; the sum stands
                log.warning("round %d: part %d: %s", r, a.part, a.reason)
        if len(ruled) < len(awaited):
            log.warning(
                "round %d: %d of %d awaited parts not audited in time; applying the round",
                r, len(awaited) - len(ruled), len(awaited),
            )  # fmt: skip
        if awaited:
            checked = sum(1 for a in ruled.values() if a.ok)
            self._notes[r] = self._notes.get(r, "") + f" audited {checked}/{len(awaited)}"

    def _report_misbound(self, r: int, disputes: Iterable[swarm.SliceDispute]) -> None:
        for d in disputes:
            self.emit(
                f"round {r}: {str(PeerID(d.peer))[-8:]} signed a slice of part {d.part} that is "
                "not the pseudo-gradient of the task it committed; asking the referee"
            )

    def _publish_audits(self, record: swarm.AuditRecord) -> None:
        key = aggregate_key(self.config.run.id, record.round)
        try:
            for i, data in enumerate(swarm.audit_values(record)):
                self.runtime.store(key, data, CLAIMS_TTL_S, tag=b"a%d" % i)
        except Exception as exc:  # the referee then rules on our parts without our claims
            log.warning("round %d: could not publish what we reduced: %s", record.round, exc)

    def _read_group_records(self, r: int, gid: bytes) -> list[swarm.AuditRecord]:
        """Each member's record of round ``r`` in group ``gid`` (its values merged)."""
        try:
            values = self.runtime.read_all(aggregate_key(self.config.run.id, r))
        except Exception as exc:
            log.info("round %d: could not read the reducers' claims: %s", r, exc)
            return []
        decoded = ((m, swarm.decode_audits(data)) for m, data in values)
        found = [(m, rec) for m, rec in decoded if rec is not None]
        return list(swarm.records_by_group(found, r).get(gid, {}).values())

    def _read_audit_results(self) -> list[AuditResult]:
        return self._coordinators_list(audits_key(self.config.run.id), decode_audit_results)

    def _coordinators_list(self, key: str, decode: Callable[[bytes], list[T]]) -> list[T]:
        """The coordinator's signed entry under ``key``, decoded (entries others wrote there
        are ignored); empty when there is none or it cannot be read."""
        try:
            data = self.runtime.read(key).get(str(self.coordinator))
            return [] if data is None else decode(data)
        except RemoteProtocolError as exc:
            log.warning("the coordinator's %s is malformed: %s", key, exc)
        except Exception as exc:
            log.info("could not read %s: %s", key, exc)
        return []

    def _poll(self, look: Callable[[], T], done: Callable[[T], bool], deadline: float) -> T:
        """``look()`` every ``POLL_S`` until ``done`` or ``deadline`` (``time.monotonic``): the
        runtime's trio-side ``poll``, each look in a worker thread (it reads the DHT through
        the runtime, as the torch thread does). What ``look`` raises propagates."""

        async def probe() -> T:
            return await trio.to_thread.run_sync(look)

        timeout_s = max(0.0, deadline - time.monotonic())
        value = self.runtime.poll(probe, done, interval_s=POLL_S, timeout_s=timeout_s)
        assert value is not None  # poll probes at least once when it does not wait first
        return value

    def note(self, round_number: int) -> str:
        """For the round's progress line: `` verified K/N`` (tasks whose two commitments
        agreed, of those assigned) and how many owners were left out; empty when none."""
        return self._notes.pop(round_number, "")

    def allowed(self, round_number: int) -> frozenset[bytes] | None:
        """The only peers round ``round_number`` may group with (its members and the newcomers
        whose first task was verified), or None when we do not know its members."""
        return self._allowed.get(round_number)

    def excluded(self, round_number: int) -> frozenset[bytes]:
        """What ``settle`` decided for the round (banned peers when it did not run)."""
        found = self._excluded.get(round_number)
        return found if found is not None else frozenset(banned(self.verdicts))

    def banned_peers(self) -> frozenset[str]:
        """Every peer a verdict we read banned, as peer id strings (membership ignores them)."""
        return frozenset(str(PeerID(cheater)) for cheater in banned(self.verdicts))

    def _read_verdicts(self) -> None:
        for v in self._coordinators_list(verdicts_key(self.config.run.id), decode_verdicts):
            if v not in self.verdicts:
                self.verdicts.append(v)
                if v.cheater is not None:
                    self.emit(
                        f"verdict: peer {str(PeerID(v.cheater))[-8:]} cheated in "
                        f"{v.describe()}: banned"
                    )

    def _read_claims(self, r: int) -> dict[bytes, RoundClaims]:
        try:
            values = self.runtime.read(verify_key(self.config.run.id, r))
        except Exception as exc:
            log.info("round %d: could not read the commitments: %s", r, exc)
            return {}
        out = {}
        for peer, data in values.items():
            claims = RoundClaims.from_bytes(data)
            if claims is not None:
                out[peer_bytes(peer)] = claims
        return out


@dataclass
class _OwnClaims:
    """This round's published claims and what more tasks need: its global parameters."""

    round: int
    params: dict[str, np.ndarray]
    start_state_hash: bytes
    claims: dict[bytes, Commitment]
    roots: dict[bytes, bytes]  # by owner: the contribution root of each task we executed


def _pseudo_gradient(start: dict[str, np.ndarray], final: Mapping[str, np.ndarray]) -> np.ndarray:
    """What DiLoCo sends for a task that ended at ``final``: start minus final, flat float32 in
    the parameters' order, each difference one IEEE float32 subtraction (the same bits as the
    node's ``torch.sub`` of its flat vectors)."""
    flat_start = np.concatenate([np.asarray(start[n], np.float32).reshape(-1) for n in start])
    flat_final = np.concatenate([np.asarray(final[n], np.float32).reshape(-1) for n in start])
    return np.subtract(flat_start, flat_final, dtype=np.float32)
