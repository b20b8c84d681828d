"""A node's local data-parallel ranks (``swarmtrain node --nproc-per-node K``).

Rank 0 is the node itself, the one swarm peer (p2p node, averager, DiLoCo, membership,
checkpoints); it spawns ranks 1..K-1 (``rank_main``), processes that only compute. They meet on
a rendezvous store on 127.0.0.1 at a free port that rank 0 serves, then form a
``torch.distributed`` group (gloo on the CPU, NCCL on CUDA, one device per rank). Each inner
phase, every rank:

1. waits for rank 0's ``Control`` message in the store (between phases a rank waits there, for as
   long as the swarm's averaging, catching up or re-syncing takes, and no collective times out);
2. takes rank 0's parameters (broadcast), and its inner AdamW state when rank 0 resumed from a
   checkpoint or the ranks' last digests differed;
3. runs the H inner steps on its shard of the node's batches (``inner_batches(shard=(k, K))``:
   the columns k*B..(k+1)*B of what the peer draws for a K-times batch, so the node's batches stay
   a pure function of run seed, round and peer id), the gradients averaged across ranks by
   ``DistributedDataParallel`` every step, the loss averaged for the node's line;
4. after the H-th optimizer step (rank 0: a hook that runs before DiLoCo's round), gathers every
   rank's digest of its parameters and AdamW state: equal digests mean the ranks hold the same
   bytes (``RankDigests``; the node's summary shows them).

Rank 0 then runs the round alone and contributes once, weighted by all ranks' tokens. At the
end it sends ``STOP``; on an error or Ctrl+C in the middle of a phase (when the others wait in
a collective) it terminates them. A rank whose parent died leaves within a second; SIGINT is
ignored by the ranks (a terminal's Ctrl+C reaches the whole process group: rank 0 decides).

With ``--fsdp`` (``ShardedGroup``) the ranks shard a training copy of the model instead of each
holding a DDP replica: step 2 scatters rank 0's parameters into the shards, the steps run on
FSDP2 (gradients reduce-scattered), and step 4 gathers the full parameters, which rank 0 hands
to DiLoCo's round (``training.loop._sharded_inner_phase``), and the inner AdamW state, which
the round's checkpoint carries whole (rank 0 lets it go after; a resume scatters it back).
"""

from __future__ import annotations

import copy
import ctypes
import datetime
import hashlib
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.parallel import DistributedDataParallel

