"""``swarmtrain status --join MULTIADDR``: a run's peers, round, loss and throughput.

For a pipeline run (``pipeline.stages > 0``) it shows, per stage, the servers (and how many are
relayed), the stage's capacity (effective samples/s) and queued requests, read from the servers'
announcements, then each trainer's latest round (``swarmtrain.pipeline.progress``).

Joins the DHT with a throwaway identity (a status query should not touch the user's key or
appear as a volunteer), fetches and verifies the run spec from the coordinator, and reads the
progress records the nodes publish after every round (``swarmtrain.membership.progress``). Nothing
here is trusted beyond what the records' signatures say: each line is what that peer claims.

Reachability: each record says how its peer found itself (``public``: reachable directly;
``private``: only through its relays), shown as ``direct`` / ``relayed``. With ``--probe`` the
status tool also connects to every active peer itself and shows what it got: ``direct``,
``punched`` (relayed, then upgraded by hole punching), ``relayed`` or ``unreachable``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from p2p import HostConfig, Node, NodeConfig, P2PError, PeerID, open_node, subkey_values
from swarmtrain.commands.coordinator import coordinator_of, fetch_spec, read_progress
from swarmtrain.keys import verdicts_key
from swarmtrain.membership.plan import Claim, candidates, unagreed_claims
from swarmtrain.membership.progress import SHOWN_REACH, SILENT_AFTER_S, AgreedState, Progress
from swarmtrain.pipeline.progress import TrainerProgress, pipeline_status, trainer_progress
from swarmtrain.runspec import RunSpec
from swarmtrain.verified.plan import AGGREGATION, Verdict, banned, decode_verdicts

# --probe: peers connected to at once, and the time one may take (a relayed dial plus the
# hole punch's budget, NatConfig.holepunch_timeout_s).
PROBE_CONCURRENCY = 8
PROBE_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class StatusReport:
    spec: RunSpec
    records: list[Progress]
    now: float
    stages: list[dict[str, Any]] = field(default_factory=list)  # pipeline runs: a row per stage
    trainers: dict[str, TrainerProgress] = field(default_factory=dict)  # pipeline: peer -> round
    verdicts: list[Verdict] = field(default_factory=list)  # verified runs: the coordinator's
    # --probe: peer id -> how the status tool reached it (direct, punched, relayed, unreachable)
    reached: dict[str, str] = field(default_factory=dict)

    def reach(self, p: Progress) -> str:
        """What the table shows: measured when probed, else what the peer published."""
        return self.reached.get(p.peer_id) or SHOWN_REACH[p.reach]

    def active(self) -> list[Progress]:
        return [p for p in self.records if self.now - p.published_at < SILENT_AFTER_S]

    def agreed(self) -> tuple[AgreedState | None, list[Claim]]:
        """The run's state as a joiner adopts it (``plan.candidates``: the run's schedule and
        ``[swarm] state_quorum``), and the newer rounds records claim that nobody adopts."""
        config = self.spec.config
        accepted = candidates(self.records, config.run.rounds, config.swarm.state_quorum)
        return (accepted[0] if accepted else None), unagreed_claims(self.records, accepted)

    def to_json(self) -> dict[str, object]:
        if self.spec.config.is_pipeline:
            return self._pipeline_json()
        agreed, unagreed = self.agreed()
        # The figures of the agreed state's holders: a claim nobody adopts is not the run's.
        holding = [
            p for p in self.records
            if agreed is not None and p.round == agreed.round and p.peer_id in agreed.holders
        ]  # fmt: skip
        return {
            "run_id": self.spec.config.run.id,
            "coordinator": self.spec.coordinator,
            "rounds": self.spec.config.run.rounds,
            "round": agreed.round if agreed else None,
            "peers": len(self.active()),
            "loss": _mean([p.loss for p in holding]),
            "tokens_per_s": round(sum(p.tokens_per_s for p in holding), 1),
            "state_hash": agreed.state_hash.hex() if agreed else None,
            "state_holders": len(agreed.holders) if agreed else 0,
            "unagreed": [{"round": c.round, "peers": c.peers} for c in unagreed],
            "verify_rate": self.spec.config.verify.rate,
            "verdicts": [v.to_json() for v in self.verdicts],
            "banned": sorted(str(PeerID(p)) for p in banned(self.verdicts)),
            "nodes": [self._node_json(p) for p in self.records],
        }

    def _node_json(self, p: Progress) -> dict[str, object]:
        out = p.to_json()
        if p.peer_id in self.reached:
            out["reached"] = self.reached[p.peer_id]
        return out

    def _pipeline_json(self) -> dict[str, object]:
        active = {
            peer: p
            for peer, p in self.trainers.items()
            if self.now - p.published_at < SILENT_AFTER_S
        }
        latest = max((p.round for p in active.values()), default=None)
        at_latest = [p for p in active.values() if p.round == latest]
        return {
            "run_id": self.spec.config.run.id,
            "coordinator": self.spec.coordinator,
            "rounds": self.spec.config.run.rounds,
            "pipeline_stages": self.spec.config.pipeline.stages,
            "stages": [
                {**row, "capacity": round(float(row["capacity"]), 2)} for row in self.stages
            ],
            "servers": sum(int(row["servers"]) for row in self.stages),
            "round": latest,
            "trainers": len(active),
            "loss": _mean([p.loss for p in at_latest if p.loss is not None]),
            "samples_per_s": round(sum(p.samples_per_s for p in at_latest), 2),
            "trainer_rounds": [
                {"peer_id": peer, **p.to_json()} for peer, p in self.trainers.items()
            ],
        }

    def _pipeline_format(self) -> str:
        summary = self._pipeline_json()
        config = self.spec.config
        lines = [
            f"run {config.run.id} (coordinator {self.spec.coordinator}): pipeline of "
            f"{config.pipeline.stages} stages, {summary['servers']} servers, "
            f"{summary['trainers']} active trainers, round "
            f"{summary['round'] if summary['round'] is not None else '-'} of {config.run.rounds}, "
            f"loss {_text(summary['loss'])}, {summary['samples_per_s']} samples/s in all",
            f"{'stage':>5}{'servers':>9}{'relayed':>9}{'samples/s':>11}{'queue':>7}",
        ]
        for row in self.stages:
            lines.append(
                f"{row['stage']:>5}{row['servers']:>9}{row['relayed']:>9}"
                f"{float(row['capacity']):>11.1f}{row['queue']:>7}"
            )
        if not self.trainers:
            lines.append("no trainer has finished a round yet")
            return "\n".join(lines)
        lines.append(
            f"{'trainer':<14}{'round':>6}{'loss':>8}{'samples/s':>11}{'failovers':>11}  last seen"
        )
        for peer, p in self.trainers.items():
            lines.append(
                f"{peer[-12:]:<14}{p.round:>6}{_text(p.loss):>8}{p.samples_per_s:>11.1f}"
                f"{p.failovers:>11}  {self.now - p.published_at:.0f} s ago"
            )
        return "\n".join(lines)

    def format(self) -> str:
        if self.spec.config.is_pipeline:
            return self._pipeline_format()
        summary = self.to_json()
        config = self.spec.config
        lines = [
            f"run {config.run.id} (coordinator {self.spec.coordinator}): "
            f"round {summary['round'] if summary['round'] is not None else '-'} of "
            f"{config.run.rounds}, {summary['peers']} active peers, "
            f"loss {_text(summary['loss'])}, {summary['tokens_per_s']} tok/s in all",
        ]
        for v in self.verdicts:
            cheater = "nobody named"
            if v.cheater is not None:
                cheater = f"{str(PeerID(v.cheater))[-12:]} banned"
            what = (
                f"part {v.op} of the all-reduce, reduced by {str(PeerID(v.owner))[-12:]}"
                if v.op_name == AGGREGATION
                else f"task of {str(PeerID(v.owner))[-12:]}, disputed by "
                f"{str(PeerID(v.verifier))[-12:]}"
            )
            lines.append(f"verdict: {v.describe()}: {what}: {cheater} ({v.reason})")
        for claim in self.agreed()[1]:
            lines.append(
                f"a claim of round {claim.round} by {claim.peers} peer(s) is not agreed "
                "(no joiner adopts it)"
            )
        if not self.records:
            lines.append("no node has finished a round yet")
            return "\n".join(lines)
        lines.append(
            f"{'peer':<14}{'round':>6}{'ok':>5}{'loss':>8}{'tok/s':>9}{'peers':>7}"
            f"{'sent MiB':>10}  {'reach':<12}state         last seen"
        )
        for p in self.records:
            lines.append(
                f"{p.peer_id[-12:]:<14}{p.round:>6}{'yes' if p.ok else 'no':>5}{p.loss:>8.3f}"
                f"{p.tokens_per_s:>9.0f}{p.peers:>7}{p.bytes_sent / 2**20:>10.2f}  "
                f"{self.reach(p):<12}{p.state_hash.hex()[:12]}  "
                f"{self.now - p.published_at:.0f} s ago"
            )
        return "\n".join(lines)


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 4) if values else None


def _text(value: object) -> str:
    return f"{value:.3f}" if isinstance(value, float) else "n/a"


async def run_status(
    join: tuple[str, ...], listen: tuple[str, ...], *, probe: bool = False
) -> StatusReport:
    """With ``probe``, also connect to every active peer (``probe_reach``).
    Raises SpecRefused or P2PError (cannot join, coordinator unreachable)."""
    coordinator: PeerID = coordinator_of(join[0])
    config = NodeConfig(HostConfig(create_new_key_pair(), listen_addrs=listen), bootstrap=join)
    async with open_node(config) as node:
        spec = await fetch_spec(node, coordinator)
        settings = spec.config
        if settings.is_pipeline:
            stages = await pipeline_status(node.dht, settings.run.id, settings.pipeline.stages)
            trainers = await trainer_progress(node.dht, settings.run.id)
            return StatusReport(spec, [], time.time(), stages, trainers)
        progress = await read_progress(node.dht, settings.run.id)
        verdicts = (
            await _verdicts(node, settings.run.id, coordinator) if settings.verify.rate > 0 else []
        )
        report = StatusReport(spec, progress, time.time(), verdicts=verdicts)
        if probe:
            active = [PeerID.from_base58(p.peer_id) for p in report.active()]
            report.reached.update(await probe_all(node, active))
    return report


async def probe_all(node: Node, peers: list[PeerID]) -> dict[str, str]:
    """``probe_reach`` for each of ``peers``, a few at a time, each bounded."""
    found: dict[str, str] = {}
    slots = trio.Semaphore(PROBE_CONCURRENCY)

    async def one(peer: PeerID) -> None:
        async with slots:
            found[str(peer)] = "unreachable"
            with trio.move_on_after(PROBE_TIMEOUT_S):
                found[str(peer)] = await probe_reach(node, peer)

    async with trio.open_nursery() as nursery:
        for peer in peers:
            if peer != node.host.peer_id:
                nursery.start_soon(one, peer)
    return found


async def probe_reach(node: Node, peer: PeerID) -> str:
    """How we reach ``peer`` (``direct``, ``punched``: relayed and then upgraded by hole
    punching, ``relayed``, or ``unreachable``). Never raises for the peer's failure."""
    try:
        addrs = await node.find(peer)
        if not addrs:
            return "unreachable"
        kind = await node.nat.connect(peer, addrs, wait_direct=False)
    except P2PError:
        return "unreachable"
    if kind == "relayed":
        return "punched" if await node.nat.upgrade(peer) else "relayed"
    return kind  # direct, or punched by an earlier connection


async def _verdicts(node: Node, run_id: str, coordinator: PeerID) -> list[Verdict]:
    """The coordinator's signed verdict list (entries others wrote under the key are ignored)."""
    records = await node.dht.get_records(verdicts_key(run_id), latest=True)
    values = subkey_values(records, now=time.time())
    mine = [v for s, v in values.items() if records[s].owner == coordinator.to_bytes()]
    return decode_verdicts(mine[0]) if mine else []
