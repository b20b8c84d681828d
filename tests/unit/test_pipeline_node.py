"""A pipeline node's decisions and output without sockets: the starting stage, the lines a human
reads, the trainers' progress records, what ``swarmtrain status`` prints, settings from a spec."""

from __future__ import annotations

from collections import Counter

import msgpack
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from swarm.pipeline.records import param_digest
from swarmtrain.commands.status import StatusReport
from swarmtrain.config import config_from_mapping
from swarmtrain.pipeline.lines import describe, read_line
from swarmtrain.pipeline.node import (
    PipelineHooks,
    PipelineSummary,
    empty_stage_move,
    least_served,
    server_settings,
    trainer_settings,
)
from swarmtrain.pipeline.progress import TrainerProgress, TrainerProgressRecord
from swarmtrain.pipeline.roles import shape_of, stage_builder
from swarmtrain.runspec import RunSpec

CONFIG = config_from_mapping(
    {
        "run": {"id": "p1", "rounds": 4},
        "model": {"d_model": 32, "n_layers": 3, "context": 16},
        "training": {"sequence_length": 8, "batch_size": 2},
        "pipeline": {
            "stages": 3,
            "microbatches": 5,
            "average_every_s": 2.0,
            "rebalance_every_s": 0.0,
        },
    }
)


def test_a_new_server_takes_the_least_served_stage() -> None:
    assert least_served([2, 0, 1], b"peer") == 1
    assert least_served([1, 1, 3], b"peer") in (0, 1)
    # Servers that read the same (empty) records spread out over the stages.
    picks = Counter(least_served([0, 0, 0], bytes([i, 7])) for i in range(60))
    assert set(picks) == {0, 1, 2} and max(picks.values()) < 40, picks
    # ... and each one's choice is deterministic.
    assert least_served([0, 0, 0], b"x") == least_served([0, 0, 0], b"x")


def test_one_server_of_the_most_served_stage_fills_an_empty_one() -> None:
    a, b, c = b"a" * 8, b"b" * 8, b"c" * 8
    by_stage = [[a, b, c], []]
    movers = [p for p in (a, b, c) if empty_stage_move(by_stage, p, 0, epoch=5) == 1]
    assert len(movers) == 1  # every server computes the same one mover
    # which one moves changes with the epoch (a mover that failed is not stuck forever)
    assert (
        len({next(p for p in (a, b, c) if empty_stage_move(by_stage, p, 0, e)) for e in range(30)})
        > 1
    )
    assert empty_stage_move([[a, b], [c]], a, 0, 5) is None  # nothing is empty
    assert empty_stage_move([[a], [], [b]], a, 0, 5) is None  # a lone server stays
    assert empty_stage_move([[a], [], [b, c]], b, 2, 7) in (None, 1)
    assert empty_stage_move([[a, b], [], []], a, 0, 5) in (None, 1)  # the lowest empty first
    assert empty_stage_move([[a, b], [c], []], c, 1, 5) is None  # not the donor stage


def test_settings_come_from_the_spec() -> None:
    server = server_settings(CONFIG, seed=11)
    assert (server.num_stages, server.seed, server.lr) == (3, 11, CONFIG.training.inner_lr)
    assert (server.batch_size, server.sequence_length) == (2, 8)
    assert server.average_every_s == 2.0 and server.rebalance_every_s is None
    assert (server.shape.d_model, server.shape.n_layers, server.shape.context) == (32, 3, 16)
    trainer = trainer_settings(CONFIG, 11, b"me", wait_for_servers_s=30)
    assert (trainer.rounds, trainer.microbatches, trainer.data_seed) == (4, 5, 11)
    assert trainer.route_seed == trainer_settings(CONFIG, 11, b"me", 30).route_seed
    assert trainer.route_seed != trainer_settings(CONFIG, 11, b"you", 30).route_seed


def test_stage_builder_cuts_the_spec_model_the_same_on_every_server() -> None:
    build = stage_builder(3, seed=5, batch_size=2, context=8, lr=1e-3, shape=shape_of(CONFIG))
    for k in range(3):
        a, b = build(k), build(k)
        digests = [
            param_digest([p.detach().numpy() for p in s.module.parameters()]) for s in (a, b)
        ]
        assert digests[0] == digests[1]
        assert a.example_input.shape[:2] == (2, 8)
    x = torch.randint(0, 256, (2, 8))
    for k in range(3):
        x = build(k).module(x)
    assert x.shape == (2, 8, 256)


