"""``--log-to``: a node's rounds as TensorBoard event files, written by torch's standard writer
and read back with TensorBoard's own reader; bad flags named in one line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from swarmtrain.metrics import RoundSample
from swarmtrain.tracking import open_trackers


def _events(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    reader = EventAccumulator(str(folder))
    reader.Reload()
    return {
        tag: [(e.step, e.value) for e in reader.Scalars(tag)] for tag in reader.Tags()["scalars"]
    }


def test_rounds_become_tensorboard_scalars_by_round(tmp_path: Path) -> None:
    (tracker,) = open_trackers([f"tensorboard:{tmp_path / 'tb'}"])
    tracker.observe_round(
        RoundSample(0, True, 3.5, 1200.0, peers=3, bytes_sent=10, allreduce_s=0.5, agree=True)
    )
    tracker.observe_round(RoundSample(1, False, 3.25, 1100.0))  # a failed round: no seconds
    tracker.close()
    events = _events(tmp_path / "tb")
    assert events["round/loss"] == [(0, 3.5), (1, 3.25)]
    assert events["round/peers"] == [(0, 3.0), (1, 0.0)]
    assert events["round/ok"] == [(0, 1.0), (1, 0.0)]
    assert events["round/allreduce_s"] == [(0, 0.5)]
    assert events["state/agree"] == [(0, 1.0)]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("tensorboard", "--log-to tensorboard: expected tensorboard:DIR or wandb:PROJECT"),
        ("mlflow:x", "--log-to mlflow:x: expected tensorboard:DIR or wandb:PROJECT"),
    ],
)
def test_a_bad_log_to_is_named(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        open_trackers([spec])


def test_wandb_is_never_required(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # absent, as on most machines: import fails
    with pytest.raises(ValueError, match="--log-to wandb: the wandb package is not installed"):
        open_trackers(["wandb:my-project"])
