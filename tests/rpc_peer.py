"""A real peer process serving test RPC methods, for tests/integration/test_rpc.py.

    python tests/rpc_peer.py [--max-connections N]

First stdout line: the peer's multiaddr (``.../p2p/<id>``). Logs go to stderr. Runs until Ctrl+C.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import logging
import sys
from collections.abc import AsyncIterator

import numpy as np
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from p2p import HostConfig, Message, RpcStream, message, open_host, serve_stream, serve_unary
from p2p.tensors import TensorHeader

ECHO = "/swarmtrain-test/echo/1"
TENSOR = "/swarmtrain-test/tensor/1"
UPLOAD = "/swarmtrain-test/upload/1"
FAIL = "/swarmtrain-test/fail/1"


@message(9100, max_bytes=1 << 16)
class Echo(Message):
    payload: bytes


@message(9101)
class TensorRequest(Message):
    elements: int
    seed: int


@message(9102)
class Digest(Message):
    sha256: bytes
    nbytes: int


def make_tensor(elements: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(elements, dtype=np.float32)


async def echo(peer: ID, req: Echo) -> Echo:
    return req


async def tensor(peer: ID, req: TensorRequest) -> AsyncIterator[Message | np.ndarray]:
    yield Digest(hashlib.sha256(make_tensor(req.elements, req.seed).tobytes()).digest(), 0)
    yield make_tensor(req.elements, req.seed)


async def fail(peer: ID, req: Echo) -> Echo:
    raise RuntimeError("this handler always fails")


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-connections", type=int, default=64)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(message)s")
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    config = HostConfig(create_new_key_pair(), max_connections=args.max_connections)
    async with open_host(config) as host:

        async def upload(stream: object) -> None:
            rpc = RpcStream(stream)  # type: ignore[arg-type]
            header = await rpc.receive(TensorHeader)
            array = await rpc.receive_tensor_body(header)
            await rpc.send(Digest(hashlib.sha256(array.tobytes()).digest(), array.nbytes))
            await rpc.close()

        serve_unary(host, ECHO, Echo, echo)
        serve_unary(host, FAIL, Echo, fail)
        serve_stream(host, TENSOR, TensorRequest, tensor)
        host.set_handler(UPLOAD, upload)
        print(host.addrs()[0], flush=True)
        await trio.sleep_forever()


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        trio.run(main)
