"""A discrete-event simulator of a swarm that drives the real sans-IO protocol machines.

Virtual time (``clock``), a network model of home and datacenter links with NAT, loss and latency
(``network``), the DHT as a store with latency and byte counts (``dht``), churn and the run
(``simulation``), and round protocols (``protocol``: the interface; ``butterfly``: today's
matchmaking + butterfly all-reduce, driving ``Matchmaker`` through ``matchmaking`` and
``AllReduce`` through ``allreduce``; ``hierarchical``: one group of every declarer and the
``GridAllReduce``). ``report`` turns the records into per-round figures. ``pipeline`` runs a
SWARM pipeline apart from the rounds: the real ``Router``, ``MicrobatchRoute`` and ``plan_move``
with stage servers that compute, queue, leave and join.
No sockets, threads or wall clock: a run is a function of its config and seed.
"""

from swarm.sim.allreduce import GroupTimeouts, SimGroup, VectorModel
from swarm.sim.butterfly import ButterflyConfig, ButterflyRounds
from swarm.sim.clock import Clock
from swarm.sim.dht import DhtModel, SimDht, record_bytes
from swarm.sim.hierarchical import HierarchicalRounds, SimGrid
from swarm.sim.network import Network, NetworkConfig, PeerLink, draw_link
from swarm.sim.pipeline import PipelineConfig, PipelineFigures, PipelineSim
from swarm.sim.protocol import RoundProtocol, World
from swarm.sim.report import GroupFigures, PeerRound, RoundFigures, round_figures, summary
from swarm.sim.simulation import SimConfig, Simulation, sim_peer_id

__all__ = [
    "ButterflyConfig",
    "ButterflyRounds",
    "Clock",
    "DhtModel",
    "GroupFigures",
    "GroupTimeouts",
    "HierarchicalRounds",
    "Network",
    "NetworkConfig",
    "PeerLink",
    "PeerRound",
    "PipelineConfig",
    "PipelineFigures",
    "PipelineSim",
    "RoundFigures",
    "RoundProtocol",
    "SimConfig",
    "SimDht",
    "SimGrid",
    "SimGroup",
    "Simulation",
    "VectorModel",
    "World",
    "draw_link",
    "record_bytes",
    "round_figures",
    "sim_peer_id",
    "summary",
]
