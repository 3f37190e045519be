"""RestClient: training runs, checkpoints, sessions and samplers. Needs no session.

Every method returns an `APIFuture` at once.
"""

from __future__ import annotations

import asyncio
import urllib.parse
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO, Any, Literal, TypeVar

import httpx
import pydantic

from tuneloop._futures import APIFuture, ClientHolder, parse_json_model
from tuneloop._http import DEFAULT_TIMEOUT, VERSION, env_api_key, error_from_response
from tuneloop._rest_admin import RestAdminMethods
from tuneloop.errors import APIConnectionError, APITimeoutError, TuneloopError
from tuneloop.types import (
    CheckpointsListResponse,
    ExternalWeightsUrlsResponse,
    GetSamplerResponse,
    GetServerCapabilitiesResponse,
    GetSessionResponse,
    ListSessionsResponse,
    TrainingRun,
    TrainingRunsResponse,
    UsageResponse,
    WeightsInfoResponse,
)

__all__ = ["RestClient", "parse_tinker_path"]

ModelT = TypeVar("ModelT", bound=pydantic.BaseModel)

# Signed URLs are renewed this long before they expire, as the official SDK does: a file
# started just before the expiry could otherwise be refused halfway through the set.
RESIGN_BEFORE = timedelta(minutes=5)
_CHUNK_BYTES = 1 << 20


def parse_tinker_path(path: str) -> tuple[str, str]:
    """`tinker://<run>/<segment>/<name>` -> (training_run_id, "<segment>/<name>")."""
    prefix = "tinker://"
    parts = path[len(prefix) :].split("/") if path.startswith(prefix) else []
    if len(parts) != 3 or not all(parts):
        raise ValueError(f"not a tinker path (tinker://<run>/<segment>/<name>): {path!r}")
    return parts[0], f"{parts[1]}/{parts[2]}"


def _q(segment: str, safe: str = ":") -> str:
    return urllib.parse.quote(segment, safe=safe)


