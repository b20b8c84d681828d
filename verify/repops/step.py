"""RepOps: reproducible training of the default model, and the traced step the dispute game checks.

A RepOps step gives the same bits on any thread count, BLAS library and device because every
floating-point reduction is made exact (then rounded once) and every other operation is a single
IEEE operation or one of our polynomials (``verify.repops.ops``). ``verify.repops.reference`` is
the same in pure numpy. This module imports no networking.

Public face:

* ``RepOpsStep(corpus, seed)``: a ``verify.trace.TracedStep`` for the default model; its state is
  the parameters (``ByteTransformer().state_dict()`` names), ``adam.m.*``, ``adam.v.*`` and the
  0-d int64 ``adam.step``; step ``i`` trains on ``batch_for(corpus, seed, i, ...)``.
* ``run_op(name, inputs, attrs)``: recompute one recorded operator (a ``verify.trace.Recompute``).
* ``train_step``: the same step on torch tensors without recording (the fast path).
* ``nesterov_step``: the DiLoCo outer step, bit-identical to ``diloco.outer.nesterov_update``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping

import numpy as np
import torch

from verify.repops.graph import (
    STEP_KEY,
    AdamWConfig,
    Executor,
    ModelShape,
    decode_attrs,
    forward_backward,
    param_shapes,
    state_names,
    training_step,
)
from verify.repops.ops import OPS
from verify.trace import LEAF_PREFIX, StepResult, tensor_hash

__all__ = [
    "DEFAULT_ADAMW",
    "DEFAULT_SHAPE",
    "OPS",
    "AdamWConfig",
    "ModelShape",
    "RepOpsStep",
    "batch_for",
    "gradients",
    "init_params",
    "initial_state",
    "nesterov_step",
    "param_shapes",
    "run_op",
    "state_names",
    "step_loss",
    "train_step",
]

_DATA_TAG = b"swarmtrain/repops/data/1"
DEFAULT_SHAPE = ModelShape()  # diloco.model.ByteTransformerConfig's defaults
DEFAULT_ADAMW = AdamWConfig()


def init_params(shape: ModelShape = DEFAULT_SHAPE, seed: int = 0) -> dict[str, np.ndarray]:
    """The parameters ``diloco.model.ByteTransformer(config, seed=seed)`` starts from.

    Same draws in the same order from a private ``torch.Generator`` (zero biases, unit norm
    weights, normal(0, 0.02) weights, residual projections scaled by 1/sqrt(2 n_layers))."""
    generator = torch.Generator().manual_seed(seed)
    residual_std = 0.02 / math.sqrt(2 * shape.n_layers)
    out: dict[str, np.ndarray] = {}
    for name, dims in param_shapes(shape).items():
        if name.endswith(".bias"):
            value = torch.zeros(dims)
        elif ".ln_" in name or name.startswith("ln_"):
            value = torch.ones(dims)
        else:
            std = residual_std if name.endswith(("proj.weight", "fc_out.weight")) else 0.02
            value = torch.randn(dims, generator=generator) * std
        out[name] = value.numpy()
    return out


def initial_state(
    params: Mapping[str, np.ndarray], shape: ModelShape = DEFAULT_SHAPE
) -> dict[str, np.ndarray]:
    """A training state from parameters: zero AdamW moments, step counter 0.

    Raises ValueError when a parameter is missing, extra, of the wrong shape or not float32."""
    expected = param_shapes(shape)
    if set(params) != set(expected):
        raise ValueError("parameters do not match the model shape's names")
    state: dict[str, np.ndarray] = {}
    for name, dims in expected.items():
        value = np.asarray(params[name])
        if value.shape != dims or value.dtype != np.float32:
            raise ValueError(f"parameter {name} must be float32 {dims}")
        state[name] = value.copy()
        state[f"adam.m.{name}"] = np.zeros(dims, np.float32)
        state[f"adam.v.{name}"] = np.zeros(dims, np.float32)
    state[STEP_KEY] = np.zeros((), np.int64)
    return state


def batch_for(
    corpus: bytes | np.ndarray, seed: int, step: int, batch_size: int, context: int
) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets), int64 ``(batch_size, context)``, targets shifted by one byte.

    Window ``b`` starts at SHA-256(tag, seed, step, b) mod (len - context): a pure function of
    its arguments on every platform (no RNG stream whose algorithm could change)."""
    if isinstance(corpus, bytes):
        corpus = np.frombuffer(corpus, np.uint8)
    span = len(corpus) - context
    if span <= 0 or batch_size <= 0 or step < 0:
        raise ValueError("corpus shorter than context + 1, or bad batch size / step")
    rows = []
    for b in range(batch_size):
        digest = hashlib.sha256(
            _DATA_TAG
            + seed.to_bytes(16, "little", signed=True)
            + step.to_bytes(8, "little")
            + b.to_bytes(4, "little")
        ).digest()
        start = int.from_bytes(digest[:8], "little") % span
        rows.append(corpus[start : start + context + 1])
    windows = np.stack(rows).astype(np.int64)
    return windows[:, :-1].copy(), windows[:, 1:].copy()


def _tamper(value: torch.Tensor) -> torch.Tensor:
    """A copy with the lowest bit of element 0 flipped (lowest mantissa bit for floats)."""
    out = value.clone()
    if out.numel() == 0:
        raise ValueError("cannot tamper with an empty tensor")
    bits = {torch.float32: torch.int32, torch.float64: torch.int64}.get(out.dtype, out.dtype)
    flat = out.view(bits).reshape(-1)
    flat[0] = flat[0] ^ 1
    return out


