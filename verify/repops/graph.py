"""The RepOps training step as a fixed sequence of operator applications, independent of backend.

Why a backend-free program: the torch kernels (``verify.repops.ops``) and the numpy reference
(``verify.repops.reference``) are two independent implementations of every operator; wiring them
into a training step the same way is what lets a test compare a whole step bit for bit, and what
makes the trace (``verify.trace.OpRecord`` list) the same canonical graph whoever produced it. This
module imports neither torch nor numpy: it only decides which operator consumes which earlier
output.

The model is ``diloco.model.ByteTransformer`` written functionally over a dict of parameters with
the same names and shapes as its ``state_dict()``; the optimizer state adds ``adam.m.<name>``,
``adam.v.<name>`` and the 0-d int64 step counter ``adam.step``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, TypeVar

import msgpack

from verify.trace import LEAF_PREFIX, OpRecord

T = TypeVar("T")
OpFn = Callable[[list[Any], dict[str, Any]], Any]

VOCAB_SIZE = 256
STEP_KEY = "adam.step"
INPUTS_LABEL = "inputs"
TARGETS_LABEL = "targets"


@dataclass(frozen=True)
class ModelShape:
    """``ByteTransformerConfig`` as plain ints (``verify`` must not import ``diloco``)."""

    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    context: int = 128
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        if min(self.d_model, self.n_layers, self.n_heads, self.context, self.mlp_ratio) <= 0:
            raise ValueError("ModelShape sizes must be positive")
        if self.d_model % self.n_heads:
            raise ValueError("ModelShape.d_model must be divisible by n_heads")


@dataclass(frozen=True)
class AdamWConfig:
    """The inner optimizer: torch.optim.AdamW's update with DiLoCo's default learning rate."""

    lr: float = 2e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01

    def __post_init__(self) -> None:
        if not (self.lr > 0 and 0 <= self.beta1 < 1 and 0 <= self.beta2 < 1 and self.eps > 0):
            raise ValueError("AdamWConfig needs lr > 0, betas in [0, 1), eps > 0")


LN_EPS = 1e-5  # nn.LayerNorm's default


def param_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter, in ``ByteTransformer.named_parameters()`` order."""
    d, hidden = shape.d_model, shape.mlp_ratio * shape.d_model
    out: dict[str, tuple[int, ...]] = {
        "embed.weight": (VOCAB_SIZE, d),
        "position.weight": (shape.context, d),
    }
    for i in range(shape.n_layers):
        p = f"blocks.{i}."
        out |= {
            p + "ln_attn.weight": (d,),
            p + "ln_attn.bias": (d,),
            p + "qkv.weight": (3 * d, d),
            p + "qkv.bias": (3 * d,),
            p + "proj.weight": (d, d),
            p + "proj.bias": (d,),
            p + "ln_mlp.weight": (d,),
            p + "ln_mlp.bias": (d,),
            p + "fc.weight": (hidden, d),
            p + "fc.bias": (hidden,),
            p + "fc_out.weight": (d, hidden),
            p + "fc_out.bias": (d,),
        }
    out |= {"ln_final.weight": (d,), "ln_final.bias": (d,), "head.weight": (VOCAB_SIZE, d)}
    return out


def state_names(shape: ModelShape) -> list[str]:
    """Every key of a RepOps training state: parameters, AdamW moments, the step counter."""
    names = list(param_shapes(shape))
    return names + [f"adam.m.{n}" for n in names] + [f"adam.v.{n}" for n in names] + [STEP_KEY]


def encode_attrs(attrs: Mapping[str, Any]) -> bytes:
    """Canonical msgpack of an operator's non-tensor arguments: keys sorted, b"" when none.

    Floats are packed as float64 and ints as the shortest msgpack int, so equal attrs give equal
    bytes on every machine."""
    if not attrs:
        return b""
    return msgpack.packb(dict(sorted(attrs.items())), use_bin_type=True)


def decode_attrs(raw: bytes) -> dict[str, Any]:
    """Inverse of ``encode_attrs``; ValueError on anything that is not a str-keyed map."""
    if not raw:
        return {}
    try:
        value = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as error:
        raise ValueError(f"bad operator attrs: {error}") from error
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ValueError("operator attrs must be a map with string keys")
    if encode_attrs(value) != raw:
        raise ValueError("operator attrs are not in canonical form")
    return value


def pow_int(base: float, exponent: int) -> float:
    """``base ** exponent`` by binary exponentiation: a fixed sequence of float64 multiplies.

    Why not ``**``: C's ``pow`` is not required to be correctly rounded, so two platforms may
    differ in the last bit of the AdamW bias correction."""
    if exponent < 0:
        raise ValueError("pow_int needs a non-negative exponent")
    result, square = 1.0, base
    while exponent:
        if exponent & 1:
            result *= square
        square *= square
        exponent >>= 1
    return result


