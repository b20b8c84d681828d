"""A pipeline trainer: holds the data and drives microbatches through the stage servers.

``PipelineTrainer.train_microbatch(inputs, targets)`` is the trio driver of one
``swarm.pipeline.routing.MicrobatchRoute``: it carries out the route's orders (forward to a
server, compute the loss, backward to a server) and reports what happened (done, failed with a
reason, deadline). It makes no routing decision itself. The loss is computed here, on the last
stage's outputs, with the caller's ``loss_fn`` in a worker thread; the servers apply the updates.

The trainer keeps every stage's inputs until the microbatch ends, which is what lets a failed
backward be replayed on another server of the stage (the route orders ``send_inputs``).

``run`` keeps the ``Router``'s view fresh: it re-reads the servers' announcements every
``refresh_every_s``. Several microbatches may be in flight at once (one task each); they share the
router and its penalties.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import trio

from p2p import Node, P2PError, PeerID, RemoteError
from swarm.pipeline.records import ServerAnnouncement, decode_announcements, servers_key
from swarm.pipeline.routing import (
    Backward,
    ComputeLoss,
    DeadlineReached,
    Fail,
    Finish,
    Forward,
    HopDone,
    HopFailed,
    LossComputed,
    MicrobatchRoute,
    Router,
    RoutingConfig,
    Start,
    penalizes,
)
from swarm.pipeline.wire import REFUSAL_CODES, call_backward, call_forward

log = logging.getLogger(__name__)

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# What a failed hop counts as (``TrainerStatistics.hop_failures``): our hop deadline passed, the
# connection failed (unreachable, a broken stream, a malformed reply), or the server refused
# with one of its codes (``swarm.pipeline.wire.REFUSAL_CODES``; an unknown code counts as
# ``refused``). A fixed set, so metrics can label by it.
HOP_FAILURE_KINDS = ("hop_timeout", "connection", "refused",
                     *(code.replace("-", "_") for code in REFUSAL_CODES))  # fmt: skip


def hop_failure_kind(exc: BaseException) -> str:
    """One of ``HOP_FAILURE_KINDS`` for what a hop raised (a P2PError or trio.TooSlowError)."""
    if isinstance(exc, trio.TooSlowError):
        return "hop_timeout"
    if isinstance(exc, RemoteError):
        return exc.code.replace("-", "_") if exc.code in REFUSAL_CODES else "refused"
    return "connection"


class MicrobatchFailed(Exception):
    """The microbatch could not complete (a stage without servers, too many failed attempts,
    or its deadline); the message names the stage and the last failure."""


@dataclass(frozen=True)
class TrainerConfig:
    run_id: str
    num_stages: int
    hop_timeout_s: float = 15.0
    microbatch_timeout_s: float = 120.0
    refresh_every_s: float = 1.0
    seed: int | None = None  # None: a random seed
    exclude_s: float = 5.0
    max_attempts_per_hop: int = 8
    relay_factor: float = 0.5


@dataclass(frozen=True)
class MicrobatchResult:
    loss: float
    path: tuple[bytes, ...]
    failovers: int
    seconds: float


@dataclass
class TrainerStatistics:
    microbatches: int = 0
    failed_microbatches: int = 0
    failovers: int = 0
    hops: int = 0
    hop_failures: Counter[str] = field(default_factory=Counter)  # by ``hop_failure_kind``


class PipelineTrainer:
    """Start with ``await nursery.start(trainer.run)``, then call ``train_microbatch``."""

    def __init__(self, node: Node, config: TrainerConfig, loss_fn: LossFn) -> None:
        self.node = node
        self.config = config
        self.loss_fn = loss_fn
        seed = config.seed if config.seed is not None else int.from_bytes(os.urandom(8), "big")
        self.router = Router(
            RoutingConfig(
                num_stages=config.num_stages,
                relay_factor=config.relay_factor,
                exclude_s=config.exclude_s,
                max_attempts_per_hop=config.max_attempts_per_hop,
            ),
            random.Random(seed),
        )
        self.statistics = TrainerStatistics()
        self._refreshed = trio.Event()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await self.refresh()
        task_status.started()
        while True:
            await trio.sleep(self.config.refresh_every_s)
            await self.refresh()

    async def refresh(self) -> list[ServerAnnouncement]:
        try:
            records = await self.node.dht.get_records(servers_key(self.config.run_id), latest=True)
        except P2PError as exc:
            log.debug("reading the servers failed: %s", exc)
            return []
        found = decode_announcements(
            [(r.owner, r.value) for r in records.values()], num_stages=self.config.num_stages
        )
        self.router.update(found)
        self._refreshed.set()
        self._refreshed = trio.Event()
        return found

    def servers_per_stage(self) -> list[int]:
        return [len(self.router.servers(s)) for s in range(self.config.num_stages)]

    async def wait_for_servers(self) -> None:
        """Until every stage has at least one announced server (the caller bounds the wait)."""
        while min(self.servers_per_stage()) == 0:
            await self._refreshed.wait()

    async def train_microbatch(
        self, inputs: torch.Tensor, targets: torch.Tensor
    ) -> MicrobatchResult:
        """Forward ``inputs`` through every stage, the loss against ``targets``, backward.

        Returns the loss and the path; raises ``MicrobatchFailed``.
        """
        started = time.monotonic()
        microbatch_id = os.urandom(16)
        route = MicrobatchRoute(self.router, deadline=started + self.config.microbatch_timeout_s)
        stage_inputs: list[np.ndarray | None] = [None] * self.config.num_stages
        stage_inputs[0] = inputs.numpy()
        carried: np.ndarray | None = None  # activations going forward, gradients going back
        loss = float("nan")
        actions = route.handle(Start(), started)
        with trio.move_on_at(trio.current_time() + self.config.microbatch_timeout_s) as scope:
            while True:
                (action,) = actions
                if isinstance(action, Finish):
                    self.statistics.microbatches += 1
                    self.statistics.failovers += action.failovers
                    return MicrobatchResult(
                        loss, action.path, action.failovers, time.monotonic() - started
                    )
                if isinstance(action, Fail):
                    break
                if isinstance(action, ComputeLoss):
                    assert carried is not None
                    loss, carried = await trio.to_thread.run_sync(
                        self._loss_and_grad, carried, targets
                    )
                    actions = route.handle(LossComputed(), time.monotonic())
                    continue
                assert isinstance(action, Forward | Backward)
                event: HopDone | HopFailed
                try:
                    with trio.fail_after(self.config.hop_timeout_s):
                        result = await self._hop(action, microbatch_id, stage_inputs, carried)
                except (P2PError, trio.TooSlowError) as exc:
                    penalize = penalizes(exc.code if isinstance(exc, RemoteError) else None)
                    reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                    self.statistics.hop_failures[hop_failure_kind(exc)] += 1
                    log.info("hop %s failed on %s: %s", action, action.peer_id.hex()[-8:], reason)
                    event = HopFailed(action.stage, action.peer_id, reason, penalize)
                else:
                    self.statistics.hops += 1
                    if isinstance(action, Forward) and action.stage + 1 < self.config.num_stages:
                        stage_inputs[action.stage + 1] = result
                    carried = result
                    event = HopDone(action.stage, action.peer_id)
                actions = route.handle(event, time.monotonic())
        if scope.cancelled_caught:
            actions = route.handle(DeadlineReached(), time.monotonic())
        self.statistics.failed_microbatches += 1
        self.statistics.failovers += route.failovers
        (fail,) = actions
        assert isinstance(fail, Fail)
        raise MicrobatchFailed(fail.reason)

    async def _hop(
        self,
        action: Forward | Backward,
        microbatch_id: bytes,
        stage_inputs: list[np.ndarray | None],
        carried: np.ndarray | None,
    ) -> np.ndarray | None:
        await self.node.reach(PeerID(action.peer_id))
        host, run_id = self.node.host, self.config.run_id
        if isinstance(action, Forward):
            inputs = stage_inputs[action.stage]
            assert inputs is not None
            return await call_forward(
                host, action.peer_id, run_id, action.stage, microbatch_id, inputs
            )
        assert carried is not None
        resend = stage_inputs[action.stage] if action.send_inputs else None
        return await call_backward(
            host, action.peer_id, run_id, action.stage, microbatch_id, carried, resend
        )

    def _loss_and_grad(
        self, outputs: np.ndarray, targets: torch.Tensor
    ) -> tuple[float, np.ndarray]:
        logits = torch.from_numpy(outputs).requires_grad_(True)
        loss = self.loss_fn(logits, targets)
        loss.backward()
        assert logits.grad is not None
        return float(loss.detach()), logits.grad.numpy()
