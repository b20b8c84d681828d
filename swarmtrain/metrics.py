"""Prometheus metrics of one long-running process (``--metrics-port``): node, coordinator, relay.
A pipeline node's stage server or trainer adds its families (``swarmtrain.pipeline.observe``).

Each process has its own ``CollectorRegistry`` (never the library's global one), served by
``prometheus_client.start_http_server`` on a thread of its own at ``/metrics``. Two feeds:

- pushed, per round: the training loop hands every finished round to ``observe_round`` as a
  ``RoundSample`` (the numbers its round line prints); the counters and histograms add it up,
  and the round's gauges (round, loss, tokens/s, peers, state agreement) show the last one, and
  are absent before the first;
- pulled, per scrape: ``watch_node`` samples the p2p node (connections by kind, the NAT verdict,
  DHT table and store, host counters) and ``watch_referee`` a coordinator's verdicts. The
  sample runs *in the node's trio loop* (``in_loop``: the runtime's ``call_sync``, or the
  loop's token from ``trio.from_thread``), so it reads the node's tables while nothing else
  changes them; a loop that has ended yields none of those families.

One scrape shows one round: ``observe_round`` and the read of every round family (the round's
gauges and the round counters and histograms) hold one lock, so a round that ends mid-scrape is
either all in it or not at all. A source whose families also follow the rounds (a pipeline
role's, ``watch(..., with_round=True)``, whose rounds are observed in its loop) reads the round
families in the same call in that loop, so its figures and the round's agree.

DHT requests are timed through the p2p ``Dht``'s ``on_request`` hook (p2p imports nothing of
ours: it calls whatever we set). Label values come from small fixed sets: a dropped peer's
free-text reason is mapped to one of ``DROP_KINDS``.

The server binds 127.0.0.1 unless ``--metrics-host`` says otherwise: metrics name the peers'
counts, the run's progress and this machine's reachability, which is nobody else's business
by default, and an open port on a volunteer's machine should be the volunteer's choice.
"""

from __future__ import annotations

import argparse
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import trio
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

T = TypeVar("T")
InLoop = Callable[[Callable[[], T]], T]

DEFAULT_HOST = "127.0.0.1"
# What a dropped peer's reason (swarm.averaging.allreduce's free text) counts as.
DROP_KINDS = ("lost", "weight", "bad_data", "protocol")
ROUND_SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
DHT_SECONDS_BUCKETS = (0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
REACHABILITY = ("public", "private", "unknown")
CONNECTION_KINDS = ("direct", "punched", "relayed")  # p2p.host.ConnectionKind


def drop_kind(reason: str) -> str:
    """One of ``DROP_KINDS`` for a reason an all-reduce gave for dropping a peer."""
    text = reason.lower()
    if text == "lost":
        return "lost"
    if "weight" in text:
        return "weight"
    if "part" in text or "slice" in text or "contributor" in text:
        return "bad_data"
    return "protocol"


class HasCheater(Protocol):
    cheater: bytes | None


@dataclass(frozen=True)
class RoundSample:
    """One finished round as the node saw it (``swarmtrain.training.loop``; a pipeline trainer's
    round or a stage server's averaging round: ``swarmtrain.pipeline.observe``). ``loss`` and
    ``tokens_per_s`` are None where the round had none (a server's averaging round, a trainer's
    round with no microbatch done): their gauges are then absent."""

    round: int
    ok: bool
    loss: float | None
    tokens_per_s: float | None
    peers: int = 0  # contributors of the round; 0 when it failed
    bytes_sent: int = 0
    bytes_received: int = 0
    matchmaking_s: float | None = None
    allreduce_s: float | None = None
    dropped: tuple[str, ...] = ()  # reasons, one per peer the all-reduce dropped
    agree: bool | None = None  # our state hash equals the majority's; None: not known
    syncs: int = 0  # states downloaded so far
    verdicts: tuple[HasCheater, ...] = ()  # a verified run's verdicts seen so far

    @classmethod
    def of(
        cls,
        round: int,
        loss: float,
        tokens_per_s: float,
        report: Any,
        *,
        agree: bool | None = None,
        syncs: int = 0,
        verdicts: Iterable[HasCheater] = (),
    ) -> RoundSample:
        """From a round's ``RoundReport`` (None: the round failed)."""
        if report is None:
            return cls(round, False, loss, tokens_per_s, syncs=syncs, verdicts=tuple(verdicts))
        return cls(
            round,
            True,
            loss,
            tokens_per_s,
            peers=report.peers,
            bytes_sent=report.bytes_sent,
            bytes_received=report.bytes_received,
            matchmaking_s=report.matchmaking_s,
            allreduce_s=report.allreduce_s,
            dropped=tuple(getattr(report, "dropped", ())),
            agree=agree,
            syncs=syncs,
            verdicts=tuple(verdicts),
        )


@dataclass(frozen=True)
class MetricsOptions:
    port: int  # 0: a free port
    host: str = DEFAULT_HOST


def add_metrics_arguments(parser: argparse.ArgumentParser) -> None:
    """``--metrics-port`` and ``--metrics-host`` for a long-running command."""
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (0: a free port, logged); "
        "the metrics are listed in the README [off]",
    )
    parser.add_argument(
        "--metrics-host",
        default=DEFAULT_HOST,
        metavar="HOST",
        help="address the metrics server binds, e.g. 0.0.0.0 for a Prometheus on another "
        f"machine (metrics tell the run's progress and this peer's reachability) [{DEFAULT_HOST}]",
    )


