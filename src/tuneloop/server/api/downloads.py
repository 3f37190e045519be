"""Adapter downloads: signed, expiring URLs for external-weights exports, served by the server."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter()
