"""``swarmtrain.metrics``: what a scrape shows after rounds are fed, and the node's sample."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from p2p import DhtStatistics, Reachability, ReachabilityVerdict
from swarmtrain.metrics import DROP_KINDS, Metrics, RoundSample, drop_kind
from swarmtrain.training.swarm_average import RoundReport


def scrape(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the exposition text, by (name, sorted labels)."""
    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_round_metrics_after_two_rounds_and_a_failure() -> None:
    metrics = Metrics("node")
    before = scrape(metrics)
    # No round yet: no round, loss or agreement (absence, not 0: round 0 is a round).
    assert ("swarmtrain_round", ()) not in before
    assert ("swarmtrain_state_agreement", ()) not in before
    assert before[("swarmtrain_info", (("role", "node"),))] == 1
    assert before[("swarmtrain_rounds_total", (("outcome", "ok"),))] == 0

    first = RoundReport(
        0,
        peers=3,
        bytes_sent=1000,
        bytes_received=1200,
        matchmaking_s=0.4,
        allreduce_s=1.5,
        dropped=("lost",),
    )
    metrics.observe_round(RoundSample.of(0, 5.5, 900.0, first, agree=True, syncs=0))
    second = RoundReport(
        1,
        peers=2,
        bytes_sent=500,
        bytes_received=600,
        matchmaking_s=0.2,
        allreduce_s=0.7,
        dropped=("weight 9 outside the run's bounds [0, 1]", "part 2: bad"),
    )
    metrics.observe_round(RoundSample.of(1, 5.1, 1000.0, second, agree=False, syncs=1))
    values = scrape(metrics)
    assert values[("swarmtrain_round", ())] == 1
    assert values[("swarmtrain_loss", ())] == 5.1
    assert values[("swarmtrain_tokens_per_second", ())] == 1000.0
    assert values[("swarmtrain_round_peers", ())] == 2
    assert values[("swarmtrain_state_agreement", ())] == 0
    assert values[("swarmtrain_state_syncs_total", ())] == 1
    assert values[("swarmtrain_allreduce_sent_bytes_total", ())] == 1500
    assert values[("swarmtrain_allreduce_received_bytes_total", ())] == 1800
    assert values[("swarmtrain_rounds_total", (("outcome", "ok"),))] == 2
    assert values[("swarmtrain_allreduce_seconds_count", ())] == 2
    assert values[("swarmtrain_allreduce_seconds_sum", ())] == 2.2
    assert values[("swarmtrain_allreduce_seconds_bucket", (("le", "1.0"),))] == 1
    assert values[("swarmtrain_matchmaking_seconds_sum", ())] == 0.6000000000000001
    dropped = {k: values[("swarmtrain_dropped_peers_total", (("kind", k),))] for k in DROP_KINDS}
    assert dropped == {"lost": 1, "weight": 1, "bad_data": 1, "protocol": 0}

    # A failed round: counted, its round and loss shown, no peers, bytes unchanged.
    metrics.observe_round(RoundSample.of(2, 5.0, 950.0, None, syncs=1))
    values = scrape(metrics)
    assert values[("swarmtrain_rounds_total", (("outcome", "failed"),))] == 1
    assert values[("swarmtrain_round", ())] == 2
    assert values[("swarmtrain_round_peers", ())] == 0
    assert ("swarmtrain_state_agreement", ()) not in values
    assert values[("swarmtrain_allreduce_sent_bytes_total", ())] == 1500


def test_drop_reasons_map_to_a_fixed_set_of_kinds() -> None:
    reasons = [
        "lost",
        "duplicate slice of part 3",
        "weight changed within the round",
        "reduced part 1: digest mismatch",
        "empty contributor list",
        "bad hello: x",
        "unexpected message Foo",
    ]
    kinds = [drop_kind(r) for r in reasons]
    assert kinds == ["lost", "bad_data", "weight", "bad_data", "bad_data", "protocol", "protocol"]
    assert set(kinds) <= set(DROP_KINDS)


@dataclass
class FakeHost:
    kinds: dict[str, str]
    statistics: SimpleNamespace = field(
        default_factory=lambda: SimpleNamespace(
            connections_closed=4,
            connections_refused_over_limit=0,
            handler_failures=1,
            rejections={"/ipfs/kad/1.0.0 deadline": 2},
        )
    )

    def connected_peers(self) -> list[str]:
        return [*self.kinds, "closing"]

    def connection_kind(self, peer: str) -> str | None:
        return self.kinds.get(peer)


