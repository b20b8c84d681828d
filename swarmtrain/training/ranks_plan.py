"""The decisions of a node's local ranks (``swarmtrain node --nproc-per-node K``), as pure code:
which K a machine allows, which runs refuse K > 1, how ``--threads`` is divided among ranks,
the control message rank 0 hands its other ranks before each inner phase, and whether the
ranks' end-of-phase digests agree. ``swarmtrain.training.ranks`` drives processes with them."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum

from swarmtrain.config import RunConfig

FLAG = "--nproc-per-node"
FSDP_FLAG = "--fsdp"


def check_nproc(nproc: int, device: str, *, cuda_devices: int, cpus: int) -> None:
    """Raise ValueError (one line naming the flag) unless ``nproc`` local ranks fit this
    machine: at least 1, on CUDA at most one per device, on the CPU at most one per CPU."""
    if nproc < 1:
        raise ValueError(f"{FLAG} must be at least 1, got {nproc}")
    if device == "cuda" and nproc > cuda_devices:
        raise ValueError(
            f"{FLAG} {nproc}: torch sees {cuda_devices} CUDA device(s) here; one rank per "
            f"device, so at most {cuda_devices}"
        )
    if device == "cpu" and nproc > cpus:
        raise ValueError(f"{FLAG} {nproc}: this machine has {cpus} CPU(s); at most {cpus} ranks")


def check_run(nproc: int, config: RunConfig) -> None:
    """Raise ValueError when the run cannot be trained by ``nproc`` > 1 local ranks: a
    pipeline run (a node serves or drives stages, it trains no whole model) or a verified run
    (its inner phase is one RepOps task, re-executed bit for bit by another peer)."""
    if nproc == 1:
        return
    if config.is_pipeline:
        raise ValueError(
            f"{FLAG} {nproc}: run {config.run.id} is a pipeline run (pipeline.stages = "
            f"{config.pipeline.stages}); its roles run in one process: run the node without {FLAG}"
        )
    if config.verify.rate > 0:
        raise ValueError(
            f"{FLAG} {nproc}: run {config.run.id} is a verified run (verify.rate = "
            f"{config.verify.rate}), whose inner phases are RepOps tasks of one process: run the "
            f"node without {FLAG}"
        )


def check_fsdp(nproc: int, config: RunConfig) -> None:
    """Raise ValueError (one line naming ``--fsdp``) when the node's ranks cannot shard the
    model: fewer than 2 ranks (nothing to shard across), a pipeline or verified run (as for
    several ranks at all), or settings the sharded phase does not run: its round is
    ``DiLoCo.finish_inner_phase`` on the gathered parameters, which needs synchronous rounds
    of the whole model (no ``overlap``, ``fragments`` = 1), and fp16's gradient scaler is not
    wired to the sharded optimizer (bf16 needs none)."""
    if nproc < 2:
        raise ValueError(
            f"{FSDP_FLAG} shards the model across the node's local ranks: it needs {FLAG} 2 or "
            f"more, got {nproc}"
        )
    check_run(nproc, config)
    training, why = config.training, ""
    if training.overlap:
        why = "training.overlap = true (a sharded phase ends in its own round)"
    elif training.fragments > 1:
        why = (
            f"training.fragments = {training.fragments} (a sharded phase averages the whole model)"
        )
    elif training.precision == "fp16":
        why = 'training.precision = "fp16" (no gradient scaler for sharded gradients; use "bf16")'
    if why:
        raise ValueError(
            f"{FSDP_FLAG}: run {config.run.id} has {why}: run the node without {FSDP_FLAG}"
        )


def threads_per_rank(threads: int | None, nproc: int, default: int) -> int:
    """Torch CPU threads for each of ``nproc`` ranks: ``--threads`` (else torch's ``default``)
    shared among them, at least one each, so K ranks do not oversubscribe the cores one
    process would use."""
    return max(1, (threads or default) // nproc)


class Op(Enum):
    TRAIN = "train"  # run one inner phase of ``round`` with ``steps`` steps
    STOP = "stop"  # leave: the node ended (``error`` says why when it failed)


@dataclass(frozen=True)
class Control:
    """What rank 0 tells the other ranks before each inner phase (through the rendezvous
    store: a rank waits there between phases for as long as the swarm takes, with no
    collective timing out). The parameters, and with ``optimizer_state`` the inner AdamW state
    (after a resume), follow as broadcasts from rank 0."""

    op: Op
    round: int = 0
    steps: int = 0
    optimizer_state: bool = False
    error: str = ""

    def __post_init__(self) -> None:
        if self.round < 0 or self.steps < 0 or (self.op is Op.TRAIN and self.steps == 0):
            raise ValueError(f"bad control message: {self}")

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "op": self.op.value,
                "round": self.round,
                "steps": self.steps,
                "optimizer_state": self.optimizer_state,
                "error": self.error,
            }
        ).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Control:
        """Raises ValueError on anything but a control message."""
        try:
            fields = json.loads(data)
            return cls(
                Op(fields["op"]),
                int(fields["round"]),
                int(fields["steps"]),
                bool(fields["optimizer_state"]),
                str(fields["error"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"bad control message {data[:80]!r}: {exc}") from None


def control_key(sequence: int) -> str:
    """The store key of rank 0's ``sequence``-th control message (each is written once)."""
    return f"swarmtrain/ranks/control/{sequence}"


@dataclass
class RankDigests:
    """The ranks' digests (parameters and inner optimizer state) at the end of each inner
    phase: ``agree`` stays True while every phase's digests were all equal; ``last`` holds the
    last phase's, by rank."""

    agree: bool | None = None
    last: list[str] = field(default_factory=list)
    phases: int = 0
    differed: list[int] = field(default_factory=list)  # the rounds whose digests differed

    def record(self, round: int, digests: list[str]) -> bool:
        """Record one phase's digests; returns whether they agree."""
        same = len(set(digests)) == 1
        self.agree = same and self.agree is not False
        self.last = list(digests)
        self.phases += 1
        if not same:
            self.differed.append(round)
        return same
