"""What ``swarmtrain status`` reads about a SWARM pipeline run, and what trainers publish for it.

Stage servers already announce themselves (``swarm.pipeline.records``, under
``pipeline/<run>/servers``); ``pipeline_status`` turns those records into rows per stage
(servers, relayed, capacity in effective samples/s, queue). Trainers add, after every round, one
``TrainerProgress`` record as their own signed subkey under ``pipeline/<run>/trainers``: round,
mean loss, microbatches done, samples/s, failovers. Like ``swarmtrain.membership.progress`` for
DiLoCo runs, each is only what that peer claims; a malformed record is skipped.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import msgpack
import trio

from p2p import Node, P2PError, PeerID, subkey_values
from swarmtrain.keys import servers_key, trainers_key

log = logging.getLogger(__name__)

TRAINER_PROGRESS_VERSION = 1
MAX_TRAINER_PROGRESS_BYTES = 512
TRAINER_PROGRESS_TTL_S = 600.0


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
        return msgpack.packb(
            [
                TRAINER_PROGRESS_VERSION,
                self.round,
                None if self.loss is None else float(self.loss),
                self.microbatches,
                float(self.samples_per_s),
                self.failovers,
                float(self.published_at),
            ],
            use_bin_type=True,
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> TrainerProgress | None:
        """The record, or None when it is malformed (a bad record is skipped, not fatal)."""
        if len(data) > MAX_TRAINER_PROGRESS_BYTES:
            return None
        try:
            obj = msgpack.unpackb(data, raw=False)
        except Exception:
            return None
        if not isinstance(obj, list) or len(obj) != 7 or obj[0] != TRAINER_PROGRESS_VERSION:
            return None
        _, rnd, loss, microbatches, sps, failovers, at = obj
        ints = (rnd, microbatches, failovers)
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ints):
            return None
        floats = (sps, at) if loss is None else (loss, sps, at)
        if not all(isinstance(v, float) and math.isfinite(v) for v in floats):
            return None
        return cls(rnd, loss, microbatches, sps, failovers, at)

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
    """Store our latest round; a failed store is only logged (status is best effort)."""
    try:
        with trio.move_on_after(10):
            await node.dht.store(
                trainers_key(run_id), progress.to_bytes(), time.time() + TRAINER_PROGRESS_TTL_S
            )
    except P2PError as exc:
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
