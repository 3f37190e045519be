"""The web console at /console: a tenant's sessions, runs and their curves, checkpoints, usage
and an OpenAI playground; the operator's view of every tenant and the engine for admin keys.

Server-rendered Jinja2 pages with htmx polling and uPlot charts, both vendored under static/
(see static/README.md), so the console works with no network.
"""

from fastapi import APIRouter

from tuneloop.server.api.console import checkpoints, operator, playground, routes, usage
from tuneloop.server.api.console.curves import RunCurves

__all__ = ["RunCurves", "router"]

router = APIRouter()
for _module in (routes, checkpoints, usage, playground, operator):
    router.include_router(_module.router)
