"""How a group cooperates: matchmaking, all-reduce, compression, averaging, and pipelines (SWARM
parallelism: routing, rebalancing, stage servers, trainers).

Protocol logic here is sans-IO (no trio, sockets, clocks or randomness); trio drivers on top of
``p2p`` move the bytes. Each protocol's events and actions live in its module, reachable from here
as ``swarm.averaging.matchmaking``, ``swarm.averaging.allreduce``, ``swarm.pipeline.routing`` and
``swarm.pipeline.rebalance`` (the names overlap: several have ``Finish``). The pipeline's torch
drivers are imported from their modules, ``swarm.pipeline.server`` (``StageServer``) and
``swarm.pipeline.trainer`` (``PipelineTrainer``), so that importing ``swarm`` does not import torch.
Errors raised on purpose derive from ``SwarmError`` (``swarm.errors``); a failed round is
``AveragingFailed``, the one class ``diloco`` re-exports.
"""

from swarm.averaging.aggregation import AGGREGATIONS, aggregate
from swarm.averaging.allreduce import AllReduce, AllReduceState, partition, reduce_part
from swarm.averaging.audit import (
    MAX_SLICE_DISPUTES,
    AuditRecord,
    PartAudit,
    SliceDispute,
    audit_values,
    audited,
    contested,
    decode_audits,
    encode_audits,
    merge_records,
    misbound,
    proof_message,
    recheck,
    records_by_group,
    slice_disputes,
    slice_hash,
    split_record,
)
from swarm.averaging.averager import (
    SLICE_PROTOCOL,
    Averager,
    AveragerConfig,
    AveragingFaults,
    AveragingResult,
    BlockingAverager,
    SliceRequest,
    StateAgreement,
)
from swarm.averaging.bandwidth import BandwidthEstimate
from swarm.averaging.channel_pool import PoolStatistics
from swarm.averaging.codec import Compression
from swarm.averaging.commitment import contribution_root
from swarm.averaging.matchmaking import (
    Declaration,
    Group,
    Matchmaker,
    MatchmakingConfig,
    MatchState,
    RoundSchedule,
    derive_groups,
    round_key,
    round_keys,
    shard_count,
    state_key,
    target_round,
)
from swarm.averaging.sparse_codec import SparseCodec
from swarm.errors import AveragingFailed, SwarmError
from swarm.pipeline.rebalance import Move, RebalanceConfig, plan_move, stage_status
from swarm.pipeline.records import ServerAnnouncement, param_digest, servers_key
from swarm.pipeline.routing import MicrobatchRoute, Router, RoutingConfig

__all__ = [
    "AGGREGATIONS",
    "MAX_SLICE_DISPUTES",
    "SLICE_PROTOCOL",
    "AllReduce",
    "AllReduceState",
    "AuditRecord",
    "Averager",
    "AveragerConfig",
    "AveragingFailed",
    "AveragingFaults",
    "AveragingResult",
    "BandwidthEstimate",
    "BlockingAverager",
    "Compression",
    "Declaration",
    "Group",
    "MatchState",
    "Matchmaker",
    "MatchmakingConfig",
    "MicrobatchRoute",
    "Move",
    "PartAudit",
    "PoolStatistics",
    "RebalanceConfig",
    "RoundSchedule",
    "Router",
    "RoutingConfig",
    "ServerAnnouncement",
    "SliceDispute",
    "SliceRequest",
    "SparseCodec",
    "StateAgreement",
    "SwarmError",
    "aggregate",
    "aggregation_audit",
    "allreduce",
    "audit_values",
    "audited",
    "compression",
    "contested",
    "contribution_root",
    "decode_audits",
    "derive_groups",
    "encode_audits",
    "matchmaking",
    "merge_records",
    "misbound",
    "param_digest",
    "partition",
    "pipeline_routing",
    "plan_move",
    "proof_message",
    "rebalance",
    "recheck",
    "records_by_group",
    "reduce_part",
    "round_key",
    "round_keys",
    "servers_key",
    "shard_count",
    "slice_disputes",
    "slice_hash",
    "split_record",
    "stage_status",
    "state_key",
    "target_round",
]
