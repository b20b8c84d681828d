"""The compiled RepOps kernels (verify/repops/native.c) give exactly the bits of the eager torch
kernels they replace, on every layout and value the step can produce, and fall back to them on
values the C code leaves alone (NaN, infinity) or when no compiler is there."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verify.repops import native, ops, split
from verify.repops.graph import ModelShape
from verify.repops.step import RepOpsStep, init_params

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CORPUS = bytes(range(256)) * 4 + b"reproducible operators, fused\n" * 30


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


def test_the_kernels_are_built_where_a_compiler_exists() -> None:
    # CI installs gcc, so there the kernels must load; a machine without one runs eager torch.
    if os.environ.get("CI") == "true" or shutil.which("cc") or shutil.which("gcc"):
        assert native.library() is not None


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().numpy().tobytes()


def _both(fn, *args):  # type: ignore[no-untyped-def]
    """fn(*args) with the compiled kernels, then with eager torch only: (fused, eager)."""
    fused = fn(*args)
    with native.disabled():
        eager = fn(*args)
    return fused, eager


def _values(rng: np.random.Generator, shape: tuple[int, ...], spread: int) -> np.ndarray:
    """float32 with exponents spread over 2**±spread, some exact zeros, -0 and subnormals."""
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-spread, spread + 1, size=shape))
    x = x.astype(np.float32)
    flat = x.reshape(-1)
    picks = rng.integers(0, flat.size, size=max(1, flat.size // 10))
    flat[picks[0::3]] = 0.0
    flat[picks[1::3]] = -0.0
    flat[picks[2::3]] *= np.float32(1e-39)
    return x


@st.composite
def _layouts(draw: st.DrawFn) -> tuple[torch.Tensor, int, int]:
    """A float32 tensor of 2 to 4 dims, maybe a transposed or sliced view, a dim, grid bits."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    dims = draw(st.lists(st.integers(1, 24), min_size=2, max_size=4))
    spread = draw(st.sampled_from([3, 30, 126]))  # 126: rows near float32's largest exponents
    x = torch.from_numpy(_values(rng, tuple(dims), spread))
    layout = draw(st.sampled_from(["contiguous", "transposed", "sliced", "permuted"]))
    if layout == "transposed":
        x = x.mT.contiguous().mT  # the transpose of a contiguous tensor, as matmul's b often is
    elif layout == "sliced":
        x = torch.cat([x, x], dim=-1)[..., 1 : 1 + dims[-1]]
    elif layout == "permuted" and x.dim() == 4:
        x = x.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)  # attention's head views
    dim = draw(st.sampled_from([-1, -2]))
    bits = draw(st.sampled_from([1, 7, 16, 21, 22, 23, 40, 51]))
    return x, dim, bits


@FAST
@given(layout=_layouts())
def test_grid_rounding_equals_eager_on_every_layout(layout: tuple[torch.Tensor, int, int]) -> None:
    x, dim, bits = layout
    fused, eager = _both(lambda: ops._grid(x, dim, bits).clone())
    assert fused.stride() == eager.stride() or fused.is_contiguous()
    assert _bits(fused) == _bits(eager)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_grid_leaves_non_finite_values_to_eager_torch(bad: float) -> None:
    x = torch.randn(5, 9)
    x[3, 4] = bad
    for dim in (-1, -2):
        out = torch.empty(5, 9, dtype=torch.float64)
        assert not native.grid_into(x, dim, 22, out)
        fused, eager = _both(lambda dim=dim: ops._grid(x, dim, 22).clone())
        assert _bits(fused) == _bits(eager)