def options_from(args: argparse.Namespace) -> MetricsOptions | None:
    """The parsed flags; None when metrics are off. ValueError for a port out of range."""
    if args.metrics_port is None:
        return None
    if not 0 <= args.metrics_port <= 65535:
        raise ValueError(f"--metrics-port must be 0-65535, got {args.metrics_port}")
    return MetricsOptions(args.metrics_port, args.metrics_host)


def node_families(node: Any) -> Iterator[Metric]:
    """A p2p ``Node``'s connections, reachability, DHT and host counters. Call it in the node's
    trio loop (it reads the node's tables)."""
    kinds = dict.fromkeys(CONNECTION_KINDS, 0)
    for peer in node.host.connected_peers():
        kind = node.host.connection_kind(peer)
        if kind is not None:
            kinds[kind] = kinds.get(kind, 0) + 1
    connections = GaugeMetricFamily(
        "swarmtrain_connections", "Peers connected, by connection kind", labels=["kind"]
    )
    for kind, count in kinds.items():
        connections.add_metric([kind], count)
    yield connections
    status = node.reachability.status.value
    reach = GaugeMetricFamily(
        "swarmtrain_reachability",
        "This peer's dial-back verdict: 1 for the current status",
        labels=["status"],
    )
    for value in REACHABILITY:
        reach.add_metric([value], 1.0 if value == status else 0.0)
    yield reach
    dht = node.dht.statistics()
    yield GaugeMetricFamily(
        "swarmtrain_dht_routing_table_peers", "Peers in the DHT routing table",
        value=dht.routing_table_size,
    )  # fmt: skip
    yield GaugeMetricFamily(
        "swarmtrain_dht_records", "DHT keys this peer holds for others", value=dht.keys_held
    )
    yield GaugeMetricFamily(
        "swarmtrain_dht_held_bytes", "Bytes of DHT records this peer holds", value=dht.bytes_held
    )
    yield CounterMetricFamily(
        "swarmtrain_dht_requests_failed", "DHT requests that failed or timed out",
        value=dht.requests_failed,
    )  # fmt: skip
    yield CounterMetricFamily(
        "swarmtrain_dht_refused_over_quota", "DHT stores refused over a storage quota",
        value=dht.refused_over_quota,
    )  # fmt: skip
    yield CounterMetricFamily(
        "swarmtrain_dht_over_key_cap",
        "DHT entries left out: their owner held its cap of entries under that key",
        value=dht.over_key_cap,
    )  # fmt: skip
    host = node.host.statistics
    yield CounterMetricFamily(
        "swarmtrain_connections_closed", "Connections closed", value=host.connections_closed
    )
    yield CounterMetricFamily(
        "swarmtrain_connections_refused", "Connections closed over the connection limit",
        value=host.connections_refused_over_limit,
    )  # fmt: skip
    yield CounterMetricFamily(
        "swarmtrain_handler_failures", "Stream handlers that raised",
        value=host.handler_failures,
    )  # fmt: skip
    rejected = CounterMetricFamily(
        "swarmtrain_rejected_inputs",
        "Inbound input refused, by protocol (a read deadline: '<protocol> deadline')",
        labels=["kind"],
    )
    for kind, count in sorted(host.rejections.items()):
        rejected.add_metric([kind], count)
    yield rejected


