"""Commitments a provider makes to a task, and the proofs that open them.

Trees are RFC 9162 (Certificate Transparency v2) Merkle trees: SHA-256, a leaf is
``H(0x00 || data)`` and a node ``H(0x01 || left || right)`` (domain separation, so a leaf can never
be passed off as a node); an odd count splits at the largest power of two below ``n``, so the tree
of the first ``k`` leaves is a left part of the tree of ``n`` (no duplicated last leaf, whose
ambiguity let Bitcoin's trees collide, CVE-2012-2459).

Why prefix roots. Bisection needs a predicate that is monotone: once two providers disagree they
must keep disagreeing. "Record j agrees" is not (a cheater can make later records match again), so
the game compares *prefix roots*: ``prefix_root(k)`` is the root of the tree over the first ``k``
leaves, and a provider shows it belongs to its commitment with a consistency proof
(``prove_consistency``). Equal prefix roots mean equal leaves ``0..k-1``, so the first divergent
leaf found by bisection has every earlier leaf, hence every input of that operator, agreed, and
those inputs are opened against the agreed prefix root itself. This is the hash chain
``c_j = H(c_{j-1} || record_j)`` made checkable: any record of the agreed prefix opens in log(k)
hashes instead of by replaying the chain.

What a provider commits for a task of S steps:

- per step t, a *trace*: the step's ``OpRecord`` list followed by one ``commit:state`` record
  whose inputs are the records holding each state tensor after the step (sorted by name), whose
  attrs are the sorted names, and whose output is the ``state_hash`` of that state; so the state
  after a step is part of what the operator bisection can reach;
- a step leaf ``(t, state_hash_t, n_ops_t, trace_root_t)``;
- the task root: the tree over the S step leaves. The final commitment is
  ``(steps, task_root, final_state_hash)``.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgpack
import numpy as np

from verify.trace import OpRecord, StepResult, state_hash, tensor_hash

HASH_BYTES = 32
STATE_OP = "commit:state"
EMPTY_ROOT = hashlib.sha256(b"").digest()  # RFC 9162: the root of the empty tree
_RECORD_TAG = b"swarmtrain/record/v1\0"
_STEP_TAG = b"swarmtrain/step/v1\0"
_TASK_TAG = b"swarmtrain/task/v1\0"
MAX_NAME_BYTES = 1024
MAX_RECORD_INPUTS = 1 << 16
MAX_ATTRS_BYTES = 1 << 20


def leaf_hash(data: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + data).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def _split(n: int) -> int:
    """The largest power of two strictly below ``n`` (n >= 2)."""
    return 1 << ((n - 1).bit_length() - 1)


class MerkleTree:
    """An RFC 9162 tree over leaf hashes, every level kept so proofs cost O(log^2 n) hashes."""

    def __init__(self, leaf_hashes: Sequence[bytes]) -> None:
        self.levels: list[list[bytes]] = [list(leaf_hashes)]
        # Level l node i covers leaves [i*2^l, (i+1)*2^l); an unpaired last node moves up as is,
        # which yields the RFC's split-at-largest-power-of-two tree.
        while len(self.levels[-1]) > 1:
            below = self.levels[-1]
            above = [node_hash(below[i], below[i + 1]) for i in range(0, len(below) - 1, 2)]
            if len(below) % 2:
                above.append(below[-1])
            self.levels.append(above)

    @classmethod
    def of(cls, items: Sequence[bytes]) -> MerkleTree:
        """The tree whose leaves are ``leaf_hash(item)``."""
        return cls([leaf_hash(item) for item in items])

    def __len__(self) -> int:
        return len(self.levels[0])

    @property
    def root(self) -> bytes:
        return self.subtree_root(0, len(self))

    def leaf(self, index: int) -> bytes:
        return self.levels[0][index]

    def subtree_root(self, start: int, end: int) -> bytes:
        """Root of the tree over leaves ``[start, end)``; ``start`` is aligned as RFC ranges are."""
        size = end - start
        if size == 0:
            return EMPTY_ROOT
        if size & (size - 1) == 0 and start % size == 0:
            return self.levels[size.bit_length() - 1][start // size]
        k = _split(size)
        return node_hash(self.subtree_root(start, start + k), self.subtree_root(start + k, end))

    def prefix_root(self, size: int) -> bytes:
        """Root of the tree over the first ``size`` leaves (``EMPTY_ROOT`` for 0)."""
        if not 0 <= size <= len(self):
            raise IndexError(f"prefix {size} of a tree of {len(self)}")
        return self.subtree_root(0, size)

    def prove(self, index: int, size: int | None = None) -> list[bytes]:
        """Inclusion path of leaf ``index`` in the tree of the first ``size`` leaves (or all)."""
        size = len(self) if size is None else size
        if not 0 <= index < size <= len(self):
            raise IndexError(f"leaf {index} of a tree of {size}")
        return self._path(index, 0, size)

    def _path(self, index: int, start: int, end: int) -> list[bytes]:
        if end - start == 1:
            return []
        k = _split(end - start)
        if index < start + k:
            return [*self._path(index, start, start + k), self.subtree_root(start + k, end)]
        return [*self._path(index, start + k, end), self.subtree_root(start, start + k)]

    def prove_consistency(self, old_size: int, new_size: int | None = None) -> list[bytes]:
        """Proof that the first ``old_size`` leaves' tree is a prefix of the ``new_size`` one."""
        new_size = len(self) if new_size is None else new_size
        if not 0 <= old_size <= new_size <= len(self):
            raise IndexError(f"consistency {old_size} -> {new_size} in a tree of {len(self)}")
        if old_size in (0, new_size):
            return []
        return self._subproof(old_size, 0, new_size, True)

    def _subproof(self, m: int, start: int, end: int, whole: bool) -> list[bytes]:
        n = end - start
        if m == n:
            return [] if whole else [self.subtree_root(start, end)]
        k = _split(n)
        if m <= k:
            return [*self._subproof(m, start, start + k, whole), self.subtree_root(start + k, end)]
        return [*self._subproof(m - k, start + k, end, False), self.subtree_root(start, start + k)]


