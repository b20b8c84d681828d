"""A pipeline role as metrics (``--metrics-port``) and experiment-tracking series (``--log-to``).

``swarmtrain.pipeline.node.run_pipeline`` hands every event of its role (``swarmtrain.pipeline
.roles``) to ``PipelineObserver.on_event``, in the role's trio loop, and tells it each
``StageServer`` it starts (``serving``); the observer's families are computed in that loop at
every scrape (``Metrics.watch``), so they read the server's statistics while nothing changes
them; the round families are read in the same call (``with_round``), so a scrape shows one
round: the trainer's round number, microbatches and failovers of the same round. Two kinds of
values:

* ``swarmtrain.metrics``' round families where they mean the same thing. A trainer's round is a
  round: its mean loss, its tokens/s, the servers its microbatches went through as its peers; it
  also goes to every ``--log-to`` tracker, as a DiLoCo node's rounds do. A stage server's
  averaging round (a clock epoch) is a round: the all-reduce's seconds and bytes, the stage's
  servers in the group as peers, no loss or tokens/s; a round that found a group but failed is
  a failed round.
* ``swarmtrain_pipeline_*`` families for what only a pipeline has: a server's stage, measured
  throughput, queue and requests; a trainer's microbatches, hops, failed hops by kind, failovers
  and the servers per stage it knows and routes through.

Label values come from small fixed sets: stages, request kinds, the servers' refusal codes and
``swarm.pipeline.trainer.HOP_FAILURE_KINDS``. Counters of a server that restarts on another
stage (an empty stage, ``run_pipeline``) carry on from the previous server's counts.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from swarm.pipeline import wire
from swarmtrain.metrics import InLoop, Metrics, RoundSample
from swarmtrain.tracking import Tracker

REQUEST_KINDS = ("forward", "backward", "params")
# A server's refusal codes as label values; anything else counts as "other".
REFUSAL_CODES = tuple(code.replace("-", "_") for code in wire.REFUSAL_CODES)


def trainer_round_sample(event: dict[str, Any]) -> RoundSample:
    """A trainer's ``round`` event as a round: failed when no microbatch finished (no loss)."""
    loss = event["loss"]
    done = isinstance(loss, float) and math.isfinite(loss)
    return RoundSample(
        int(event["round"]),
        done,
        loss if done else None,
        float(event["tokens_per_s"]) if done else None,
        peers=sum(event.get("route_servers_per_stage", ())),
    )


def server_round_sample(event: dict[str, Any], syncs: int) -> RoundSample:
    """A server's ``averaged`` or ``average_failed`` event as a round."""
    if event["event"] != "averaged":
        return RoundSample(int(event["round"]), False, None, None, syncs=syncs)
    return RoundSample(
        int(event["round"]),
        True,
        None,
        None,
        peers=int(event["group"]),
        bytes_sent=int(event.get("bytes_sent", 0)),
        bytes_received=int(event.get("bytes_received", 0)),
        matchmaking_s=event.get("matchmaking_s"),
        allreduce_s=event.get("allreduce_s"),
        syncs=syncs,
    )


def server_counts(server: Any) -> Counter[tuple[Any, ...]]:
    """A ``StageServer``'s counters: ("served", stage, kind), ("refused", code), ("steps",),
    ("moves",)."""
    stats = server.statistics
    counts: Counter[tuple[Any, ...]] = Counter()
    for (stage, kind), n in stats.served.items():
        counts["served", stage, kind] += n
    for code, n in stats.refusals_by_code.items():
        label = code.replace("-", "_")
        counts["refused", label if label in REFUSAL_CODES else "other"] += n
    counts["steps",] = stats.optimizer_steps
    counts["moves",] = stats.moves
    return counts


