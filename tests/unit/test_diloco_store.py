"""The global state on disk (``diloco.store``): slices round-trip, the outer step and the encoding
are the in-memory path's bits, the buffers stay bounded, and a half-written update is detected
while the last checkpoint keeps the previous state."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from diloco import (
    ByteTransformer,
    ByteTransformerConfig,
    DiLoCo,
    GlobalState,
    LocalAverage,
    OuterConfig,
    checkpoint,
    layout_digest,
    outer_step,
    save_checkpoint,
)
from diloco.store import StateStore, TornState
from swarm.averaging.averager import _given

torch.set_num_threads(1)
LAYOUT = layout_digest([("w", (103,))])
NUMEL = 103
SLICE = 7  # 15 slices, the last one short


def _random_state(round: int = 4) -> GlobalState:
    generator = torch.Generator().manual_seed(round)
    params = torch.randn(NUMEL, generator=generator)
    momentum = torch.randn(NUMEL, generator=generator)
    return GlobalState(round, params, momentum, LAYOUT)


def _store(tmp_path: Path, state: GlobalState | None = None) -> StateStore:
    store = StateStore(NUMEL, LAYOUT, tmp_path, slice_elements=SLICE)
    if state is not None:
        store.assign(state)
    return store


def test_slices_round_trip_and_the_encoding_is_the_in_memory_one(tmp_path: Path) -> None:
    state = _random_state()
    store = _store(tmp_path)
    assert (
        store.state_hash()
        == GlobalState(0, torch.zeros(NUMEL), torch.zeros(NUMEL), LAYOUT).state_hash()
    )  # a new store is zeros at round 0
    for name in ("params", "momentum"):
        for a, b in store.ranges(0, NUMEL):
            store.write(name, a, getattr(state, name)[a:b])
    store.round = state.round
    assert torch.equal(store.vector("params"), state.params)
    assert torch.equal(store.vector("momentum", 10, 50), state.momentum[10:50])
    assert store.to_bytes() == state.to_bytes() and store.encoded_size() == state.encoded_size()
    assert store.state_hash() == state.state_hash()
    assert store.to_state().state_hash() == state.state_hash()
    # The files are anonymous: nothing is left in the directory they were made in.
    assert list(tmp_path.iterdir()) == []


def test_downloaded_bytes_are_verified_before_anything_is_written(tmp_path: Path) -> None:
    state = _random_state()
    store = _store(tmp_path)
    store.load_bytes(state.to_bytes())
    assert store.round == state.round and store.state_hash() == state.state_hash()
    assert torch.equal(store.vector("momentum"), state.momentum)
    before = store.state_hash()
    damaged = bytearray(_random_state(9).to_bytes())
    damaged[100] ^= 1
    with pytest.raises(ValueError, match="digest mismatch"):
        store.load_bytes(bytes(damaged))
    other = GlobalState(1, torch.zeros(5), torch.zeros(5), layout_digest([("v", (5,))]))
    with pytest.raises(ValueError, match="another model"):
        store.load_bytes(other.to_bytes())
    assert store.state_hash() == before and store.round == state.round


@pytest.mark.parametrize("span", [slice(0, NUMEL), slice(20, 61)])
def test_the_outer_step_on_disk_is_the_in_memory_step_bit_for_bit(
    tmp_path: Path, span: slice
) -> None:
    config = OuterConfig(lr=0.7, momentum=0.9, momentum_warmup=3)
    memory = _random_state(round=1)
    store = _store(tmp_path, memory)
    generator = torch.Generator().manual_seed(11)
    for _ in range(3):
        mean = torch.randn(span.stop - span.start, generator=generator) * 1e-3
        memory = outer_step(memory, mean, config, span=span)
        store.outer_step(mean, config, span.start)
        assert store.round == memory.round
        assert torch.equal(store.vector("params"), memory.params)
        assert torch.equal(store.vector("momentum"), memory.momentum)
        assert store.state_hash() == memory.state_hash()
    store.skip_round()
    assert store.round == memory.round + 1


def test_the_buffers_stay_one_slice_whatever_the_size(tmp_path: Path) -> None:
    store = _store(tmp_path, _random_state())
    store.outer_step(torch.ones(NUMEL), OuterConfig(), 0)
    store.to_bytes()
    assert all(b.numel() == SLICE for b in store._buffers.values())
    with pytest.raises(ValueError, match="over 7"):
        store.read("params", 0, SLICE + 1)
    with pytest.raises(ValueError, match="outside"):
        store.write("params", NUMEL - 2, torch.zeros(3))


def _failing_writes(monkeypatch: pytest.MonkeyPatch, at: int) -> None:
    """The disk fails at the ``at``-th ``StateStore.write`` from now (ENOSPC)."""
    writes = 0
    real_write = StateStore.write

    def write(self: StateStore, name: str, start: int, values: torch.Tensor) -> None:
        nonlocal writes
        writes += 1
        if writes == at:
            raise OSError(28, "No space left on device")
        real_write(self, name, start, values)

    monkeypatch.setattr(StateStore, "write", write)


def test_an_update_that_fails_half_way_is_detected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _store(tmp_path, _random_state())
    _failing_writes(monkeypatch, at=5)  # params and momentum of two slices written, then fails
    with pytest.raises(OSError, match="No space"):
        store.outer_step(torch.ones(NUMEL), OuterConfig(), 0)
    monkeypatch.undo()
    for read in (
        lambda: store.read("params", 0, 3),
        store.state_hash,
        store.to_bytes,
        lambda: store.outer_step(torch.ones(NUMEL), OuterConfig(), 0),
    ):
        with pytest.raises(TornState):
            read()


def _train_round(diloco: DiLoCo, model: ByteTransformer) -> None:
    for _ in range(diloco.inner_steps):
        inputs = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))
        model.loss(inputs, inputs).backward()
        diloco.step(samples=16)
        diloco.zero_grad()


def test_a_crash_in_the_outer_step_leaves_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = ByteTransformerConfig(d_model=16, n_layers=1, n_heads=2, context=8)

    def node(seed: int) -> tuple[DiLoCo, ByteTransformer]:
        model = ByteTransformer(config, seed=seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        average = LocalAverage(1).member("solo")
        return DiLoCo(model, optimizer, average, inner_steps=2, state_dir=tmp_path), model

    diloco, model = node(3)
    _train_round(diloco, model)
    saved = diloco.state_hash()
    # The disk fails in the middle of the next round's outer step (its second slice).
    diloco._store.slice_elements = 64  # several slices in this small model
    _failing_writes(monkeypatch, at=3)
    with pytest.raises(OSError, match="No space"):
        _train_round(diloco, model)
    with pytest.raises(TornState):
        diloco.state_hash()
    monkeypatch.undo()
    # A restart resumes from the last checkpoint: the state before the failed round.
    resumed, _ = node(8)
    assert resumed.round == 1 and resumed.state_hash() == saved


def test_a_given_vector_is_used_as_it_is_and_others_are_copied() -> None:
    vector = torch.arange(10, dtype=torch.float32)
    given = _given(vector)
    assert given is not None and np.shares_memory(given, vector.numpy())
    assert _given(torch.arange(20, dtype=torch.float32)[::2]) is None  # strided: copied
    assert _given(torch.arange(10, dtype=torch.float64)) is None
    assert _given(np.zeros(4, np.float32)) is not None
    with pytest.raises(ValueError, match="NaN"):
        _given(torch.tensor([1.0, float("nan")]))


def _adamw_state() -> dict:
    param = torch.nn.Parameter(torch.ones(3, 2))
    optimizer = torch.optim.AdamW([param], lr=1e-3)
    param.grad = torch.full((3, 2), 0.5)
    optimizer.step()
    return optimizer.state_dict()


def test_a_checkpoint_resumes_into_the_store_without_decoding_its_state(tmp_path: Path) -> None:
    older, newer = _random_state(2), _random_state(3)
    save_checkpoint(tmp_path, older, "run-a", _adamw_state())
    path = save_checkpoint(tmp_path, newer, "run-a", _adamw_state())
    store = _store(tmp_path / "store")
    # The in-place path (not the whole-file decode) reads it: checksums, then slices.
    resumed = checkpoint._resume_in_place(path, "run-a", store, store.encoded_size())
    assert resumed is not None and resumed.round == 3
    assert store.state_hash() == newer.state_hash() and store.to_bytes() == newer.to_bytes()
    assert resumed.offset == checkpoint.state_offset("run-a", newer)
    with path.open("rb") as file:
        file.seek(resumed.offset)
        assert file.read(resumed.length) == newer.to_bytes()
    assert resumed.inner_state is not None
    assert torch.equal(resumed.inner_state["state"][0]["exp_avg"], torch.full((3, 2), 0.05))


@pytest.mark.parametrize("damage", ["state", "inner", "truncate"])
def test_a_damaged_newest_checkpoint_is_skipped_when_resuming_in_place(
    tmp_path: Path, damage: str
) -> None:
    save_checkpoint(tmp_path, _random_state(2), "run-a", _adamw_state())
    newest = save_checkpoint(tmp_path, _random_state(3), "run-a", _adamw_state())
    data = bytearray(newest.read_bytes())
    offset = checkpoint.state_offset("run-a", _random_state(3))
    if damage == "state":
        data[offset + 200] ^= 1
    elif damage == "inner":
        data[-5] ^= 1
    else:
        data = data[: offset + 100]
    newest.write_bytes(bytes(data))
    store = _store(tmp_path / "store")
    resumed = checkpoint.resume(tmp_path, "run-a", store)
    assert resumed is not None and resumed.round == 2
    assert store.state_hash() == _random_state(2).state_hash()


def test_resuming_a_checkpoint_of_another_config_is_refused(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, _random_state(2), "run-b", None)
    with pytest.raises(ValueError, match="run config"):
        checkpoint.resume(tmp_path, "run-a", _store(tmp_path / "store"))
