"""A user's model in a pipeline run (``[model] factory``): the allow list, the contract, the
balanced cut (hypothesis), identical seeded parameters on every server."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from swarm.pipeline.records import param_digest
from swarmtrain.commands.coordinator import join_lines
from swarmtrain.commands.node import NodeOptions
from swarmtrain.config import config_from_mapping
from swarmtrain.pipeline.model import (
    ModelContractError,
    ModelRefused,
    SpecRefused,
    balanced_cut,
    build_model,
    check_allowed,
    cut_model,
    layers_of,
)
from swarmtrain.pipeline.node import server_settings
from swarmtrain.pipeline.roles import stage_builder

FACTORY = "pipeline_user_model:build"  # tests/ is on pytest's path


def digest(module: torch.nn.Module) -> str:
    return param_digest([p.detach().numpy() for p in module.parameters()])


def check_groups(sizes: list[int], stages: int, groups: list[tuple[int, int]]) -> None:
    assert len(groups) == stages
    assert groups[0][0] == 0 and groups[-1][1] == len(sizes)
    for (_, end), (start, _) in itertools.pairwise(groups):
        assert end == start  # contiguous, in order
    assert all(start < end for start, end in groups)  # non-empty


def best_max(sizes: list[int], stages: int) -> int:
    """The smallest largest group over every cut (brute force)."""
    n = len(sizes)
    return min(
        max(sum(sizes[a:b]) for a, b in itertools.pairwise((0, *cuts, n)))
        for cuts in itertools.combinations(range(1, n), stages - 1)
    )


@given(st.lists(st.integers(0, 10_000), min_size=1, max_size=60), st.data())
def test_the_cut_is_contiguous_non_empty_and_covers_every_layer(sizes: list[int], data) -> None:
    stages = data.draw(st.integers(1, len(sizes)))
    check_groups(sizes, stages, balanced_cut(sizes, stages))


@given(st.lists(st.integers(0, 50), min_size=1, max_size=9), st.data())
def test_the_cut_minimizes_the_largest_stage(sizes: list[int], data) -> None:
    stages = data.draw(st.integers(1, len(sizes)))
    groups = balanced_cut(sizes, stages)
    assert max(sum(sizes[a:b]) for a, b in groups) == best_max(sizes, stages)


@given(st.lists(st.integers(0, 100), min_size=0, max_size=8), st.integers(-2, 12))
def test_more_stages_than_layers_is_a_clear_error(sizes: list[int], stages: int) -> None:
    if 1 <= stages <= len(sizes):
        check_groups(sizes, stages, balanced_cut(sizes, stages))
    else:
        with pytest.raises(ValueError, match=f"cannot cut {len(sizes)} layers into {stages}"):
            balanced_cut(sizes, stages)


def test_the_cut_balances_parameters() -> None:
    assert balanced_cut([10, 10, 10, 10], 2) == [(0, 2), (2, 4)]
    assert balanced_cut([30, 1, 1, 1, 30], 2) == [(0, 3), (3, 5)]  # 32 | 31
    assert balanced_cut([5, 0, 5, 0], 2) == [(0, 2), (2, 4)]  # a ReLU stays with its layer
    assert balanced_cut([1, 1, 1], 3) == [(0, 1), (1, 2), (2, 3)]


def test_a_node_imports_only_the_factories_it_allows() -> None:
    check_allowed("", [])  # the default model needs no flag
    check_allowed(FACTORY, [FACTORY, "other:thing"])
    with pytest.raises(ModelRefused) as info:
        check_allowed("evil.module:payload", [FACTORY], run_id="r1")
    message = str(info.value)
    assert isinstance(info.value, SpecRefused) and "\n" not in message
    assert "run r1 names model factory evil.module:payload" in message
    assert message.endswith("pass --allow-model evil.module:payload")
    with pytest.raises(ValueError, match="--allow-model 'nope': expected MODULE:FUNCTION"):
        NodeOptions(join=("/ip4/127.0.0.1/tcp/1",), state_dir=None, allow_models=("nope",))  # type: ignore[arg-type]


def test_every_server_builds_the_same_parameters_from_the_run_seed() -> None:
    state = torch.random.get_rng_state()
    a, b, c = build_model(FACTORY, 7), build_model(FACTORY, 7), build_model(FACTORY, 8)
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's RNG is left alone
    assert digest(a) == digest(b) != digest(c)
    build = stage_builder(2, seed=7, batch_size=2, context=8, lr=1e-3, factory=FACTORY)
    for k in range(2):
        assert digest(build(k).module) == digest(build(k).module)
    x = torch.randint(0, 256, (2, 8))
    assert torch.equal(build(1).module(build(0).module(x)), a(x))  # the stages compose to it


def test_the_model_is_cut_by_parameter_count_with_examples_for_each_stage() -> None:
    stages, examples = cut_model(FACTORY, 1, 2, batch_size=3, context=5)
    counts = [sum(p.numel() for p in s.parameters()) for s in stages]
    assert abs(counts[0] - counts[1]) < 0.2 * sum(counts), counts
    assert examples[0].dtype == torch.int64 and examples[0].shape == (3, 5)
    assert examples[1].shape == (3, 5, 32) and examples[1].dtype == torch.float32
    layered, _ = cut_model("pipeline_user_model:build_layered", 1, 2, batch_size=1, context=4)
    assert [type(s[0]).__name__ for s in layered] == ["Embedding", "Linear"]
    assert len(layers_of(build_model(FACTORY, 0))) == 5


@pytest.mark.parametrize(
    ("factory", "stages", "message"),
    [
        ("no_such_module_here:build", 2, "cannot import no_such_module_here"),
        ("pipeline_user_model:missing", 2, "pipeline_user_model has no function missing"),
        ("pipeline_user_model:build_not_layers", 2, "returned a int: expected an nn.Sequential"),
        ("pipeline_user_model:build_wrong_output", 2, "returns (2, 4, 10), not (2, 4, 256)"),
        (FACTORY, 6, "cannot cut 5 layers into 6 stages"),
        ("pipeline_user_model:build_layered", 2, None),
    ],
)
def test_a_broken_factory_is_a_one_line_error(factory: str, stages: int, message: str) -> None:
    if message is None:
        cut_model(factory, 0, stages, batch_size=2, context=4)
        return
    with pytest.raises(ModelContractError) as info:
        cut_model(factory, 0, stages, batch_size=2, context=4)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_the_spec_factory_reaches_servers_and_the_printed_server_command() -> None:
    config = config_from_mapping(
        {
            "run": {"id": "u1"},
            "model": {"n_layers": 2, "factory": FACTORY},
            "pipeline": {"stages": 3},
        }
    )
    assert server_settings(config, seed=3).model_factory == FACTORY
    lines = join_lines(config, "12D3coord", "/ip4/1.2.3.4/tcp/1/p2p/12D3coord")
    assert f"model {FACTORY}" in lines[0]
    assert lines[1].endswith(f"--join /ip4/1.2.3.4/tcp/1/p2p/12D3coord --allow-model {FACTORY}")
    assert lines[2].endswith("--role trainer")  # trainers never import the model
    plain = join_lines(
        config.replace(model={"factory": "", "n_layers": 3}), "12D3coord", "/ip4/x/p2p/12D3coord"
    )
    assert "--allow-model" not in plain[1] and "model " not in plain[0]
