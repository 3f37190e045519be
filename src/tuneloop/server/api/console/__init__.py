"""The web console at /console: a tenant's sessions, runs and their curves, checkpoints, usage
and an OpenAI playground; the operator's view of every tenant and the engine for admin keys.

Server-rendered Jinja2 pages with htmx polling and uPlot charts, both vendored under static/
(see static/README.md), so the console works with no network.
"""

from tuneloop.server.api.console.curves import RunCurves
from tuneloop.server.api.console.routes import router

__all__ = ["RunCurves", "router"]
