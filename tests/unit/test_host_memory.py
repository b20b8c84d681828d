"""``release_large_blocks``: glibc's mmap threshold fixed, so a freed large block leaves the RSS."""

from __future__ import annotations

import subprocess
import sys

import pytest

# In a fresh process: the threshold grows when a large block is freed (glibc's default), so
# an 8 MiB block allocated after a 16 MiB one is freed comes from the heap and, held beside a
# small allocation above it, stays in the RSS after it is freed; with the threshold fixed, it
# is unmapped. Prints the RSS (KiB) that freeing it gave back.
PROBE = """
import sys
import numpy as np
from swarmtrain.host_memory import release_large_blocks

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1])

if sys.argv[1] == "fixed":
    assert release_large_blocks()
big = np.ones(4 << 20, np.float32)
del big
block = np.ones(2 << 20, np.float32)
above = np.ones(64, np.float32)
before = rss()
del block
print(before - rss())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_freed_large_block_leaves_the_rss_once_the_threshold_is_fixed() -> None:
    def returned(mode: str) -> int:
        out = subprocess.run(
            [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True
        )
        return int(out.stdout)

    assert returned("fixed") >= 7 * 1024  # the 8 MiB block, unmapped
    assert returned("default") < 1024  # kept by the heap: what the node no longer does
