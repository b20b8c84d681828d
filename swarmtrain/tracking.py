"""``--log-to``: a node's rounds as experiment-tracking series, written by the standard writers.

``tensorboard:DIR`` writes TensorBoard event files with ``torch.utils.tensorboard``'s
``SummaryWriter`` (the ``tensorboard`` package must be installed; the README's test set-up
installs it); ``wandb:PROJECT`` logs to Weights & Biases when ``wandb`` is installed and never
requires it. Each finished round is one step: the same series ``--metrics-port`` serves (loss,
tokens/s, peers, bytes, matchmaking and all-reduce seconds, state agreement). A pipeline trainer's
rounds are fed too (``swarmtrain.pipeline.observe``): its loss, tokens/s and the servers it went
through as peers (a trainer averages nothing: no bytes, no seconds).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from swarmtrain.metrics import RoundSample

KINDS = ("tensorboard", "wandb")


class Tracker(Protocol):
    def observe_round(self, sample: RoundSample) -> None: ...
    def close(self) -> None: ...


def series(sample: RoundSample) -> dict[str, float]:
    """A round's scalars by tag (absent ones, e.g. a failed round's seconds, left out)."""
    out = {
        "round/ok": float(sample.ok),
        "round/peers": float(sample.peers),
        "round/sent_bytes": float(sample.bytes_sent),
        "round/received_bytes": float(sample.bytes_received),
        "state/syncs": float(sample.syncs),
    }
    if sample.loss is not None:
        out["round/loss"] = sample.loss
    if sample.tokens_per_s is not None:
        out["round/tokens_per_s"] = sample.tokens_per_s
    if sample.matchmaking_s is not None:
        out["round/matchmaking_s"] = sample.matchmaking_s
    if sample.allreduce_s is not None:
        out["round/allreduce_s"] = sample.allreduce_s
    if sample.agree is not None:
        out["state/agree"] = float(sample.agree)
    return out


class TensorBoard:
    """Event files under ``folder`` (TensorBoard: ``tensorboard --logdir folder``)."""

    def __init__(self, folder: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ValueError(
                "--log-to tensorboard: needs the tensorboard package (pip install tensorboard)"
            ) from None
        self._writer = SummaryWriter(log_dir=str(folder))

    def observe_round(self, sample: RoundSample) -> None:
        for tag, value in series(sample).items():
            self._writer.add_scalar(tag, value, global_step=sample.round)
        self._writer.flush()  # a round is minutes apart: a reader sees it at once

    def close(self) -> None:
        self._writer.close()


class Wandb:
    """A Weights & Biases run in ``project`` (only when ``wandb`` is installed)."""

    def __init__(self, project: str, name: str) -> None:
        try:
            wandb: Any = importlib.import_module("wandb")
        except ImportError:
            raise ValueError("--log-to wandb: the wandb package is not installed") from None
        self._run = wandb.init(project=project, name=name or None)

    def observe_round(self, sample: RoundSample) -> None:
        self._run.log(series(sample), step=sample.round)

    def close(self) -> None:
        self._run.finish()


def open_trackers(specs: Iterable[str], name: str = "") -> list[Tracker]:
    """The trackers ``--log-to`` names (``KIND:WHERE``). Raises ValueError naming the flag for
    an unknown kind, an empty target or a writer that is not installed."""
    trackers: list[Tracker] = []
    try:
        for spec in specs:
            kind, _, where = spec.partition(":")
            if kind not in KINDS or not where:
                raise ValueError(f"--log-to {spec}: expected tensorboard:DIR or wandb:PROJECT")
            trackers.append(
                TensorBoard(Path(where)) if kind == "tensorboard" else Wandb(where, name)
            )
    except BaseException:
        for tracker in trackers:
            tracker.close()
        raise
    return trackers
