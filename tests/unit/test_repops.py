"""RepOps: torch kernels equal the numpy reference bit for bit, whatever the thread count; the
traced step replays operator by operator; the model trains close to native torch autograd."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diloco.model import ByteTransformer, ByteTransformerConfig
from diloco.outer import nesterov_update
from verify.repops import ops, reference
from verify.repops.graph import AdamWConfig, ModelShape, decode_attrs, encode_attrs
from verify.repops.step import (
    RepOpsStep,
    batch_for,
    gradients,
    init_params,
    initial_state,
    nesterov_step,
    run_op,
    step_loss,
    train_step,
)
from verify.trace import state_hash, tensor_hash

CORPUS = bytes(range(256)) * 8 + b"the quick brown fox jumps over the lazy dog\n" * 40
FAST = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(autouse=True)
def one_thread() -> None:
    # Other tests and machines may change it; every test states what it runs on.
    torch.set_num_threads(1)


def _wide(rng: np.random.Generator, shape: tuple[int, ...], spread: int = 30) -> np.ndarray:
    """float32 values whose exponents vary by up to 2**spread across elements and rows."""
    scale = np.exp2(rng.integers(-spread, spread // 2, size=shape))
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _t(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(x, copy=True))


def _same(a: torch.Tensor | np.ndarray, b: np.ndarray) -> None:
    left = a.numpy() if isinstance(a, torch.Tensor) else a
    assert left.dtype == b.dtype and left.shape == b.shape
    assert left.tobytes() == b.tobytes(), f"{np.sum(left != b)} of {b.size} elements differ"


# ---- primitive kernels ----------------------------------------------------------------------


@FAST
@given(
    m=st.integers(1, 40),
    k=st.integers(1, 300),
    n=st.integers(1, 40),
    batch=st.integers(0, 3),
    seed=st.integers(0, 2**32 - 1),
)
def test_matmul_equals_reference_and_is_accurate(
    m: int, k: int, n: int, batch: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    lead = (batch,) if batch else ()
    a, b = _wide(rng, (*lead, m, k)), _wide(rng, (*lead, k, n))
    got = ops.matmul(_t(a), _t(b))
    _same(got, reference.matmul(a, b))
    # Error bound: each row of a (column of b) is rounded to a grid of 2**(e - bits), where 2**e
    # bounds its largest magnitude; then one float32 rounding.
    bits = ops.matmul_bits(k)
    da = np.exp2(np.frexp(np.abs(a).max(axis=-1, keepdims=True))[1] - bits - 1.0)
    db = np.exp2(np.frexp(np.abs(b).max(axis=-2, keepdims=True))[1] - bits - 1.0)
    a64, b64 = np.abs(a).astype(np.float64), np.abs(b).astype(np.float64)
    bound = a64.sum(-1, keepdims=True) * db + da * b64.sum(-2, keepdims=True) + k * da * db
    exact = np.matmul(a.astype(np.float64), b.astype(np.float64))
    assert np.all(np.abs(got.numpy() - exact) <= bound + np.abs(exact) * 2**-23)


def test_matmul_and_sum_of_extreme_magnitudes_equal_reference() -> None:
    rng = np.random.default_rng(8)
    a = rng.standard_normal((6, 40)).astype(np.float32)
    a[0] = rng.uniform(-1, 1, 40) * 1e36  # 2**120: a float32 grid constant would overflow
    a[1] *= np.float32(1e-40)  # subnormal row: grid exponent raised to E_MIN
    a[2] = 0.0
    a[3, ::2] = -0.0
    b = rng.standard_normal((40, 5)).astype(np.float32)
    _same(ops.matmul(_t(a), _t(b)), reference.matmul(a, b))
    _same(ops.sum_exact(_t(a), 1), reference.sum_exact(a, 1))
    zero = ops.matmul(_t(a[2:3]), _t(-np.abs(b)))
    assert not np.signbit(zero.numpy()).any()  # 0 * negative sums to +0, never -0


def test_matmul_chunks_long_inner_dimension_in_fixed_order() -> None:
    rng = np.random.default_rng(5)
    a, b = _wide(rng, (3, 4500), 10), _wide(rng, (4500, 2), 10)
    _same(ops.matmul(_t(a), _t(b)), reference.matmul(a, b))
    onehot = np.zeros((5, 4500), np.float32)
    onehot[rng.integers(0, 5, 4500), np.arange(4500)] = 1.0
    _same(ops.matmul(_t(onehot), _t(b), a_bits=1), reference.matmul(onehot, b, a_bits=1))


@FAST
@given(
    shape=st.lists(st.integers(1, 50), min_size=1, max_size=3),
    dim=st.integers(0, 2),
    seed=st.integers(0, 2**32 - 1),
)
def test_sum_exact_equals_reference_and_fsum(shape: list[int], dim: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = _wide(rng, tuple(shape))
    dim = dim % x.ndim
    got = ops.sum_exact(_t(x), dim)
    _same(got, reference.sum_exact(x, dim))
    # Terms are rounded 51 - ceil_log2(K) bits below the largest, far below float32's precision.
    flat = np.moveaxis(x, dim, -1).reshape(-1, x.shape[dim]).astype(np.float64)
    exact = np.array([math.fsum(row) for row in flat]).reshape(got.shape)
    tolerance = np.abs(flat).max(axis=1).reshape(got.shape) * 2.0**-30 + np.abs(exact) * 2**-23
    assert np.all(np.abs(got.numpy() - exact) <= tolerance)


@FAST
@given(
    shape=st.lists(st.integers(1, 70), min_size=1, max_size=3),
    dim=st.integers(0, 2),
    seed=st.integers(0, 2**32 - 1),
)
def test_sum_tree_equals_reference_and_is_accurate(shape: list[int], dim: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = _wide(rng, tuple(shape), 12)
    dim = dim % x.ndim
    got = ops.sum_tree(_t(x), dim)
    _same(got, reference.sum_tree(x, dim))
    flat = np.moveaxis(x, dim, -1).reshape(-1, x.shape[dim]).astype(np.float64)
    exact = np.array([math.fsum(row) for row in flat]).reshape(got.shape)
    levels = max(1, (x.shape[dim] - 1).bit_length())
    bound = np.abs(flat).sum(axis=1).reshape(got.shape) * levels * 2.0**-23
    assert np.all(np.abs(got.numpy() - exact) <= bound)


@FAST
@given(seed=st.integers(0, 2**32 - 1))
def test_elementwise_functions_equal_reference_and_are_accurate(seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = np.concatenate(
        [
            (rng.standard_normal(3000) * rng.choice([0.1, 3.0, 40.0], 3000)).astype(np.float32),
            np.array([-np.inf, -1000, -86.5, -86, 0, 88, 500, 1e-30, -1e-30], np.float32),
        ]
    )
    e = ops.exp(_t(x))
    _same(e, reference.exp(x))
    finite = (x > -86) & (x < 88)
    truth = np.exp(x[finite].astype(np.float64))
    assert np.all(np.abs(e.numpy()[finite] - truth) <= truth * 3e-7)
    assert np.all(e.numpy()[x < -86] == 0)

    bounded = np.clip(x, -20, 20)
    erf = ops.erf(_t(bounded))
    _same(erf, reference.erf(bounded))
    truth = np.array([math.erf(v) for v in bounded.astype(np.float64)])
    assert np.max(np.abs(erf.numpy() - truth)) < 6e-7

    positive = np.abs(x[np.isfinite(x) & (np.abs(x) > 1e-30)])
    log = ops.log_pos(_t(positive))
    _same(log, reference.log_pos(positive))
    truth = np.log(positive.astype(np.float64))
    assert np.all(np.abs(log.numpy() - truth) <= np.abs(truth) * 2**-23 + 1e-12)

    # Correctly rounded: equal to numpy's IEEE sqrt (torch's own vectorized sqrt is not).
    squares = np.concatenate([positive, np.array([0.0, 1.0, 4.0], np.float32)])
    _same(ops.sqrt(_t(squares)), np.sqrt(squares))


@pytest.mark.parametrize("threads", [1, 2])
def test_sqrt_is_correctly_rounded_for_every_significand(threads: int) -> None:
    # ops.sqrt rounds torch's float64 sqrt (not correctly rounded itself) to float32; that is
    # exact as long as the float64 result is within 4 ulp. Every float32 in [1, 4) covers every
    # significand at both exponent parities; other binades are these scaled by powers of 4.
    torch.set_num_threads(threads)
    x = np.arange(0x3F800000, 0x40800000, dtype=np.uint32).view(np.float32)
    _same(ops.sqrt(_t(x)), np.sqrt(x))
    tiny = np.arange(0, 1 << 23, 997, dtype=np.uint32).view(np.float32)  # subnormals and 0
    special = np.array([0.0, -0.0, np.inf, np.finfo(np.float32).max, 1e-45], np.float32)
    for values in (tiny, special):
        _same(ops.sqrt(_t(values)), np.sqrt(values))


# ---- every operator, through whole steps on random shapes ----------------------------------


def _shape_and_batch(draw: st.DrawFn) -> tuple[ModelShape, int]:
    heads = draw(st.integers(1, 3))
    shape = ModelShape(
        d_model=heads * draw(st.integers(1, 6)),
        n_layers=draw(st.integers(1, 2)),
        n_heads=heads,
        context=draw(st.integers(2, 12)),
        mlp_ratio=draw(st.integers(1, 3)),
    )
    return shape, draw(st.integers(1, 3))


@st.composite
def _configs(draw: st.DrawFn) -> tuple[ModelShape, int, int]:
    shape, batch = _shape_and_batch(draw)
    return shape, batch, draw(st.integers(0, 2**31))


@FAST
@given(config=_configs())
def test_every_operator_of_a_step_equals_the_numpy_reference(
    config: tuple[ModelShape, int, int],
) -> None:
    shape, batch, seed = config
    stepper = RepOpsStep(CORPUS, seed, shape=shape, batch_size=batch)
    state = stepper.initial_state(init_params(shape, seed % 1000))
    for step in range(2):  # the second step has non-zero AdamW moments
        torch_result = stepper(state, step)
        inputs, targets = stepper.batch(step)
        new, _, ex = reference.training_step_reference(
            state, inputs, targets, shape, AdamWConfig(), record=True
        )
        assert [r.name for r in torch_result.records] == [r.name for r in ex.records]
        for ours, theirs in zip(torch_result.records, ex.records, strict=True):
            assert ours == theirs, f"{ours.name} differs"
        assert state_hash(torch_result.state) == state_hash(new)
        state = torch_result.state


def test_step_is_the_same_on_one_and_two_threads() -> None:
    # Big enough that MKL and torch's elementwise loops do split work across threads.
    shape = ModelShape(d_model=64, n_layers=2, n_heads=2, context=64)
    stepper = RepOpsStep(CORPUS, 3, shape=shape, batch_size=4)
    state = {k: _t(v) for k, v in stepper.initial_state(init_params(shape, 4)).items()}
    inputs, targets = (torch.from_numpy(a) for a in stepper.batch(0))
    hashes = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        new, _ = train_step(state, inputs, targets, shape)
        new, loss = train_step(new, inputs, targets, shape)
        hashes.append((state_hash({k: v.numpy() for k, v in new.items()}), loss.item()))
    assert hashes[0] == hashes[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_cuda_step_equals_cpu_step() -> None:
    shape = ModelShape(d_model=32, n_layers=2, n_heads=2, context=32)
    cpu = RepOpsStep(CORPUS, 1, shape=shape, batch_size=4)
    gpu = RepOpsStep(CORPUS, 1, shape=shape, batch_size=4, device="cuda")
    state = cpu.initial_state(init_params(shape))
    assert cpu(state, 0).records == gpu(state, 0).records


# ---- the traced step ------------------------------------------------------------------------


def _small() -> tuple[RepOpsStep, dict[str, np.ndarray]]:
    shape = ModelShape(d_model=16, n_layers=2, n_heads=2, context=16)
    stepper = RepOpsStep(CORPUS, 11, shape=shape, batch_size=2)
    return stepper, stepper.initial_state(init_params(shape, 2))


def test_every_record_of_the_default_step_replays_through_run_op() -> None:
    stepper = RepOpsStep(CORPUS, 5, batch_size=2)
    result = stepper(stepper.initial_state(), 0)
    assert len(result.records) == len(result.outputs)
    for index, record in enumerate(result.records):
        assert tensor_hash(result.outputs[index]) == record.output
        assert all(i < index for i in record.inputs)
        if record.is_leaf:
            continue
        inputs = [result.outputs[i] for i in record.inputs]
        assert tensor_hash(run_op(record.name, inputs, record.attrs)) == record.output, index
    leaves = {r.name for r in result.records if r.is_leaf}
    assert {"leaf:inputs", "leaf:targets", "leaf:adam.step"} <= leaves
    assert {f"leaf:{name}" for name in result.state} <= leaves
    assert 0 < step_loss(result) < 6.0  # about log(256) = 5.55 at initialisation


def test_reference_run_op_agrees_with_torch_run_op() -> None:
    stepper, state = _small()
    result = stepper(state, 0)
    # The untraced fast path computes the same state as the traced step.
    inputs, targets = (torch.from_numpy(a) for a in stepper.batch(0))
    fast, _ = train_step({k: _t(v) for k, v in state.items()}, inputs, targets, stepper.shape)
    assert state_hash({k: v.numpy() for k, v in fast.items()}) == state_hash(result.state)
    for record in result.records:
        if not record.is_leaf:
            inputs = [result.outputs[i] for i in record.inputs]
            _same(run_op(record.name, inputs, record.attrs),
                  reference.run_op(record.name, inputs, record.attrs))  # fmt: skip


def test_tampered_operator_is_caught_by_recomputing_it() -> None:
    stepper, state = _small()
    honest = stepper(state, 3)
    ops_only = [i for i, r in enumerate(honest.records) if not r.is_leaf]
    changed_state = 0
    for target in [*ops_only[:: max(1, len(ops_only) // 12)], ops_only[-1]]:
        cheat = stepper(state, 3, tamper_op=target)
        changed_state += state_hash(cheat.state) != state_hash(honest.state)
        assert cheat.records[:target] == honest.records[:target]
        record = cheat.records[target]
        assert record.output != honest.records[target].output
        assert tensor_hash(cheat.outputs[target]) == record.output
        inputs = [cheat.outputs[i] for i in record.inputs]
        assert tensor_hash(run_op(record.name, inputs, record.attrs)) != record.output
        # Exactly one bit: element 0's lowest bit.
        diff = np.bitwise_xor(
            cheat.outputs[target].view(np.uint8), honest.outputs[target].view(np.uint8)
        )
        assert diff.sum() == 1 and diff.reshape(-1)[0] == 1
    # A flipped last bit can be rounded away downstream (22-bit matmul grids, AdamW's 0.1 * g,
    # the loss feeds nothing), so not every tamper reaches the state; most do.
    assert changed_state > 7


def test_tamper_op_must_name_an_operator_of_the_step() -> None:
    stepper, state = _small()
    with pytest.raises(ValueError):
        stepper(state, 0, tamper_op=0)  # a leaf
    with pytest.raises(ValueError):
        stepper(state, 0, tamper_op=10**6)
    with pytest.raises(ValueError):
        run_op("leaf:inputs", [], b"")
    with pytest.raises(ValueError):
        run_op("linear", [np.zeros((2, 3), np.float32)], b"")  # two inputs missing
    with pytest.raises(ValueError):
        run_op("matmul", [np.zeros((2, 3), np.float32), np.zeros((4, 2), np.float32)], b"")
    with pytest.raises(ValueError):
        run_op("attention_probs", [np.zeros((4, 6), np.float32)], b"")  # no heads/batch attrs
    with pytest.raises(ValueError):
        stepper({k: v for k, v in state.items() if k != "adam.step"}, 0)


def test_attrs_are_canonical_msgpack() -> None:
    raw = encode_attrs({"heads": 4, "batch": 8})
    assert raw == encode_attrs({"batch": 8, "heads": 4})
    assert decode_attrs(raw) == {"batch": 8, "heads": 4}
    assert encode_attrs({}) == b""
    with pytest.raises(ValueError):
        decode_attrs(b"\x82\xa5heads\x04\xa5batch\x08")  # keys out of order
    with pytest.raises(ValueError):
        decode_attrs(b"\x93\x01\x02\x03")


def test_batches_are_a_function_of_seed_and_step() -> None:
    corpus = np.frombuffer(CORPUS, np.uint8)
    inputs, targets = batch_for(corpus, 1, 0, 4, 16)
    assert inputs.shape == targets.shape == (4, 16) and inputs.dtype == np.int64
    assert np.array_equal(inputs[:, 1:], targets[:, :-1])
    again = batch_for(corpus, 1, 0, 4, 16)
    assert np.array_equal(inputs, again[0])
    assert not np.array_equal(inputs, batch_for(corpus, 1, 1, 4, 16)[0])
    assert not np.array_equal(inputs, batch_for(corpus, 2, 0, 4, 16)[0])


# ---- close to native torch --------------------------------------------------------------------


def test_init_params_equal_byte_transformer() -> None:
    config = ByteTransformerConfig(d_model=32, n_layers=2, n_heads=2, context=16)
    model = ByteTransformer(config, seed=9)
    ours = init_params(ModelShape(32, 2, 2, 16), seed=9)
    theirs = model.state_dict()
    assert list(ours) == list(theirs)
    for name, value in theirs.items():
        _same(value, ours[name])
    with pytest.raises(ValueError):
        initial_state(
            {k: v for k, v in ours.items() if k != "head.weight"}, ModelShape(32, 2, 2, 16)
        )


def test_loss_and_grads_are_close_to_native_autograd() -> None:
    stepper = RepOpsStep(CORPUS, 2, batch_size=4)
    model = ByteTransformer(seed=1)
    # Trained-looking parameters: perturb the init so LayerNorm and biases matter too.
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    inputs, targets = (torch.from_numpy(a) for a in stepper.batch(0))
    native = model.loss(inputs, targets)
    native.backward()
    loss, grads = gradients({k: v.detach() for k, v in model.state_dict().items()}, inputs, targets)
    assert abs(loss.item() - native.item()) < 2e-5 * native.item()
    for name, param in model.named_parameters():
        want, got = param.grad, grads[name]
        error = (got - want).abs().max().item()
        assert error <= 2e-3 * want.abs().max().item() + 1e-7, name
        cosine = torch.nn.functional.cosine_similarity(got.reshape(-1), want.reshape(-1), dim=0)
        assert cosine.item() > 0.99999, name


def test_adamw_step_is_close_to_torch_adamw() -> None:
    generator = torch.Generator().manual_seed(3)
    param = torch.randn(1000, generator=generator)
    reference_param = param.clone().requires_grad_()
    optimizer = torch.optim.AdamW([reference_param], lr=2e-3)
    m, v, step = torch.zeros(1000), torch.zeros(1000), torch.tensor(0)
    hyper = {"lr": 2e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}
    for _ in range(5):
        grad = torch.randn(1000, generator=generator)
        reference_param.grad = grad.clone()
        optimizer.step()
        step = ops.OPS["increment"]([step], {})
        m = ops.OPS["adamw_m"]([m, grad], {"beta1": 0.9})
        v = ops.OPS["adamw_v"]([v, grad], {"beta2": 0.999})
        param = ops.OPS["adamw_param"]([param, m, v, step], hyper)
    torch.testing.assert_close(param, reference_param.detach(), rtol=1e-5, atol=1e-6)


def test_outer_nesterov_step_equals_diloco_bit_for_bit() -> None:
    generator = torch.Generator().manual_seed(4)
    params, momentum = torch.randn(5000, generator=generator), torch.zeros(5000)
    theirs = (params, momentum)
    for _ in range(3):
        pseudo = torch.randn(5000, generator=generator) * 0.01
        params, momentum = nesterov_step(params, momentum, pseudo, lr=0.7, mu=0.9)
        theirs = nesterov_update(theirs[0], theirs[1], pseudo, lr=0.7, mu=0.9)
        _same(params, theirs[0].numpy())
        _same(momentum, theirs[1].numpy())
        attrs = encode_attrs({"lr": 0.7, "momentum": 0.9})
        raw = reference.run_op("nesterov_momentum", [momentum.numpy(), pseudo.numpy()], attrs)
        _same(run_op("nesterov_momentum", [momentum.numpy(), pseudo.numpy()], attrs), raw)


def test_repops_training_lowers_the_loss() -> None:
    shape = ModelShape(d_model=32, n_layers=1, n_heads=2, context=32)
    stepper = RepOpsStep(CORPUS, 0, shape=shape, batch_size=8)
    state = {k: _t(v) for k, v in stepper.initial_state(init_params(shape)).items()}
    losses = []
    for step in range(40):
        inputs, targets = (torch.from_numpy(a) for a in stepper.batch(step))
        state, loss = train_step(state, inputs, targets, shape, AdamWConfig(lr=1e-2))
        losses.append(loss.item())
    assert np.mean(losses[-5:]) < losses[0] - 1.0
