"""The ops dashboard: a single page served by the gateway and the JSON state it polls.

events.py   a bounded ring of swallowed errors and watchdog events (``metrics.events``)
stats.py    the rolling per-lane window of rates and percentiles (``Recorder.window``)
state.py    the JSON state, built at a bounded rate
guard.py    who may read ``/admin/*`` and ``/dashboard`` (bearer token or loopback only)
routes.py   the routes; ``add_dashboard_routes(app, gateway)`` is the one entry point
static/     index.html, app.js, style.css: no build step, no CDN, works air-gapped

This package's own module imports nothing: metrics.py and record.py import the leaf modules
(events, stats) and must not pull the routes, which depend on the whole gateway, back in.
"""
