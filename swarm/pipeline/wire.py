"""The pipeline's wire: forward, backward and parameter-download calls between trainers and servers.

One libp2p protocol per method (``/swarmtrain/pipeline/<method>/1``), one request frame, one reply
frame. Tensors travel inside the message as (dtype from an allow-list, shape, little-endian bytes),
checked when the message is built: ``len(data) == prod(shape) * itemsize``. The frame length is
checked against the message type's limit before a byte of the body is read, so a peer announcing a
huge activation costs us four bytes. Activations are small next to the all-reduce's vectors (a
microbatch of a stage's output), so they ride the libp2p stream rather than the bulk data plane,
whose negotiation would cost more than the bytes.

Every call raises ``P2PError`` subclasses only: ``RemoteError`` (the server refused; ``code`` says
why, one of ``REFUSAL_CODES``),
``RemoteProtocolError`` (a bad reply), ``PeerUnreachable``. The caller sets the deadline.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import Any

import numpy as np
import trio

from p2p import Host, Message, PeerID, RemoteError, RpcStream, message

FORWARD_PROTOCOL = "/swarmtrain/pipeline/forward/1"
BACKWARD_PROTOCOL = "/swarmtrain/pipeline/backward/1"
PARAMS_PROTOCOL = "/swarmtrain/pipeline/params/1"

MAX_HOP_BYTES = 64 << 20
MAX_PARAMS_BYTES = 256 << 20
MAX_MICROBATCH_ID_BYTES = 32
MAX_DIMS = 8
# Activations are float; a first stage takes token ids.
_DTYPES = {name: np.dtype(name).newbyteorder("<") for name in ("float32", "float16", "int64")}


def _check_tensor(dtype: str, shape: list[int], data: bytes, *, optional: bool = False) -> None:
    if optional and dtype == "":
        if shape or data:
            raise ValueError("an absent tensor has no shape or data")
        return
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not allowed")
    if len(shape) > MAX_DIMS or any(d < 0 for d in shape):
        raise ValueError(f"bad shape {shape}")
    if math.prod(shape) * _DTYPES[dtype].itemsize != len(data):
        raise ValueError(f"shape {shape} of {dtype} does not match {len(data)} bytes")


def _check_id(microbatch_id: bytes) -> None:
    if not 0 < len(microbatch_id) <= MAX_MICROBATCH_ID_BYTES:
        raise ValueError("microbatch id must be 1..32 bytes")


def to_fields(array: np.ndarray | None) -> tuple[str, list[int], bytes]:
    """(dtype, shape, bytes) of an array for a message; ("", [], b"") for None."""
    if array is None:
        return "", [], b""
    wanted = _DTYPES.get(array.dtype.name)
    if wanted is None:
        raise ValueError(f"dtype {array.dtype.name} cannot travel in the pipeline")
    return array.dtype.name, list(array.shape), np.ascontiguousarray(array, wanted).tobytes()


def from_fields(dtype: str, shape: list[int], data: bytes) -> np.ndarray | None:
    """A writable array from message fields (a copy: torch wants writable memory)."""
    if dtype == "":
        return None
    return np.frombuffer(bytearray(data), dtype=_DTYPES[dtype]).reshape(shape)


@message(110, max_bytes=MAX_HOP_BYTES)
class ForwardRequest(Message):
    run_id: str
    stage: int
    microbatch_id: bytes
    dtype: str
    shape: list[int]
    data: bytes

    def __post_init__(self) -> None:
        _check_id(self.microbatch_id)
        _check_tensor(self.dtype, self.shape, self.data)


@message(111, max_bytes=MAX_HOP_BYTES)
class ForwardReply(Message):
    microbatch_id: bytes
    dtype: str
    shape: list[int]
    data: bytes

    def __post_init__(self) -> None:
        _check_tensor(self.dtype, self.shape, self.data)


@message(112, max_bytes=MAX_HOP_BYTES)
class BackwardRequest(Message):
    """``grad_*``: gradient of the loss w.r.t. the stage's outputs. ``input_*``: the stage's
    inputs again (a failover: the server that ran the forward is gone), or absent."""

    run_id: str
    stage: int
    microbatch_id: bytes
    grad_dtype: str
    grad_shape: list[int]
    grad_data: bytes
    input_dtype: str
    input_shape: list[int]
    input_data: bytes

    def __post_init__(self) -> None:
        _check_id(self.microbatch_id)
        _check_tensor(self.grad_dtype, self.grad_shape, self.grad_data)
        _check_tensor(self.input_dtype, self.input_shape, self.input_data, optional=True)


@message(113, max_bytes=MAX_HOP_BYTES)
class BackwardReply(Message):
    """Gradient w.r.t. the stage's inputs; absent for integer inputs (token ids)."""

    microbatch_id: bytes
    dtype: str
    shape: list[int]
    data: bytes

    def __post_init__(self) -> None:
        _check_tensor(self.dtype, self.shape, self.data, optional=True)


