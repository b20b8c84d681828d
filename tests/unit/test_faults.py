"""The fault hook: honest by default, tampering only in its round."""

from __future__ import annotations

import numpy as np
import pytest

from swarmtrain.faults import NO_FAULTS, Faults, parse_task_fault


def test_no_faults_is_honest_in_every_round() -> None:
    assert all(NO_FAULTS.tamper_task(r) is None for r in range(5))
    assert all(NO_FAULTS.tamper_reduced(r) is None for r in range(5))


def test_task_fault_from_its_round_on() -> None:
    faults = Faults(task=parse_task_fault("1:2:30"))
    assert faults.tamper_task(0) is None and faults.tamper_task(1) == (2, 30)
    assert faults.tamper_task(4) == (2, 30)  # a cheater keeps cheating


def test_reduce_fault_shifts_the_first_value_of_a_copy() -> None:
    tamper = Faults(reduce_round=2).tamper_reduced(2)
    assert tamper is not None and Faults(reduce_round=2).tamper_reduced(1) is None
    part = np.zeros(3, np.float32)
    assert tamper(0, part).tolist() == [1.0, 0.0, 0.0] and part.tolist() == [0.0] * 3
    assert len(tamper(0, np.zeros(0, np.float32))) == 0


@pytest.mark.parametrize("text", ["1:2", "a:b:c", "1:2:-3", ""])
def test_bad_task_fault_text(text: str) -> None:
    with pytest.raises(ValueError):
        parse_task_fault(text)