class Executor(Generic[T]):
    """Applies operators from ``impl`` in program order; optionally records the trace.

    ``hash_fn`` (tensor -> 32-byte hash) turns recording on. ``tamper`` flips the lowest bit of
    element 0 of a backend tensor; it is applied to record ``tamper_op``'s output before anything
    downstream (including the record's own hash) sees it, which is what a cheater would commit to.
    """

    def __init__(
        self,
        impl: Mapping[str, OpFn],
        *,
        hash_fn: Callable[[T], bytes] | None = None,
        tamper: Callable[[T], T] | None = None,
        tamper_op: int | None = None,
    ) -> None:
        if tamper_op is not None and tamper is None:
            raise ValueError("tamper_op needs a tamper function")
        self._impl = impl
        self._hash = hash_fn
        self._tamper = tamper
        self._tamper_op = tamper_op
        self.values: list[T] = []
        self.records: list[OpRecord] = []
        self._tampered = False

    def _push(self, name: str, inputs: tuple[int, ...], raw: bytes, value: T) -> int:
        index = len(self.values)
        if index == self._tamper_op:
            if name.startswith(LEAF_PREFIX):
                raise ValueError(f"tamper_op {index} is a leaf record")
            assert self._tamper is not None
            value = self._tamper(value)
            self._tampered = True
        self.values.append(value)
        if self._hash is not None:
            self.records.append(OpRecord(name, inputs, raw, self._hash(value)))
        return index

    def leaf(self, label: str, value: T) -> int:
        return self._push(LEAF_PREFIX + label, (), b"", value)

    def op(self, name: str, inputs: Sequence[int], **attrs: Any) -> int:
        raw = encode_attrs(attrs)
        # Attrs go to the kernel decoded from their canonical bytes, exactly as run_op will see
        # them, so a recomputation cannot differ through (say) an int passed as a float.
        value = self._impl[name]([self.values[i] for i in inputs], decode_attrs(raw))
        return self._push(name, tuple(inputs), raw, value)

    def check_tampered(self) -> None:
        """ValueError when ``tamper_op`` named no record of the step (out of range)."""
        if self._tamper_op is not None and not self._tampered:
            raise ValueError(f"tamper_op {self._tamper_op} is not a record of this step")


def _linear_backward(
    ex: Executor[Any], dy: int, x: int, w: int, bias: str | None, grads: dict[str, int], name: str
) -> int:
    """Weight and bias grads into ``grads``; returns the input grad."""
    grads[name + ".weight"] = ex.op("matmul_tn", [dy, x])
    if bias is not None:
        grads[bias] = ex.op("sum_rows", [dy])
    return ex.op("matmul", [dy, w])


def _layernorm_backward(
    ex: Executor[Any], x: int, stats: int, g: int, dy: int, grads: dict[str, int], name: str
) -> int:
    grads[name + ".weight"] = ex.op("layernorm_grad_weight", [x, stats, dy])
    grads[name + ".bias"] = ex.op("sum_rows", [dy])
    return ex.op("layernorm_backward", [x, stats, g, dy])


class StepRefs(NamedTuple):
    """Record indices of what a step produced: the new state, the loss, each parameter's grad."""

    state: dict[str, int]
    loss: int
    grads: dict[str, int]