def test_a_node_is_sampled_in_its_loop_at_each_scrape() -> None:
    dht = SimpleNamespace(
        statistics=lambda: DhtStatistics(
            routing_table_size=5,
            keys_held=7,
            requests_failed=2,
            bytes_held=4096,
            over_key_cap=3,
        ),
        on_request=None,
    )
    node = SimpleNamespace(
        host=FakeHost({"a": "direct", "b": "relayed", "c": "direct", "d": "punched"}),
        dht=dht,
        reachability=ReachabilityVerdict(Reachability.PRIVATE, "no dial-back"),
    )
    calls: list[int] = []

    def in_loop(fn):  # the runtime's call_sync, here a plain call that counts
        calls.append(1)
        return fn()

    metrics = Metrics("relay")
    metrics.watch_node(node, in_loop)
    assert dht.on_request is not None
    dht.on_request(0.03, True)
    dht.on_request(5.0, False)
    values = scrape(metrics)
    assert calls == [1]
    assert values[("swarmtrain_connections", (("kind", "direct"),))] == 2
    assert values[("swarmtrain_connections", (("kind", "relayed"),))] == 1
    assert values[("swarmtrain_connections", (("kind", "punched"),))] == 1
    assert values[("swarmtrain_reachability", (("status", "private"),))] == 1
    assert values[("swarmtrain_reachability", (("status", "public"),))] == 0
    assert values[("swarmtrain_dht_routing_table_peers", ())] == 5
    assert values[("swarmtrain_dht_records", ())] == 7
    assert values[("swarmtrain_dht_requests_failed_total", ())] == 2
    assert values[("swarmtrain_dht_over_key_cap_total", ())] == 3
    assert values[("swarmtrain_connections_closed_total", ())] == 4
    assert (
        values[("swarmtrain_rejected_inputs_total", (("kind", "/ipfs/kad/1.0.0 deadline"),))] == 2
    )
    ok = (("outcome", "ok"),)
    assert values[("swarmtrain_dht_request_seconds_count", ok)] == 1
    assert values[("swarmtrain_dht_request_seconds_bucket", (("le", "0.05"), *ok))] == 1
    assert values[("swarmtrain_dht_request_seconds_count", (("outcome", "failed"),))] == 1

    # The loop is gone (the node stopped): its families are left out, the scrape still works.
    def gone(fn):
        raise RuntimeError("the p2p node is not running")

    metrics = Metrics("node")
    metrics.watch_node(node, gone)
    values = scrape(metrics)
    assert ("swarmtrain_connections", (("kind", "direct"),)) not in values
    assert values[("swarmtrain_info", (("role", "node"),))] == 1


def test_verdicts_and_bans_of_a_referee() -> None:
    referee = SimpleNamespace(
        verdicts=[
            SimpleNamespace(cheater=b"x"),
            SimpleNamespace(cheater=None),
            SimpleNamespace(cheater=b"x"),
        ]
    )
    metrics = Metrics("coordinator")
    metrics.watch_referee(referee)
    values = scrape(metrics)
    assert values[("swarmtrain_verdicts_total", (("cheater", "named"),))] == 2
    assert values[("swarmtrain_verdicts_total", (("cheater", "none"),))] == 1
    assert values[("swarmtrain_banned_peers", ())] == 1