class RestClient(RestAdminMethods):
    """Read and manage what the server stores.

    Made by `ServiceClient.create_rest_client()` (sharing its connection), or on its own with
    `RestClient(base_url=..., api_key=...)`, which fetches the client config and opens no session;
    call `close()` on a stand-alone one.
    """

    def __init__(
        self,
        _holder: ClientHolder | None = None,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        _transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._owns_holder = _holder is None
        if _holder is None:
            from tuneloop.service_client import resolve_base_url

            _holder = ClientHolder(
                resolve_base_url(base_url), api_key or env_api_key(), transport=_transport
            )
            try:
                _holder.call(_holder.fetch_config(VERSION))
            except BaseException:
                _holder.close()
                raise
        self._holder = _holder
        # File downloads use signed URLs and no API key: their own client (the same transport
        # as the API calls when a test injects one).
        self._file_transport = _transport

    def close(self) -> None:
        """Release the connection (only for a stand-alone RestClient)."""
        if self._owns_holder:
            self._holder.close()

    def __enter__(self) -> RestClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(
        self,
        method: str,
        path: str,
        model: type[ModelT] | None,
        *,
        params: dict[str, Any] | None = None,
        json_body: Any = None,
    ) -> APIFuture[Any]:
        async def run() -> Any:
            response = await self._holder.http.request(
                method, path, params=params, json_body=json_body
            )
            return None if model is None else parse_json_model(response, model)

        return self._holder.submit(run())

    # ---- training runs -------------------------------------------------------------------------

    def get_training_run(self, training_run_id: str) -> APIFuture[TrainingRun]:
        return self._call("GET", f"/api/v1/training_runs/{_q(training_run_id)}", TrainingRun)

    def get_training_run_by_tinker_path(self, tinker_path: str) -> APIFuture[TrainingRun]:
        return self.get_training_run(parse_tinker_path(tinker_path)[0])

    def list_training_runs(
        self, limit: int = 20, offset: int = 0, project_id: str | None = None
    ) -> APIFuture[TrainingRunsResponse]:
        params: dict[str, Any] = {"limit": limit, "offset": offset}
        if project_id is not None:
            params["project_id"] = project_id
        return self._call("GET", "/api/v1/training_runs", TrainingRunsResponse, params=params)

    # ---- checkpoints ---------------------------------------------------------------------------

    def list_checkpoints(self, training_run_id: str) -> APIFuture[CheckpointsListResponse]:
        path = f"/api/v1/training_runs/{_q(training_run_id)}/checkpoints"
        return self._call("GET", path, CheckpointsListResponse)

    def list_user_checkpoints(
        self, limit: int = 100, offset: int = 0
    ) -> APIFuture[CheckpointsListResponse]:
        return self._call(
            "GET",
            "/api/v1/checkpoints",
            CheckpointsListResponse,
            params={"limit": limit, "offset": offset},
        )

    def delete_checkpoint(self, training_run_id: str, checkpoint_id: str) -> APIFuture[None]:
        """Delete e.g. checkpoint_id="weights/step1" (the id holds one slash)."""
        path = (
            f"/api/v1/training_runs/{_q(training_run_id)}/checkpoints/"
            f"{_q(checkpoint_id, safe=':/')}"
        )
        return self._call("DELETE", path, None)

    def delete_checkpoint_from_tinker_path(self, tinker_path: str) -> APIFuture[None]:
        return self.delete_checkpoint(*parse_tinker_path(tinker_path))

    def get_weights_info_by_tinker_path(self, tinker_path: str) -> APIFuture[WeightsInfoResponse]:
        return self._call(
            "POST",
            "/api/v1/weights_info",
            WeightsInfoResponse,
            json_body={"tinker_path": tinker_path},
        )

    # ---- sessions, samplers, server ------------------------------------------------------------

    def get_sampler(self, sampler_id: str) -> APIFuture[GetSamplerResponse]:
        return self._call("GET", f"/api/v1/samplers/{_q(sampler_id)}", GetSamplerResponse)

    def get_session(self, session_id: str) -> APIFuture[GetSessionResponse]:
        return self._call("GET", f"/api/v1/sessions/{_q(session_id)}", GetSessionResponse)

    def list_sessions(self, limit: int = 20, offset: int = 0) -> APIFuture[ListSessionsResponse]:
        return self._call(
            "GET",
            "/api/v1/sessions",
            ListSessionsResponse,
            params={"limit": limit, "offset": offset},
        )

    def get_server_capabilities(self) -> APIFuture[GetServerCapabilitiesResponse]:
        return self._call("GET", "/api/v1/get_server_capabilities", GetServerCapabilitiesResponse)

    def get_usage(
        self,
        session_id: str | None = None,
        *,
        training_run_id: str | None = None,
        since: datetime | str | None = None,
        until: datetime | str | None = None,
        bucket: Literal["none", "hour", "day"] = "none",
    ) -> APIFuture[UsageResponse]:
        """Tokens (prefill, sampled, trained) and requests metered for your tenant: all of it,
        or one session's, or one training run's (or sampler's).

        `since`/`until` are datetimes or strings: ISO times, or spans back from now such as
        "24h" or "7d"; usage is kept per UTC hour, so they resolve to whole hours. With
        `bucket="hour"` or `"day"` the answer also lists each hour or day that has usage.
        """
        params: dict[str, Any] = {"bucket": bucket}
        for name, value in (
            ("session_id", session_id),
            ("training_run_id", training_run_id),
            ("since", since),
            ("until", until),
        ):
            if value is not None:
                params[name] = value.isoformat() if isinstance(value, datetime) else value
        return self._call("GET", "/api/v1/usage", UsageResponse, params=params)

    def set_checkpoint_ttl_from_tinker_path(
        self, tinker_path: str, ttl_seconds: int | None
    ) -> APIFuture[None]:
        """Expire a checkpoint `ttl_seconds` from now (an hour to ten years), or never (None);
        the server deletes expired checkpoints, files and all."""
        run_id, checkpoint_id = parse_tinker_path(tinker_path)
        path = f"/api/v1/training_runs/{_q(run_id)}/checkpoints/{_q(checkpoint_id, safe=':/')}/ttl"
        return self._call("PUT", path, None, json_body={"ttl_seconds": ttl_seconds})

    # ---- downloads -----------------------------------------------------------------------------

    def get_external_weights_urls(self, tinker_path: str) -> APIFuture[ExternalWeightsUrlsResponse]:
        """Signed URLs, one per file, of an external-weights checkpoint
        (`tinker://<run>/external_weights/<name>`, from `TrainingClient.save_weights_external`).

        The URLs need no API key (anyone holding one can fetch that file) and stop working at
        `expires`; ask again for fresh ones.
        """
        run_id, checkpoint_id = _downloadable(tinker_path)
        path = (
            f"/api/v1/training_runs/{_q(run_id)}/checkpoints/{_q(checkpoint_id, safe=':/')}"
            "/external_weights_urls"
        )
        return self._call("GET", path, ExternalWeightsUrlsResponse)

    def download_checkpoint(self, tinker_path: str, out_dir: str | Path) -> APIFuture[Path]:
        """Download every file of an external-weights checkpoint into `out_dir` (created; it
        must not hold files already); the result is the folder.

        For an adapter export that is the PEFT layout: `peft.PeftModel.from_pretrained(base,
        out_dir)` loads it. URLs are signed again when they come within 5 minutes of expiring.
        A training checkpoint is downloaded by exporting it first:
        `service.create_training_client_from_state(path).save_weights_external(name)`.
        """
        _downloadable(tinker_path)
        target = Path(out_dir)
        if target.exists() and (not target.is_dir() or any(target.iterdir())):
            raise ValueError(f"out_dir {str(target)!r} exists and is not an empty folder")
        return self._holder.submit(self._download(tinker_path, target))

    async def _download(self, tinker_path: str, target: Path) -> Path:
        urls = await self.get_external_weights_urls(tinker_path)
        if not urls.urls:
            raise TuneloopError(f"{tinker_path} has no files to download")
        for name in urls.urls:  # the names come from the server: never write outside out_dir
            parts = name.split("/")
            if name.startswith("/") or "\\" in name or any(p in ("", ".", "..") for p in parts):
                raise TuneloopError(f"refusing to write {name!r} outside {target}")
        await asyncio.to_thread(target.mkdir, parents=True, exist_ok=True)
        async with httpx.AsyncClient(
            transport=self._file_transport, timeout=DEFAULT_TIMEOUT, follow_redirects=True
        ) as client:
            for name in sorted(urls.urls):
                if datetime.now(UTC) >= urls.expires - RESIGN_BEFORE:
                    urls = await self.get_external_weights_urls(tinker_path)
                url = urls.urls.get(name)
                if url is None:
                    raise TuneloopError(f"{name!r} of {tinker_path} is gone from the server")
                await _fetch(client, url, target / name)
        return target


def _downloadable(tinker_path: str) -> tuple[str, str]:
    run_id, checkpoint_id = parse_tinker_path(tinker_path)
    segment = checkpoint_id.split("/", 1)[0]
    if segment == "sampler_weights":
        raise ValueError(f"sampler checkpoints cannot be downloaded: {tinker_path}")
    if segment != "external_weights":
        raise ValueError(
            "only external-weights checkpoints (tinker://<run>/external_weights/<name>) are "
            f"downloaded; export {tinker_path} with TrainingClient.save_weights_external first"
        )
    return run_id, checkpoint_id


async def _fetch(client: httpx.AsyncClient, url: str, dest: Path) -> None:
    """One file, streamed to `dest` through a temporary name, its length checked."""
    await asyncio.to_thread(dest.parent.mkdir, parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".part")
    try:
        async with client.stream("GET", url) as response:
            if response.status_code != 200:
                await response.aread()
                raise error_from_response(response)
            expected = response.headers.get("content-length")
            written = 0
            f: IO[bytes] = await asyncio.to_thread(partial.open, "wb")
            try:
                async for chunk in response.aiter_bytes(_CHUNK_BYTES):
                    await asyncio.to_thread(f.write, chunk)
                    written += len(chunk)
            finally:
                await asyncio.to_thread(f.close)
        if expected is not None and int(expected) != written:
            raise APIConnectionError(f"{dest.name}: got {written} of {expected} bytes")
        await asyncio.to_thread(partial.replace, dest)
    except httpx.TimeoutException as exc:
        raise APITimeoutError(f"downloading {dest.name} timed out: {exc!r}") from exc
    except httpx.TransportError as exc:
        raise APIConnectionError(f"downloading {dest.name} failed: {exc!r}") from exc
    finally:
        await asyncio.to_thread(partial.unlink, missing_ok=True)
