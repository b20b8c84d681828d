"""A bounded sample of ``bench.fuzz`` (``python -m bench.fuzz --inputs 100000`` is the full one):
real relay, coordinator, training-node, pipeline stage server and verified-run node processes
take hostile input on every protocol they serve and still answer, without crashing, hanging, or
growing memory or open files."""

from __future__ import annotations

import pytest

from bench.fuzz import CATEGORIES, run


@pytest.mark.parametrize(
    ("target", "inputs", "ours"),
    [
        # Samples sized to the suite's time budget; bench.fuzz's full run is the real measure.
        ("relay", 300, "/swarmtrain/dialback/1"),
        ("coordinator", 300, "/swarmtrain/runspec/1"),
        ("node", 150, "/swarmtrain/state/1"),
        ("stage", 150, "/swarmtrain/pipeline/forward/1"),
        ("verified", 150, "/swarmtrain/verify/step-open/1"),
    ],
)
def test_a_target_survives_a_fuzz_sample(target: str, inputs: int, ours: str) -> None:
    summary = run((target,), inputs, CATEGORIES, check_every=150, seed=1)
    assert summary["inputs"] == inputs, summary
    assert summary["crashes"] == 0 and summary["hangs"] == 0, summary
    assert summary["rss_growth_mib"] < 50, summary
    # Open files may differ by the few connections still closing when counted.
    assert summary["fds_growth"] <= 4, summary
    protocols = summary["protocols"]
    assert any(ours in names for names in protocols.values()), protocols
