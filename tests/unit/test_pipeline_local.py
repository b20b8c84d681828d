"""The default model cut into stages computes exactly the whole model, stage builders agree, and
``swarmtrain local --pipeline-stages`` sums its nodes' ``--json`` summaries up right."""

from __future__ import annotations

import pytest
import torch

from diloco import ByteTransformer
from swarm.pipeline.records import param_digest
from swarmtrain.pipeline.local import combine, pipeline_config
from swarmtrain.pipeline.node import PipelineHooks
from swarmtrain.pipeline.roles import cut_stages, model_config, shape_of, stage_builder


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_stages_compose_to_the_whole_model(stages: int) -> None:
    model = ByteTransformer(model_config(stages, d_model=32, context=16), seed=3)
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = model(idx)
        x = idx
        for stage in cut_stages(model, stages):
            x = stage(x)
    assert torch.equal(x, whole)
    # every parameter of the model sits in exactly one stage
    owned = [id(p) for stage in cut_stages(model, stages) for p in stage.parameters()]
    assert sorted(owned) == sorted(id(p) for p in model.parameters())


def test_builders_give_every_server_the_same_stage_parameters() -> None:
    build = stage_builder(3, seed=7, batch_size=2, context=8, lr=1e-3)
    for k in range(3):
        a, b = build(k), build(k)
        digest = [param_digest([p.detach().numpy() for p in s.module.parameters()]) for s in (a, b)]
        assert digest[0] == digest[1]
        assert a.example_input.shape[0] == 2
    with pytest.raises(ValueError):
        cut_stages(ByteTransformer(model_config(2, d_model=32, context=8)), 3)


def test_the_local_spec_holds_the_small_model_and_the_pipeline() -> None:
    config = pipeline_config("p", 3, rounds=4, microbatches=6, factory="m.n:f")
    assert shape_of(config) == model_config(3, context=32)
    assert (config.pipeline.stages, config.run.rounds, config.pipeline.microbatches) == (3, 4, 6)
    assert config.model.factory == "m.n:f" and config.is_pipeline


def test_hooks_travel_as_node_options_and_back() -> None:
    hooks = PipelineHooks(stage=1, slow_stage=0, slow_ms=150.0, stop_on_failure=True)
    argv = hooks.argv()
    assert argv[:2] == ["--pipeline-hook", "stage=1"] and len(argv) == 8
    assert PipelineHooks.parse(argv[1::2]) == hooks
    assert PipelineHooks().argv() == []
    for bad in (["stage"], ["speed=1"], ["stage=x"], ["stage=-1"], ["stop_on_failure=yes"]):
        with pytest.raises(ValueError):
            PipelineHooks.parse(bad)


def _server(stage: int, averages: list[tuple[int, int, str]], moves: int = 0) -> dict:
    return {
        "role": "server",
        "stage": stage,
        "moves": moves,
        "averages": [{"stage": k, "round": r, "digest": d, "group": 2} for k, r, d in averages],
    }


def test_summary_from_the_nodes_summaries() -> None:
    servers = [
        _server(0, [(0, 5, "aa"), (0, 6, "bb")]),
        _server(0, [(0, 6, "bb"), (0, 7, "cc")], moves=1),  # round 7: alone, shows nothing
        _server(1, [(1, 6, "dd")]),
    ]
    trainers = [
        {"role": "trainer", "losses": [5.0, 4.0], "failovers": 1},
        {"role": "trainer", "losses": [None, 3.0, 2.0], "failovers": 0},  # a round without loss
    ]
    summary = combine(2, servers, trainers)
    assert summary == {
        "stages": 2,
        "servers_per_stage": [2, 1],
        "loss_first": 5.0,
        "loss_last": 3.0,
        "stage_hashes_agree": True,
        "averaging_rounds": 1,
        "rebalances": 1,
        "failovers": 1,
    }
    differ = combine(2, [*servers, _server(0, [(0, 6, "xx")])], trainers)
    assert differ["stage_hashes_agree"] is False and differ["servers_per_stage"] == [3, 1]
    # No round with two servers: nothing shows that the stages agree.
    assert combine(2, [_server(0, [(0, 1, "aa")])], [])["stage_hashes_agree"] is False
    assert combine(1, [], [])["loss_first"] is None
