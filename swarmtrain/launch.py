"""The console script's entry point, kept free of imports.

``swarmtrain.cli`` imports trio, libp2p and the rest of the project (about a second); a Ctrl+C
in that second raised KeyboardInterrupt out of an import, with a traceback. Here it stops the
process as a later Ctrl+C does: one line, exit status 130.
"""

from __future__ import annotations

import sys


def run() -> None:
    try:
        from swarmtrain.cli import run_and_exit
    except KeyboardInterrupt:
        sys.stderr.write("swarmtrain: stopped\n")
        raise SystemExit(130) from None
    run_and_exit()


if __name__ == "__main__":
    run()
