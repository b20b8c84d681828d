"""A pipeline role (stage server or trainer) in its own process, with an optional fault.

``python pipeline_peer.py _server|_trainer [role options] [--fault SPEC]`` runs exactly what
``swarmtrain.pipeline.local`` runs for that role (same options, same JSON event lines), after
installing the fault, which then happens for real in this process:

    kill-after-forwards:N   SIGKILL ourselves inside our (N+1)th forward: the request has arrived,
                            the reply never leaves (a server dying mid-microbatch)
"""

from __future__ import annotations

import os
import signal
import sys

from swarm.pipeline.server import StageServer
from swarmtrain.pipeline.local import role_main


def install_fault(spec: str) -> None:
    kind, _, arg = spec.partition(":")
    if kind != "kill-after-forwards":
        raise SystemExit(f"unknown fault {spec!r}")
    limit = int(arg)
    forward = StageServer._forward

    def dying_forward(self, *args):  # type: ignore[no-untyped-def]
        if self.statistics.forwards >= limit:
            print('{"event": "dying"}', flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return forward(self, *args)

    StageServer._forward = dying_forward  # type: ignore[method-assign]


def main(argv: list[str]) -> int:
    if "--fault" in argv:
        at = argv.index("--fault")
        install_fault(argv[at + 1])
        argv = argv[:at] + argv[at + 2 :]
    return role_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
