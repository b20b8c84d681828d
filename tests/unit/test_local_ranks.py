"""The pure parts of a node's local ranks (``swarmtrain node --nproc-per-node K``): the node's
batches shared among its ranks, which K a machine and a run allow, the threads per rank, the
control message and the ranks' digest agreement. (The ranks themselves, as processes, are in
``tests/integration/test_nproc.py``.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from diloco import inner_batches, load_stdlib_corpus
from swarmtrain.cli import main
from swarmtrain.commands.local import LocalOptions
from swarmtrain.commands.node import NodeOptions
from swarmtrain.config import RunConfig
from swarmtrain.training.ranks_plan import (
    Control,
    Op,
    RankDigests,
    check_fsdp,
    check_nproc,
    check_run,
    control_key,
    threads_per_rank,
)

SMALL = 1 << 20
DRAW = {"run_seed": 7, "round": 3, "peer_id": b"peer", "steps": 4, "context": 16}


def test_the_ranks_shards_are_disjoint_slices_of_the_nodes_k_times_larger_draw() -> None:
    corpus = load_stdlib_corpus(SMALL)
    whole = inner_batches(corpus, batch_size=3 * 2, **DRAW)  # type: ignore[arg-type]
    shards = [inner_batches(corpus, batch_size=2, shard=(k, 3), **DRAW) for k in range(3)]  # type: ignore[arg-type]
    for step, (inputs, targets) in enumerate(whole):
        assert all(s[step][0].shape == (2, 16) for s in shards)
        assert torch.equal(torch.cat([s[step][0] for s in shards]), inputs)
        assert torch.equal(torch.cat([s[step][1] for s in shards]), targets)
    # One rank is the peer's own draw, as before ranks existed.
    alone = inner_batches(corpus, batch_size=6, **DRAW)  # type: ignore[arg-type]
    one = inner_batches(corpus, batch_size=6, shard=(0, 1), **DRAW)  # type: ignore[arg-type]
    assert all(torch.equal(a[0], b[0]) for a, b in zip(alone, one, strict=True))
    for bad in ((3, 3), (-1, 3), (0, 0)):
        with pytest.raises(ValueError, match="shard"):
            inner_batches(corpus, batch_size=2, shard=bad, **DRAW)  # type: ignore[arg-type]


def test_k_must_fit_the_devices() -> None:
    check_nproc(1, "cpu", cuda_devices=0, cpus=1)
    check_nproc(4, "cpu", cuda_devices=0, cpus=4)
    check_nproc(2, "cuda", cuda_devices=2, cpus=1)  # CUDA: one rank per device, CPUs aside
    with pytest.raises(ValueError, match=r"^--nproc-per-node must be at least 1, got 0$"):
        check_nproc(0, "cpu", cuda_devices=0, cpus=4)
    with pytest.raises(ValueError, match=r"^--nproc-per-node 3: torch sees 2 CUDA device"):
        check_nproc(3, "cuda", cuda_devices=2, cpus=64)
    with pytest.raises(ValueError, match=r"^--nproc-per-node 5: this machine has 4 CPU\(s\)"):
        check_nproc(5, "cpu", cuda_devices=8, cpus=4)


def test_pipeline_and_verified_runs_refuse_several_ranks() -> None:
    pipeline = RunConfig().replace(run={"id": "p"}, pipeline={"stages": 2})
    verified = RunConfig().replace(run={"id": "v"}, verify={"rate": 0.5})
    for config in (RunConfig(), pipeline, verified):
        check_run(1, config)  # one rank: today's node, any run
    check_run(2, RunConfig())
    with pytest.raises(ValueError, match=r"^--nproc-per-node 2: run p is a pipeline run"):
        check_run(2, pipeline)
    with pytest.raises(ValueError, match=r"^--nproc-per-node 2: run v is a verified run"):
        check_run(2, verified)


def test_fsdp_needs_two_ranks_and_a_run_whose_phase_ends_in_its_own_whole_round() -> None:
    check_fsdp(2, RunConfig())
    check_fsdp(4, RunConfig().replace(training={"precision": "bf16", "grad_accumulation": 2}))
    with pytest.raises(ValueError, match=r"^--fsdp shards .* needs --nproc-per-node 2 or more"):
        check_fsdp(1, RunConfig())
    refused = {
        "a pipeline run": {"pipeline": {"stages": 2}},
        "a verified run": {"verify": {"rate": 0.5}},
        "training.overlap = true": {"training": {"overlap": True}},
        "training.fragments = 2": {"training": {"fragments": 2}},
        'training.precision = "fp16"': {"training": {"precision": "fp16"}},
    }
    for why, keys in refused.items():
        with pytest.raises(ValueError, match=why) as caught:
            check_fsdp(2, RunConfig().replace(run={"id": "f"}, **keys))
        assert "\n" not in str(caught.value), caught.value


def test_node_refuses_fsdp_without_several_ranks_in_one_line_before_joining(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    nobody = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWRiHhC2akhj4ztNdh9sAEKzZrN87JfzokqDmDZzZiYVZb"
    argv = ["node", "--join", nobody, "--state-dir", str(tmp_path / "n"), "--fsdp"]
    assert main(argv) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "swarmtrain node: --fsdp shards the model across the node's local ranks: it needs "
        "--nproc-per-node 2 or more, got 1"
    ]
    assert not (tmp_path / "n").exists()


def test_threads_are_shared_among_ranks_at_least_one_each() -> None:
    assert threads_per_rank(8, 2, default=16) == 4  # --threads given
    assert threads_per_rank(None, 4, default=16) == 4  # torch's default shared
    assert threads_per_rank(3, 2, default=16) == 1
    assert threads_per_rank(None, 8, default=2) == 1


def test_the_control_message_round_trips_and_refuses_anything_else() -> None:
    for control in (
        Control(Op.TRAIN, round=5, steps=20, optimizer_state=True),
        Control(Op.STOP, error="boom"),
    ):
        assert Control.from_bytes(control.to_bytes()) == control
    for bad in (b"", b"{}", b'{"op": "dance", "round": 0, "steps": 1, "optimizer_state": false, '
                b'"error": ""}', b"[1, 2]"):  # fmt: skip
        with pytest.raises(ValueError, match="bad control message"):
            Control.from_bytes(bad)
    with pytest.raises(ValueError):
        Control(Op.TRAIN, round=0, steps=0)  # a phase of no steps
    assert control_key(0) != control_key(1)


def test_digests_agree_until_one_phase_differs() -> None:
    digests = RankDigests()
    assert digests.agree is None  # no phase yet
    assert digests.record(0, ["a", "a"]) and digests.agree is True
    assert not digests.record(1, ["a", "b"]) and digests.agree is False
    assert digests.record(2, ["c", "c"]) and digests.agree is False  # once differed, reported
    assert digests.last == ["c", "c"] and digests.differed == [1] and digests.phases == 3


def test_node_refuses_a_k_over_the_cpus_in_one_line_before_joining(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ValueError, match="--nproc-per-node must be at least 1"):
        NodeOptions(join=("/ip4/127.0.0.1/tcp/1",), state_dir=tmp_path, nproc_per_node=0)
    too_many = (os.cpu_count() or 1) + 1
    # The join address names nobody: the refusal comes before any dial.
    nobody = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWRiHhC2akhj4ztNdh9sAEKzZrN87JfzokqDmDZzZiYVZb"
    argv = ["node", "--join", nobody, "--state-dir", str(tmp_path / "n"),
            "--device", "cpu", "--nproc-per-node", str(too_many)]  # fmt: skip
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"swarmtrain node: --nproc-per-node {too_many}: this machine has {too_many - 1} CPU(s); "
        f"at most {too_many - 1} ranks"
    ], err
    assert not (tmp_path / "n").exists()  # nothing written


def test_local_passes_k_to_its_nodes_and_refuses_it_where_a_node_would(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert LocalOptions(nproc_per_node=2).nproc_per_node == 2
    with pytest.raises(ValueError, match="--nproc-per-node must be positive"):
        LocalOptions(nproc_per_node=0)
    with pytest.raises(ValueError, match=r"^--nproc-per-node: a verified run's inner phases"):
        LocalOptions(nproc_per_node=2, verify_rate=0.5)
    assert main(["local", "--pipeline-stages", "2", "--nproc-per-node", "2"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "swarmtrain local: --nproc-per-node needs a DiLoCo run (no --pipeline-stages): a "
        "pipeline's roles run in one process"
    ]
