"""The global state on disk: DiLoCo's global parameters and outer momentum, read and written a
bounded slice at a time.

Why: the two flat float32 vectors live for the whole run but are touched only at the round
boundary (pseudo-gradient, outer step, the model reset to the new parameters, the checkpoint).
Held in memory they cost 2x the model's float32 bytes through every inner phase: 800 MB of a
100M-parameter node's RAM for a few seconds of use per round. Here each vector is a file and
the round streams it through two buffers of ``slice_elements`` floats (4 MiB each by default).

Not mmap: mapped file pages count in the process's RSS as soon as they are touched, so a mapped
vector is as resident as an array once the round has read it. ``os.preadv``/``os.pwrite`` copy
through the page cache instead, which the kernel reclaims under pressure and never charges to
the process.

The files are anonymous (``tempfile.TemporaryFile``: unlinked at once, gone with the process),
in ``directory`` (the node's state directory, so they sit on its disk; else ``TMPDIR``; on a
tmpfs they would be memory again, only not the process's). They are a working copy, never
resumed from: what a restart resumes is the checkpoint, written atomically from this store after
every round (``diloco.checkpoint.save`` streams ``write_to``). So a crash in the middle of an
update leaves the previous state in the last checkpoint. Inside the process a half-done update
is detected: ``update()`` marks the store torn until its block ends without an exception, and a
torn store refuses every read (``TornState``) instead of serving a mix of two rounds.

Bits: every element goes through the same float32 operations as the in-memory path
(``diloco.outer.nesterov_update_`` on each slice, elementwise), and the encoding is
``GlobalState``'s byte for byte: the same state hash.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO

import numpy as np
import torch

from diloco.outer import OuterConfig, nesterov_update_
from diloco.state import (
    _DIGEST_BYTES,
    _HEADER,
    MAGIC,
    TENSOR_NAMES,
    VERSION,
    GlobalState,
    encoded_size,
    parse,
    tensor_head,
)

# Floats per slice: the buffers are this size whatever the model's (4 MiB each).
SLICE_ELEMENTS = 1 << 20
_FLOAT = 4


class TornState(RuntimeError):
    """An update of the store raised half-way: its files hold parts of two rounds."""


class StateStore:
    """The global state (round, layout, params, momentum of ``numel`` floats each) in two
    anonymous files under ``directory`` (None: ``TMPDIR``). Starts at round 0 with zero
    parameters and momentum; fill it with ``write`` or ``assign``.

    ``read`` returns a view of the store's own buffer for that vector (valid until the next
    ``read`` of it); the buffers never grow past ``slice_elements`` floats each."""

    def __init__(
        self,
        numel: int,
        layout: bytes,
        directory: str | os.PathLike[str] | None = None,
        *,
        slice_elements: int = SLICE_ELEMENTS,
    ) -> None:
        if numel < 0 or len(layout) != 32 or slice_elements <= 0:
            raise ValueError("StateStore needs numel >= 0, a 32-byte layout, slice_elements > 0")
        if sys.byteorder != "little":
            raise RuntimeError("the state store writes native float32: a little-endian host")
        self.numel = numel
        self.layout = layout
        self.round = 0
        self.slice_elements = slice_elements
        if directory is not None:
            os.makedirs(directory, exist_ok=True)
        self._files: dict[str, IO[bytes]] = {}
        for name in TENSOR_NAMES:
            # Kept open for the store's life (closed by ``close`` or when collected).
            file = tempfile.TemporaryFile(prefix=f".diloco-{name}-", dir=directory)  # noqa: SIM115
            os.ftruncate(file.fileno(), numel * _FLOAT)  # reads as zeros, no blocks written
            self._files[name] = file
        self._buffers = {name: torch.empty(min(numel, slice_elements)) for name in TENSOR_NAMES}
        self._hash: bytes | None = None  # the encoding's digest while no write changed it
        self._torn = False
        # Whole-state readers (the hash, the encoding) may run in another thread than the round
        # (overlap mode's averaging thread asks for the hash): they wait for an update to end
        # and read through buffers of their own.
        self._lock = threading.RLock()

    # -- slices --------------------------------------------------------------------------------

    def ranges(self, start: int, stop: int) -> Iterator[tuple[int, int]]:
        """``[start, stop)`` cut into slices of at most ``slice_elements``."""
        self._check_span(start, stop)
        for a in range(start, stop, self.slice_elements):
            yield a, min(a + self.slice_elements, stop)

    def read(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of vector ``name`` (at most ``slice_elements``), in the
        store's buffer for that vector. For the thread that runs the rounds."""
        self._check_slice(start, stop)
        return self._pread(name, start, self._buffers[name][: stop - start])

    def _pread(self, name: str, start: int, out: torch.Tensor) -> torch.Tensor:
        if self._torn:
            raise TornState("the global state was left half-written by a failed update")
        view = memoryview(out.numpy()).cast("B")
        fd, offset, done = self._files[name].fileno(), start * _FLOAT, 0
        while done < len(view):
            got = os.preadv(fd, [view[done:]], offset + done)
            if got <= 0:
                raise OSError(f"the state file of {name} ends early (read {done} bytes)")
            done += got
        return out

    def write(self, name: str, start: int, values: torch.Tensor) -> None:
        """Write flat float32 CPU ``values`` at ``start`` of vector ``name``. Call it inside
        ``update()`` when it is one of several writes that belong together."""
        if values.dtype != torch.float32 or values.dim() != 1 or values.device.type != "cpu":
            raise ValueError("StateStore.write takes a flat float32 CPU tensor")
        self._pwrite(name, start, values.contiguous().numpy())

    def _pwrite(self, name: str, start: int, values: np.ndarray) -> None:
        self._check_span(start, start + len(values))
        self._hash = None
        view = memoryview(values).cast("B")
        fd, offset, done = self._files[name].fileno(), start * _FLOAT, 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], offset + done)

    @contextmanager
    def update(self) -> Iterator[None]:
        """Writes that make one new state: if the block raises, the store is torn for good."""
        with self._lock:
            if self._torn:
                raise TornState("the global state was left half-written by a failed update")
            try:
                yield
            except BaseException:
                self._torn = True
                self._hash = None
                raise

    # -- whole-state operations ----------------------------------------------------------------

    def assign(self, state: GlobalState) -> None:
        """Take ``state``'s round and vectors (its layout must be ours: ValueError)."""
        self._check_layout(state.layout, state.params.numel())
        with self.update():
            for name in TENSOR_NAMES:
                vector = getattr(state, name)
                for a, b in self.ranges(0, self.numel):
                    self.write(name, a, vector[a:b])
            self.round = state.round

    def load_bytes(self, data: bytes | bytearray | memoryview) -> None:
        """Take an encoded state (``GlobalState.to_bytes()``, e.g. downloaded from peers) after
        verifying it, without decoding it into memory. ValueError as ``GlobalState.from_bytes``
        or for another layout; nothing is written then."""
        round_, layout, arrays = parse(data)
        self._check_layout(layout, len(arrays[0]))
        with self.update():
            for name, array in zip(TENSOR_NAMES, arrays, strict=True):
                for a, b in self.ranges(0, self.numel):
                    # A little-endian host: the views are native float32 already (no copy).
                    self._pwrite(name, a, array[a:b])
            self.round = round_
            self._hash = bytes(memoryview(data)[-_DIGEST_BYTES:])

    def load_file(self, fd: int, offset: int) -> int:
        """Take the encoded state at ``offset`` of the open file ``fd`` (a checkpoint, whose
        checksums the caller verified), copied a slice at a time without decoding it into
        memory. Returns its round. ValueError, before anything is written, when it is not an
        encoding of a state of our layout."""
        head = os.pread(fd, _HEADER.size, offset)
        if len(head) != _HEADER.size:
            raise ValueError("the state's encoding ends inside its header")
        magic, version, round_, layout, count = _HEADER.unpack(head)
        if magic != MAGIC or version != VERSION or count != len(TENSOR_NAMES):
            raise ValueError("not a state encoding of this version")
        self._check_layout(layout, self.numel)
        starts, position = [], offset + _HEADER.size
        for name in TENSOR_NAMES:
            expected = tensor_head(name, self.numel)
            if os.pread(fd, len(expected), position) != expected:
                raise ValueError("the state is for another model (parameter layout differs)")
            starts.append(position + len(expected))
            position += len(expected) + _FLOAT * self.numel
        digest = os.pread(fd, _DIGEST_BYTES, position)
        if len(digest) != _DIGEST_BYTES:
            raise ValueError("the state's encoding ends before its digest")
        with self.update():
            for name, start in zip(TENSOR_NAMES, starts, strict=True):
                for a, b in self.ranges(0, self.numel):
                    buffer = self._buffers[name][: b - a].numpy()
                    view, done = memoryview(buffer).cast("B"), 0
                    while done < len(view):
                        got = os.preadv(fd, [view[done:]], start + _FLOAT * a + done)
                        if got <= 0:
                            raise ValueError("the state's encoding ends inside its data")
                        done += got
                    self._pwrite(name, a, buffer)
            self.round = round_
            self._hash = digest
        return round_

    def outer_step(self, mean: torch.Tensor, config: OuterConfig, start: int = 0) -> None:
        """The outer Nesterov step of round ``self.round`` on elements ``[start, start +
        len(mean))`` (a fragment, or all of them), a slice at a time; round + 1. The same bits
        as ``diloco.outer.outer_step`` in memory."""
        stop = start + mean.numel()
        mu = config.momentum_at(self.round)
        with self.update():
            for a, b in self.ranges(start, stop):
                params, momentum = self.read("params", a, b), self.read("momentum", a, b)
                nesterov_update_(params, momentum, mean[a - start : b - start], config.lr, mu)
                self.write("params", a, params)
                self.write("momentum", a, momentum)
            self.round += 1

    def skip_round(self) -> None:
        """A failed round: the vectors stay, round + 1 (``diloco.outer.skipped_round``)."""
        with self._lock:
            self.round += 1
            self._hash = None

    def vector(self, name: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """A copy of ``[start, stop)`` of vector ``name`` in memory (all of it by default)."""
        stop = self.numel if stop is None else stop
        self._check_span(start, stop)
        with self._lock:
            return self._pread(name, start, torch.empty(stop - start))

    def to_state(self) -> GlobalState:
        """The state as an in-memory ``GlobalState`` (two full copies: for tests and tools)."""
        with self._lock:
            params, momentum = self.vector("params"), self.vector("momentum")
            return GlobalState(self.round, params, momentum, self.layout)

    # -- encoding (GlobalState's, streamed from the files) -------------------------------------

    def encoded_size(self) -> int:
        return encoded_size(self.numel)

    def write_to(self, write: Callable[[bytes], object]) -> bytes:
        """Hand the encoding to ``write`` piece by piece (a slice at a time); returns its digest,
        the state hash, which is kept until the next change."""
        hasher = hashlib.sha256()
        with self._lock:
            for piece in self._pieces():
                hasher.update(piece)
                write(piece)  # type: ignore[arg-type]  # an ndarray is bytes-like
            digest = hasher.digest()
            write(digest)
            self._hash = digest
        return digest

    def state_hash(self) -> str:
        """SHA-256 hex of the encoding (``GlobalState.state_hash``); read from the files once
        after each change."""
        with self._lock:
            if self._hash is None:
                hasher = hashlib.sha256()
                for piece in self._pieces():
                    hasher.update(piece)
                self._hash = hasher.digest()
            return self._hash.hex()

    def to_bytes(self) -> bytes:
        pieces: list[bytes] = []
        self.write_to(lambda piece: pieces.append(bytes(piece)))
        return b"".join(pieces)

    def close(self) -> None:
        for file in self._files.values():
            file.close()

    def _pieces(self) -> Iterator[bytes | np.ndarray]:
        """The encoding without its digest; the vectors a slice at a time through a buffer of
        this call's own (the caller holds the lock)."""
        buffer = torch.empty(min(self.numel, self.slice_elements))
        yield _HEADER.pack(MAGIC, VERSION, self.round, self.layout, len(TENSOR_NAMES))
        for name in TENSOR_NAMES:
            yield tensor_head(name, self.numel)
            for a, b in self.ranges(0, self.numel):
                yield self._pread(name, a, buffer[: b - a]).numpy()

    def _check_layout(self, layout: bytes, numel: int) -> None:
        if layout != self.layout or numel != self.numel:
            raise ValueError("the state is for another model (parameter layout differs)")

    def _check_span(self, start: int, stop: int) -> None:
        if not 0 <= start <= stop <= self.numel:
            raise ValueError(f"[{start}, {stop}) is outside the state's {self.numel} elements")

    def _check_slice(self, start: int, stop: int) -> None:
        self._check_span(start, stop)
        if stop - start > self.slice_elements:
            raise ValueError(f"a read of {stop - start} elements is over {self.slice_elements}")
