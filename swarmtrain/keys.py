"""Every DHT key of a run, in one place.

A run's records live under ``run/<id>/…`` (DiLoCo runs) and ``pipeline/<id>/…`` (SWARM pipeline
runs). The keys swarmtrain reads and writes are built here; the three that ``swarm`` itself reads
and writes are built in ``swarm`` (it sits below swarmtrain and must not import it) and are
re-exported here so that this module lists them all:

=====================================  ==================================  ====================
key                                    value (one signed subkey per peer)  built by
=====================================  ==================================  ====================
``run/<id>/round/<r>``                 matchmaking declaration             ``swarm.round_key``
``run/<id>/round/<r>/<shard>``         the same, sharded (scheduled)       ``swarm.round_key``
``run/<id>/state/<r>``                 state hash after round r            ``swarm.state_key``
``run/<id>/progress``                  ``ProgressRecord``                  ``progress_key``
``run/<id>/join/<r>``                  join announcement                   ``join_key``
``run/<id>/starts``                    ``StartAnnouncement``               ``starts_key``
``run/<id>/admissions``                ``JoinToken`` (token runs)          ``admissions_key``
``run/<id>/verify/<r>``                ``RoundClaims`` (verified runs)     ``verify_key``
``run/<id>/verdicts``                  coordinator's verdict list          ``verdicts_key``
``run/<id>/aggregate/<r>``             aggregation audit records           ``aggregate_key``
``run/<id>/audits``                    coordinator's audit results         ``audits_key``
``pipeline/<id>/servers``              stage server announcement           ``swarm.servers_key``
``pipeline/<id>/trainers``             ``TrainerProgress``                 ``trainers_key``
=====================================  ==================================  ====================

A run id is non-empty and holds no ``/`` (``swarmtrain.config`` refuses such ids on load), so
no key of one run can name a key of another.
"""

from __future__ import annotations

from swarm import round_key, servers_key, state_key

__all__ = [
    "admissions_key",
    "aggregate_key",
    "audits_key",
    "join_key",
    "progress_key",
    "round_key",
    "servers_key",
    "starts_key",
    "state_key",
    "trainers_key",
    "verdicts_key",
    "verify_key",
]


def _run(run_id: str) -> str:
    if not run_id or "/" in run_id:
        raise ValueError(f"run id must be non-empty and contain no '/': {run_id!r}")
    return f"run/{run_id}"


def progress_key(run_id: str) -> str:
    """Each peer's latest round (the freshest record per peer wins)."""
    return f"{_run(run_id)}/progress"


def join_key(run_id: str, round_number: int) -> str:
    """Joiners that hold the agreed state and contribute from ``round_number``."""
    return f"{_run(run_id)}/join/{round_number}"


def starts_key(run_id: str) -> str:
    """Each peer's last start: the round it trains first and when it started (own subkey)."""
    return f"{_run(run_id)}/starts"


def verify_key(run_id: str, round_number: int) -> str:
    """Each member's commitments (claims) for the verified tasks of ``round_number``."""
    return f"{_run(run_id)}/verify/{round_number}"


def verdicts_key(run_id: str) -> str:
    """The coordinator's signed list of verdicts (who cheated)."""
    return f"{_run(run_id)}/verdicts"


def aggregate_key(run_id: str, round_number: int) -> str:
    """Where members publish their ``swarm.AuditRecord`` after a verified round."""
    return f"{_run(run_id)}/aggregate/{round_number}"


def audits_key(run_id: str) -> str:
    """The coordinator's signed list of ``AuditResult``."""
    return f"{_run(run_id)}/audits"


def trainers_key(run_id: str) -> str:
    """Each pipeline trainer's latest round (own subkey)."""
    if not run_id or "/" in run_id:
        raise ValueError(f"run id must be non-empty and contain no '/': {run_id!r}")
    return f"pipeline/{run_id}/trainers"


def admissions_key(run_id: str) -> str:
    """Where a token run's members store their join tokens (``swarmtrain.admission``)."""
    return f"run/{run_id}/admissions"