def test_events_become_readable_lines() -> None:
    averaged = describe(
        {"event": "averaged", "stage": 1, "round": 7, "digest": "ab" * 32, "group": 2,
         "forwards": 40, "backwards": 39}
    )  # fmt: skip
    assert averaged == (
        "stage 1: averaged round 7 with 2 servers, stage hash abababababab; 40 forwards, "
        "39 backwards"
    )
    moved = describe({"event": "moved", "from_stage": 0, "to_stage": 2, "hash": "cd" * 32})
    assert moved is not None and "moved from stage 0 to stage 2" in moved
    line = describe(
        {"event": "round", "round": 3, "loss": 3.21, "microbatches": 8, "samples_per_s": 12.5,
         "failovers": 1, "servers_per_stage": [2, 1], "seconds": 4.2}
    )  # fmt: skip
    assert line is not None and line.startswith("round 3 loss 3.210 microbatches 8 ")
    assert "failovers 1" in line and "[2, 1]" in line
    assert describe({"event": "round", "round": 0, "loss": None, "microbatches": 0,
                     "samples_per_s": 0.0, "failovers": 0, "servers_per_stage": [1, 1],
                     "seconds": 1.0})  # fmt: skip
    assert describe({"event": "ready", "peer": "00"}) is None  # the server's: "serving" says it
    assert describe({"event": "something else"}) is None


def test_lines_read_back_as_their_events() -> None:
    """What ``swarmtrain local --pipeline-stages`` and the pipeline tests read of a node."""
    events = [
        {"event": "serving", "stage": 2, "throughput": 41.5},
        {"event": "joined", "stage": 1, "round": 12},
        {"event": "averaged", "stage": 0, "round": 3, "digest": "ef" * 32, "group": 3,
         "forwards": 7, "backwards": 6},
        {"event": "moved", "from_stage": 1, "to_stage": 0, "hash": "01" * 32},
        {"event": "round", "round": 2, "loss": 2.5, "microbatches": 4, "samples_per_s": 9.75,
         "failovers": 0, "servers_per_stage": [3, 1, 2], "seconds": 3.5},
        {"event": "ready", "servers_per_stage": [1, 1]},
        {"event": "microbatch_failed", "attempt": 2, "reason": "stage 1: no server (timeout)"},
        {"event": "restarting", "stage": 1},
    ]  # fmt: skip
    for event in events:
        line = describe(event)
        assert line is not None
        read = read_line(line)
        assert read is not None and read["event"] == event["event"], line
        for key, value in read.items():
            if key == "digest" or key == "hash":
                assert str(event[key]).startswith(value) and len(value) == 12
            elif key == "attempt":
                assert value == event["attempt"] + 1  # as a human counts
            else:
                assert value == event[key], (key, line)
    nothing = describe({"event": "round", "round": 0, "loss": None, "microbatches": 0,
                        "samples_per_s": 0.0, "failovers": 0, "servers_per_stage": [1],
                        "seconds": 1.0})  # fmt: skip
    assert nothing is not None and read_line(nothing)["loss"] is None  # type: ignore[index]
    for other in ("", "done: trainer, 3 rounds", "run r: spec signed", "round 1 loss"):
        assert read_line(other) is None


def test_hooks_change_only_the_settings_they_name() -> None:
    plain = server_settings(CONFIG, seed=5)
    assert server_settings(CONFIG, 5, PipelineHooks()) == plain
    hooked = server_settings(
        CONFIG, 5, PipelineHooks(stage=2, slow_stage=1, slow_ms=150, rebalance_after_s=6)
    )
    assert (hooked.slow_stage, hooked.slow_s, hooked.rebalance_after_s) == (1, 0.15, 6)
    assert hooked.average_every_s == plain.average_every_s and hooked.lr == plain.lr
    trainer = trainer_settings(
        CONFIG, 5, b"peer", 30.0, PipelineHooks(in_flight=4, duration_s=9, stop_on_failure=True)
    )
    assert (trainer.in_flight, trainer.duration_s, trainer.stop_on_failure) == (4, 9, True)
    assert trainer.hop_timeout_s == trainer_settings(CONFIG, 5, b"peer", 30.0).hop_timeout_s


