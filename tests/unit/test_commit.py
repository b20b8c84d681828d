"""Commitments: RFC 9162 trees against a recursive reference, inclusion / consistency / append
proofs for every index and size, tampering refused, record and tensor codecs strict."""

from __future__ import annotations

import contextlib
import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verify.commit import (
    EMPTY_ROOT,
    STATE_OP,
    MerkleTree,
    StepLeaf,
    StepTrace,
    decode_record,
    encode_record,
    hash_of_named,
    leaf_hash,
    node_hash,
    state_names,
    tensor_from_canonical,
    verify_append,
    verify_consistency,
    verify_proof,
)
from verify.dispute.toytask import ToyTask
from verify.trace import OpRecord, canonical_bytes, state_hash, tensor_hash


def reference_root(leaves: list[bytes]) -> bytes:
    """RFC 9162 section 2.1.1, written as the recursion it states."""
    n = len(leaves)
    if n == 0:
        return hashlib.sha256(b"").digest()
    if n == 1:
        return leaves[0]
    k = 1
    while k * 2 < n:
        k *= 2
    return node_hash(reference_root(leaves[:k]), reference_root(leaves[k:]))


def leaves_of(n: int, salt: int = 0) -> list[bytes]:
    return [leaf_hash(f"{salt}:{i}".encode()) for i in range(n)]


def flipped(value: bytes) -> bytes:
    return bytes([value[0] ^ 1]) + value[1:]


@pytest.mark.parametrize("n", range(1, 34))
def test_roots_prefixes_and_every_inclusion_proof(n: int) -> None:
    leaves = leaves_of(n)
    tree = MerkleTree(leaves)
    assert tree.root == reference_root(leaves)
    for size in range(n + 1):
        assert tree.prefix_root(size) == reference_root(leaves[:size])
    for i in range(n):
        proof = tree.prove(i)
        assert verify_proof(tree.root, i, n, leaves[i], proof)
        assert not verify_proof(tree.root, i, n, flipped(leaves[i]), proof)
        assert not verify_proof(flipped(tree.root), i, n, leaves[i], proof)
        if n > 1:
            assert not verify_proof(tree.root, (i + 1) % n, n, leaves[i], proof)
            assert not verify_proof(tree.root, i, n, leaves[i], [flipped(proof[0]), *proof[1:]])
            assert not verify_proof(tree.root, i, n, leaves[i], proof[:-1])
        assert not verify_proof(tree.root, i, n, leaves[i], [*proof, EMPTY_ROOT])


