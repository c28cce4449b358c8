"""The ops dashboard: a single page served by the gateway and the JSON state it polls.

events.py   a bounded ring of swallowed errors and watchdog events (``metrics.events``)
stats.py    the rolling per-lane window of rates and percentiles (``Recorder.window``)
state.py    the JSON state, built at a bounded rate
guard.py    who may read ``/admin/*`` and ``/dashboard`` (bearer token or loopback only)
routes.py   the routes; ``add_dashboard_routes(app, gateway)`` is the one entry point
static/     index.html, app.js, style.css: no build step, no CDN, works air-gapped
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastapi import FastAPI

    from gateway.app import Gateway


def add_dashboard_routes(app: FastAPI, gateway: Gateway) -> None:
    """Add the dashboard routes and the admin guard (covering every ``/admin/*`` route)."""
    # Imported here, not at the top: gateway.metrics imports this package's leaf modules
    # (events, stats), so importing the package must not pull in the app back.
    from gateway.dashboard.routes import add_dashboard_routes as add

    add(app, gateway)
