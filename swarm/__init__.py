"""How a group cooperates: matchmaking, all-reduce, compression, averaging, and pipelines (SWARM
parallelism: routing, rebalancing, stage servers, trainers).

Protocol logic here is sans-IO (no trio, sockets, clocks or randomness); trio drivers on top of
``p2p`` move the bytes. Each protocol's events and actions live in its module, reachable from here
as ``swarm.matchmaking``, ``swarm.allreduce``, ``swarm.pipeline_routing`` and ``swarm.rebalance``
(the names overlap: several have ``Finish``). The pipeline's torch drivers are imported from
their modules, ``swarm.stage_server`` (``StageServer``) and ``swarm.pipeline_trainer``
(``PipelineTrainer``), so that importing ``swarm`` does not import torch.
"""

from swarm import (
    aggregation_audit,
    allreduce,
    compression,
    matchmaking,
    pipeline_routing,
    rebalance,
)
from swarm.aggregation_audit import (
    AuditRecord,
    PartAudit,
    audited,
    contested,
    decode_audits,
    encode_audits,
    merge_records,
    proof_message,
    recheck,
    records_by_group,
    split_record,
)
from swarm.allreduce import AllReduce, AllReduceState, partition, reduce_part
from swarm.allreduce_session import AveragingFailed
from swarm.averager import (
    SLICE_PROTOCOL,
    Averager,
    AveragerConfig,
    AveragingResult,
    BlockingAverager,
    SliceRequest,
    StateAgreement,
)
from swarm.bandwidth import BandwidthEstimate
from swarm.channel_pool import PoolStatistics
from swarm.compression import Compression
from swarm.matchmaking import (
    Declaration,
    Group,
    Matchmaker,
    MatchmakingConfig,
    MatchState,
    derive_groups,
    round_key,
    target_round,
)
from swarm.pipeline_records import ServerAnnouncement, param_digest, servers_key
from swarm.pipeline_routing import MicrobatchRoute, Router, RoutingConfig
from swarm.rebalance import Move, RebalanceConfig, plan_move, stage_status

__all__ = [
    "SLICE_PROTOCOL",
    "AllReduce",
    "AllReduceState",
    "AuditRecord",
    "Averager",
    "AveragerConfig",
    "AveragingFailed",
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
    "Router",
    "RoutingConfig",
    "ServerAnnouncement",
    "SliceRequest",
    "StateAgreement",
    "aggregation_audit",
    "allreduce",
    "audited",
    "compression",
    "contested",
    "decode_audits",
    "derive_groups",
    "encode_audits",
    "matchmaking",
    "merge_records",
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
    "servers_key",
    "split_record",
    "stage_status",
    "target_round",
]