def forward_backward(
    ex: Executor[Any], shape: ModelShape, leaf: Callable[[str], int], inputs: Any, targets: Any
) -> tuple[int, dict[str, int]]:
    """Loss and the gradient of every parameter, by a hand-written backward pass.

    ``leaf(name)`` returns the record index of a parameter (recording it on first use).
    Returns (loss record, name -> grad record)."""
    batch = _batch_size(inputs)
    heads = {"heads": shape.n_heads}
    tok = ex.leaf(INPUTS_LABEL, inputs)
    x = ex.op("embed", [tok, leaf("embed.weight"), leaf("position.weight")])
    saved: list[dict[str, int]] = []
    for i in range(shape.n_layers):
        p = f"blocks.{i}."
        s: dict[str, int] = {"x_in": x}
        s["st1"] = ex.op("layernorm_stats", [x], eps=LN_EPS)
        s["h1"] = ex.op(
            "layernorm", [x, s["st1"], leaf(p + "ln_attn.weight"), leaf(p + "ln_attn.bias")]
        )
        s["qkv"] = ex.op("linear", [s["h1"], leaf(p + "qkv.weight"), leaf(p + "qkv.bias")])
        s["probs"] = ex.op("attention_probs", [s["qkv"]], batch=batch, **heads)
        s["att"] = ex.op("attention_values", [s["probs"], s["qkv"]], **heads)
        a = ex.op("linear", [s["att"], leaf(p + "proj.weight"), leaf(p + "proj.bias")])
        x = s["x_mid"] = ex.op("add", [x, a])
        s["st2"] = ex.op("layernorm_stats", [x], eps=LN_EPS)
        s["h2"] = ex.op(
            "layernorm", [x, s["st2"], leaf(p + "ln_mlp.weight"), leaf(p + "ln_mlp.bias")]
        )
        s["f"] = ex.op("linear", [s["h2"], leaf(p + "fc.weight"), leaf(p + "fc.bias")])
        s["cdf"] = ex.op("gelu_cdf", [s["f"]])
        s["gelu"] = ex.op("mul", [s["f"], s["cdf"]])
        m = ex.op("linear", [s["gelu"], leaf(p + "fc_out.weight"), leaf(p + "fc_out.bias")])
        x = ex.op("add", [x, m])
        saved.append(s)
    stf = ex.op("layernorm_stats", [x], eps=LN_EPS)
    hf = ex.op("layernorm", [x, stf, leaf("ln_final.weight"), leaf("ln_final.bias")])
    logits = ex.op("matmul_nt", [hf, leaf("head.weight")])
    tgt = ex.leaf(TARGETS_LABEL, targets)
    loss = ex.op("cross_entropy", [logits, tgt])

    grads: dict[str, int] = {}
    dlogits = ex.op("cross_entropy_backward", [logits, tgt])
    dh = _linear_backward(ex, dlogits, hf, leaf("head.weight"), None, grads, "head")
    dx = _layernorm_backward(ex, x, stf, leaf("ln_final.weight"), dh, grads, "ln_final")
    for i in reversed(range(shape.n_layers)):
        p, s = f"blocks.{i}.", saved[i]
        dgelu = _linear_backward(
            ex, dx, s["gelu"], leaf(p + "fc_out.weight"), p + "fc_out.bias", grads, p + "fc_out"
        )
        df = ex.op("gelu_backward", [s["f"], s["cdf"], dgelu])
        dh2 = _linear_backward(
            ex, df, s["h2"], leaf(p + "fc.weight"), p + "fc.bias", grads, p + "fc"
        )
        dxm = _layernorm_backward(
            ex, s["x_mid"], s["st2"], leaf(p + "ln_mlp.weight"), dh2, grads, p + "ln_mlp"
        )
        dx = ex.op("add", [dx, dxm])
        datt = _linear_backward(
            ex, dx, s["att"], leaf(p + "proj.weight"), p + "proj.bias", grads, p + "proj"
        )
        dscores = ex.op("attention_scores_backward", [s["probs"], s["qkv"], datt], **heads)
        dqkv = ex.op("attention_qkv_backward", [s["probs"], s["qkv"], datt, dscores], **heads)
        dh1 = _linear_backward(
            ex, dqkv, s["h1"], leaf(p + "qkv.weight"), p + "qkv.bias", grads, p + "qkv"
        )
        dxa = _layernorm_backward(
            ex, s["x_in"], s["st1"], leaf(p + "ln_attn.weight"), dh1, grads, p + "ln_attn"
        )
        dx = ex.op("add", [dx, dxa])
    grads["embed.weight"] = ex.op("embedding_backward", [tok, dx], vocab=VOCAB_SIZE)
    grads["position.weight"] = ex.op("position_backward", [dx], batch=batch, context=shape.context)
    return loss, grads


def training_step(
    ex: Executor[T],
    shape: ModelShape,
    optimizer: AdamWConfig,
    state: Mapping[str, T],
    inputs: T,
    targets: T,
) -> StepRefs:
    """Run one AdamW training step of the model through ``ex``.

    ``inputs`` and ``targets`` are int64 ``(B, T)``; every other value lives in ``state``.
    Leaves are recorded right before their first use, so a trace reads top to bottom like the
    step: forward, loss, backward, then per parameter (in state_dict order) m, v, parameter.
    """
    refs: dict[str, int] = {}

    def leaf(key: str) -> int:
        if key not in refs:
            refs[key] = ex.leaf(key, state[key])
        return refs[key]

    loss, grads = forward_backward(ex, shape, leaf, inputs, targets)
    new: dict[str, int] = {}
    new[STEP_KEY] = ex.op("increment", [leaf(STEP_KEY)])
    hyper = {
        "lr": optimizer.lr,
        "beta1": optimizer.beta1,
        "beta2": optimizer.beta2,
        "eps": optimizer.eps,
        "weight_decay": optimizer.weight_decay,
    }
    for name in param_shapes(shape):
        g = grads[name]
        m = new[f"adam.m.{name}"] = ex.op(
            "adamw_m", [leaf(f"adam.m.{name}"), g], beta1=optimizer.beta1
        )
        v = new[f"adam.v.{name}"] = ex.op(
            "adamw_v", [leaf(f"adam.v.{name}"), g], beta2=optimizer.beta2
        )
        new[name] = ex.op("adamw_param", [leaf(name), m, v, new[STEP_KEY]], **hyper)
    return StepRefs(new, loss, grads)


def _batch_size(inputs: Any) -> int:
    shape = tuple(inputs.shape)
    if len(shape) != 2:
        raise ValueError("inputs must be (batch, length)")
    return int(shape[0])
