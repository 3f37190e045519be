"""The RestClient methods for projects, publishing, copies, session search and traces, and the
audit and billing views (the official SDK's RestClient and AdminClient have the same names).

Answers are the JSON objects the server sends (dicts), as documented in docs/rest.md.
"""

from __future__ import annotations

import asyncio
import urllib.parse
from datetime import date, datetime
from typing import Any, Literal

from tuneloop._futures import APIFuture, ClientHolder

__all__ = ["RestAdminMethods"]

TRACE_POLL_S = 5.0  # how often a pending trace export is asked again (the official SDK's)


def _q(segment: str, safe: str = ":") -> str:
    return urllib.parse.quote(segment, safe=safe)


def _checkpoint_route(tinker_path: str) -> str:
    prefix = "tinker://"
    parts = tinker_path[len(prefix) :].split("/") if tinker_path.startswith(prefix) else []
    if len(parts) != 3 or not all(parts):
        raise ValueError(f"not a tinker path (tinker://<run>/<segment>/<name>): {tinker_path!r}")
    return f"/api/v1/training_runs/{_q(parts[0])}/checkpoints/{_q(parts[1])}/{_q(parts[2])}"


def _iso(value: datetime | str) -> str:
    return value.isoformat() if isinstance(value, datetime) else value


class RestAdminMethods:
    _holder: ClientHolder

    def _json(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, Any] | None = None,
        json_body: Any = None,
    ) -> APIFuture[Any]:
        async def run() -> Any:
            response = await self._holder.http.request(
                method, path, params=params, json_body=json_body
            )
            return response.json() if response.content else None

        return self._holder.submit(run())

    # ---- publishing ----------------------------------------------------------------------------

    def publish_checkpoint_from_tinker_path(self, tinker_path: str) -> APIFuture[Any]:
        """Make the checkpoint readable by every tenant of the server, by its path (sampling,
        create_training_client_from_state); only you can still change or delete it."""
        return self._json("POST", _checkpoint_route(tinker_path) + "/publish")

    def unpublish_checkpoint_from_tinker_path(self, tinker_path: str) -> APIFuture[Any]:
        return self._json("DELETE", _checkpoint_route(tinker_path) + "/publish")

    # ---- projects and copies -------------------------------------------------------------------

    def assign_session_project(self, session_id: str, project_id: str) -> APIFuture[Any]:
        return self._json(
            "PUT",
            f"/api/v1/sessions/{_q(session_id)}/project",
            json_body={"project_id": project_id},
        )

    def copy_weights(
        self, path: str, destination_project_id: str, *, ttl_seconds: int | None = None
    ) -> APIFuture[str]:
        """Copy a checkpoint into one of your projects (the bytes are shared); the copy's path.
        Retries of one call carry one idempotency key, so they never make two copies."""
        body: dict[str, Any] = {
            "source_path": path,
            "destination_project_id": destination_project_id,
        }
        if ttl_seconds is not None:
            body["ttl_seconds"] = ttl_seconds

        async def run() -> str:
            response = await self._holder.http.request(
                "POST", "/api/v1/copy_weights", json_body=body
            )
            return str(response.json()["tinker_path"])

        return self._holder.submit(run())

    # ---- sessions ------------------------------------------------------------------------------

    def search_sessions(self, **criteria: Any) -> APIFuture[Any]:
        """Sessions matching every criterion (session_id, display_name, user_metadata,
        project_ids, statuses, limit, cursor), newest first: `{"sessions", "next_cursor"}`."""
        return self._json("POST", "/api/v1/sessions/search", json_body=criteria)

    def export_session_trace(self, session_id: str) -> APIFuture[str]:
        """A signed URL of the session's trace (a JSON file of its requests with timings, in
        the Trace Event Format that ui.perfetto.dev opens)."""

        async def run() -> str:
            while True:
                response = await self._holder.http.request(
                    "GET", f"/api/v1/sessions/{_q(session_id)}/trace_export"
                )
                answer = response.json()
                if answer["status"] == "ready":
                    return str(answer["url"])
                if answer["status"] == "failed":
                    raise RuntimeError(
                        f"trace export of {session_id} failed: {answer.get('error')}"
                    )
                await asyncio.sleep(TRACE_POLL_S)

        return self._holder.submit(run())

    # ---- audit and billing ---------------------------------------------------------------------

    def get_audit_log(
        self,
        event_type: Literal["all", "checkpoints", "projects", "teams", "organizations"] = "all",
        day: date | None = None,
    ) -> APIFuture[Any]:
        params: dict[str, Any] = {"event_type": event_type}
        if day is not None:
            params["day"] = day.isoformat()
        return self._json("GET", "/api/v1/audit", params=params)

    def get_billing_usage(
        self, starting_on: datetime | str, ending_before: datetime | str
    ) -> APIFuture[Any]:
        """Hourly usage events in [starting_on, ending_before) (UTC hour boundaries, at most 14
        days): training, sampling prefill and sampled tokens, checkpoints saved."""
        params = {"starting_on": _iso(starting_on), "ending_before": _iso(ending_before)}
        return self._json("GET", "/api/v1/billing/usage/events", params=params)

    def get_current_checkpoint_storage_usage(self, project_id: str | None = None) -> APIFuture[Any]:
        params = {"project_id": project_id} if project_id is not None else None
        return self._json("GET", "/api/v1/billing/usage/checkpoints/current", params=params)