def test_summaries_say_what_the_role_did() -> None:
    server = PipelineSummary("server", "12D3", stopped=True, seconds=9.0)
    server.server = {"event": "final", "stage": 1, "forwards": 5, "backwards": 5, "moves": 0,
                     "averaged_rounds": 2, "failed_rounds": 0}  # fmt: skip
    assert server.done_line().startswith("stopped: stage server, last on stage 1, 5 forwards")
    assert server.to_json()["averaged_rounds"] == 2 and "event" not in server.to_json()
    trainer = PipelineSummary("trainer", "12D3", seconds=20.0)
    trainer.rounds = [
        {"round": 0, "loss": 5.0, "microbatches": 4, "failovers": 0},
        {"round": 1, "loss": None, "microbatches": 0, "failovers": 2},
        {"round": 2, "loss": 3.5, "microbatches": 4, "failovers": 2},
    ]
    assert trainer.done_line() == (
        "done: trainer, 3 rounds, loss 5.000 -> 3.500, 8 microbatches, 2 failovers in 20.0 s"
    )
    assert trainer.to_json()["losses"] == [5.0, None, 3.5]
    trainer.trained = {"samples": 64, "failed": 1, "stopped": "stage 1: no server"}
    assert {k: trainer.to_json()[k] for k in ("samples", "failed", "gave_up")} == {
        "samples": 64, "failed": 1, "gave_up": "stage 1: no server",
    }  # fmt: skip
    server.server["averages"] = [{"stage": 1, "round": 4, "digest": "ab", "group": 2}]
    assert server.to_json()["averages"] == server.server["averages"]


def test_trainer_progress_round_trips() -> None:
    record = TrainerProgress(3, 2.5, 8, 12.25, 1, 1000.0)
    assert TrainerProgress.from_bytes(record.to_bytes()) == record
    empty = TrainerProgress(0, None, 0, 0.0, 0, 1000.0)
    assert TrainerProgress.from_bytes(empty.to_bytes()) == empty
    code = TrainerProgressRecord.TYPE_CODE
    for bad in (
        [-1, 2.5, 8, 12.25, 1, 1000.0],
        [3, float("nan"), 8, 12.25, 1, 1000.0],
        [3, 2.5, True, 12.25, 1, 1000.0],
        [3, 2.5, 8, 12.25, 1],
    ):
        assert TrainerProgress.from_bytes(msgpack.packb([1, code, bad])) is None
    assert (
        TrainerProgress.from_bytes(msgpack.packb([2, code, [3, 2.5, 8, 12.25, 1, 1000.0]])) is None
    )
    with pytest.raises(ValueError):  # a round no reader would accept is never published
        TrainerProgress(3, float("nan"), 8, 12.25, 1, 1000.0).to_bytes()


@given(st.binary(max_size=600))
def test_garbage_trainer_progress_is_skipped_not_fatal(data: bytes) -> None:
    record = TrainerProgress.from_bytes(data)
    assert record is None or TrainerProgress.from_bytes(record.to_bytes()) == record


def test_status_shows_servers_per_stage_and_the_trainers() -> None:
    spec = RunSpec(CONFIG, "12D3KooWcoordinator", 1.0)
    rows = [
        {"stage": 0, "servers": 2, "relayed": 0, "capacity": 40.123, "queue": 1},
        {"stage": 1, "servers": 1, "relayed": 1, "capacity": 10.0, "queue": 0},
        {"stage": 2, "servers": 0, "relayed": 0, "capacity": 0.0, "queue": 0},
    ]
    trainers = {
        "12D3KooWtrainerA": TrainerProgress(2, 3.0, 5, 10.0, 0, 990.0),
        "12D3KooWtrainerB": TrainerProgress(2, 4.0, 5, 6.0, 1, 995.0),
        "12D3KooWtrainerC": TrainerProgress(1, 5.0, 5, 6.0, 1, 100.0),  # silent for 900 s
    }
    report = StatusReport(spec, [], 1000.0, rows, trainers)
    shown = report.to_json()
    assert shown["stages"][0]["capacity"] == 40.12 and shown["servers"] == 3
    assert (shown["round"], shown["trainers"], shown["loss"]) == (2, 2, 3.5)
    assert shown["samples_per_s"] == 16.0 and len(shown["trainer_rounds"]) == 3  # type: ignore[arg-type]
    text = report.format()
    assert "pipeline of 3 stages, 3 servers, 2 active trainers, round 2 of 4" in text
    assert "    2        0        0        0.0      0" in text  # an unserved stage shows
    assert "trainerA" in text and "900 s ago" in text
    nobody = StatusReport(spec, [], 1000.0, rows, {}).format()
    assert "no trainer has finished a round yet" in nobody