from diloco import Corpus
from swarmtrain.config import RunConfig, TrainingSection
from swarmtrain.host_memory import release_large_blocks
from swarmtrain.training.inner_step import (
    accumulate,
    grad_scaler,
    inner_optimizer,
    phase_batches,
    set_lr,
)
from swarmtrain.training.ranks_plan import FLAG, Control, Op, RankDigests, control_key
from swarmtrain.training.workload import build_model, check_data, load_data

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
READY_TIMEOUT_S = 180.0  # a rank's start: import torch, load the data, build the model
COLLECTIVE_TIMEOUT_S = 300.0  # one collective of a phase (a step's gradients, a broadcast)
STOP_GRACE_S = 10.0
POLL_S = 0.05
# ``--fsdp`` on the CPU: allocations from this size up get their own mmap, given back to the OS
# when freed. glibc's default threshold rises to the largest chunk freed (up to 32 MiB), after
# which FSDP's per-block gather buffers and the sync's per-tensor copies come from the heap,
# which fragments and never shrinks: bench.ranks_memory measured a rank's peak above a DDP
# replica's that way, and well under it with the threshold pinned.
MMAP_THRESHOLD_BYTES = 128 << 10
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (glibc's malloc.h)


@dataclass(frozen=True)
class RankJob:
    """What a spawned rank gets (pickled): the verified run config, the node's peer id (the
    node's batches are drawn for it), its rank, the rendezvous port and its share of threads."""

    config: RunConfig
    peer_id: bytes
    rank: int
    nproc: int
    device: str  # "cpu" | "cuda"
    threads: int
    port: int
    fsdp: bool = False  # ``--fsdp``: the ranks shard the model (``ShardedGroup``)


class _Loss(nn.Module):
    """DDP averages the gradients of its module's ``forward``: here the model's loss."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.model.loss(inputs, targets)  # type: ignore[operator,no-any-return]


class RankGroup:
    """One rank's side of the group: the DDP wrapper and a phase's collectives, the same on
    every rank and in the same order."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        rank: int,
        nproc: int,
        scaler: torch.amp.GradScaler | None = None,
        training: TrainingSection | None = None,  # a spawned rank's: it steps through ``step``
    ):
        self.model, self.optimizer, self.rank, self.nproc = model, optimizer, rank, nproc
        self.training = training
        # fp16: rank 0's DiLoCo steps through its own scaler; every rank sees the same averaged
        # gradients, so the scalers skip the same steps and keep the same scale.
        self.scaler = scaler
        self.device = next(model.parameters()).device
        ids = [self.device.index or 0] if self.device.type == "cuda" else None
        # Construction broadcasts rank 0's parameters and checks every rank's shapes.
        self.ddp = DistributedDataParallel(_Loss(model), device_ids=ids)

    def sync(self, control: Control) -> None:
        """Take rank 0's parameters and buffers (and, when ``control`` says so, its inner
        optimizer state): every rank starts the phase on the same bytes."""
        with torch.no_grad():
            for tensor in [*self.model.parameters(), *self.model.buffers()]:
                dist.broadcast(tensor.detach(), src=0)
        if control.optimizer_state:
            # With the fp16 scaler's state (a resumed checkpoint's scale): every rank scales
            # its loss by the same factor before DDP averages the gradients.
            scaler = self.scaler if self.scaler is not None and self.scaler.is_enabled() else None
            mine = (_on_cpu(self.optimizer.state_dict()), scaler and scaler.state_dict())
            state = [mine if self.rank == 0 else None]
            dist.broadcast_object_list(state, src=0)
            if self.rank != 0:
                optimizer_state, scaler_state = state[0]  # type: ignore[misc]
                self.optimizer.load_state_dict(optimizer_state)
                if scaler is not None and scaler_state:
                    scaler.load_state_dict(scaler_state)

    def start_phase(self, control: Control) -> None:
        """A spawned rank's start of a phase (``_phase``): rank 0's bytes, as ``sync``."""
        self.sync(control)

    def step(self, micro: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, int]:
        """A spawned rank's inner step on its batches (DDP averages the gradients across
        ranks), through the scaler in fp16. Returns (this rank's loss, tokens)."""
        assert self.training is not None, "a spawned rank's group is built with its training"
        loss, tokens = accumulate(
            self.model, micro, self.training, self.ddp, self.scaler, self.optimizer
        )
        if self.scaler is None:
            self.optimizer.step()
        else:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return loss, tokens

    def finish_phase(self) -> None:
        """A spawned rank's end of a phase: its part in rank 0's digest gather."""
        self.digests()

    def mean_loss(self, loss: float) -> float:
        """The ranks' mean of this step's loss (the node's loss: its whole batch's)."""
        total = torch.tensor([loss], dtype=torch.float64, device=self.device)
        dist.all_reduce(total)
        return float(total) / self.nproc

    def digests(self) -> list[str]:
        """Every rank's SHA-256 of its parameters and inner optimizer state, by rank."""
        mine = torch.tensor(list(self.digest()), dtype=torch.uint8, device=self.device)
        every = [torch.empty_like(mine) for _ in range(self.nproc)]
        dist.all_gather(every, mine)
        return [bytes(d.cpu().tolist()).hex() for d in every]

    def digest(self) -> bytes:
        hasher = hashlib.sha256(b"swarmtrain/ranks/digest/1")
        for param in self.model.parameters():
            hasher.update(_raw(param))
            state = self.optimizer.state.get(param, {})
            for key in sorted(state):
                value = state[key]
                hasher.update(_raw(value) if torch.is_tensor(value) else repr(value).encode())
        return hasher.digest()


