"""The outer Nesterov step and the weighted mean: exact, order-fixed float arithmetic."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diloco import GlobalState, OuterConfig, nesterov_update, outer_step, weighted_mean

torch.set_num_threads(1)


def test_nesterov_by_hand() -> None:
    # p=1, g=0.5, m=0.25, lr=0.5, mu=0.5:
    # m' = 0.5*0.25 + 0.5 = 0.625; direction = 0.5 + 0.5*0.625 = 0.8125; p' = 1 - 0.40625.
    # Every value is a short binary fraction, so float32 holds them exactly.
    params, momentum = nesterov_update(
        torch.tensor([1.0]), torch.tensor([0.25]), torch.tensor([0.5]), lr=0.5, mu=0.5
    )
    assert params.item() == 0.59375
    assert momentum.item() == 0.625


def test_nesterov_equals_per_operation_float32_numpy_bit_for_bit() -> None:
    rng = np.random.default_rng(0)
    p = rng.standard_normal(10_001).astype(np.float32)
    m = np.zeros_like(p)
    tp, tm = torch.from_numpy(p.copy()), torch.from_numpy(m.copy())
    lr, mu = np.float32(0.7), np.float32(0.9)
    for _ in range(4):
        g = rng.standard_normal(p.shape).astype(np.float32) * np.float32(0.01)
        m = m * mu + g
        p = p - (g + m * mu) * lr
        tp, tm = nesterov_update(tp, tm, torch.from_numpy(g), lr=0.7, mu=0.9)
    assert tp.numpy().tobytes() == p.tobytes()
    assert tm.numpy().tobytes() == m.tobytes()


def test_nesterov_matches_torch_sgd_up_to_rounding() -> None:
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(1000, generator=generator)
    reference = start.clone().requires_grad_()
    sgd = torch.optim.SGD([reference], lr=0.7, momentum=0.9, nesterov=True)
    params, momentum = start, torch.zeros_like(start)
    for _ in range(5):
        gradient = torch.randn(1000, generator=generator)
        reference.grad = gradient.clone()
        sgd.step()
        params, momentum = nesterov_update(params, momentum, gradient, lr=0.7, mu=0.9)
    torch.testing.assert_close(params, reference.detach(), rtol=1e-5, atol=1e-5)


def test_outer_step_advances_the_round_and_keeps_inputs() -> None:
    state = GlobalState(4, torch.ones(3), torch.zeros(3), bytes(32))
    after = outer_step(state, torch.full((3,), 0.5), OuterConfig())
    assert after.round == 5 and state.round == 4
    assert torch.equal(state.params, torch.ones(3))
    assert not torch.equal(after.params, state.params)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError):
        nesterov_update(torch.ones(3), torch.ones(3), torch.ones(4), lr=0.7, mu=0.9)
    with pytest.raises(ValueError):
        nesterov_update(torch.ones(3), torch.ones(3), torch.ones(3, dtype=torch.float64), 0.7, 0.9)
    with pytest.raises(ValueError):
        OuterConfig(lr=0.0)
    with pytest.raises(ValueError):
        OuterConfig(momentum=1.0)


def test_weighted_mean_is_exact_and_independent_of_insertion_order() -> None:
    a = [torch.tensor([1.0, 2.0]), torch.tensor([[4.0]])]
    b = [torch.tensor([3.0, 6.0]), torch.tensor([[0.0]])]
    first = weighted_mean({"a": (a, 1.0), "b": (b, 3.0)})
    second = weighted_mean({"b": (b, 3.0), "a": (a, 1.0)})
    assert first[0].tolist() == [2.5, 5.0] and first[1].tolist() == [[1.0]]
    assert first[1].dtype == torch.float32
    assert all(torch.equal(x, y) for x, y in zip(first, second, strict=True))
    with pytest.raises(ValueError):
        weighted_mean({"a": (a, 0.0)})
    with pytest.raises(ValueError):
        weighted_mean({"a": (a, 1.0), "b": (b[:1], 1.0)})


def test_momentum_warmup_ramps_linearly_from_zero_then_holds() -> None:
    config = OuterConfig(lr=1.0, momentum=0.9, momentum_warmup=4)
    assert [config.momentum_at(r) for r in range(6)] == [0.0, 0.225, 0.45, 0.675, 0.9, 0.9]
    assert OuterConfig(momentum=0.9).momentum_at(0) == 0.9  # no warm-up: constant
    with pytest.raises(ValueError):
        OuterConfig(momentum_warmup=-1)


def test_outer_step_uses_the_momentum_of_its_round_bit_for_bit() -> None:
    generator = torch.Generator().manual_seed(3)
    params, momentum, gradient = (torch.randn(257, generator=generator) for _ in range(3))
    config = OuterConfig(lr=0.7, momentum=0.9, momentum_warmup=3)
    for round in range(5):
        state = GlobalState(round, params, momentum, bytes(32))
        after = outer_step(state, gradient, config)
        expected = nesterov_update(params, momentum, gradient, 0.7, config.momentum_at(round))
        assert torch.equal(after.params, expected[0]) and torch.equal(after.momentum, expected[1])
    # Round 0 of a warm-up is plain averaging: p - lr * g, and the momentum restarts at g.
    first = outer_step(GlobalState(0, params, momentum, bytes(32)), gradient, config)
    assert torch.equal(first.params, torch.sub(params, torch.mul(gradient, torch.tensor(0.7))))
    assert torch.equal(first.momentum, gradient)


def test_the_in_place_update_in_slices_gives_the_same_bits_and_reuses_the_tensors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Slices of 1000 over 10,001 elements: a ragged last slice, every slice boundary crossed.
    monkeypatch.setattr("diloco.outer.CHUNK", 1000)
    generator = torch.Generator().manual_seed(3)
    params, momentum = torch.randn(10_001, generator=generator), torch.zeros(10_001)
    state = GlobalState(2, params.clone(), momentum.clone(), bytes(32))
    for _ in range(3):
        g = torch.randn(10_001, generator=generator) * 0.01
        params, momentum = nesterov_update(params, momentum, g, lr=0.7, mu=0.9)
        same = (state.params, state.momentum)
        state = outer_step(state, g, OuterConfig(momentum=0.9), in_place=True)
        assert state.params is same[0] and state.momentum is same[1]  # no copy
    assert state.round == 5
    assert state.params.numpy().tobytes() == params.numpy().tobytes()
    assert state.momentum.numpy().tobytes() == momentum.numpy().tobytes()


def test_momentum_zero_is_a_plain_sgd_step_bit_for_bit() -> None:
    """SparseLoCo's outer step (``outer_momentum = 0``, the error-feedback residual in the
    momentum's place): p - lr * g exactly in float32, the momentum buffer holding g alone."""
    rng = np.random.default_rng(20)
    params = torch.from_numpy(rng.standard_normal(1000).astype(np.float32))
    stale = torch.from_numpy(rng.standard_normal(1000).astype(np.float32))
    gradient = torch.from_numpy(rng.standard_normal(1000).astype(np.float32))
    new_params, new_momentum = nesterov_update(params, stale, gradient, lr=0.7, mu=0.0)
    expected = params.numpy() - np.float32(0.7) * gradient.numpy()
    assert new_params.numpy().tobytes() == expected.tobytes()
    assert torch.equal(new_momentum, gradient)
