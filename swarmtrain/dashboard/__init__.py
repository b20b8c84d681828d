"""The coordinator's live web dashboard (``--dashboard-port``): the run's history and the JSON
document it serves (``history``, pure), the ASGI app (``app``), the flags and the listening
socket (``options``) and the trio driver that refreshes the history and serves it through
hypercorn (``server``).

Import the modules themselves: this package's import stays free of torch and hypercorn, so
every CLI command that only parses ``--dashboard-port`` starts in a fraction of a second."""
