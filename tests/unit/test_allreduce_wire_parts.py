"""A lossy round's values made a part at a time give the bits of the whole-vector round trip.

The machine may take our slice's wire values from ``own`` (made when it reduces the part) and
keep the others' slices ``Encoded`` (their wire bytes, decoded when reduced) instead of being
handed the round trip of the whole vector and every slice decoded up front. The same round,
delivered in the same order, crashes included (parts reduced again over a smaller set), must
end with the same bytes on every survivor either way.
"""

from __future__ import annotations

import random

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_allreduce import FakeNetwork, make_vectors, peer_ids

from swarm.averaging.allreduce import AllReduce, Encoded, PartReceived, SendPart
from swarm.averaging.codec import Compression
from swarm.averaging.payload import Layout
from swarm.averaging.session_wire import RoundValues


class PartsNetwork(FakeNetwork):
    """``FakeNetwork`` whose machines are built as a session builds them for a lossy layout:
    ``own`` and ``decode`` hooks when ``hooked`` (slices travel ``Encoded``), else the whole
    vector's round trip up front (``RoundValues.wire_values``) and decoded slices."""

    def __init__(self, originals, bandwidths, rng, chunks: int, hooked: bool) -> None:
        ids = tuple(peer_ids(len(originals)))
        self.layout = Layout.for_sizes([len(originals[0])], Compression.INT8)
        self.wire = {
            me: RoundValues("run", None, me, self.layout, vector, None)  # type: ignore[arg-type]
            for me, vector in zip(ids, originals, strict=True)
        }
        decoded = [self.wire[me].wire_values(ids, bandwidths, chunks) for me in ids]
        super().__init__(
            decoded, [1.0 + i for i in range(len(ids))], bandwidths, rng, chunks=chunks
        )
        self.hooked = hooked
        for me in ids:
            values = self.wire[me]
            values.parts = self.machines[me].parts
            if hooked:
                self.machines[me] = AllReduce(
                    me,
                    ids,
                    bandwidths,
                    originals[ids.index(me)],
                    self.weights[me],
                    100.0,
                    values.finalizer(None),
                    chunks,
                    own=values.own_values,
                    decode=self.layout.decode,
                )
            else:
                self.machines[me].__init__(  # type: ignore[misc]
                    me, ids, bandwidths, decoded[ids.index(me)], self.weights[me], 100.0,
                    values.finalizer(None), chunks,
                )  # fmt: skip

    def apply(self, me: bytes, actions) -> None:
        if not self.hooked:
            return super().apply(me, actions)
        for action in actions:
            if isinstance(action, SendPart):
                payload = bytes(self.wire[me].payload(action))
                event = PartReceived(me, action.part_index, Encoded(payload), self.weights[me])
                self.links[(me, action.peer)].append(event)
            else:
                super().apply(me, [action])
        return None


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.integers(2, 5),
    st.integers(1, 5000),
    st.integers(1, 3),
    st.integers(0, 60),
    st.integers(0, 4),
    st.integers(0, 2**32 - 1),
)
def test_part_at_a_time_values_give_the_same_bits(n, numel, chunks, crash_after, victim, seed):
    results = []
    for hooked in (False, True):
        rng = random.Random(seed)
        bandwidths = [rng.randint(1, 1000) for _ in range(n)]
        net = PartsNetwork(make_vectors(rng, n, numel), bandwidths, rng, chunks, hooked)
        net.start()
        for _ in range(crash_after):
            if not net.step():
                break
        net.crash(net.ids[victim % n])
        net.run()
        results.append(
            {p: (f.result.tobytes(), f.contributors) for p, f in net.finished.items()}
            | {p: f.reason for p, f in net.failed.items()}
        )
    assert results[0] == results[1]
    finishes = {value for value in results[0].values() if isinstance(value, tuple)}
    assert len(finishes) <= 1  # every survivor that finished holds the same bytes


def test_a_slice_kept_encoded_is_refused_by_a_machine_without_decode() -> None:
    """Rule 5: a machine that cannot decode wire bytes drops their sender, never crashes."""
    ids = peer_ids(2)
    local = np.ones(8, np.float32)
    machine = AllReduce(ids[0], ids, [1, 1], local, 1.0, 100.0)
    machine.start(0.0)
    actions = machine.handle(PartReceived(ids[1], 0, Encoded(b"\x00" * 8), 1.0), 1.0)
    assert any(
        getattr(a, "reason", "").endswith("data is not a 1-D float32 array") for a in actions
    )
