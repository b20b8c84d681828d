"""BufferPool lends a buffer again only once nothing refers to it, and keeps within its limit."""

from __future__ import annotations

import numpy as np
import torch

from swarm.averaging.buffers import BufferPool


def test_a_free_buffer_is_lent_again_and_a_held_one_never() -> None:
    pool = BufferPool()
    first = pool.take(1000)
    first_id = id(first)
    held = pool.take(1000)  # `first` is still referenced: a second buffer
    assert held is not first and pool.allocated == 2
    del first
    again = pool.take(1000)
    assert id(again) == first_id and pool.reused == 1
    assert pool.take(1000) is not again and pool.take(1000) is not held


def test_views_memoryviews_and_tensors_keep_a_buffer_out_of_reach() -> None:
    pool = BufferPool()
    for make_ref in (
        lambda b: b[10:20],
        lambda b: memoryview(b).cast("B"),
        lambda b: torch.from_numpy(b[5:]),
        lambda b: b.reshape(10, 100),
    ):
        buffer = pool.take(1000)
        ref = make_ref(buffer)
        del buffer
        other = pool.take(1000)
        assert np.shares_memory(other, np.asarray(ref)) is False, make_ref
        del ref, other


def test_sizes_are_kept_apart_and_the_limit_drops_the_oldest() -> None:
    pool = BufferPool(limit_bytes=3 * 4000)
    a = pool.take(1000)
    b = pool.take(500)
    assert a.size == 1000 and b.size == 500 and a.dtype == np.float32
    del a, b
    assert pool.take(500).size == 500 and pool.reused == 1
    for _ in range(4):
        pool.take(1000)  # each free again at once: reused, nothing new kept
    assert pool.nbytes <= pool.limit_bytes
    big = [pool.take(1000) for _ in range(4)]  # four held at once: over the limit
    assert pool.nbytes <= pool.limit_bytes and len({id(x) for x in big}) == 4
