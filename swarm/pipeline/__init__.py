"""SWARM pipelines: server announcements (``records``), stochastic routing (``routing``) and
rebalancing (``rebalance``), both sans-IO, their wire messages (``wire``), and the torch drivers:
the stage server (``server``) and the trainer (``trainer``), imported from their modules so that
importing this package does not import torch.
"""

from swarm.pipeline.rebalance import RebalanceConfig, stage_status
from swarm.pipeline.records import decode_announcements, servers_key

__all__ = [
    "RebalanceConfig",
    "decode_announcements",
    "servers_key",
    "stage_status",
]
