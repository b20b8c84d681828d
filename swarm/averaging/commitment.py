"""A contribution committed before its round: digests of the vector per fixed chunk (issue 19).

In a verified run a peer publishes, before the all-reduce, a commitment to its task (the final
state hash) and, next to it, ``contribution_root``: one SHA-256 over the digests of its
contribution cut into fixed *leaves* of ``leaf_size(numel)`` elements. A task's re-executor
computes the same root from the task (the commitments are compared before the round), so the
root names exactly the values the task owes.

The round's parts are then cut on leaf boundaries (``allreduce.partition``'s ``align``), the
sender's ``Hello`` carries its leaf digests (``contribution_leaves``), and every reducer checks
each slice it receives, before summing it, against them (``check_contribution``): a slice other
than the committed one is refused in the round by whichever reducer gets it, and the machine's
rule for a refused slice drops its sender on every survivor. The leaves are fixed by the vector's
length alone, so they do not depend on the group, its bandwidths or a reducer lost mid-round
(which moves who reduces a part, never the parts).

At most ``MAX_LEAVES`` leaves (32 KiB of digests in the Hello), each at least
``MIN_LEAF_ELEMENTS``: a part boundary moves by less than one leaf, ``numel / 1024`` elements.

Pure: no IO.
"""

from __future__ import annotations

import hashlib

import numpy as np

MIN_LEAF_ELEMENTS = 1024
MAX_LEAVES = 1024
LEAF_DIGEST_BYTES = 32
_LEAF_TAG = b"swarmtrain/contribution-leaf/1"
_ROOT_TAG = b"swarmtrain/contribution-root/1"


def leaf_size(numel: int) -> int:
    """Elements per leaf of a vector of ``numel``: a power of two, at least
    ``MIN_LEAF_ELEMENTS``, and few enough leaves (``MAX_LEAVES``)."""
    size = MIN_LEAF_ELEMENTS
    while size * MAX_LEAVES < numel:
        size *= 2
    return size


def _leaf_digest(values: np.ndarray) -> bytes:
    data = np.ascontiguousarray(values, dtype="<f4")
    return hashlib.sha256(_LEAF_TAG + memoryview(data).cast("B")).digest()


def contribution_leaves(vector: np.ndarray) -> bytes:
    """The digests of ``vector``'s leaves, concatenated (what a sender's Hello carries)."""
    size = leaf_size(len(vector))
    return b"".join(_leaf_digest(vector[i : i + size]) for i in range(0, len(vector), size))


def leaves_root(numel: int, leaves: bytes) -> bytes:
    """The commitment to a vector of ``numel`` whose leaf digests are ``leaves``."""
    return hashlib.sha256(_ROOT_TAG + numel.to_bytes(8, "little") + leaves).digest()


def contribution_root(vector: np.ndarray) -> bytes:
    """What a peer commits to for its contribution ``vector`` (flat float32)."""
    return leaves_root(len(vector), contribution_leaves(vector))


def check_contribution(
    root: bytes, leaves: bytes, numel: int, start: int, values: np.ndarray
) -> str | None:
    """Why ``values``, a slice at ``start`` of a vector of ``numel``, is not the committed
    contribution ``root`` given the sender's ``leaves``; None when it is. A slice must start on
    a leaf boundary and end on one (or at the vector's end): the round's parts are aligned."""
    size = leaf_size(numel)
    stop = start + len(values)
    if len(leaves) != LEAF_DIGEST_BYTES * -(-numel // size) or leaves_root(numel, leaves) != root:
        return "its slice digests do not match its commitment"
    if start % size or (stop % size and stop != numel) or stop > numel:
        return f"its slice [{start}, {stop}) is not on the committed leaves"
    for offset in range(0, len(values), size):
        index = (start + offset) // size
        want = leaves[index * LEAF_DIGEST_BYTES : (index + 1) * LEAF_DIGEST_BYTES]
        if _leaf_digest(values[offset : offset + size]) != want:
            return "its slice does not match its commitment"
    return None
