"""Checkpoints: atomic files, the last two kept, corruption skipped, and an exact resume."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import msgpack
import pytest
import torch

from diloco import (
    ByteTransformer,
    ByteTransformerConfig,
    DiLoCo,
    GlobalState,
    LocalAverage,
    inner_batches,
    layout_digest,
    load_latest,
    load_stdlib_corpus,
    save_checkpoint,
)
from diloco.checkpoint import MAGIC, decode

torch.set_num_threads(1)
CONFIG = ByteTransformerConfig(d_model=32, n_layers=1, n_heads=2, context=16)
LAYOUT = layout_digest([("w", (4,))])


def _state(round: int) -> GlobalState:
    return GlobalState(round, torch.full((4,), float(round)), torch.zeros(4), LAYOUT)


def _adamw_state() -> dict:
    param = torch.nn.Parameter(torch.ones(3, 2))
    optimizer = torch.optim.AdamW([param], lr=1e-3, betas=(0.8, 0.95))
    param.grad = torch.full((3, 2), 0.5)
    optimizer.step()
    return optimizer.state_dict()


def test_save_and_load_round_trip_with_optimizer_state(tmp_path: Path) -> None:
    inner = _adamw_state()
    path = save_checkpoint(tmp_path, _state(3), "run-a", inner)
    assert path.name == "diloco-0000000003.ckpt"
    loaded = load_latest(tmp_path, "run-a")
    assert loaded is not None and loaded.path == path
    assert loaded.state.state_hash() == _state(3).state_hash()
    assert loaded.inner_state is not None
    restored = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3, 2))])
    restored.load_state_dict(loaded.inner_state)
    state = restored.state_dict()
    assert torch.equal(state["state"][0]["exp_avg"], inner["state"][0]["exp_avg"])
    assert torch.equal(state["state"][0]["step"], inner["state"][0]["step"])
    assert list(state["param_groups"][0]["betas"]) == [0.8, 0.95]


def test_only_the_last_two_are_kept_and_no_temporary_file_remains(tmp_path: Path) -> None:
    for round in range(1, 5):
        save_checkpoint(tmp_path, _state(round), "run-a")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "diloco-0000000003.ckpt",
        "diloco-0000000004.ckpt",
    ]
    assert load_latest(tmp_path) is not None
    assert load_latest(tmp_path / "missing") is None


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty"])
def test_a_corrupt_newest_checkpoint_is_skipped_for_the_previous(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    save_checkpoint(tmp_path, _state(1), "run-a")
    newest = save_checkpoint(tmp_path, _state(2), "run-a")
    data = bytearray(newest.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip":
        data[-10] ^= 0x01
    else:
        data = bytearray()
    newest.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="diloco.checkpoint"):
        loaded = load_latest(tmp_path, "run-a")
    assert loaded is not None and loaded.state.round == 1
    assert f"checkpoint {newest} is unusable, skipping it" in caplog.text
    newest.unlink()
    (tmp_path / "diloco-0000000001.ckpt").write_bytes(b"junk")
    with caplog.at_level(logging.WARNING, logger="diloco.checkpoint"):
        assert load_latest(tmp_path, "run-a") is None


def test_a_checkpoint_of_another_config_is_refused(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, _state(1), "run-a")
    with pytest.raises(ValueError, match="run config"):
        load_latest(tmp_path, "run-b")


def test_well_checksummed_but_malformed_payloads_are_value_errors(tmp_path: Path) -> None:
    def framed(payload: bytes) -> bytes:
        return MAGIC + hashlib.sha256(payload).digest() + payload

    bad_tensor = msgpack.ExtType(1, msgpack.packb(["float32", [1000], b"\0" * 4]))
    payloads = [
        b"\xc1",  # never-used msgpack byte
        msgpack.packb([1, 2]),
        msgpack.packb({"version": 2}),
        msgpack.packb({"version": 1, "fingerprint": "x", "state": b"nope", "inner": None}),
        msgpack.packb({"version": 1, "fingerprint": "x", "state": b"", "inner": bad_tensor}),
        msgpack.packb({"version": 1, "inner": msgpack.ExtType(9, b"")}),
    ]
    for payload in payloads:
        with pytest.raises(ValueError):
            decode(framed(payload), tmp_path / "x")


def _train(diloco: DiLoCo, model: ByteTransformer, rounds: int) -> None:
    corpus = load_stdlib_corpus(1 << 20)
    for _ in range(rounds):
        batches = inner_batches(
            corpus,
            run_seed=3,
            round=diloco.round,
            peer_id=b"solo",
            steps=diloco.inner_steps,
            batch_size=2,
            context=CONFIG.context,
        )
        for inputs, targets in batches:
            model.loss(inputs, targets).backward()
            diloco.step(samples=inputs.numel())
            diloco.zero_grad()


def _node(state_dir: Path, seed: int = 4) -> tuple[DiLoCo, ByteTransformer]:
    model = ByteTransformer(CONFIG, seed=seed)
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    diloco = DiLoCo(
        model, inner, LocalAverage(1).member("solo"), inner_steps=3, state_dir=state_dir
    )
    return diloco, model


def test_a_restarted_node_resumes_bit_identically(tmp_path: Path) -> None:
    straight, straight_model = _node(tmp_path / "straight")
    with straight:
        _train(straight, straight_model, 3)

    first, first_model = _node(tmp_path / "restarted")
    with first:
        _train(first, first_model, 2)
    # A fresh process: other init seed, fresh AdamW; everything comes from the state directory.
    second, second_model = _node(tmp_path / "restarted", seed=77)
    assert second.round == 2 and second.state_hash() == first.state_hash()
    with second:
        _train(second, second_model, 1)
    assert second.state_hash() == straight.state_hash()
    assert all(
        torch.equal(a, b)
        for a, b in zip(second_model.parameters(), straight_model.parameters(), strict=True)
    )


def test_a_state_dir_of_another_config_is_refused(tmp_path: Path) -> None:
    diloco, model = _node(tmp_path)
    with diloco:
        _train(diloco, model, 1)
    other = ByteTransformer(CONFIG)
    with pytest.raises(ValueError, match="run config"):
        DiLoCo(
            other,
            torch.optim.AdamW(other.parameters()),
            LocalAverage(1).member("solo"),
            inner_steps=5,
            state_dir=tmp_path,
        )


def test_the_streamed_file_is_the_msgpack_of_its_fields_and_holds_the_state_where_said(
    tmp_path: Path,
) -> None:
    from diloco.checkpoint import state_offset

    state, inner = _state(5), _adamw_state()
    path = save_checkpoint(tmp_path, state, "run-a", inner)
    data = path.read_bytes()

    def tensor(t: torch.Tensor) -> msgpack.ExtType:
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return msgpack.ExtType(1, msgpack.packb([str(t.dtype).split(".")[1], list(t.shape), raw]))

    fields = {"version": 1, "fingerprint": "run-a", "state": state.to_bytes(), "inner": inner}
    payload = msgpack.packb(fields, default=tensor)  # what the file held before it streamed
    assert data == MAGIC + hashlib.sha256(payload).digest() + payload
    offset = state_offset("run-a", state)
    assert data[offset : offset + state.encoded_size()] == state.to_bytes()


def test_a_node_points_at_its_state_inside_its_newest_checkpoint(tmp_path: Path) -> None:
    diloco, model = _node(tmp_path)
    assert diloco.state_file() is None  # nothing saved yet
    with diloco:
        _train(diloco, model, 2)
        saved = diloco.state_file()
        assert saved is not None and saved.path.name == "diloco-0000000002.ckpt"
        with saved.path.open("rb") as file:
            file.seek(saved.offset)
            assert file.read(saved.length) == diloco.state_bytes()
        assert saved.length == diloco.state_size() == len(diloco.state_bytes())
    resumed, _ = _node(tmp_path, seed=5)
    assert resumed.state_file() == saved