@FAST
@given(
    m=st.integers(1, 40),
    k=st.integers(1, 200),
    n=st.integers(1, 40),
    seed=st.integers(0, 2**32 - 1),
)
def test_matmul_with_bias_equals_eager(m: int, k: int, n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    a, w = (torch.from_numpy(_values(rng, s, 20)) for s in ((m, k), (n, k)))
    bias = torch.from_numpy(_values(rng, (n,), 4))
    bias[0] = -0.0
    fused, eager = _both(lambda: ops.OPS["linear"]([a, w, bias], {}))
    assert _bits(fused) == _bits(eager)
    zero = torch.zeros(m, k)
    fused, eager = _both(lambda: ops.matmul(zero, -w.abs().mT))
    assert _bits(fused) == _bits(eager)
    assert not torch.signbit(fused).any()  # sums of -0 still come out +0


def _activations(rng: np.random.Generator, n: int) -> torch.Tensor:
    x = (rng.standard_normal(n) * rng.choice([0.01, 1.0, 3.0, 30.0], n)).astype(np.float32)
    edges = np.array([0.0, -0.0, 1e-40, 90.0, -90.0, 1e30, -1e30, 4.0], np.float32)
    x[: min(n, 8)] = edges[:n]
    return torch.from_numpy(x)


@FAST
@given(n=st.integers(1, 5000), seed=st.integers(0, 2**32 - 1), spread=st.sampled_from([1, 60]))
def test_exp_kernel_equals_eager(n: int, seed: int, spread: int) -> None:
    x = _activations(np.random.default_rng(seed), n) * spread
    x[-1] = [float("inf"), -float("inf"), -104.0, 88.8, -87.5][seed % 5]
    fused, eager = _both(lambda: ops.exp(x))
    assert _bits(fused) == _bits(eager)


@FAST
@given(n=st.integers(1, 5000), seed=st.integers(0, 2**32 - 1))
def test_gelu_kernels_equal_eager(n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    x, dy = _activations(rng, n), torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    cdf, cdf_eager = _both(lambda: ops.OPS["gelu_cdf"]([x], {}))
    assert _bits(cdf) == _bits(cdf_eager)
    grad, grad_eager = _both(lambda: ops.OPS["gelu_backward"]([x, cdf, dy], {}))
    assert _bits(grad) == _bits(grad_eager)


@FAST
@given(
    batch=st.integers(1, 3),
    heads=st.integers(1, 3),
    length=st.integers(1, 40),
    head_dim=st.integers(1, 12),
    spread=st.sampled_from([0.1, 3.0, 300.0]),
    seed=st.integers(0, 2**32 - 1),
)
def test_attention_and_loss_kernels_equal_eager(
    batch: int, heads: int, length: int, head_dim: int, spread: float, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    width = heads * head_dim

    def rand(*shape: int) -> torch.Tensor:
        return torch.from_numpy((rng.standard_normal(shape) * spread).astype(np.float32))

    qkv, dout = rand(batch * length, 3 * width), rand(batch * length, width)
    attrs = {"heads": heads, "batch": batch}
    probs, probs_eager = _both(lambda: ops.OPS["attention_probs"]([qkv], attrs))
    assert _bits(probs) == _bits(probs_eager)
    grad, grad_eager = _both(
        lambda: ops.OPS["attention_scores_backward"]([probs, qkv, dout], attrs)
    )
    assert _bits(grad) == _bits(grad_eager)
    logits = rand(batch, length, 7)
    targets = torch.from_numpy(rng.integers(0, 7, (batch, length)))
    dlogits, dlogits_eager = _both(lambda: ops.OPS["cross_entropy_backward"]([logits, targets], {}))
    assert _bits(dlogits) == _bits(dlogits_eager)


@FAST
@given(
    rows=st.integers(1, 70),
    cols=st.integers(1, 200),
    spread=st.sampled_from([1, 60]),
    seed=st.integers(0, 2**32 - 1),
)
def test_layernorm_and_tree_sum_kernels_equal_eager(
    rows: int, cols: int, spread: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    x, dy = (torch.from_numpy(_values(rng, (rows, cols), spread)) for _ in range(2))
    g, b = (torch.from_numpy(_values(rng, (cols,), 1)) for _ in range(2))
    stats, stats_eager = _both(lambda: ops.OPS["layernorm_stats"]([x], {"eps": 1e-5}))
    assert _bits(stats) == _bits(stats_eager)
    for name, inputs in (
        ("layernorm", [x, stats, g, b]),
        ("layernorm_backward", [x, stats, g, dy]),
        ("layernorm_grad_weight", [x, stats, dy]),
    ):
        fused, eager = _both(lambda name=name, inputs=inputs: ops.OPS[name](inputs, {}))
        assert _bits(fused) == _bits(eager), name
    # The tree over either axis of a matrix, its transpose and a 3-d tensor's middle axis.
    cube = x.view(rows, 1, cols).expand(rows, 2, cols).contiguous()
    for tensor, dim in ((x, 0), (x, 1), (x.t(), 0), (x.t(), 1), (cube, 1), (cube, 0)):
        fused, eager = _both(lambda tensor=tensor, dim=dim: ops.sum_tree(tensor, dim))
        assert _bits(fused) == _bits(eager), (tuple(tensor.shape), tensor.stride(), dim)


@FAST
@given(n=st.integers(1, 3000), seed=st.integers(0, 2**32 - 1), bad=st.booleans())
def test_adamw_kernel_equals_eager(n: int, seed: int, bad: bool) -> None:
    rng = np.random.default_rng(seed)
    p, g, m = (_values(rng, (n,), 20) for _ in range(3))
    v = np.abs(_values(rng, (n,), 20))
    if bad:  # the kernel stops at this element's block; the eager ops do the rest
        g[int(rng.integers(0, n))] = np.inf
    attrs = {"lr": 2e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}
    step = int(rng.integers(1, 5000))

    def update() -> list[torch.Tensor]:
        tensors = [torch.from_numpy(a.copy()) for a in (p, g, m, v)]
        ops.adamw_(*tensors, step, attrs)
        return tensors

    fused, eager = _both(update)
    for got, want in zip(fused, eager, strict=True):
        assert _bits(got) == _bits(want)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.integers(1, 40), cols=st.integers(1, 90), seed=st.integers(0, 2**32 - 1))
def test_every_kernel_gives_the_same_bits_split_over_1_2_and_3_threads(
    rows: int, cols: int, seed: int
) -> None:
    # Every kernel split however small its work (the threshold lowered to one element), so that
    # each range boundary and the causal mask's row numbering across a cut are exercised.
    rng = np.random.default_rng(seed)
    x, dy, z = (torch.from_numpy(_values(rng, (rows, cols), 8)) for _ in range(3))
    g, b = (torch.from_numpy(_values(rng, (cols,), 1)) for _ in range(2))
    v = z.abs()
    if rng.random() < 0.5:
        dy[int(rng.integers(0, rows)), int(rng.integers(0, cols))] = np.inf
    attrs = {"lr": 2e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}
    masked = x.clone()
    masked[int(rng.integers(0, rows))] = -np.inf  # a fully masked row: 0s from _safe_softmax

    def every_kernel() -> list[torch.Tensor]:
        stats = ops.OPS["layernorm_stats"]([x], {"eps": 1e-5})
        p, m, w = x.clone(), z.clone(), v.clone()
        ops.adamw_(p, dy, m, w, 7, attrs)
        return [
            ops.matmul(x, z.t(), bias=b[:rows] if cols >= rows else None),
            ops.matmul(x.expand(2, rows, cols), z.t().expand(2, cols, rows)),
            ops.exp(x),
            ops.OPS["gelu_backward"]([x, ops.OPS["gelu_cdf"]([x], {}), z], {}),
            native.gelu(x, ops.NATIVE_CONSTANTS),
            native.gelu_backward_of_x(x, z, ops.NATIVE_CONSTANTS),
            native.softmax_rows(x, ops.NATIVE_CONSTANTS, 0.5, 1 + seed % 7),
            native.softmax_rows(masked, ops.NATIVE_CONSTANTS, safe=True),
            ops.OPS["attention_scores_backward"](
                [ops.softmax_rows(x), x.repeat(1, 3), z], {"heads": 1, "batch": 1}
            ) if cols == rows else x,
            ops.sum_tree(x, 0), ops.sum_tree(x, 1), stats,
            ops.OPS["layernorm"]([x, stats, g, b], {}),
            ops.OPS["layernorm_backward"]([x, stats, g, z], {}),
            native.layernorm_xhat_dy(x, stats, z),
            native.scores_grad_rows(z, ops.softmax_rows(x), 0.5),
            p, m, w,
        ]  # fmt: skip

    # Unsplit (these sizes are under the threshold): the kernels the other tests hold to eager.
    want = [_bits(t) for t in every_kernel()]
    lib = native.library()
    assert lib is not None and lib.run_ranges is not None, "built without OpenMP"
    original, threads_before = lib.run_ranges, torch.get_num_threads()
    kernels: set[str] = set()

    def spy(kernel: int, ranges: int, *rest: object) -> int:
        kernels.add(split.KERNELS[kernel])
        return original(kernel, ranges, *rest)

    lowered = split.MIN_ELEMENTS_PER_THREAD
    split.MIN_ELEMENTS_PER_THREAD = 1
    lib.run_ranges = spy
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            assert [_bits(t) for t in every_kernel()] == want, threads
    finally:
        split.MIN_ELEMENTS_PER_THREAD = lowered
        lib.run_ranges = original
        torch.set_num_threads(threads_before)
    if rows > 1:  # each kernel went through OpenMP's threads (AdamW's cut is 256-element blocks)
        assert kernels == set(split.KERNELS) - ({"adamw"} if rows * cols <= 256 else set())


def test_a_nan_input_takes_the_eager_path_and_gives_its_bits() -> None:
    x = torch.randn(64)
    x[5] = float("nan")
    for name, inputs in (
        ("gelu_cdf", [x]),
        ("gelu_backward", [x, torch.rand(64), torch.randn(64)]),
        ("cross_entropy_backward", [x.view(8, 8), torch.zeros(8, dtype=torch.int64)]),
    ):
        fused, eager = _both(lambda name=name, inputs=inputs: ops.OPS[name](inputs, {}))
        assert _bits(fused) == _bits(eager), name
    fused, eager = _both(lambda: ops.exp(x))
    assert _bits(fused) == _bits(eager)


def test_two_training_steps_give_the_same_records_with_and_without_the_kernels() -> None:
    shape = ModelShape(d_model=32, n_layers=2, n_heads=2, context=24)
    stepper = RepOpsStep(CORPUS, 7, shape=shape, batch_size=3)
    state = stepper.initial_state(init_params(shape, 5))

    def two_steps() -> list[object]:
        first = stepper(state, 0)
        return [*first.records, *stepper(first.state, 1).records]

    fused, eager = _both(two_steps)
    assert fused == eager


def test_without_a_compiler_the_eager_kernels_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: object, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(native, "_loaded", native._Loaded())
    assert native.library() is None
    assert "could not build the RepOps C kernels" in caplog.text
    x = torch.randn(6, 10)
    assert not native.grid_into(x, -1, 22, torch.empty(6, 10, dtype=torch.float64))
    assert native.gelu_cdf(x, ops.NATIVE_CONSTANTS) is None
    ops.matmul(x, x.mT)  # runs, eagerly


def test_switched_off_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWARMTRAIN_REPOPS_NATIVE", "0")
    assert native.library() is None
