"""The Verde dispute game: the referee's sans-IO machine (``game``), its wire messages (``wire``),
the trio driver over p2p (``driver``), a provider answering queries (``provider``), and a small
numpy task for tests of the game (``toytask``).
"""

from verify.dispute.driver import DisputeOutcome, run_referee, serve_provider
from verify.dispute.game import Referee, RefereeConfig
from verify.dispute.provider import Provider

__all__ = [
    "DisputeOutcome",
    "Provider",
    "Referee",
    "RefereeConfig",
    "run_referee",
    "serve_provider",
]