# The codes a server's ``HopRefused`` carries (``swarm.pipeline.server.Refusal``): a fixed set,
# so a trainer's failed hops and a server's refusals can be counted by code.
REFUSAL_CODES = ("wrong-stage", "wrong-run", "unknown-microbatch", "bad-request", "timeout",
                 "internal")  # fmt: skip


@message(114, max_bytes=4096)
class HopRefused(Message):
    code: str
    message: str


@message(115, max_bytes=1024)
class ParamsRequest(Message):
    run_id: str
    stage: int


@message(116, max_bytes=MAX_PARAMS_BYTES)
class ParamsReply(Message):
    """The parameters of the last averaging round (or the initial ones, round -1)."""

    stage: int
    param_round: int
    param_hash: bytes
    dtypes: list[str]
    shapes: list[list[int]]
    data: list[bytes]

    def __post_init__(self) -> None:
        if not len(self.dtypes) == len(self.shapes) == len(self.data):
            raise ValueError("dtypes, shapes and data differ in length")
        for dtype, shape, data in zip(self.dtypes, self.shapes, self.data, strict=True):
            _check_tensor(dtype, shape, data)


@asynccontextmanager
async def _call(host: Host, peer_id: bytes, protocol: str) -> AsyncIterator[RpcStream]:
    stream = await host.open_stream(PeerID(peer_id), protocol)
    rpc = RpcStream(stream)
    try:
        yield rpc
    except BaseException:
        # A stream that is already gone cannot be reset twice.
        with trio.CancelScope(shield=True), trio.move_on_after(1), suppress(Exception):
            await stream.reset()
        raise
    await rpc.close()


def _raise_refused(reply: Message) -> None:
    if isinstance(reply, HopRefused):
        raise RemoteError(reply.code, reply.message)


async def call_forward(
    host: Host,
    peer_id: bytes,
    run_id: str,
    stage: int,
    microbatch_id: bytes,
    inputs: np.ndarray,
) -> np.ndarray:
    """The stage's outputs for ``inputs``; the server keeps the inputs for the backward."""
    request = ForwardRequest(run_id, stage, microbatch_id, *to_fields(inputs))
    async with _call(host, peer_id, FORWARD_PROTOCOL) as rpc:
        await rpc.send(request)
        reply = await rpc.receive(ForwardReply, HopRefused)
    _raise_refused(reply)
    assert isinstance(reply, ForwardReply)
    outputs = from_fields(reply.dtype, reply.shape, reply.data)
    assert outputs is not None
    return outputs


async def call_backward(
    host: Host,
    peer_id: bytes,
    run_id: str,
    stage: int,
    microbatch_id: bytes,
    grad_outputs: np.ndarray,
    inputs: np.ndarray | None,
) -> np.ndarray | None:
    """Gradient w.r.t. the stage's inputs (None for token ids); the server accumulates its
    parameters' gradients. ``inputs`` only when this server did not run the forward."""
    request = BackwardRequest(
        run_id, stage, microbatch_id, *to_fields(grad_outputs), *to_fields(inputs)
    )
    async with _call(host, peer_id, BACKWARD_PROTOCOL) as rpc:
        await rpc.send(request)
        reply = await rpc.receive(BackwardReply, HopRefused)
    _raise_refused(reply)
    assert isinstance(reply, BackwardReply)
    return from_fields(reply.dtype, reply.shape, reply.data)


async def fetch_params(
    host: Host, peer_id: bytes, run_id: str, stage: int
) -> tuple[int, bytes, list[np.ndarray]]:
    """(round, announced hash, arrays) of ``stage`` from a server of it. The caller checks the
    hash against the arrays and the server's signed announcement."""
    async with _call(host, peer_id, PARAMS_PROTOCOL) as rpc:
        await rpc.send(ParamsRequest(run_id, stage))
        reply = await rpc.receive(ParamsReply, HopRefused)
    _raise_refused(reply)
    assert isinstance(reply, ParamsReply)
    if reply.stage != stage:
        raise RemoteError("wrong-stage", f"asked for stage {stage}, got {reply.stage}")
    arrays: list[Any] = [
        from_fields(d, s, b) for d, s, b in zip(reply.dtypes, reply.shapes, reply.data, strict=True)
    ]
    return reply.param_round, reply.param_hash, arrays
