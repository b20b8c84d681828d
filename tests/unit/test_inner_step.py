"""``[training]``'s inner-step settings as the node runs them (``swarmtrain.training.inner_step``):
gradient accumulation equal to the large batch, the clip, bfloat16 autocast, and the learning
rate schedule that ``bench.diloco`` runs (one function for both)."""

from __future__ import annotations

import re

import pytest
import torch

from diloco import ByteTransformer, ByteTransformerConfig, lr_factor
from swarmtrain.config import ConfigError, RunConfig, TrainingSection
from swarmtrain.training.inner_step import accumulate, grad_scaler, set_lr

SHAPE = ByteTransformerConfig(d_model=32, n_layers=2, n_heads=4, context=16)


def batch(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (rows, 17), generator=g)
    return ids[:, :-1], ids[:, 1:]


def grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def test_two_microbatches_give_the_gradient_of_their_union() -> None:
    a, b = batch(4, 1), batch(4, 2)
    union = (torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]]))
    split, whole = ByteTransformer(SHAPE, seed=0), ByteTransformer(SHAPE, seed=0)
    loss_split, tokens = accumulate(split, [a, b], TrainingSection(grad_accumulation=2))
    loss_whole, _ = accumulate(whole, [union], TrainingSection())
    assert tokens == 8 * 16
    assert loss_split == pytest.approx(loss_whole, rel=1e-6)
    assert torch.allclose(grads(split), grads(whole), atol=1e-6)


def test_the_clip_bounds_the_global_norm_and_bf16_keeps_float32_gradients() -> None:
    model = ByteTransformer(SHAPE, seed=0)
    accumulate(model, [batch(4, 1)], TrainingSection(grad_clip=0.01))
    assert float(grads(model).norm()) <= 0.01 + 1e-6
    low = ByteTransformer(SHAPE, seed=0)
    loss, _ = accumulate(low, [batch(4, 1)], TrainingSection(precision="bf16"))
    assert torch.isfinite(torch.tensor(loss)) and grads(low).dtype == torch.float32
    exact = ByteTransformer(SHAPE, seed=0)
    reference, _ = accumulate(exact, [batch(4, 1)], TrainingSection())
    assert loss == pytest.approx(reference, rel=0.05)  # same model, coarser arithmetic


def test_the_schedule_is_bench_dilocos_across_the_runs_inner_steps() -> None:
    from bench import diloco as bench

    assert bench.lr_factor is lr_factor  # the bench and the node run one schedule
    training = TrainingSection(inner_lr=1e-2, lr_schedule="cosine", warmup=0.1, final_lr=0.1)
    optimizer = torch.optim.AdamW(ByteTransformer(SHAPE, seed=0).parameters(), lr=1.0)
    total = 5 * 20
    seen = [set_lr(optimizer, training, step, total) for step in range(total)]
    assert seen[0] == pytest.approx(1e-2 / 10) and seen[9] == pytest.approx(1e-2)
    assert seen[-1] == pytest.approx(1e-3, rel=0.01)
    assert all(g["lr"] == seen[-1] for g in optimizer.param_groups)
    assert set_lr(optimizer, TrainingSection(inner_lr=3e-3), 57, total) == 3e-3


def test_a_verified_run_refuses_other_inner_settings() -> None:
    message = "training.grad_accumulation, training.precision: a verified run"
    with pytest.raises(ConfigError, match=re.escape(message)):
        RunConfig().replace(
            training={"grad_accumulation": 2, "precision": "bf16"}, verify={"rate": 1}
        )


def test_fp16_scales_the_loss_and_hands_back_unscaled_float32_gradients() -> None:
    training = TrainingSection(precision="fp16")
    model = ByteTransformer(SHAPE, seed=0)
    optimizer = torch.optim.AdamW(model.parameters())
    scaler = grad_scaler(model, training)
    assert scaler is not None and scaler.get_scale() == 2.0**16
    assert grad_scaler(model, TrainingSection(precision="bf16")) is None
    loss, _ = accumulate(model, [batch(4, 1)], training, None, scaler, optimizer)
    exact = ByteTransformer(SHAPE, seed=0)
    reference, _ = accumulate(exact, [batch(4, 1)], TrainingSection())
    assert grads(model).dtype == torch.float32
    assert loss == pytest.approx(reference, rel=0.01)
    # Unscaled before returning: float16's gradients, not 65536 times them.
    assert torch.allclose(grads(model), grads(exact), rtol=0.05, atol=1e-3)
    with pytest.raises(ValueError, match="needs the optimizer"):
        accumulate(model, [batch(4, 1)], training, None, scaler)
