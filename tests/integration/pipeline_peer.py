"""``swarmtrain`` in its own process, with an optional fault for a pipeline stage server.

``python pipeline_peer.py node ... [--fault SPEC]`` runs exactly ``swarmtrain node ...`` (the
same options, the same lines, the same ``--json`` summary), after installing the fault, which
then happens for real in this process:

    kill-after-forwards:N   SIGKILL ourselves inside our (N+1)th forward: the request has arrived,
                            the reply never leaves (a server dying mid-microbatch); the line
                            ``dying`` comes first
"""

from __future__ import annotations

import os
import signal
import sys

from swarm.pipeline.server import StageServer
from swarmtrain.cli import main as swarmtrain_main


def install_fault(spec: str) -> None:
    kind, _, arg = spec.partition(":")
    if kind != "kill-after-forwards":
        raise SystemExit(f"unknown fault {spec!r}")
    limit = int(arg)
    forward = StageServer._forward

    def dying_forward(self, *args):  # type: ignore[no-untyped-def]
        if self.statistics.forwards >= limit:
            print("dying", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return forward(self, *args)

    StageServer._forward = dying_forward  # type: ignore[method-assign]


def main(argv: list[str]) -> int:
    if "--fault" in argv:
        at = argv.index("--fault")
        install_fault(argv[at + 1])
        argv = argv[:at] + argv[at + 2 :]
    return swarmtrain_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
