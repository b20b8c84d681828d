"""The embedded byte transformer: shapes, size, and a seed-only deterministic init."""

from __future__ import annotations

import math

import pytest
import torch

from diloco import VOCAB_SIZE, ByteTransformer, ByteTransformerConfig

torch.set_num_threads(1)
TINY = ByteTransformerConfig(d_model=32, n_layers=2, n_heads=2, context=16)


def test_default_config_is_about_0_9m_parameters() -> None:
    count = sum(p.numel() for p in ByteTransformer().parameters())
    assert 0.8e6 < count < 1.0e6


def test_forward_shapes_and_initial_loss_near_uniform() -> None:
    model = ByteTransformer(TINY, seed=0)
    idx = torch.randint(0, VOCAB_SIZE, (3, 16), generator=torch.Generator().manual_seed(1))
    assert model(idx).shape == (3, 16, VOCAB_SIZE)
    assert model(idx[:, :5]).shape == (3, 5, VOCAB_SIZE)
    # Small init keeps the logits near zero, so the first loss is about ln 256 nats per byte.
    assert abs(model.loss(idx, idx).item() - math.log(VOCAB_SIZE)) < 0.1


def test_longer_than_context_is_refused() -> None:
    with pytest.raises(ValueError, match="context"):
        ByteTransformer(TINY)(torch.zeros(1, 17, dtype=torch.int64))


def test_init_depends_on_the_seed_only() -> None:
    torch.manual_seed(123)  # the global RNG must not matter
    first = ByteTransformer(TINY, seed=7).state_dict()
    torch.rand(1000)
    second = ByteTransformer(TINY, seed=7).state_dict()
    other = ByteTransformer(TINY, seed=8).state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert not torch.equal(first["embed.weight"], other["embed.weight"])


def test_bad_config_is_refused() -> None:
    with pytest.raises(ValueError):
        ByteTransformerConfig(d_model=30, n_heads=4)
    with pytest.raises(ValueError):
        ByteTransformerConfig(n_layers=0)