def verdict_families(verdicts: Sequence[HasCheater]) -> Iterator[Metric]:
    """A verified run's verdicts (named a cheater or nobody) and the peers they banned."""
    named = sum(1 for v in verdicts if v.cheater is not None)
    family = CounterMetricFamily(
        "swarmtrain_verdicts", "Dispute verdicts, by whether they named a cheater",
        labels=["cheater"],
    )  # fmt: skip
    family.add_metric(["named"], named)
    family.add_metric(["none"], len(verdicts) - named)
    yield family
    yield GaugeMetricFamily(
        "swarmtrain_banned_peers", "Peers a verdict named as cheaters (banned from the run)",
        value=len({v.cheater for v in verdicts if v.cheater is not None}),
    )  # fmt: skip


class _Live(Collector):
    """The families computed at scrape time: the last round's gauges, and each watched source
    sampled in its loop."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[Metric]:
        metrics = self._metrics
        out: list[Metric] = [metrics._info]
        rounds_read = False
        for sample, with_round in list(metrics._sources):
            try:
                out.extend(sample())
            except (trio.RunFinishedError, RuntimeError) as exc:
                log.debug("metrics source gone: %s", exc)
            else:
                rounds_read = rounds_read or with_round
        if not rounds_read:  # no source read them (or its loop has ended: nothing changes them)
            out.extend(metrics.round_families())
        return out


class Metrics:
    """One process's metrics; ``role`` (node, coordinator, relay) is the ``swarmtrain_info``
    label. Thread-safe: rounds are observed from the torch thread, scrapes come from the
    server's, DHT requests from the trio loop's."""

    def __init__(self, role: str) -> None:
        self.registry = CollectorRegistry()
        # (sample, whether it reads the round families too)
        self._sources: list[tuple[Callable[[], list[Metric]], bool]] = []
        self._lock = threading.Lock()  # observe_round against round_families
        self._last: RoundSample | None = None
        self._server: Any = None
        self.url = ""
        info = GaugeMetricFamily("swarmtrain_info", "This process's role", labels=["role"])
        info.add_metric([role], 1)
        self._info = info
        # The round counters and histograms: not served by themselves, but read with the last
        # round under the lock (round_families).
        r = self._rounds_registry = CollectorRegistry()
        self.rounds = Counter(
            "swarmtrain_rounds", "Rounds finished, by outcome", ["outcome"], registry=r
        )
        for outcome in ("ok", "failed"):
            self.rounds.labels(outcome)
        self.sent = Counter(
            "swarmtrain_allreduce_sent_bytes", "Bytes this peer sent in all-reduces", registry=r
        )
        self.received = Counter(
            "swarmtrain_allreduce_received_bytes", "Bytes this peer received in all-reduces",
            registry=r,
        )  # fmt: skip
        self.allreduce = Histogram(
            "swarmtrain_allreduce_seconds", "Seconds of a successful round's all-reduce",
            buckets=ROUND_SECONDS_BUCKETS, registry=r,
        )  # fmt: skip
        self.matchmaking = Histogram(
            "swarmtrain_matchmaking_seconds", "Seconds of a successful round's matchmaking",
            buckets=ROUND_SECONDS_BUCKETS, registry=r,
        )  # fmt: skip
        self.dropped = Counter(
            "swarmtrain_dropped_peers", "Peers our all-reduces dropped, by kind of reason",
            ["kind"], registry=r,
        )  # fmt: skip
        for kind in DROP_KINDS:
            self.dropped.labels(kind)
        self.dht_requests = Histogram(
            "swarmtrain_dht_request_seconds",
            "Seconds of this peer's DHT requests (one peer, one request), by outcome",
            ["outcome"], buckets=DHT_SECONDS_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.registry.register(_Live(self))

    # -- feeds -----------------------------------------------------------------------------------

    def observe_round(self, sample: RoundSample) -> None:
        """A finished round (the training loop's ``on_round``)."""
        with self._lock:
            self.rounds.labels("ok" if sample.ok else "failed").inc()
            if sample.ok:
                self.sent.inc(sample.bytes_sent)
                self.received.inc(sample.bytes_received)
                if sample.allreduce_s is not None:
                    self.allreduce.observe(sample.allreduce_s)
                if sample.matchmaking_s is not None:
                    self.matchmaking.observe(sample.matchmaking_s)
                for reason in sample.dropped:
                    self.dropped.labels(drop_kind(reason)).inc()
            self._last = sample

    def observe_dht_request(self, seconds: float, ok: bool) -> None:
        """One DHT request (the p2p ``Dht``'s ``on_request`` hook)."""
        self.dht_requests.labels("ok" if ok else "failed").observe(seconds)

    def watch_node(self, node: Any, in_loop: InLoop[list[Metric]] | None = None) -> None:
        """Sample ``node`` (a p2p ``Node``) at every scrape, in its loop: ``in_loop`` runs a
        function there (default: the trio loop this is called from). Also times its DHT
        requests."""
        self.watch(lambda: node_families(node), in_loop)
        node.dht.on_request = self.observe_dht_request

    def watch(
        self,
        families: Callable[[], Iterable[Metric]],
        in_loop: InLoop[list[Metric]] | None = None,
        *,
        with_round: bool = False,
    ) -> None:
        """Add ``families()`` to every scrape, called in a trio loop: ``in_loop`` runs a
        function there (default: the loop this is called from). ``with_round``: its families
        follow the rounds, observed in that loop: the round families are read in the same call,
        so a scrape cannot show one round's figures with another's."""
        run = in_loop if in_loop is not None else _this_loop()
        if with_round:
            self._sources.append((lambda: run(lambda: [*self.round_families(), *families()]), True))
        else:
            self._sources.append((lambda: run(lambda: list(families())), False))

    def watch_referee(self, referee: Any) -> None:
        """A coordinator's ``RefereeService``: its verdicts at every scrape."""
        self._sources.append((lambda: list(verdict_families(list(referee.verdicts))), False))

    # -- serving ---------------------------------------------------------------------------------

    def serve(self, options: MetricsOptions) -> str:
        """Start the HTTP server; returns its URL. Raises ValueError naming ``--metrics-port``
        when it cannot bind."""
        try:
            server, _thread = start_http_server(options.port, options.host, self.registry)
        except OSError as exc:
            raise ValueError(
                f"--metrics-port {options.port} on {options.host}: {exc.strerror or exc}"
            ) from exc
        self._server = server
        host, port = server.server_address[:2]
        host = f"[{host}]" if ":" in host else host
        self.url = f"http://{host}:{port}/metrics"
        log.info("serving Prometheus metrics at %s", self.url)
        return self.url

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def round_families(self) -> list[Metric]:
        """The last round's gauges and the round counters and histograms, read at one moment."""
        with self._lock:
            return [*_last_round_families(self._last), *self._rounds_registry.collect()]


def _last_round_families(last: RoundSample | None) -> Iterator[Metric]:
    if last is None:
        return
    yield GaugeMetricFamily(
        "swarmtrain_round", "The last round this node finished", value=last.round
    )
    if last.loss is not None:
        yield GaugeMetricFamily(
            "swarmtrain_loss", "Mean inner loss of the last round's inner phase",
            value=last.loss,
        )  # fmt: skip
    if last.tokens_per_s is not None:
        yield GaugeMetricFamily(
            "swarmtrain_tokens_per_second", "Tokens per second of the last inner phase",
            value=last.tokens_per_s,
        )  # fmt: skip
    yield GaugeMetricFamily(
        "swarmtrain_round_peers", "Peers in the last round (0 when it failed)",
        value=last.peers,
    )  # fmt: skip
    if last.agree is not None:
        yield GaugeMetricFamily(
            "swarmtrain_state_agreement",
            "1 when the last round's state hash equals the majority's, else 0",
            value=1.0 if last.agree else 0.0,
        )
    yield CounterMetricFamily(
        "swarmtrain_state_syncs", "States downloaded from peers (join, catch-up, re-sync)",
        value=last.syncs,
    )  # fmt: skip
    if last.verdicts:
        yield from verdict_families(last.verdicts)


def _this_loop() -> InLoop[Any]:
    token = trio.lowlevel.current_trio_token()

    def run(fn: Callable[[], T]) -> T:
        return trio.from_thread.run_sync(fn, trio_token=token)

    return run
