"""The admin surface: the ops page served by the gateway, the JSON state it polls, who may read it.

state.py    the JSON state, built at a bounded rate
guard.py    who may read ``/admin/*`` and ``/dashboard`` (bearer token or loopback only)
routes.py   the routes; ``add_dashboard_routes(app, gateway)`` is the one entry point
merge.py    the workers' metrics and admin state merged into the whole gateway's
static/     index.html, app.js, style.css: no build step, no CDN, works air-gapped

The ring of events and the rolling window it shows are observe/'s (events.py, stats.py): the
recorder fills them without importing the admin surface, which takes the whole gateway.
"""
