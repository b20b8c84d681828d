"""Children of the test run stop on Ctrl+C, however pytest was started.

A shell without job control (``cmd &`` in a script, ``nohup``, some CI runners) starts
background commands with SIGINT ignored, an ignored signal stays ignored across exec, and a
Python child then never turns it into KeyboardInterrupt: each test's ``PeerProcess.stop``
waited its 10 s for the SIGINT and then killed the process (a rehearsal spent minutes so, and
tested the SIGKILL path instead of the shutdown). Python's own handler in the test process makes
every child start with SIGINT at its default (exec resets handled signals), as from a terminal.
"""

import signal

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
