"""An aten call as the dispatch trace records it: the operator's name, its tensor arguments (the
record's inputs, in order) and ``attrs``, the canonical msgpack of everything else.

``attrs`` is ``[args, kwargs, output]``: the positional and keyword arguments with each tensor
replaced by its position among the inputs, and which tensor of the result the record is (an
operator with several tensor outputs gives several records). Values other than tensors are
msgpack's own (ints, floats as float64, bools, None, strings, lists; keyword names sorted) or an
extension type for a torch dtype, layout or memory format by name, and for a device. A device is
recorded without its type or index: where a provider ran is not part of what it computed, and the
referee recomputes on its CPU. ``decode_call`` is the referee's inverse; it accepts only what
``encode_call`` writes, and names of the ``aten`` namespace.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack
import torch
from torch.utils._pytree import tree_flatten

_TENSOR, _DTYPE, _DEVICE, _LAYOUT, _FORMAT = 1, 2, 3, 4, 5
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool,
)}  # fmt: skip
_LAYOUTS = {"strided": torch.strided}
_FORMATS = {
    "preserve_format": torch.preserve_format,
    "contiguous_format": torch.contiguous_format,
    "channels_last": torch.channels_last,
}
MAX_DEPTH = 8


class CallError(ValueError):
    """A call the trace cannot record, or attrs the referee cannot decode; says which."""


def _pack(value: Any, tensors: list[torch.Tensor], depth: int = 0) -> Any:
    if depth > MAX_DEPTH:
        raise CallError("arguments nested too deeply")
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return msgpack.ExtType(_TENSOR, (len(tensors) - 1).to_bytes(4, "little"))
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_pack(v, tensors, depth + 1) for v in value]
    if isinstance(value, torch.dtype):
        return msgpack.ExtType(_DTYPE, str(value).removeprefix("torch.").encode())
    if isinstance(value, torch.device):
        return msgpack.ExtType(_DEVICE, b"")
    if isinstance(value, torch.layout):
        return msgpack.ExtType(_LAYOUT, str(value).removeprefix("torch.").encode())
    if isinstance(value, torch.memory_format):
        return msgpack.ExtType(_FORMAT, str(value).removeprefix("torch.").encode())
    raise CallError(f"an argument of type {type(value).__name__} cannot be recorded")


def encode_call(
    args: Sequence[Any], kwargs: dict[str, Any], output: int
) -> tuple[list[torch.Tensor], bytes]:
    """(the call's tensor arguments in order, its attrs for output ``output``)."""
    tensors: list[torch.Tensor] = []
    packed_args = _pack(list(args), tensors)
    packed_kwargs = {k: _pack(kwargs[k], tensors) for k in sorted(kwargs)}
    attrs = msgpack.packb([packed_args, packed_kwargs, output], use_bin_type=True)
    return tensors, attrs


def _ext(code: int, data: bytes) -> Any:
    if code == _TENSOR and len(data) == 4:
        return _Slot(int.from_bytes(data, "little"))
    table = {_DTYPE: _DTYPES, _LAYOUT: _LAYOUTS, _FORMAT: _FORMATS}.get(code)
    if table is not None and data.decode(errors="replace") in table:
        return table[data.decode()]
    if code == _DEVICE and not data:
        return torch.device("cpu")
    raise CallError(f"unknown attrs extension {code}")


class _Slot:
    """A tensor argument's place, filled by ``decode_call``."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def _fill(value: Any, tensors: Sequence[torch.Tensor], used: set[int], depth: int = 0) -> Any:
    if depth > MAX_DEPTH:
        raise CallError("attrs nested too deeply")
    if isinstance(value, _Slot):
        if not 0 <= value.index < len(tensors):
            raise CallError(f"attrs name tensor {value.index} of {len(tensors)}")
        used.add(value.index)
        return tensors[value.index]
    if isinstance(value, list):
        return [_fill(v, tensors, used, depth + 1) for v in value]
    if isinstance(value, (bytes, dict)):
        raise CallError("attrs hold a value no call has")
    return value


def overload_named(name: str) -> torch._ops.OpOverload:
    """``torch.ops.aten.<op>.<overload>`` from ``aten.<op>.<overload>``; CallError otherwise."""
    parts = name.split(".")
    if len(parts) != 3 or parts[0] != "aten" or not all(p.isidentifier() for p in parts[1:]):
        raise CallError(f"{name!r} is not an aten operator name")
    try:
        overload = getattr(getattr(torch.ops.aten, parts[1]), parts[2])
    except (AttributeError, RuntimeError):
        raise CallError(f"no aten operator {name!r} in torch {torch.__version__}") from None
    if not isinstance(overload, torch._ops.OpOverload):
        raise CallError(f"{name!r} is not an operator overload")
    return overload


def decode_call(
    attrs: bytes, tensors: Sequence[torch.Tensor]
) -> tuple[list[Any], dict[str, Any], int]:
    """(args, kwargs, output index) of a recorded call, its tensors put back in their places.
    Raises CallError for attrs ``encode_call`` does not write or tensors left unused."""
    try:
        decoded = msgpack.unpackb(attrs, raw=False, ext_hook=_ext, strict_map_key=True)
    except CallError:
        raise
    except Exception as exc:  # msgpack raises many types on garbage
        raise CallError(f"attrs undecodable: {exc}") from None
    if (
        not isinstance(decoded, list)
        or len(decoded) != 3
        or not isinstance(decoded[0], list)
        or not isinstance(decoded[1], dict)
        or not isinstance(decoded[2], int)
        or isinstance(decoded[2], bool)
    ):
        raise CallError("attrs are not [args, kwargs, output]")
    used: set[int] = set()
    args = _fill(decoded[0], tensors, used)
    kwargs = {str(k): _fill(v, tensors, used) for k, v in decoded[1].items()}
    if used != set(range(len(tensors))):
        raise CallError(f"attrs place {len(used)} of the {len(tensors)} input tensors")
    return args, kwargs, decoded[2]


def tensor_outputs(out: Any) -> list[torch.Tensor]:
    """The tensors of an operator's result, in order (None and non-tensors skipped)."""
    return [leaf for leaf in tree_flatten(out)[0] if isinstance(leaf, torch.Tensor)]


def results(func: torch._ops.OpOverload, args: Sequence[Any], kwargs: dict[str, Any], out: Any
            ) -> list[torch.Tensor]:  # fmt: skip
    """What a call of ``func`` produced: the tensors it returned, or for an operator that returns
    nothing and writes its arguments in place (``_foreach_add_``, ``_fused_adamw_``) the
    tensors of those arguments, in schema order, after the call."""
    if func._schema.returns:
        return tensor_outputs(out)
    written: list[torch.Tensor] = []
    for position, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[position] if position < len(args) else kwargs.get(argument.name)
        written.extend(tensor_outputs(value))
    return written
