"""The ``swarm`` layer's errors: one base, ``SwarmError``, and the conditions under it.

``SwarmError`` subclasses ``Exception``, not ``p2p.P2PError``: a failed round is this layer's
outcome (too few peers, everyone else lost, a deadline), not a transport fault, and handlers that
keep a p2p service alive by catching ``P2PError`` must not swallow it. A ``p2p`` error that ends a
round surfaces as ``AveragingFailed`` with the cause chained.
"""

from __future__ import annotations

__all__ = ["AveragingFailed", "SwarmError"]


class SwarmError(Exception):
    """Base of the errors the ``swarm`` layer raises on purpose."""


class AveragingFailed(SwarmError):
    """A round ended without a result for this peer; the message says why. The one class for
    it: ``diloco`` re-exports it, so a DiLoCo loop and the swarm under it catch the same name."""
