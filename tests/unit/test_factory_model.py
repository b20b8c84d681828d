"""``[model] factory`` in a DiLoCo run: a user's ``nn.Module`` (``tests/pipeline_user_model.py``)
built from the run seed behind ``FactoryLM``'s face, its own loss or cross entropy, and every way
a factory can break the contract as one error naming the factory. The 2-peer run is in
tests/integration/test_diloco_user_model.py."""

from __future__ import annotations

import re

import pytest
import torch

from swarmtrain.config import RunConfig
from swarmtrain.pipeline.model import ModelContractError
from swarmtrain.training.workload import FactoryLM, build_model
from swarmtrain.verified.task import check_verifiable


def factory_config(factory: str, **training: object) -> RunConfig:
    return RunConfig().replace(
        run={"id": "run-factory"},
        model={"factory": f"pipeline_user_model:{factory}"},
        training={"sequence_length": 16, **training},
    )


def params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_a_users_module_is_built_from_the_run_seed_and_trains_with_cross_entropy() -> None:
    config = factory_config("build")
    model = build_model(config)
    assert isinstance(model, FactoryLM)
    assert torch.equal(params(model), params(build_model(config)))  # every peer the same
    other = config.replace(run={"id": "run-other"})
    assert not torch.equal(params(model), params(build_model(other)))
    ids = torch.randint(0, 256, (2, 16))
    loss = model.loss(ids, ids)
    logits = model(ids)
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), ids.reshape(-1))
    assert torch.allclose(loss, expected)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_a_module_with_its_own_loss_keeps_it() -> None:
    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(256, 256)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return self.embed(idx)

        def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return self(idx).mean() * 0 + 42.0

    loss = FactoryLM(Scaled()).loss(torch.zeros(1, 4, dtype=torch.int64), None)
    assert float(loss.detach()) == 42.0


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        ("build_not_layers", "returned a int, not an nn.Module"),
        ("build_layered", "its module failed on a (1, 16) batch of token ids"),
        ("build_wrong_output", "maps (1, 16) token ids to (1, 16, 10), not (1, 16, V) logits"),
        ("no_such_function", "pipeline_user_model has no function no_such_function"),
        ("build_raises", "raised RuntimeError: weights.bin is missing"),
    ],
)
def test_a_broken_factory_is_one_error_naming_it(factory: str, message: str) -> None:
    with pytest.raises(ModelContractError, match=re.escape(message)) as error:
        build_model(factory_config(factory))
    assert f"pipeline_user_model:{factory}" in str(error.value)
    assert "\n" not in str(error.value)  # the node prints it as its one error line


def test_a_verified_run_takes_a_factory_whose_operators_all_map() -> None:
    """Its tasks are dispatch traces (``swarmtrain.verified.task``); the spec check runs one."""
    config = factory_config("build").replace(verify={"rate": 0.5})
    assert check_verifiable(config) > 100  # the step's records: leaves, operators, state
