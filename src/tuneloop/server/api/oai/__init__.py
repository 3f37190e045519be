"""OpenAI-compatible routes under /oai/api/v1: chat completions, completions, models, health.

Requests are sampled by the same engine loop as the Tinker API's (queued with its other sampling
work, metered to the tenant, under the in-flight quota). See docs/openai.md.
"""

from __future__ import annotations

from tuneloop.server.api.oai.routes import router

__all__ = ["router"]
