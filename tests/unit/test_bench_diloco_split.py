"""``bench.diloco`` tunes on the validation half and reports the test half (issue 20 point 4),
and refuses bad sparse settings with one line: its real ``main`` at a tiny setting."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from bench import diloco as bench
from bench.diloco_sparse_round import parse_codec
from swarm.averaging.sparse_codec import SparseCodec

TINY = ["--workers", "2", "--steps", "2", "--inner-steps", "1", "--batch", "1", "--context", "16",
        "--eval-batches", "1", "--sequential"]  # fmt: skip


def _run(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    torch.set_num_threads(1)
    monkeypatch.setattr(sys, "argv", ["bench.diloco", *TINY, *argv])
    bench.main()
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_the_last_line_reports_the_test_half_and_the_validation_half_apart(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    summary = _run(
        monkeypatch, capsys, "--compression", "sparse", "--sparse-outer-lr", "2",
        "--sparse-error-decay", "0.5",
    )  # fmt: skip
    methods = {"diloco", "data_parallel", "alone", "diloco_sparse"}
    assert set(summary["heldout"]) == set(summary["validation"]["heldout"]) == methods
    # Two disjoint halves: the same model scores differently on each.
    assert summary["heldout"]["alone"] != summary["validation"]["heldout"]["alone"]
    heldout, validation = summary["heldout"], summary["validation"]["heldout"]
    for losses, recovered in (
        (heldout, summary["sparse_recovered_fraction"]),
        (validation, summary["validation"]["sparse_recovered_fraction"]),
    ):
        gap = losses["alone"] - losses["data_parallel"]
        assert recovered == pytest.approx((losses["alone"] - losses["diloco_sparse"]) / gap)
    assert summary["config"]["sparse_outer_lr"] == 2.0
    assert summary["config"]["sparse_error_decay"] == 0.5
    # The default codec: pooled selection, 60 of every 4096 on average (docs/diloco_tuning.md).
    assert summary["config"]["sparse"] == "SPARSE-EFP:4096:60:2"


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--sparse-error-decay", "1.5", "--sparse-error-decay 1.5: expected 0 to 1"),
        ("--sparse-outer-lr", "0", "--sparse-outer-lr 0.0: expected a positive number"),
        ("--sparse-select", "tensor", "invalid choice: 'tensor'"),
    ],
)
def test_bad_sparse_settings_are_refused_with_one_line(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    option: str,
    value: str,
    message: str,
) -> None:
    # With the sparse codec on, and off (a mistyped option is refused where it is unused too).
    for compression in ("sparse", "int8"):
        with pytest.raises(SystemExit) as exit:
            _run(monkeypatch, capsys, "--compression", compression, option, value)
        assert exit.value.code == 2
        assert message in capsys.readouterr().err


def test_the_one_round_script_parses_its_codecs() -> None:
    assert parse_codec("exact") is None
    assert parse_codec("part:4096:60:2") == SparseCodec(4096, 60, 2, "part")
    assert parse_codec("chunk:256:3:2") == SparseCodec(256, 3, 2)
    with pytest.raises(ValueError, match="SELECT:CHUNK:KEEP:BITS"):
        parse_codec("part:4096:60")
    with pytest.raises(ValueError, match="sparse select"):
        parse_codec("tensor:4096:60:2")
