"""The default model cut into stages computes exactly the whole model, and stage builders agree."""

from __future__ import annotations

import pytest
import torch

from diloco import ByteTransformer
from swarm.pipeline.records import param_digest
from swarmtrain.pipeline.local import cut_stages, model_config, stage_builder


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