class PipelineObserver:
    """Feeds ``metrics`` (None: off) and ``trackers`` from one pipeline role (``role``: server
    or trainer) of a run of ``num_stages`` stages."""

    def __init__(
        self,
        role: str,
        num_stages: int,
        metrics: Metrics | None,
        trackers: Sequence[Tracker] = (),
        in_loop: InLoop[list[Metric]] | None = None,
    ) -> None:
        self.role = role
        self.num_stages = num_stages
        self.metrics = metrics
        self.trackers = tuple(trackers)
        self._server: Any = None
        self._retired: Counter[tuple[Any, ...]] = Counter()  # earlier servers' counts
        self._syncs = 0  # a server's parameter downloads: joins and moves
        self._trainer: dict[str, Any] = {}  # the latest cumulative figures of the trainer
        self._microbatches_done = 0
        self._microbatches_failed = 0
        if metrics is not None:
            # Its rounds are observed in the role's loop, like its families read there.
            metrics.watch(self.families, in_loop, with_round=True)

    def serving(self, server: Any) -> None:
        """A ``StageServer`` now serves for this process (a restart replaces the previous)."""
        if self._server is not None and self._server is not server:
            self._retired += server_counts(self._server)
        self._server = server

    def on_event(self, event: dict[str, Any]) -> None:
        kind = event.get("event")
        if kind in ("joined", "moved"):
            self._syncs += 1
        elif kind in ("averaged", "average_failed"):
            self._observe(server_round_sample(event, self._syncs), trackers=False)
        elif kind == "microbatch_failed":
            self._microbatches_failed += 1
            self._trainer["hop_failures"] = event.get("hop_failures", {})
        elif kind == "round" and self.role == "trainer":
            self._microbatches_done += int(event["microbatches"])
            self._trainer.update(event)
            self._observe(trainer_round_sample(event), trackers=True)

    def _observe(self, sample: RoundSample, *, trackers: bool) -> None:
        if self.metrics is not None:
            self.metrics.observe_round(sample)
        if trackers:
            for tracker in self.trackers:
                tracker.observe_round(sample)

    # -- families (called in the role's trio loop) ---------------------------------------------

    def families(self) -> Iterator[Metric]:
        role = GaugeMetricFamily(
            "swarmtrain_pipeline_role", "1 for this pipeline node's role", labels=["role"]
        )
        role.add_metric([self.role], 1)
        yield role
        if self.role == "server":
            yield from self._server_families()
        else:
            yield from self._trainer_families()

    def _server_families(self) -> Iterator[Metric]:
        server = self._server
        if server is None:
            return  # not serving yet
        counts = self._retired + server_counts(server)
        stage = GaugeMetricFamily(
            "swarmtrain_pipeline_stage", "1 for the stage this server serves, 0 for the others",
            labels=["stage"],
        )  # fmt: skip
        for k in range(self.num_stages):
            stage.add_metric([str(k)], 1.0 if k == server.stage else 0.0)
        yield stage
        yield GaugeMetricFamily(
            "swarmtrain_pipeline_throughput_samples_per_second",
            "This server's measured samples/s through forward + backward (what it announces)",
            value=server.throughput(),
        )
        yield GaugeMetricFamily(
            "swarmtrain_pipeline_queue_requests",
            "Requests waiting for this server's stage or computing on it",
            value=server.queue_length(),
        )
        served = CounterMetricFamily(
            "swarmtrain_pipeline_requests", "Requests this server served, by stage and kind",
            labels=["stage", "kind"],
        )  # fmt: skip
        for k in range(self.num_stages):
            for kind in REQUEST_KINDS:
                served.add_metric([str(k), kind], counts["served", k, kind])
        yield served
        refused = CounterMetricFamily(
            "swarmtrain_pipeline_requests_refused",
            "Requests this server refused (a reply naming why), by code",
            labels=["code"],
        )
        for code in (*REFUSAL_CODES, "other"):
            refused.add_metric([code], counts["refused", code])
        yield refused
        yield CounterMetricFamily(
            "swarmtrain_pipeline_optimizer_steps", "Optimizer steps of this server's stage",
            value=counts["steps",],
        )  # fmt: skip
        yield CounterMetricFamily(
            "swarmtrain_pipeline_moves", "Moves to another stage (rebalancing)",
            value=counts["moves",],
        )  # fmt: skip

    def _trainer_families(self) -> Iterator[Metric]:
        from swarm.pipeline.trainer import HOP_FAILURE_KINDS

        latest = self._trainer
        microbatches = CounterMetricFamily(
            "swarmtrain_pipeline_microbatches",
            "Microbatch attempts: ok (trained) or failed (retried or given up)",
            labels=["outcome"],
        )
        microbatches.add_metric(["ok"], self._microbatches_done)
        microbatches.add_metric(["failed"], self._microbatches_failed)
        yield microbatches
        yield CounterMetricFamily(
            "swarmtrain_pipeline_hops", "Hops (a forward or backward on one server) that succeeded",
            value=latest.get("hops", 0),
        )  # fmt: skip
        failures = CounterMetricFamily(
            "swarmtrain_pipeline_hop_failures", "Hops that failed, by kind",
            labels=["reason"],
        )  # fmt: skip
        failed: dict[str, int] = latest.get("hop_failures", {})
        for reason in HOP_FAILURE_KINDS:
            failures.add_metric([reason], failed.get(reason, 0))
        yield failures
        yield CounterMetricFamily(
            "swarmtrain_pipeline_failovers",
            "Hops retried on another server of their stage",
            value=latest.get("failovers", 0),
        )
        for name, key, text in (
            ("swarmtrain_pipeline_stage_servers", "servers_per_stage",
             "Servers of each stage the trainer knows (announced), at its last round"),
            ("swarmtrain_pipeline_route_servers", "route_servers_per_stage",
             "Servers of each stage the last round's microbatches went through"),
        ):  # fmt: skip
            if key in latest:
                family = GaugeMetricFamily(name, text, labels=["stage"])
                for k, count in enumerate(latest[key]):
                    family.add_metric([str(k)], count)
                yield family


def observer_for(
    role: str,
    num_stages: int,
    metrics: Metrics | None,
    trackers: Sequence[Tracker],
    in_loop: Callable[..., Any],
) -> PipelineObserver | None:
    """An observer when metrics or trackers are on; None when neither is."""
    if metrics is None and not trackers:
        return None
    return PipelineObserver(role, num_stages, metrics, trackers, in_loop)
