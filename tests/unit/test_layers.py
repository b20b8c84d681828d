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


# Torch drivers imported from their modules, so that importing their package imports no torch.
FACE_EXCEPTIONS = {"swarm.pipeline.server", "swarm.pipeline.trainer"}


def test_other_packages_use_only_the_faces_of_swarm_verify_and_diloco() -> None:
    """Outside a package, imports name the package or one of its folders (``swarm.averaging``,
    ``verify.dispute``), whose ``__init__`` is the face; a module file inside it is refused."""
    offenders = []
    for package in ("swarm", "verify", "diloco"):
        for outside in LAYER.keys() - {package}:
            for path in (ROOT / outside).rglob("*.py"):
                tree = ast.parse(path.read_text(), filename=str(path))
                for node in ast.walk(tree):
                    if not isinstance(node, ast.ImportFrom) or node.level != 0:
                        continue
                    module = node.module or ""
                    if not module.startswith(package + ".") or module in FACE_EXCEPTIONS:
                        continue
                    if not (ROOT / module.replace(".", "/") / "__init__.py").exists():
                        offenders.append(f"{path.relative_to(ROOT)}: from {module} import")
    assert not offenders, offenders


def test_every_folder_is_a_package_with_a_docstring() -> None:
    """Each folder of a layer holds one idea, which its ``__init__`` docstring names."""
    for package in LAYER:
        for folder in [ROOT / package, *(ROOT / package).rglob("*/")]:
            if folder.name == "__pycache__" or not any(folder.glob("*.py")):
                continue
            init = folder / "__init__.py"
            assert init.exists(), f"{folder.relative_to(ROOT)} has no __init__.py"
            assert ast.get_docstring(ast.parse(init.read_text())), f"{init} has no docstring"


# Protocol decisions live in sans-IO modules: no event loop, sockets, clocks or randomness.
SANS_IO = [
    "p2p/wire.py",
    "p2p/tensors.py",
    "p2p/dht/records.py",
    "p2p/nat/reachability.py",
    "p2p/bulk/frames.py",
    "p2p/bulk/control.py",
    "p2p/bulk/negotiate.py",
    "p2p/nat/reservations.py",
    "swarm/averaging/codec.py",
    "swarm/averaging/payload.py",
    "swarm/averaging/sparse_codec.py",
    "swarm/averaging/matchmaking.py",
    "swarm/averaging/aggregation.py",
    "swarm/averaging/allreduce.py",
    "swarm/averaging/audit.py",
    "swarm/averaging/bandwidth.py",
    "swarm/averaging/channels.py",
    "swarm/averaging/liveness.py",
    "swarm/pipeline/records.py",
    "swarm/pipeline/routing.py",
    "swarm/pipeline/rebalance.py",
    "verify/trace.py",
    "verify/commit.py",
    "verify/dispute/game.py",
    "verify/dispute/wire.py",
    "swarmtrain/membership/state_sync_plan.py",
    "swarmtrain/membership/progress.py",
    "swarmtrain/dashboard/history.py",
    "swarmtrain/membership/plan.py",
    "swarmtrain/verified/plan.py",
    "swarmtrain/training/ranks_plan.py",
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


# Folders whose modules share no private names: what a sibling needs is a public name of the
# module that owns it (issue 17: the bulk driver imported 16 underscore names from its siblings).
NO_PRIVATE_IMPORTS = ["p2p/bulk"]


def test_no_module_imports_a_private_name_of_another() -> None:
    offenders = []
    for folder in NO_PRIVATE_IMPORTS:
        for path in (ROOT / folder).rglob("*.py"):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom):
                    private = [a.name for a in node.names if a.name.startswith("_")]
                    if private:
                        offenders.append(f"{path.relative_to(ROOT)}: {node.module} {private}")
    assert not offenders, offenders