@pytest.mark.parametrize("n", range(1, 34))
def test_every_consistency_and_append_proof(n: int) -> None:
    leaves = leaves_of(n)
    tree = MerkleTree(leaves)
    for m in range(n + 1):
        old = tree.prefix_root(m)
        proof = tree.prove_consistency(m)
        assert verify_consistency(old, m, tree.root, n, proof), (m, n)
        assert not verify_consistency(flipped(old), m, tree.root, n, proof)
        if m > 0:  # from the empty tree every tree is consistent
            assert not verify_consistency(old, m, flipped(tree.root), n, proof)
        if 0 < m < n:
            assert not verify_consistency(old, m, tree.root, n, [flipped(proof[0]), *proof[1:]])
            assert not verify_consistency(old, m + 1, tree.root, n, proof)
            assert not verify_consistency(old, m, tree.root, n, [])
    # Another tree with the same first leaves is consistent only up to where they agree.
    other = MerkleTree([*leaves[: n // 2], *leaves_of(n - n // 2, salt=1)])
    for m in range(n // 2 + 1, n + 1):
        proof = other.prove_consistency(m)
        assert not verify_consistency(tree.prefix_root(m), m, other.root, n, proof)
    for size in range(1, n + 1):
        path = tree.prove(size - 1, size)
        new, old = tree.prefix_root(size), tree.prefix_root(size - 1)
        assert verify_append(old, new, size, leaves[size - 1], path)
        assert not verify_append(flipped(old), new, size, leaves[size - 1], path)
        assert not verify_append(old, new, size, flipped(leaves[size - 1]), path)


def test_leaves_and_nodes_are_domain_separated() -> None:
    a, b = b"a" * 32, b"b" * 32
    tree = MerkleTree.of([a, b])
    assert tree.root == node_hash(leaf_hash(a), leaf_hash(b))
    # A node's preimage presented as one leaf does not give the same root.
    assert MerkleTree.of([tree.levels[0][0] + tree.levels[0][1]]).root != tree.root
    assert MerkleTree([]).root == EMPTY_ROOT


@settings(deadline=None, max_examples=60)
@given(st.lists(st.binary(max_size=8), min_size=1, max_size=70), st.data())
def test_random_trees_prove_and_refuse(items: list[bytes], data: st.DataObject) -> None:
    tree = MerkleTree.of(items)
    assert tree.root == reference_root([leaf_hash(x) for x in items])
    i = data.draw(st.integers(0, len(items) - 1))
    assert verify_proof(tree.root, i, len(items), leaf_hash(items[i]), tree.prove(i))
    m = data.draw(st.integers(0, len(items)))
    proof = tree.prove_consistency(m)
    assert verify_consistency(tree.prefix_root(m), m, tree.root, len(items), proof)


records = st.builds(
    OpRecord,
    st.text(max_size=20),
    st.lists(st.integers(0, 2**32 - 1), max_size=6).map(tuple),
    st.binary(max_size=40),
    st.binary(min_size=32, max_size=32),
)


@settings(deadline=None, max_examples=100)
@given(records)
def test_record_round_trip(record: OpRecord) -> None:
    assert decode_record(encode_record(record)) == record


@settings(deadline=None, max_examples=300)
@given(st.binary(max_size=120))
def test_garbage_record_or_tensor_is_a_value_error(data: bytes) -> None:
    for decoder in (decode_record, tensor_from_canonical, StepLeaf.decode):
        with contextlib.suppress(ValueError):
            decoder(data)


@pytest.mark.parametrize(
    "array",
    [
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.float64(2.5) * np.ones((2, 0, 3)),
        np.array(7, dtype=np.int64),
        np.array([True, False]),
    ],
)
def test_tensor_round_trip_and_truncation(array: np.ndarray) -> None:
    data = canonical_bytes(array)
    back = tensor_from_canonical(data)
    # trace.canonical_bytes encodes a 0-d array as shape (1,) (np.ascontiguousarray), so compare
    # encodings, not shapes.
    assert back.dtype == array.dtype and canonical_bytes(back) == data
    assert tensor_hash(back) == tensor_hash(array)
    with pytest.raises(ValueError):
        tensor_from_canonical(data + b"\0")
    if array.nbytes:
        with pytest.raises(ValueError):
            tensor_from_canonical(data[:-1])


def test_object_dtype_is_refused() -> None:
    data = canonical_bytes(np.arange(3, dtype=np.float32)).replace(b"<f4", b"|O8")
    with pytest.raises(ValueError, match="not allowed"):
        tensor_from_canonical(data)


def test_step_trace_binds_the_state_after_the_step() -> None:
    toy = ToyTask(layers=3)
    state = toy.initial_state()
    result = toy(state, 0)
    trace = StepTrace(0, result)
    last = trace.records[-1]
    assert last.name == STATE_OP and last.output == state_hash(result.state)
    assert trace.leaf.state_hash == state_hash(result.state)
    names = state_names(last)
    assert names == sorted(result.state)
    hashes = {n: trace.records[i].output for n, i in zip(names, last.inputs, strict=True)}
    assert hash_of_named(hashes) == state_hash(result.state)
    assert StepLeaf.decode(trace.leaf.encode()) == trace.leaf
    # The state after the step is made of the step's last updates, not its leaves.
    assert all(not trace.records[i].is_leaf for i in last.inputs)
