"""A small deterministic training task that speaks the ``verify.trace`` contract in numpy.

A deep linear network trained by SGD on a squared loss, forward and backward written out as
recorded operators (matmul, transpose, sub, mul, scale, sum), so the dispute game can be tested
on every position of a tampered operator without torch. Not a stand-in for RepOps: its matmul is a
broadcast multiply and a numpy ``sum`` over one axis, whose order is fixed by numpy for a given
shape, which is all a same-machine test needs. ``run_op`` is its ``Recompute``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import msgpack
import numpy as np

from verify.trace import LEAF_PREFIX, OpRecord, StepResult, tensor_hash

Op = Callable[[list[np.ndarray], bytes], np.ndarray]


def _matmul(inputs: list[np.ndarray], attrs: bytes) -> np.ndarray:
    a, b = inputs
    return (a[:, :, None] * b[None, :, :]).sum(axis=1, dtype=np.float32)


def _scale(inputs: list[np.ndarray], attrs: bytes) -> np.ndarray:
    factor = msgpack.unpackb(attrs)
    if not isinstance(factor, float):
        raise ValueError("scale needs a float factor")
    return (inputs[0] * np.float32(factor)).astype(np.float32)


OPS: dict[str, Op] = {
    "matmul": _matmul,
    "transpose": lambda inputs, attrs: np.ascontiguousarray(inputs[0].T),
    "sub": lambda inputs, attrs: inputs[0] - inputs[1],
    "mul": lambda inputs, attrs: inputs[0] * inputs[1],
    "sum": lambda inputs, attrs: np.asarray(inputs[0].sum(dtype=np.float32)),
    "scale": _scale,
}
ARITY = {"matmul": 2, "transpose": 1, "sub": 2, "mul": 2, "sum": 1, "scale": 1}


def run_op(name: str, inputs: list[np.ndarray], attrs: bytes) -> np.ndarray:
    """The toy task's ``Recompute``: one operator from its inputs. ``ValueError`` if unknown."""
    if name not in OPS or len(inputs) != ARITY[name]:
        raise ValueError(f"no operator {name!r} with {len(inputs)} inputs")
    if any(x.dtype != np.float32 for x in inputs):
        raise ValueError("the toy task computes in float32 only")
    return OPS[name](inputs, attrs)


def flip_low_bit(array: np.ndarray) -> np.ndarray:
    """The contract's tamper: the lowest mantissa bit of element 0 flipped."""
    out = np.array(array, copy=True)
    flat = out.reshape(-1).view(np.uint32)
    flat[0] ^= 1
    return out


class _Recorder:
    def __init__(self, tamper_op: int | None) -> None:
        self.records: list[OpRecord] = []
        self.outputs: list[np.ndarray] = []
        self.tamper_op = tamper_op

    def leaf(self, label: str, value: np.ndarray) -> int:
        self.records.append(OpRecord(LEAF_PREFIX + label, (), b"", tensor_hash(value)))
        self.outputs.append(value)
        return len(self.records) - 1

    def op(self, name: str, *inputs: int, attrs: bytes = b"") -> int:
        out = run_op(name, [self.outputs[i] for i in inputs], attrs)
        if len(self.records) == self.tamper_op:
            out = flip_low_bit(out)
        self.records.append(OpRecord(name, tuple(inputs), attrs, tensor_hash(out)))
        self.outputs.append(out)
        return len(self.records) - 1


class ToyTask:
    """``TracedStep`` of a ``layers``-deep linear network of width ``dim`` (state: ``w0..``)."""

    def __init__(
        self, *, dim: int = 4, batch: int = 8, layers: int = 2, lr: float = 0.05, data_seed: int = 0
    ) -> None:
        self.dim, self.batch, self.layers, self.lr, self.data_seed = (
            dim,
            batch,
            layers,
            lr,
            data_seed,
        )

    def initial_state(self, seed: int = 0) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        scale = np.float32(1.0 / np.sqrt(self.dim))
        return {
            f"w{i}": (rng.standard_normal((self.dim, self.dim), dtype=np.float32) * scale)
            for i in range(self.layers)
        }

    def batch_for(self, step: int) -> dict[str, np.ndarray]:
        """The data of ``step``: a function of the task's seed and the step only."""
        rng = np.random.default_rng([self.data_seed, step])
        x = rng.standard_normal((self.batch, self.dim), dtype=np.float32)
        return {"x": x, "y": np.ascontiguousarray(x[:, ::-1])}

    def data_leaf_hash(self, step: int, label: str, attrs: bytes) -> bytes | None:
        """What the referee checks a data leaf against (None: not a data leaf)."""
        data = self.batch_for(step)
        return tensor_hash(data[label]) if label in data and not attrs else None

    def __call__(
        self, state: Mapping[str, np.ndarray], step: int, tamper_op: int | None = None
    ) -> StepResult:
        rec = _Recorder(tamper_op)
        weights = [rec.leaf(f"w{i}", np.asarray(state[f"w{i}"])) for i in range(self.layers)]
        data = self.batch_for(step)
        acts = [rec.leaf("x", data["x"])]
        target = rec.leaf("y", data["y"])
        for w in weights:
            acts.append(rec.op("matmul", acts[-1], w))
        err = rec.op("sub", acts[-1], target)
        rec.op("sum", rec.op("mul", err, err))  # the loss: recorded, used by nothing after it
        grad = rec.op("scale", err, attrs=msgpack.packb(2.0 / self.batch))
        new_state: dict[str, int] = {}
        for i in reversed(range(self.layers)):
            grad_w = rec.op("matmul", rec.op("transpose", acts[i]), grad)
            if i:
                grad = rec.op("matmul", grad, rec.op("transpose", weights[i]))
            step_w = rec.op("scale", grad_w, attrs=msgpack.packb(float(self.lr)))
            new_state[f"w{i}"] = rec.op("sub", weights[i], step_w)
        if tamper_op is not None and not (
            0 <= tamper_op < len(rec.records) and not rec.records[tamper_op].is_leaf
        ):
            raise ValueError(f"tamper_op {tamper_op} is not a non-leaf record of this step")
        state_out = {name: rec.outputs[index] for name, index in new_state.items()}
        return StepResult(state_out, rec.records, rec.outputs)
