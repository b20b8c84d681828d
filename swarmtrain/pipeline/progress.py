"""What ``swarmtrain status`` reads about a SWARM pipeline run, and what trainers publish for it.

Stage servers already announce themselves (``swarm.pipeline.records``, under
``pipeline/<run>/servers``); ``pipeline_status`` turns those records into rows per stage
(servers, relayed, capacity in effective samples/s, queue). Trainers add, after every round, one
``TrainerProgress`` record as their own signed subkey under ``pipeline/<run>/trainers``: round,
mean loss, microbatches done, samples/s, failovers. Like ``swarmtrain.membership.progress`` for
DiLoCo runs, each is only what that peer claims. The value is a ``p2p`` wire message,
``TrainerProgressRecord`` (code 506): a malformed value is one ``RemoteProtocolError`` and the
record is skipped; a round no reader would accept (a NaN loss) is not published.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import trio

from p2p import (
    Message,
    Node,
    P2PError,
    PeerID,
    RemoteProtocolError,
    decode,
    encode,
    message,
    subkey_values,
)
from swarmtrain.keys import servers_key, trainers_key

log = logging.getLogger(__name__)

MAX_TRAINER_PROGRESS_BYTES = 512
TRAINER_PROGRESS_TTL_S = 600.0


@message(506, max_bytes=MAX_TRAINER_PROGRESS_BYTES)
class TrainerProgressRecord(Message):
    """The DHT value of a ``TrainerProgress`` (``pipeline/<run>/trainers``, the trainer's own
    subkey). Raises ``ValueError`` when a count is negative or a figure is not finite."""

    round: int
    loss: float | None
    microbatches: int
    samples_per_s: float
    failovers: int
    published_at: float

    def __post_init__(self) -> None:
        if min(self.round, self.microbatches, self.failovers) < 0:
            raise ValueError("round, microbatches and failovers must be >= 0")
        figures = (self.samples_per_s, self.published_at, 0.0 if self.loss is None else self.loss)
        if not all(math.isfinite(v) for v in figures):
            raise ValueError("loss, samples/s and publication time must be finite")


@dataclass(frozen=True)
class TrainerProgress:
    """A trainer's latest round as it published it; ``loss`` is None when no microbatch of the
    round completed."""

    round: int
    loss: float | None
    microbatches: int
    samples_per_s: float
    failovers: int
    published_at: float

    def to_bytes(self) -> bytes:
        """The DHT value. Raises ValueError for a round no reader would accept (a NaN loss)."""
        return encode(TrainerProgressRecord(*dataclasses.astuple(self)))

    @classmethod
    def from_bytes(cls, data: bytes) -> TrainerProgress | None:
        """The record, or None when it is malformed (a bad record is skipped, not fatal)."""
        try:
            return cls(*decode(data, TrainerProgressRecord).to_wire())
        except RemoteProtocolError as exc:
            log.debug("trainer progress ignored: %s", exc)
            return None

    def to_json(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "loss": None if self.loss is None else round(self.loss, 4),
            "microbatches": self.microbatches,
            "samples_per_s": round(self.samples_per_s, 2),
            "failovers": self.failovers,
            "published_at": self.published_at,
        }


async def publish_trainer_progress(node: Node, run_id: str, progress: TrainerProgress) -> None:
    """Store our latest round; a failed store, or a round no reader would accept, is only
    logged (status is best effort)."""
    try:
        value = progress.to_bytes()
        with trio.move_on_after(10):
            await node.dht.store(trainers_key(run_id), value, time.time() + TRAINER_PROGRESS_TTL_S)
    except (P2PError, ValueError) as exc:
        log.info("publishing the trainer's progress failed: %s", exc)


async def trainer_progress(dht: Any, run_id: str) -> dict[str, TrainerProgress]:
    """``{trainer peer id: latest round}`` from the DHT; raises P2PError when the read fails."""
    records = await dht.get_records(trainers_key(run_id), latest=True)
    values = subkey_values(records, now=time.time())
    found = {
        str(PeerID(records[s].owner)): TrainerProgress.from_bytes(v) for s, v in values.items()
    }
    return {peer: p for peer, p in sorted(found.items()) if p is not None}


async def servers_by_stage(dht: Any, run_id: str, num_stages: int) -> list[list[bytes]]:
    """The peer ids announced on each stage (sorted); raises P2PError when the read fails."""
    from swarm.pipeline import decode_announcements

    records = await dht.get_records(servers_key(run_id), latest=True)
    found = decode_announcements(
        [(r.owner, r.value) for r in records.values()], num_stages=num_stages
    )
    by_stage: list[list[bytes]] = [[] for _ in range(num_stages)]
    for announcement in found:
        by_stage[announcement.stage].append(announcement.peer_id)
    return by_stage


async def pipeline_status(dht: Any, run_id: str, num_stages: int) -> list[dict[str, Any]]:
    """What ``swarmtrain status`` shows for a pipeline run, read from the servers' records: per
    stage, its servers, how many are relayed, capacity (effective samples/s) and queued requests.
    ``dht`` is a running ``p2p.Dht``; raises ``P2PError`` when the read fails."""
    from swarm.pipeline import RebalanceConfig, decode_announcements, stage_status

    records = await dht.get_records(servers_key(run_id), latest=True)
    found = decode_announcements(
        [(r.owner, r.value) for r in records.values()], num_stages=num_stages
    )
    return stage_status(found, RebalanceConfig(num_stages=num_stages))
