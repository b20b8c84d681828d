"""How a group cooperates: matchmaking, all-reduce, compression, averaging (pipelines later).

Protocol logic here is sans-IO (no trio, sockets, clocks or randomness); trio drivers on top of
``p2p`` move the bytes. Each protocol's events and actions live in its module, reachable from here
as ``swarm.matchmaking`` and ``swarm.allreduce`` (the names overlap: both have ``Finish``).
"""

from swarm import allreduce, compression, matchmaking
from swarm.allreduce import AllReduce, AllReduceState, partition, reduce_part
from swarm.allreduce_session import AveragingFailed
from swarm.averager import (
    Averager,
    AveragerConfig,
    AveragingResult,
    BlockingAverager,
    StateAgreement,
)
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

__all__ = [
    "AllReduce",
    "AllReduceState",
    "Averager",
    "AveragerConfig",
    "AveragingFailed",
    "AveragingResult",
    "BlockingAverager",
    "Compression",
    "Declaration",
    "Group",
    "MatchState",
    "Matchmaker",
    "MatchmakingConfig",
    "StateAgreement",
    "allreduce",
    "compression",
    "derive_groups",
    "matchmaking",
    "partition",
    "reduce_part",
    "round_key",
    "target_round",
]
