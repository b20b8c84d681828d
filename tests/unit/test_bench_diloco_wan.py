"""``bench.diloco_wan``'s pure parts (the bench itself needs root and the NAT lab): the stop vote
in a round's weights, the within-budget round all workers share, and which worker runs which
codec and mode (the sparse codec is ``bench.diloco``'s)."""

from __future__ import annotations

import argparse

import pytest

from bench import diloco_wan
from bench.diloco import add_sparse_options, sparse_codec
from bench.diloco_wan_worker import STOP_MARK, marked, weights_verdict
from swarm.averaging.sparse_codec import SparseCodec


def test_a_stop_vote_rides_the_weight_and_every_reader_sees_it() -> None:
    go, stop = marked(1000.0, True), marked(1000.0, False)
    assert go == 1000.0 and stop == 1000.0 + STOP_MARK and stop != go
    assert weights_verdict({"a": go, "b": marked(2000.0, True)}) is True
    assert weights_verdict({"a": go, "b": stop}) is False
    # The mark survives the largest carried weight a bench round reaches (exact in float64).
    assert weights_verdict({"a": marked(float(2**40), False)}) is False
    with pytest.raises(ValueError, match="whole number"):
        marked(1000.5, True)


def test_within_the_budget_is_the_latest_round_every_worker_applied() -> None:
    def entry(r: int) -> dict[str, object]:
        return {"round": r, "steps": 10 * (r + 1), "rounds": r + 1, "loss": 5.0 - r, "hash": r}

    # Worker 1 applied round 4 before the mark, worker 0 only a moment after it.
    replies = [{"within": [entry(2), entry(3)]}, {"within": [entry(3), entry(4)]}]
    assert [w["round"] for w in diloco_wan.within_budget(replies)] == [3, 3]
    # Nobody applied a round in time: the initial parameters (round -1) are common.
    replies = [{"within": [entry(-1)]}, {"within": [entry(-1), entry(0)]}]
    assert [w["round"] for w in diloco_wan.within_budget(replies)] == [-1, -1]


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--compression", default="int8")
    parser.add_argument("--overlap", action="store_true")
    add_sparse_options(parser)
    return parser.parse_args(list(argv))


def test_overlap_goes_to_the_named_method_and_the_int8_run_beside_sparse_stays_synchronous() -> (
    None
):
    args = _args("--compression", "sparse", "--overlap", "--sparse-density", "0.01")
    sparse = diloco_wan.worker_options("diloco_sparse", args)
    int8 = diloco_wan.worker_options("diloco", args)
    assert sparse[:4] == ["--method", "diloco", "--compression", "sparse"]
    assert "--overlap" in sparse and "--overlap" not in int8
    assert int8[:4] == ["--method", "diloco", "--compression", "int8"]
    assert diloco_wan.worker_options("dp", args) == ["--method", "dp"]
    # The worker parses what the driver passes back into the same codec.
    worker = _args(*sparse[2:])
    assert (
        sparse_codec(worker)
        == sparse_codec(args)
        == SparseCodec.from_density(0.01, 2, 4096, "part")
    )
    assert "--overlap" in diloco_wan.worker_options("diloco", _args("--overlap"))
