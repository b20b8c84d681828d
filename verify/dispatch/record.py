"""The dispatch trace: what ``RepOpsMode(recorder=...)`` writes while it runs a step.

Every aten operator the mode routes becomes one ``verify.trace.OpRecord`` per tensor it returns
(or, for an operator that returns nothing, per tensor it writes: a fused AdamW's parameters and
moments, ``verify.dispatch.calls.results``): its name (``aten.mm.default``), the records whose
outputs are its tensor arguments, its attrs (``verify.dispatch.calls``: every other argument,
and which output) and its output's hash. The step's own tensors (parameters, optimizer state,
the batch) enter as ``leaf:<name>`` records first. So the trace of any model's step is the
dispatch log, and one record is recomputed from its inputs alone (``recompute``), by the same
``route`` the mode runs.

Which record an argument is. A tensor is found by where its values live: storage address,
offset, sizes, strides and dtype. Every recorded tensor is kept alive to the end of the step, so
an address is never reused, and the key survives autograd's shallow copies of a view. An
operator that writes in place makes its output the latest record of that place (its version
counter is remembered with it). Two cases have no record and are refused with the operator's
name (``TraceError``): a tensor changed in place through another view of its memory since its
record (its version moved on without a record; the trace cannot say what it holds), and a tensor
made outside the step that is larger than ``MAX_CONST_ELEMENTS``. A small one (a Python scalar
made a tensor, a ``torch.tensor`` literal) becomes a ``dispatch:const`` record whose attrs are
its canonical bytes.

What a record costs: its output hashed. ``outputs`` (what a provider opens) are numpy views of
the tensors themselves, copied only before an operator writes to their memory (and, by
``release``, memory that outlives the step, such as the parameters): a step's trace holds about
what autograd held, not a copy of every operator's output. ``empty`` and its relatives are
zero-filled when recording, so that their outputs (never read by a correct program before
written) hash the same everywhere; ``route`` does it, traced or not.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from verify.commit import tensor_from_canonical
from verify.dispatch.calls import (
    CallError,
    decode_call,
    encode_call,
    overload_named,
    results,
    tensor_outputs,
)
from verify.dispatch.mode import PASSIVE_NAMESPACES, route
from verify.trace import LEAF_PREFIX, OpRecord, canonical_bytes, tensor_hash

aten = torch.ops.aten
CONST_OP = "dispatch:const"
MAX_CONST_ELEMENTS = 4096
# Operators that read memory by address rather than by value: recomputable from their input's
# values only when that input is exactly its whole storage, contiguous from offset 0.
BY_ADDRESS = frozenset({aten.as_strided, aten._reshape_alias})
_BITS = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16}
_NUMPY = frozenset(
    {torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.int16,
     torch.int8, torch.uint8, torch.bool}
)  # fmt: skip
_PLACEHOLDER = torch.empty(0)  # stands for a record's inputs when only its attrs are read


class TraceError(RuntimeError):
    """A step the dispatch trace cannot record faithfully; the message names the operator."""


def _values(tensor: torch.Tensor) -> np.ndarray:
    """``tensor``'s values as numpy: its own memory on the CPU, a copy from another device."""
    if tensor.dtype not in _NUMPY:
        raise TraceError(f"a {tensor.dtype} tensor cannot be traced (RepOps maps float32)")
    return tensor.detach().cpu().numpy()


def snapshot(tensor: torch.Tensor) -> np.ndarray:
    """A C-contiguous numpy copy of ``tensor``'s values."""
    return np.array(_values(tensor), order="C")