def verify_proof(root: bytes, index: int, size: int, leaf: bytes, proof: Sequence[bytes]) -> bool:
    """Whether ``leaf`` (a leaf *hash*) is leaf ``index`` of the ``size``-leaf tree ``root``."""
    if not 0 <= index < size or len(proof) > 64:
        return False
    fn, sn, r = index, size - 1, leaf
    for p in proof:
        if sn == 0 or len(p) != HASH_BYTES:
            return False
        if fn & 1 or fn == sn:
            r = node_hash(p, r)
            while not fn & 1 and fn:
                fn, sn = fn >> 1, sn >> 1
        else:
            r = node_hash(r, p)
        fn, sn = fn >> 1, sn >> 1
    return sn == 0 and r == root


def verify_consistency(
    old_root: bytes, old_size: int, new_root: bytes, new_size: int, proof: Sequence[bytes]
) -> bool:
    """RFC 9162 section 2.1.4.2: the ``old_size`` tree is a prefix of the ``new_size`` tree."""
    if not 0 <= old_size <= new_size or len(proof) > 64:
        return False
    if any(len(p) != HASH_BYTES for p in proof):
        return False
    if old_size == 0:
        return old_root == EMPTY_ROOT and not proof
    if old_size == new_size:
        return old_root == new_root and not proof
    if not proof:
        return False
    path = list(proof)
    if old_size & (old_size - 1) == 0:
        path.insert(0, old_root)
    if not path:
        return False
    fn, sn = old_size - 1, new_size - 1
    while fn & 1:
        fn, sn = fn >> 1, sn >> 1
    fr = sr = path[0]
    for c in path[1:]:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            fr, sr = node_hash(c, fr), node_hash(c, sr)
            while not fn & 1 and fn:
                fn, sn = fn >> 1, sn >> 1
        else:
            sr = node_hash(sr, c)
        fn, sn = fn >> 1, sn >> 1
    return fr == old_root and sr == new_root and sn == 0


