"""Every bench module imports: benches run by hand (some need root and the NAT lab), so nothing
else would notice one that a refactor of another left broken."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import bench

MODULES = sorted(m.name for m in pkgutil.iter_modules(bench.__path__))


def test_the_benches_are_found() -> None:
    assert {"allreduce", "diloco", "diloco_wan", "diloco_wan_worker", "swarm"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_bench_module_imports(name: str) -> None:
    importlib.import_module(f"bench.{name}")
