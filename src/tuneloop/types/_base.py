"""Pydantic bases for wire types: requests are strict, responses tolerate unknown fields."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictBase(BaseModel):
    """Request bodies: frozen, and an unknown field is an error that names the field."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class ResponseBase(BaseModel):
    """Response bodies: newer servers may add fields, so unknown ones are ignored."""

    model_config = ConfigDict(extra="ignore")