@functools.cache
def _written(func: torch._ops.OpOverload) -> tuple[tuple[int, str], ...]:
    """(position, name) of each argument ``func`` writes to (in place or ``out=``)."""
    return tuple(
        (i, a.name)
        for i, a in enumerate(func._schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    )


def is_view(name: str, output: int) -> bool:
    """Whether output ``output`` of operator ``name`` is a view of an input (not written):
    it computes nothing, and changing its bits would change its base's."""
    return output >= 0 and _views(overload_named(name))(output)


@functools.cache
def _views(func: torch._ops.OpOverload) -> Callable[[int], bool]:
    returns = func._schema.returns
    flags = [r.alias_info is not None and not r.alias_info.is_write for r in returns]
    return lambda output: flags[min(output, len(flags) - 1)] if flags else False


def tamperable(record: OpRecord) -> bool:
    """Whether a cheater can flip a bit of this record's output: an operator's output, not a
    leaf, a constant, the state record or a view."""
    if record.is_leaf or ":" in record.name:
        return False
    try:
        _, _, output = decode_call(record.attrs, [_PLACEHOLDER] * len(record.inputs))
    except CallError:
        return False
    return not is_view(record.name, output)


def flip_low_bit(tensor: torch.Tensor) -> None:
    """The contract's tamper, in place: the lowest bit of element 0 (a float's mantissa)."""
    if tensor.numel() == 0:
        raise ValueError("cannot tamper with an empty tensor")
    bits = tensor.view(_BITS.get(tensor.dtype, tensor.dtype))
    first = bits[(0,) * bits.dim()]
    if bits.dtype == torch.bool:
        first.logical_not_()
    else:
        first.bitwise_xor_(1)


def _key(t: torch.Tensor) -> tuple:
    return (
        t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype,
        t.device,
    )  # fmt: skip


class Recorder:
    """The records of one step, in dispatch order (see the module docstring).

    ``tamper_op`` (the cheating provider's) flips one bit of that record's output before
    anything downstream reads it; ``check_tampered`` raises if the step had no such operator.
    """

    def __init__(self, tamper_op: int | None = None) -> None:
        self.records: list[OpRecord] = []
        self.outputs: list[np.ndarray] = []
        self.tamper_op = tamper_op
        self.tampered = False
        self._places: dict[tuple, int] = {}  # where a tensor's values live -> its record
        # Per record, the tensor whose version counter tells whether it still holds the record's
        # values: itself, or for a view the base whose memory it shares, and that counter's
        # value. Versions are read when the next operator starts: inside dispatch an in-place
        # operator has not yet bumped its counter, nor has a view's been made its base's.
        self._watch: list[torch.Tensor] = []
        self._versions: list[int] = []
        self._unsettled: list[int] = []
        self._shared: dict[int, list[int]] = {}  # storage address -> records whose outputs view it

    def leaf(self, label: str, tensor: torch.Tensor) -> int:
        """Record one of the step's inputs (a state tensor or the batch)."""
        return self._add(LEAF_PREFIX + label, (), b"", tensor)

    def _add(
        self,
        name: str,
        inputs: tuple[int, ...],
        attrs: bytes,
        tensor: torch.Tensor,
        watch: torch.Tensor | None = None,
    ) -> int:
        value = _values(tensor)
        self.records.append(OpRecord(name, inputs, attrs, tensor_hash(value)))
        self.outputs.append(value)
        self._watch.append(tensor if watch is None else watch)  # also keeps memory alive
        self._versions.append(-1)
        index = len(self.records) - 1
        self._unsettled.append(index)
        self._places[_key(tensor)] = index
        if tensor.device.type == "cpu":
            self._shared.setdefault(tensor.untyped_storage().data_ptr(), []).append(index)
        return index

    def release(self, tensor: torch.Tensor) -> None:
        """Copy the outputs that view ``tensor``'s memory: it is about to be written."""
        for index in self._shared.pop(tensor.untyped_storage().data_ptr(), ()):
            self.outputs[index] = np.array(self.outputs[index], order="C")

    def _settle(self) -> None:
        for index in self._unsettled:
            self._versions[index] = self._watch[index]._version
        self._unsettled.clear()

    def _input(self, tensor: torch.Tensor, name: str, position: int) -> int:
        found = self._places.get(_key(tensor))
        if found is not None:
            if self._versions[found] == self._watch[found]._version:
                return found
            raise TraceError(
                f"{name}: tensor argument {position} was changed in place through another view "
                "of its memory since it was recorded; the dispatch trace cannot follow that"
            )
        if tensor.numel() > MAX_CONST_ELEMENTS:
            raise TraceError(
                f"{name}: tensor argument {position}, of shape {tuple(tensor.shape)}, was made "
                "outside the step and is no parameter, buffer or batch: the trace cannot check it"
            )
        return self._add(CONST_OP, (), canonical_bytes(snapshot(tensor)), tensor)

    def call(self, func: torch._ops.OpOverload, args: Any, kwargs: Any) -> Any:
        """Run one operator (``route``) and record it; what ``RepOpsMode`` calls."""
        if func.namespace in PASSIVE_NAMESPACES:  # markers: no data, not part of the trace
            return route(func, args, kwargs)
        self._settle()
        name = str(func)
        try:
            tensors, _ = encode_call(args, kwargs, 0)
        except CallError as exc:
            raise TraceError(f"{name}: {exc}") from None
        inputs = tuple(self._input(t, name, i) for i, t in enumerate(tensors))
        if func.overloadpacket in BY_ADDRESS:
            base = tensors[0]
            if not (
                base.is_contiguous()
                and base.storage_offset() == 0
                and base.untyped_storage().nbytes() == base.numel() * base.element_size()
            ):
                raise TraceError(f"{name} reads memory beyond its input's values")
        for position, key in _written(func):
            target = args[position] if position < len(args) else kwargs.get(key)
            for tensor in tensor_outputs(target):
                self.release(tensor)
        out = route(func, args, kwargs)
        views = _views(func)
        for position, tensor in enumerate(results(func, args, kwargs, out)):
            attrs = encode_call(args, kwargs, position)[1]
            watch = None
            if views(position):
                watch = self._base_of(tensor, tensors, inputs, name)
            if len(self.records) == self.tamper_op:
                if watch is not None:
                    raise ValueError(f"tamper_op {self.tamper_op} is a view ({name})")
                flip_low_bit(tensor)
                self.tampered = True
            self._add(name, inputs, attrs, tensor, watch)
        return out

    def _base_of(
        self, view: torch.Tensor, tensors: list[torch.Tensor], inputs: tuple[int, ...], name: str
    ) -> torch.Tensor:
        storage = view.untyped_storage().data_ptr()
        for tensor, record in zip(tensors, inputs, strict=True):
            if tensor.untyped_storage().data_ptr() == storage:
                return self._watch[record]
        raise TraceError(f"{name}: a view of none of its inputs")

    def check_tampered(self) -> None:
        if self.tamper_op is not None and not self.tampered:
            op = self.tamper_op
            what = self.records[op].name if 0 <= op < len(self.records) else "no record"
            raise ValueError(f"tamper_op {op} is not an operator of this step ({what})")


def recompute(name: str, inputs: list[np.ndarray], attrs: bytes) -> np.ndarray:
    """The referee's recomputation of one dispatch record from its input tensors
    (``verify.trace.Recompute``). Raises ValueError when the record cannot be run."""
    if name == CONST_OP:
        if inputs:
            raise ValueError("a constant has no inputs")
        return np.array(tensor_from_canonical(attrs), order="C")
    try:
        func = overload_named(name)
        tensors = [torch.from_numpy(np.array(x, order="C")) for x in inputs]
        args, kwargs, output = decode_call(attrs, tensors)
        outs = results(func, args, kwargs, route(func, args, kwargs))
        if not 0 <= output < len(outs):
            raise ValueError(f"{name} has no output {output}")
        return snapshot(outs[output])
    except Exception as error:  # a provider's bytes: whatever they make the kernel do, no crash
        raise ValueError(f"{name} cannot run on these inputs: {error}") from error