def test_a_pipeline_trainers_and_servers_events_become_rounds_and_pipeline_families() -> None:
    import trio

    from p2p import PeerUnreachable, RemoteError
    from swarm.pipeline.trainer import HOP_FAILURE_KINDS, hop_failure_kind
    from swarmtrain.pipeline.observe import PipelineObserver

    kinds = [
        hop_failure_kind(e)
        for e in (
            trio.TooSlowError(),
            RemoteError("wrong-stage", "serves 1"),
            RemoteError("unknown-microbatch", "resend"),
            RemoteError("no-such-code", "?"),
            PeerUnreachable("gone"),
        )
    ]
    assert kinds == ["hop_timeout", "wrong_stage", "unknown_microbatch", "refused", "connection"]
    assert set(kinds) <= set(HOP_FAILURE_KINDS)

    metrics = Metrics("node")
    trainer = PipelineObserver("trainer", 2, metrics, in_loop=lambda fn: fn())
    trainer.on_event({"event": "microbatch_failed", "hop_failures": {"hop_timeout": 1}})
    round_event = {
        "event": "round", "round": 0, "loss": 5.25, "microbatches": 4, "tokens_per_s": 640.0,
        "failovers": 1, "servers_per_stage": [1, 2], "route_servers_per_stage": [1, 2],
        "hops": 17, "hop_failures": {"hop_timeout": 1},
    }  # fmt: skip
    trainer.on_event(round_event)
    values = scrape(metrics)
    assert values[("swarmtrain_round", ())] == 0
    assert values[("swarmtrain_loss", ())] == 5.25
    assert values[("swarmtrain_tokens_per_second", ())] == 640.0
    assert values[("swarmtrain_round_peers", ())] == 3  # the servers the round went through
    assert values[("swarmtrain_pipeline_role", (("role", "trainer"),))] == 1
    assert values[("swarmtrain_pipeline_microbatches_total", (("outcome", "ok"),))] == 4
    assert values[("swarmtrain_pipeline_microbatches_total", (("outcome", "failed"),))] == 1
    assert values[("swarmtrain_pipeline_hops_total", ())] == 17
    failures = (("reason", "hop_timeout"),)
    assert values[("swarmtrain_pipeline_hop_failures_total", failures)] == 1
    assert values[("swarmtrain_pipeline_hop_failures_total", (("reason", "connection"),))] == 0
    assert values[("swarmtrain_pipeline_failovers_total", ())] == 1
    assert values[("swarmtrain_pipeline_stage_servers", (("stage", "1"),))] == 2
    assert values[("swarmtrain_pipeline_route_servers", (("stage", "0"),))] == 1
    # A round where no microbatch finished: a failed round, and no loss or tokens/s to show.
    trainer.on_event({**round_event, "round": 1, "loss": None, "microbatches": 0})
    values = scrape(metrics)
    assert values[("swarmtrain_rounds_total", (("outcome", "failed"),))] == 1
    assert values[("swarmtrain_round", ())] == 1
    assert ("swarmtrain_loss", ()) not in values
    assert ("swarmtrain_tokens_per_second", ()) not in values

    # A server's averaging rounds (clock epochs): the all-reduce families, no loss; not serving
    # yet, so no stage families.
    metrics = Metrics("node")
    server = PipelineObserver("server", 2, metrics, in_loop=lambda fn: fn())
    server.on_event({"event": "joined", "stage": 1, "round": 7})
    server.on_event(
        {"event": "averaged", "stage": 1, "round": 9, "digest": "ab", "group": 2,
         "matchmaking_s": 0.1, "allreduce_s": 0.3, "bytes_sent": 100, "bytes_received": 120}
    )  # fmt: skip
    server.on_event({"event": "average_failed", "stage": 1, "round": 10})
    values = scrape(metrics)
    assert values[("swarmtrain_round", ())] == 10
    assert values[("swarmtrain_rounds_total", (("outcome", "ok"),))] == 1
    assert values[("swarmtrain_rounds_total", (("outcome", "failed"),))] == 1
    assert values[("swarmtrain_allreduce_seconds_sum", ())] == 0.3
    assert values[("swarmtrain_allreduce_received_bytes_total", ())] == 120
    assert values[("swarmtrain_state_syncs_total", ())] == 1
    assert ("swarmtrain_loss", ()) not in values
    assert values[("swarmtrain_pipeline_role", (("role", "server"),))] == 1
    assert ("swarmtrain_pipeline_stage", (("stage", "1"),)) not in values


def test_a_round_that_ends_mid_scrape_is_all_in_it_or_not_at_all() -> None:
    """A pipeline trainer's round ends while a scrape waits for the role's loop: the scrape's
    round number, round counters and the observer's figures are all of the new round."""
    from swarmtrain.pipeline.observe import PipelineObserver

    def round_event(r: int) -> dict[str, object]:
        return {
            "event": "round", "round": r, "loss": 5.0, "microbatches": 4, "tokens_per_s": 1.0,
            "failovers": r, "servers_per_stage": [1, 1], "route_servers_per_stage": [1, 1],
            "hops": 16 * (r + 1), "hop_failures": {},
        }  # fmt: skip

    pending = [round_event(1)]

    def in_loop(fn):  # the loop runs the round's event before it gets to the scrape's call
        while pending:
            trainer.on_event(pending.pop())
        return fn()

    metrics = Metrics("node")
    trainer = PipelineObserver("trainer", 2, metrics, in_loop=in_loop)
    trainer.on_event(round_event(0))
    values = scrape(metrics)
    r = values[("swarmtrain_round", ())]
    assert r == 1, values
    assert values[("swarmtrain_rounds_total", (("outcome", "ok"),))] == r + 1
    assert values[("swarmtrain_pipeline_microbatches_total", (("outcome", "ok"),))] == 4 * (r + 1)
    assert values[("swarmtrain_pipeline_failovers_total", ())] == r