def verify_append(
    old_root: bytes, new_root: bytes, new_size: int, leaf: bytes, proof: Sequence[bytes]
) -> bool:
    """Whether ``new_root`` is the tree of ``old_root``'s ``new_size - 1`` leaves plus ``leaf``.

    ``proof`` is ``prove(new_size - 1, new_size)``: the path of a last leaf is exactly the perfect
    subtrees that make up the old tree, smallest first, so folding it right to left gives the old
    root. This is how the referee checks a divergent record against the agreed prefix.
    """
    if not verify_proof(new_root, new_size - 1, new_size, leaf, proof):
        return False
    if not proof:
        return old_root == EMPTY_ROOT and new_size == 1
    folded = proof[0]
    for p in proof[1:]:
        folded = node_hash(p, folded)
    return folded == old_root


# Records, step leaves, tasks -----------------------------------------------------------------


def encode_record(record: OpRecord) -> bytes:
    """Canonical bytes of a record: the leaf data of the trace tree and its wire form."""
    name = record.name.encode()
    return b"".join(
        [
            struct.pack("<H", len(name)),
            name,
            struct.pack("<I", len(record.inputs)),
            struct.pack(f"<{len(record.inputs)}I", *record.inputs),
            struct.pack("<I", len(record.attrs)),
            record.attrs,
            record.output,
        ]
    )


def decode_record(data: bytes) -> OpRecord:
    """Inverse of ``encode_record``; raises ``ValueError`` on anything else."""
    try:
        (name_len,) = struct.unpack_from("<H", data, 0)
        if name_len > MAX_NAME_BYTES:
            raise ValueError("malformed record: record name too long")
        pos = 2 + name_len
        name = data[2:pos].decode()
        (count,) = struct.unpack_from("<I", data, pos)
        if count > MAX_RECORD_INPUTS:
            raise ValueError("malformed record: too many inputs")
        inputs = struct.unpack_from(f"<{count}I", data, pos + 4)
        pos += 4 + 4 * count
        (attrs_len,) = struct.unpack_from("<I", data, pos)
        if attrs_len > MAX_ATTRS_BYTES:
            raise ValueError("malformed record: attrs too long")
        attrs = data[pos + 4 : pos + 4 + attrs_len]
        output = data[pos + 4 + attrs_len :]
    except (struct.error, UnicodeDecodeError) as exc:
        raise ValueError(f"malformed record: {exc}") from exc
    if len(attrs) != attrs_len or len(output) != HASH_BYTES:
        raise ValueError("malformed record: bad lengths")
    return OpRecord(name, tuple(inputs), bytes(attrs), bytes(output))


def record_leaf(record: OpRecord) -> bytes:
    return leaf_hash(_RECORD_TAG + encode_record(record))


@dataclass(frozen=True, slots=True)
class StepLeaf:
    """What a task commits per step: the state after it and the root of its trace."""

    step: int
    state_hash: bytes
    n_ops: int
    trace_root: bytes

    def encode(self) -> bytes:
        return struct.pack("<QI", self.step, self.n_ops) + self.state_hash + self.trace_root

    @classmethod
    def decode(cls, data: bytes) -> StepLeaf:
        if len(data) != 12 + 2 * HASH_BYTES:
            raise ValueError(f"step leaf of {len(data)} bytes")
        step, n_ops = struct.unpack_from("<QI", data)
        return cls(step, data[12:44], n_ops, data[44:76])

    @property
    def hash(self) -> bytes:
        return leaf_hash(_STEP_TAG + self.encode())


@dataclass(frozen=True, slots=True)
class TaskSpec:
    """What the client asks for: S steps from a start state, data drawn from ``data_seed``."""

    start_state_hash: bytes
    data_seed: int
    steps: int

    def __post_init__(self) -> None:
        if len(self.start_state_hash) != HASH_BYTES or self.steps < 1:
            raise ValueError("a task needs a 32-byte start state hash and at least one step")

    @property
    def task_id(self) -> bytes:
        packed = struct.pack("<qQ", self.data_seed, self.steps)
        return hashlib.sha256(_TASK_TAG + self.start_state_hash + packed).digest()


@dataclass(frozen=True, slots=True)
class Commitment:
    """A provider's final claim about a task."""

    steps: int
    task_root: bytes
    final_state_hash: bytes


