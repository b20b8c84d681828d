"""The coordinator's live web dashboard (``--dashboard-port``): the run's history and the JSON
document it serves (``history``, pure), the ASGI app (``app``), the flags and the listening
socket (``options``) and the trio driver that refreshes the history and serves it through
hypercorn (``server``)."""

from swarmtrain.dashboard.app import dashboard_app
from swarmtrain.dashboard.history import JSON_VERSION, Reading, RunHistory, RunInfo
from swarmtrain.dashboard.options import (
    DashboardListener,
    DashboardOptions,
    add_dashboard_arguments,
    options_from,
)
from swarmtrain.dashboard.server import Dashboard

__all__ = [
    "JSON_VERSION",
    "Dashboard",
    "DashboardListener",
    "DashboardOptions",
    "Reading",
    "RunHistory",
    "RunInfo",
    "add_dashboard_arguments",
    "dashboard_app",
    "options_from",
]