def _raw(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def _on_cpu(value: Any) -> Any:
    """An optimizer state dict with its tensors on the CPU (unpickled on any rank's device)."""
    if torch.is_tensor(value):
        return value.detach().to("cpu")
    if isinstance(value, dict):
        return {k: _on_cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_on_cpu(v) for v in value)
    return value


class _ShardedForward:
    """The sharded root as ``accumulate`` drives a rank wrapper: called for the loss, and
    ``no_sync`` for the batches before the last (FSDP2 keeps their gradients unreduced)."""

    def __init__(self, root: FSDPModule) -> None:
        self.root = root

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.root(inputs, targets)  # type: ignore[operator,no-any-return]

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        self.root.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.root.set_requires_gradient_sync(True)


def shard(model: nn.Module, mesh: DeviceMesh) -> FSDPModule:
    """FSDP2 over ``model`` in place: each block of its top-level ``nn.ModuleList``s (a
    transformer's layers: one all-gather per block in the forward, freed after it) is a unit,
    the rest (embeddings, head, norms) the root's, whose module is the loss wrapper (FSDP2
    gathers a unit in its ``forward``; the model's ``loss`` is not one). Returns the root."""
    done: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or any(name.startswith(d + ".") for d in done):
            continue
        for block in module:
            fully_shard(block, mesh=mesh)
        done.append(name)
    root = fully_shard(_Loss(model), mesh=mesh)
    assert isinstance(root, FSDPModule)
    return root


class ShardedGroup:
    """One rank's side of a ``--fsdp`` node: its shard of a training copy of the model (FSDP2,
    ``shard``) and an inner AdamW over the shards only (its moments sharded too: the memory
    FSDP saves); the same collectives in the same order on every rank. Rank 0's plain model
    (DiLoCo's) is where a phase starts and ends: ``sync`` scatters it into the shards, ``end``
    gathers them back."""

    def __init__(self, model: nn.Module, training: TrainingSection, rank: int, nproc: int):
        self.rank, self.nproc, self.training = rank, nproc, training
        self.device = next(model.parameters()).device
        self.mesh = init_device_mesh(self.device.type, (nproc,))
        self.root = shard(model, self.mesh)
        self.model = model  # its parameters are now DTensors, each rank holding a shard
        self.forward = _ShardedForward(self.root)
        self.optimizer = inner_optimizer(model, training)

    def _trainable(self, model: nn.Module) -> list[tuple[str, torch.Tensor]]:
        return [(n, p) for n, p in model.named_parameters() if p.requires_grad]

    def sync(self, plain: nn.Module | None) -> None:
        """Every rank's shard of rank 0's ``plain`` parameters (None on the other ranks), a
        tensor at a time (a scatter: no rank holds the whole model for this); buffers
        broadcast."""
        sources = dict(self._trainable(plain)) if plain is not None else {}
        with torch.no_grad():
            for name, param in self._trainable(self.model):
                assert isinstance(param, DTensor)
                full = sources[name].detach() if plain is not None else None
                if full is None:
                    full = torch.empty(param.shape, dtype=param.dtype, device=self.device)
                piece = distribute_tensor(
                    full.to(self.device), param.device_mesh, param.placements, src_data_rank=0
                )
                param.to_local().copy_(piece.to_local())
            buffers = dict(plain.named_buffers()) if plain is not None else {}
            for name, buffer in self.model.named_buffers():
                if plain is not None:
                    buffer.copy_(buffers[name])
                dist.broadcast(buffer, src=0)

    def gather_optimizer(self, plain: nn.Module | None, into: torch.optim.Optimizer | None) -> None:
        """Every rank gathers the inner AdamW state a tensor at a time; rank 0 puts it in
        ``into`` (DiLoCo's optimizer over ``plain``), whose checkpoint then carries it."""
        targets = dict(self._trainable(plain)) if plain is not None else {}
        for name, param in self._trainable(self.model):
            state = self.optimizer.state.get(param)
            if not state:
                continue  # every rank stepped the same: none has state for it either
            full = {
                key: value.full_tensor() if isinstance(value, DTensor) else value.clone()
                for key, value in state.items()
            }
            if into is not None:
                into.state[targets[name]] = full

    def scatter_optimizer(
        self, plain: nn.Module | None, source: torch.optim.Optimizer | None
    ) -> None:
        """Every rank's shard of rank 0's inner AdamW state (``source``, over ``plain``: a
        resumed checkpoint's), a tensor at a time; a parameter without state gets none."""
        sources = dict(self._trainable(plain)) if plain is not None else {}
        self.optimizer.state.clear()
        for name, param in self._trainable(self.model):
            assert isinstance(param, DTensor)
            state = source.state.get(sources[name], {}) if source is not None else {}
            has = torch.tensor([1.0 if state else 0.0, float(state.get("step", 0))])
            dist.broadcast(has, src=0)
            if not has[0]:
                continue
            shard: dict[str, Any] = {"step": torch.tensor(float(has[1]))}
            for key in ("exp_avg", "exp_avg_sq"):
                full = state[key] if key in state else torch.empty(param.shape, dtype=param.dtype)
                shard[key] = distribute_tensor(
                    full.to(self.device), param.device_mesh, param.placements, src_data_rank=0
                )
            self.optimizer.state[param] = shard

    def start_phase(self, control: Control) -> None:
        """A spawned rank's start of a phase (``_phase``): its shards of rank 0's parameters,
        and of its inner AdamW state when ``control`` says so."""
        self.sync(None)
        if control.optimizer_state:
            self.scatter_optimizer(None, None)

    def finish_phase(self) -> None:
        """A spawned rank's end of a phase: its part in rank 0's gathers (parameters and
        digests, then the inner AdamW state for the round's checkpoint)."""
        self.end(None)
        self.gather_optimizer(None, None)

    def step(self, micro: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, int]:
        """One inner step on this rank's batches (FSDP reduce-scatters the gradients across
        ranks, the clip's norm is the whole model's). Returns (this rank's loss, tokens)."""
        loss, tokens = accumulate(self.model, micro, self.training, self.forward)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss, tokens

    def mean_loss(self, loss: float) -> float:
        total = torch.tensor([loss], dtype=torch.float64, device=self.device)
        dist.all_reduce(total)
        return float(total) / self.nproc

    def end(self, out: torch.Tensor | None) -> list[str]:
        """The phase's end: every rank gathers the full parameters a tensor at a time (rank 0
        writes them into ``out``, DiLoCo's flat float32 vector) and hashes them with its
        buffers and its optimizer's replicated state (step counts, settings); returns every
        rank's digest, by rank. The shards themselves exist once each, so there is no second
        copy to compare them with: equal digests say every rank took part in the gather and
        holds the same replicated state."""
        hasher = hashlib.sha256(b"swarmtrain/ranks/sharded-digest/1")
        offset = 0
        with torch.no_grad():
            for _, param in self._trainable(self.model):
                assert isinstance(param, DTensor)
                full = param.full_tensor()
                hasher.update(_raw(full))
                if out is not None:
                    out[offset : offset + full.numel()].copy_(full.reshape(-1))
                offset += full.numel()
                del full
        for buffer in self.model.buffers():
            hasher.update(_raw(buffer))
        for param in self.optimizer.state:
            step = self.optimizer.state[param].get("step")
            hasher.update(repr(float(step) if torch.is_tensor(step) else step).encode())
        for group in self.optimizer.param_groups:
            hasher.update(repr({k: v for k, v in group.items() if k != "params"}).encode())
        mine = torch.tensor(list(hasher.digest()), dtype=torch.uint8, device=self.device)
        every = [torch.empty_like(mine) for _ in range(self.nproc)]
        dist.all_gather(every, mine)
        return [bytes(d.cpu().tolist()).hex() for d in every]


def pin_mmap_threshold() -> bool:
    """Pin this process's glibc mmap threshold (``MMAP_THRESHOLD_BYTES``); False where the C
    library is not glibc (nothing changed)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    except (OSError, AttributeError):
        return False


def _backend(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


def _timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


class LocalRanks:
    """Rank 0's side: spawns the other ranks at once (they start while the node joins), then
    ``connect`` (before the node announces its start), ``begin_phase`` before each inner phase,
    ``mean_loss`` each step, ``close`` at the end. ``digests``: the ranks' agreement."""

    def __init__(
        self,
        config: RunConfig,
        peer_id: bytes,
        nproc: int,
        device: torch.device,
        threads: int,
        *,
        fsdp: bool = False,
    ) -> None:
        self.nproc = nproc
        self.device = device
        self.fsdp = fsdp
        self._training = config.training
        self._sharded: ShardedGroup | None = None
        self.digests = RankDigests()
        self._store = dist.TCPStore(
            HOST, 0, nproc, is_master=True, wait_for_workers=False,
            timeout=_timeout(COLLECTIVE_TIMEOUT_S),
        )  # fmt: skip
        self._group: RankGroup | None = None
        self._sequence = 0
        self._resend_state = True  # the first phase takes rank 0's optimizer state, if any
        self._phase: tuple[int, int] | None = None  # (round, steps) of the phase in progress
        self._steps = 0
        context = multiprocessing.get_context("spawn")
        self._procs = [
            context.Process(
                target=rank_main,
                args=(
                    RankJob(
                        config, peer_id, k, nproc, device.type, threads, self._store.port, fsdp
                    ),
                ),
                name=f"swarmtrain-rank{k}",
                daemon=True,  # multiprocessing ends them if this process exits without close()
            )
            for k in range(1, nproc)
        ]
        pinned = fsdp and device.type == "cpu" and "MALLOC_MMAP_THRESHOLD_" not in os.environ
        if pinned:
            pin_mmap_threshold()
            os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD_BYTES)  # the ranks' too
        try:
            with _sigint_ignored():  # inherited: Ctrl+C in a terminal is rank 0's to handle
                for proc in self._procs:
                    proc.start()
        finally:
            if pinned:
                del os.environ["MALLOC_MMAP_THRESHOLD_"]

    @property
    def shard(self) -> tuple[int, int]:
        return (0, self.nproc)

    @property
    def ddp(self) -> DistributedDataParallel:
        assert self._group is not None, "connect() first"
        return self._group.ddp

    def connect(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Wait (bounded) until every rank is ready, form the group and wrap ``model``; the
        digest hook goes on ``optimizer`` (call before DiLoCo registers its round hook, so the
        digests are of the inner phase's end). Raises RuntimeError naming a rank that failed."""
        ready = [f"ready/{k}" for k in range(1, self.nproc)]
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self._store.check(ready):
            for k, proc in enumerate(self._procs, start=1):
                if self._store.check([f"error/{k}"]):
                    reason = self._store.get(f"error/{k}").decode(errors="replace")
                    raise RuntimeError(f"{FLAG}: rank {k} could not start: {reason}")
                if proc.exitcode is not None:
                    raise RuntimeError(f"{FLAG}: rank {k} exited with status {proc.exitcode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{FLAG}: the ranks were not ready in {READY_TIMEOUT_S:.0f} s")
            time.sleep(POLL_S)  # a process start, not a protocol wait
        dist.init_process_group(
            _backend(self.device.type), store=self._store, rank=0, world_size=self.nproc,
            timeout=_timeout(COLLECTIVE_TIMEOUT_S),
        )  # fmt: skip
        if self.fsdp:
            # A training copy to shard: DiLoCo keeps ``model`` whole (its rounds, checkpoints
            # and state sync see plain tensors); ``optimizer`` (DiLoCo's) never steps.
            self._sharded = ShardedGroup(copy.deepcopy(model), self._training, 0, self.nproc)
            log.info("%d local ranks joined (%s), sharding the model (FSDP2)",
                     self.nproc, _backend(self.device.type))  # fmt: skip
            return
        self._group = RankGroup(model, optimizer, 0, self.nproc)
        optimizer.register_step_post_hook(self._after_step)
        log.info("%d local ranks joined (%s)", self.nproc, _backend(self.device.type))

    @property
    def sharded(self) -> ShardedGroup:
        assert self._sharded is not None, "connect() a --fsdp node first"
        return self._sharded

    def begin_sharded_phase(
        self, round: int, steps: int, plain: nn.Module, optimizer: torch.optim.Optimizer
    ) -> None:
        """``--fsdp``: start inner phase ``round`` on every rank from ``plain`` (DiLoCo's model:
        its parameters scattered into the ranks' shards) and, when ``optimizer`` (DiLoCo's)
        holds state (a resumed checkpoint's), its AdamW moments, which it then lets go."""
        state = bool(optimizer.state)
        if state:
            log.info("round %d: the ranks take our inner optimizer state, sharded", round)
        self._send(Control(Op.TRAIN, round, steps, optimizer_state=state))
        self._phase, self._steps = (round, steps), 0
        self.sharded.sync(plain)
        if state:
            self.sharded.scatter_optimizer(plain, optimizer)
            optimizer.state.clear()  # the shards hold it now; DiLoCo's copy is whole

    def end_sharded_phase(
        self, out: torch.Tensor, plain: nn.Module, optimizer: torch.optim.Optimizer
    ) -> None:
        """``--fsdp``: after the phase's last step, gather the full parameters into ``out``
        (DiLoCo's flat float32 vector), record the ranks' digests, and gather the inner AdamW
        state into ``optimizer`` (DiLoCo's, over ``plain``), whose next checkpoint carries it
        (the caller clears it after)."""
        assert self._phase is not None, "begin_sharded_phase() first"
        round, _ = self._phase
        digests = self.sharded.end(out)
        self.sharded.gather_optimizer(plain, optimizer)
        self._phase = None
        if not self.digests.record(round, digests):
            log.error("round %d: the node's ranks disagree after the gather: %s", round, digests)

    def share_scaler(self, scaler: torch.amp.GradScaler | None) -> None:
        """DiLoCo's fp16 scaler (rank 0 steps through it): its state goes to the ranks with the
        inner optimizer's after a resume (``RankGroup.sync``)."""
        if self._group is not None:
            self._group.scaler = scaler

    def begin_phase(self, round: int, steps: int) -> None:
        """Start inner phase ``round`` of ``steps`` steps on every rank, from our parameters."""
        assert self._group is not None, "connect() first"
        optimizer_state = self._resend_state and bool(self._group.optimizer.state)
        control = Control(Op.TRAIN, round, steps, optimizer_state=optimizer_state)
        if optimizer_state:
            log.info("round %d: the ranks take our inner optimizer state", round)
        self._send(control)
        self._phase, self._steps = (round, steps), 0
        self._group.sync(control)
        self._resend_state = False

    def mean_loss(self, loss: float) -> float:
        if self._sharded is not None:
            return self._sharded.mean_loss(loss)
        assert self._group is not None
        return self._group.mean_loss(loss)

    def _after_step(self, *_: object) -> None:
        if self._phase is None:
            return
        self._steps += 1
        round, steps = self._phase
        if self._steps < steps:
            return
        assert self._group is not None
        digests = self._group.digests()
        self._phase = None
        if not self.digests.record(round, digests):
            # The next phase starts from our parameters again; take our optimizer state too.
            self._resend_state = True
            log.error("round %d: the node's ranks hold different bytes: %s", round, digests)

    def _send(self, control: Control) -> None:
        self._store.set(control_key(self._sequence), control.to_bytes())
        self._sequence += 1

    def failed_rank(self, wait_s: float = 2.0) -> str:
        """A line naming a rank that exited, or "" when none did within ``wait_s``: a dying
        rank's sockets close (and break our collective) just before its exit status shows."""
        deadline = time.monotonic() + wait_s
        while True:
            for k, proc in enumerate(self._procs, start=1):
                if proc.exitcode not in (None, 0):
                    return f"{FLAG}: rank {k} exited with status {proc.exitcode} (its log is above)"
            if time.monotonic() > deadline:
                return ""
            time.sleep(POLL_S)

    def close(self, error: str = "") -> None:
        """Stop the other ranks: ``STOP`` between phases, else (they wait in a collective of a
        phase we left) terminate them; bounded either way."""
        mid_phase = self._phase is not None or (self._group is None and self._sharded is None)
        if not mid_phase:
            try:
                self._send(Control(Op.STOP, error=error))
            except Exception as exc:  # the store is ours: only a dying process gets here
                log.warning("could not tell the ranks to stop: %s", exc)
        for proc in self._procs:
            if not mid_phase:
                proc.join(STOP_GRACE_S)
            if proc.is_alive():
                proc.terminate()
                proc.join(STOP_GRACE_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
        if dist.is_initialized():
            dist.destroy_process_group()


@contextmanager
def _sigint_ignored() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def rank_main(job: RankJob) -> None:
    """A spawned rank (1..K-1): build the run's data and model as rank 0 did, then run the
    phases rank 0 starts until it says ``STOP`` or goes away. Exits 1 on any failure."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    release_large_blocks()  # as the node's own process (``swarmtrain.host_memory``)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)-7s rank {job.rank} %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
    threading.Thread(target=_leave_with_parent, args=(os.getppid(),), daemon=True).start()
    store = dist.TCPStore(
        HOST, job.port, job.nproc, is_master=False, timeout=_timeout(COLLECTIVE_TIMEOUT_S)
    )
    try:
        torch.set_num_threads(job.threads)
        device = torch.device("cpu")
        if job.device == "cuda":
            device = torch.device("cuda", job.rank)
            torch.cuda.set_device(device)
        corpus = load_data(job.config)
        check_data(job.config, corpus)
        model = build_model(job.config, corpus.vocab_size).to(device)
        optimizer = inner_optimizer(model, job.config.training)
    except Exception as exc:
        store.set(f"error/{job.rank}", f"{type(exc).__name__}: {exc}".splitlines()[0])
        raise SystemExit(1) from None
    store.set(f"ready/{job.rank}", "1")
    log.info("ready (pid %d, %d threads, %s)", os.getpid(), job.threads, device)
    try:
        dist.init_process_group(
            _backend(job.device), store=store, rank=job.rank, world_size=job.nproc,
            timeout=_timeout(COLLECTIVE_TIMEOUT_S),
        )  # fmt: skip
        group: RankGroup | ShardedGroup
        if job.fsdp:
            del optimizer  # the sharded group's own is over the shards
            group = ShardedGroup(model, job.config.training, job.rank, job.nproc)
        else:
            scaler = grad_scaler(model, job.config.training)
            group = RankGroup(
                model, optimizer, job.rank, job.nproc, scaler, training=job.config.training
            )
        sequence = 0
        while (control := _next_control(store, sequence)).op is Op.TRAIN:
            sequence += 1
            group.start_phase(control)
            _phase(group, corpus, job, control)
        dist.destroy_process_group()
    except Exception as exc:
        # Rank 0 failed or left mid-phase (its own error is the node's line): say it briefly.
        log.error("stopping: %s", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        raise SystemExit(1) from None


def _next_control(store: dist.TCPStore, sequence: int) -> Control:
    key = control_key(sequence)
    while not store.check([key]):  # raises when rank 0's store is gone
        time.sleep(POLL_S)
    return Control.from_bytes(store.get(key))


def _phase(group: RankGroup | ShardedGroup, corpus: Corpus, job: RankJob, control: Control) -> None:
    """Inner phase ``control.round`` on this rank's shard of the node's batches: what rank 0's
    ``training.loop._native_inner_phase`` (or, with ``--fsdp``, ``_sharded_inner_phase``)
    does, less DiLoCo's round."""
    training = job.config.training
    micro = training.grad_accumulation
    batches = phase_batches(
        job.config, corpus, control.round, job.peer_id, control.steps, (job.rank, job.nproc)
    )
    total = job.config.run.rounds * control.steps
    for step in range(control.steps):
        set_lr(group.optimizer, training, control.round * control.steps + step, total)
        loss, _ = group.step(batches[step * micro : (step + 1) * micro])
        group.mean_loss(loss)
    group.finish_phase()


def _leave_with_parent(parent: int) -> None:
    """Exit when rank 0 is gone (its pid no longer our parent): no orphan ranks."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)
