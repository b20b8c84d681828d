"""``settle_landings``: the vector a round hands out when reduced parts were received in place.

The driver receives the first copy of each raw reduced part straight into the result buffer
while the machine, in a worker thread, may assemble that same buffer from other copies. A clean
CI run once had an honest peer return a part it had not kept (a copy from the peer that sent
garbage, landed while the machine assembled): these cases pin what the settled vector must be.
"""

from __future__ import annotations

import numpy as np

from swarm.averaging.session_wire import settle_landings

PARTS = [(b"a", 0, 4), (b"b", 4, 8), (b"c", 8, 12)]
MEMBERS = frozenset({b"a", b"b"})


def held_parts(result: np.ndarray) -> list:
    """Part 0 held as the copy landed in place, parts 1 and 2 as arrays of their own."""
    return [
        (result[0:4], MEMBERS),
        (np.full(4, 2.0, np.float32), MEMBERS),
        (np.full(4, 3.0, np.float32), MEMBERS),
    ]


def test_a_landed_copy_the_machine_did_not_keep_is_overwritten_by_the_held_part() -> None:
    result = np.zeros(12, np.float32)
    held = held_parts(result)
    result[0:4] = 1.0
    result[8:12] = 3.0  # the machine's assemble wrote the held part 2 ...
    result[4:8] = 9.0  # ... and a landing of an unkept copy of part 1 overwrote part 1 after
    settled = settle_landings(result, PARTS, held, landed={0, 1}, landing=set())
    assert settled is result  # nothing is still being written: no copy needed
    assert settled.tolist() == [1.0] * 4 + [2.0] * 4 + [3.0] * 4


def test_a_landing_still_in_progress_gets_a_copy_with_the_held_parts() -> None:
    result = np.zeros(12, np.float32)
    held = held_parts(result)
    result[0:4] = 1.0
    result[8:12] = 3.0
    result[4:6] = 9.0  # half of an unkept copy of part 1 so far
    settled = settle_landings(result, PARTS, held, landed={0, 1}, landing={1})
    assert settled is not result
    result[6:8] = 9.0  # the receive goes on writing into the buffer: not into what we hand out
    assert settled.tolist() == [1.0] * 4 + [2.0] * 4 + [3.0] * 4


def test_parts_held_in_place_are_left_as_they_are() -> None:
    result = np.zeros(12, np.float32)
    held = held_parts(result)
    result[:] = [1.0] * 4 + [2.0] * 4 + [3.0] * 4
    assert settle_landings(result, PARTS, held, landed={0}, landing=set()) is result
    assert result.tolist() == [1.0] * 4 + [2.0] * 4 + [3.0] * 4
