"""OpenAI-compatible routes under /oai/api/v1 (chat completions, completions, models)."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter(prefix="/oai/api/v1")
