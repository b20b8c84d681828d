"""Imports point down (swarmtrain -> diloco, swarm, verify -> p2p); p2p imports nothing of ours."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYER = {"p2p": 0, "swarm": 1, "verify": 1, "diloco": 2, "swarmtrain": 3}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_imports_only_point_down() -> None:
    violations = []
    for package, level in LAYER.items():
        for path in (ROOT / package).rglob("*.py") if (ROOT / package).is_dir() else []:
            for name in _imports(path) & LAYER.keys():
                if name != package and LAYER[name] >= level:
                    violations.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not violations, violations


def test_p2p_exists_and_is_checked() -> None:
    assert any((ROOT / "p2p").rglob("*.py"))


def test_other_packages_use_only_the_public_face_of_p2p() -> None:
    """Outside p2p, ``from p2p.<module> import`` is refused: p2p/__init__ names the API."""
    offenders = []
    for package in LAYER.keys() - {"p2p"}:
        for path in (ROOT / package).rglob("*.py") if (ROOT / package).is_dir() else []:
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("p2p."):
                    offenders.append(f"{path.relative_to(ROOT)}: from {node.module} import")
    assert not offenders, offenders


# Protocol decisions live in sans-IO modules: no event loop, sockets, clocks or randomness.
SANS_IO = [
    "p2p/wire.py",
    "p2p/tensors.py",
    "p2p/records.py",
    "p2p/reachability.py",
    "p2p/bulk_frames.py",
    "p2p/reservations.py",
    "swarm/compression.py",
    "swarm/payload.py",
    "swarm/matchmaking.py",
    "swarm/allreduce.py",
    "swarm/aggregation_audit.py",
    "swarm/bandwidth.py",
    "swarm/pipeline_records.py",
    "swarm/pipeline_routing.py",
    "swarm/rebalance.py",
    "verify/trace.py",
    "verify/commit.py",
    "verify/dispute.py",
    "verify/dispute_wire.py",
    "swarmtrain/state_sync_plan.py",
    "swarmtrain/progress.py",
    "swarmtrain/verify_plan.py",
]
FORBIDDEN_IN_SANS_IO = {"trio", "libp2p", "socket", "time", "random", "asyncio", "threading"}


def test_sans_io_modules_import_no_io() -> None:
    offenders = []
    for rel in SANS_IO:
        path = ROOT / rel
        assert path.exists(), f"{rel} is listed as sans-IO but does not exist"
        bad = _imports(path) & FORBIDDEN_IN_SANS_IO
        if bad:
            offenders.append(f"{rel} imports {sorted(bad)}")
    assert not offenders, offenders