def state_record(result: StepResult) -> OpRecord:
    """The ``commit:state`` record binding ``result.state`` to the records that produced it.

    Each state tensor is bound to the *last* record whose output has its hash: a function of the
    trace alone, so honest providers pick the same indices.
    """
    last_by_hash = {record.output: index for index, record in enumerate(result.records)}
    names = sorted(result.state)
    inputs = []
    for name in names:
        digest = tensor_hash(result.state[name])
        if digest not in last_by_hash:
            raise ValueError(f"state tensor {name!r} is the output of no record of the step")
        inputs.append(last_by_hash[digest])
    attrs = msgpack.packb(names, use_bin_type=True)
    return OpRecord(STATE_OP, tuple(inputs), attrs, state_hash(result.state))


def state_names(record: OpRecord) -> list[str]:
    """The state names a ``commit:state`` record binds; ``ValueError`` if its attrs are not that."""
    try:
        names = msgpack.unpackb(record.attrs, raw=False)
    except Exception as exc:  # msgpack raises many types on garbage
        raise ValueError(f"state record attrs undecodable: {exc}") from exc
    if (
        not isinstance(names, list)
        or not all(isinstance(n, str) for n in names)
        or names != sorted(set(names))
        or len(names) != len(record.inputs)
    ):
        raise ValueError("state record attrs must be the sorted, distinct names of its inputs")
    return names


def hash_of_named(hashes: Mapping[str, bytes]) -> bytes:
    """``state_hash`` computed from tensor hashes alone (the referee never sees the state)."""
    digest = hashlib.sha256(b"swarmtrain/state/v1\0")
    for name in sorted(hashes):
        encoded = name.encode()
        digest.update(struct.pack("<I", len(encoded)) + encoded + hashes[name])
    return digest.digest()


class StepTrace:
    """One step's committed trace: its records plus the state record, and their tree."""

    def __init__(self, step: int, result: StepResult) -> None:
        self.step = step
        self.records = [*result.records, state_record(result)]
        self.outputs: list[np.ndarray | None] = [*result.outputs, None]
        self.tree = MerkleTree([record_leaf(r) for r in self.records])
        self.leaf = StepLeaf(step, self.records[-1].output, len(self.records), self.tree.root)


def task_tree(leaves: Sequence[StepLeaf]) -> MerkleTree:
    return MerkleTree([leaf.hash for leaf in leaves])


# What travels: tensors in ``trace.canonical_bytes`` form, whose SHA-256 is their tensor_hash.
_TENSOR_TAG = b"swarmtrain/tensor/v1\0"
_ALLOWED_DTYPES = frozenset(
    {"<f8", "<f4", "<f2", "<i8", "<i4", "<i2", "|i1", "<u8", "<u4", "<u2", "|u1", "|b1"}
)
MAX_TENSOR_DIMS = 8


def tensor_from_canonical(data: bytes) -> np.ndarray:
    """Decode ``canonical_bytes`` (dtype from an allow-list, sizes checked before the view).

    Raises ``ValueError`` on anything that is not exactly a canonical encoding.
    """
    if not data.startswith(_TENSOR_TAG):
        raise ValueError("not a canonical tensor")
    pos = len(_TENSOR_TAG)
    try:
        dtype_len = data[pos]
        dtype_str = data[pos + 1 : pos + 1 + dtype_len].decode()
        pos += 1 + dtype_len
        (ndim,) = struct.unpack_from("<I", data, pos)
        if ndim > MAX_TENSOR_DIMS:
            raise ValueError(f"{ndim} dims")
        shape = struct.unpack_from(f"<{ndim}Q", data, pos + 4)
    except (IndexError, struct.error, UnicodeDecodeError) as exc:
        raise ValueError(f"malformed tensor header: {exc}") from exc
    if dtype_str not in _ALLOWED_DTYPES:
        raise ValueError(f"dtype {dtype_str!r} is not allowed")
    dtype = np.dtype(dtype_str)
    pos += 4 + 8 * ndim
    if len(data) - pos != int(np.prod(shape, dtype=object)) * dtype.itemsize:
        raise ValueError("tensor body length does not match its shape")
    return np.frombuffer(data, dtype=dtype, offset=pos).reshape(shape)