def _hash(value: torch.Tensor) -> bytes:
    return tensor_hash(value.detach().cpu().numpy())


def _check_state(state: Mapping[str, object], shape: ModelShape) -> None:
    missing = set(state_names(shape)) ^ set(state)
    if missing:
        raise ValueError(f"state keys do not match the model: {sorted(missing)[:4]}")


def train_step(
    state: Mapping[str, torch.Tensor],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    shape: ModelShape = DEFAULT_SHAPE,
    optimizer: AdamWConfig = DEFAULT_ADAMW,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One RepOps AdamW step on torch tensors (any device), untraced: (new state, loss)."""
    _check_state(state, shape)
    ex: Executor[torch.Tensor] = Executor(OPS)
    refs = training_step(ex, shape, optimizer, state, inputs, targets)
    return {k: ex.values[r] for k, r in refs.state.items()}, ex.values[refs.loss]


def gradients(
    params: Mapping[str, torch.Tensor],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    shape: ModelShape = DEFAULT_SHAPE,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """RepOps loss and the gradient of every parameter (no optimizer step): (loss, grads)."""
    ex: Executor[torch.Tensor] = Executor(OPS)
    index = {name: ex.leaf(name, params[name]) for name in param_shapes(shape)}
    loss, grads = forward_backward(ex, shape, index.__getitem__, inputs, targets)
    return ex.values[loss], {k: ex.values[r] for k, r in grads.items()}


class RepOpsStep:
    """The default model's traced RepOps training step (``verify.trace.TracedStep``).

    ``corpus`` is the training text (bytes or a uint8 array); step ``i`` trains on
    ``batch_for(corpus, seed, i, batch_size, shape.context)``. ``device`` is where torch runs
    ("cpu" or "cuda"); the bits do not depend on it.
    """

    def __init__(
        self,
        corpus: bytes | np.ndarray,
        seed: int,
        *,
        shape: ModelShape = DEFAULT_SHAPE,
        optimizer: AdamWConfig = DEFAULT_ADAMW,
        batch_size: int = 8,
        device: str = "cpu",
    ) -> None:
        data = np.frombuffer(corpus, np.uint8) if isinstance(corpus, bytes) else corpus
        if data.dtype != np.uint8 or data.ndim != 1 or len(data) <= shape.context:
            raise ValueError("corpus must be bytes (or uint8) longer than the context")
        self.corpus = data
        self.seed = seed
        self.shape = shape
        self.optimizer = optimizer
        self.batch_size = batch_size
        self.device = torch.device(device)

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        return batch_for(self.corpus, self.seed, step, self.batch_size, self.shape.context)

    def initial_state(
        self, params: Mapping[str, np.ndarray] | None = None
    ) -> dict[str, np.ndarray]:
        """``initial_state`` of ``params`` (default: ``init_params(shape, seed=0)``)."""
        return initial_state(init_params(self.shape) if params is None else params, self.shape)

    def __call__(
        self, state: Mapping[str, np.ndarray], step: int, tamper_op: int | None = None
    ) -> StepResult:
        _check_state(state, self.shape)
        inputs, targets = self.batch(step)

        def load(value: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.array(value, copy=True)).to(self.device)

        ex: Executor[torch.Tensor] = Executor(
            OPS, hash_fn=_hash, tamper=_tamper, tamper_op=tamper_op
        )
        tensors = {k: load(v) for k, v in state.items()}
        refs = training_step(ex, self.shape, self.optimizer, tensors, load(inputs), load(targets))
        ex.check_tampered()
        outputs = [v.detach().cpu().numpy() for v in ex.values]
        return StepResult({k: outputs[r] for k, r in refs.state.items()}, ex.records, outputs)


def step_loss(result: StepResult) -> float:
    """The training loss a traced step recorded (its ``cross_entropy`` record)."""
    for record, output in zip(result.records, result.outputs, strict=True):
        if record.name == "cross_entropy":
            return float(output)
    raise ValueError("no cross_entropy record in this step")


def run_op(name: str, inputs: list[np.ndarray], attrs: bytes) -> np.ndarray:
    """Recompute one recorded operator from its inputs, bit for bit (``verify.trace.Recompute``).

    Raises ValueError for a leaf or unknown name, malformed attrs, or inputs the operator cannot
    take (wrong count, dtype or shape: what a lying provider may hand the referee)."""
    if name.startswith(LEAF_PREFIX) or name not in OPS:
        raise ValueError(f"no RepOps operator named {name!r}")
    decoded = decode_attrs(attrs)
    try:
        tensors = [torch.from_numpy(np.array(x, copy=True)) for x in inputs]
        return OPS[name](tensors, decoded).numpy()
    except (RuntimeError, TypeError, IndexError, KeyError, ValueError, OverflowError) as error:
        raise ValueError(f"operator {name} cannot run on these inputs: {error}") from error


def nesterov_step(
    params: torch.Tensor,
    momentum: torch.Tensor,
    pseudo_gradient: torch.Tensor,
    lr: float,
    mu: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DiLoCo's outer Nesterov SGD step through the RepOps operators: (new params, new momentum)."""
    attrs = {"lr": lr, "momentum": mu}
    new_momentum = OPS["nesterov_momentum"]([momentum, pseudo_gradient], attrs)
    return OPS["nesterov_params"]([params, pseudo_gradient, new_momentum], attrs), new_momentum
