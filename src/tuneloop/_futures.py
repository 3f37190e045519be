"""APIFuture, the background event loop every client shares, and the retrieve_future poller.

One `ClientHolder` per `ServiceClient` (or stand-alone `RestClient`) owns a daemon thread that runs
an asyncio loop, the HTTP transport on that loop, the server's client config and the session.
The clients a ServiceClient creates share its holder. Public calls schedule coroutines on the loop
and hand back an `APIFuture` at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Generator
from typing import Any, Generic, TypeVar

import httpx
import pydantic

from tuneloop._http import PROTOBUF, HttpTransport, error_from_response, retry_delay
from tuneloop.errors import (
    APIConnectionError,
    APIResponseValidationError,
    RequestFailedError,
    TuneloopError,
)
from tuneloop.types import ClientConfigResponse
from tuneloop.types.codec import WireFormatError

__all__ = ["APIFuture", "ClientHolder"]

T = TypeVar("T")
logger = logging.getLogger("tuneloop")

HEARTBEAT_INTERVAL_S = 10.0
HEARTBEAT_TIMEOUT_S = 10.0
HEARTBEAT_WARN_AFTER_S = 120.0
# The server long-polls retrieve_future for about 30 s; the read timeout must outlast that.
POLL_READ_TIMEOUT_S = 45.0
# Long-polls in flight at once, per kind (sampling, training); more futures wait for a slot.
# Separate kinds keep minutes-long training polls from holding the slots that fast sampling
# results need.
POLL_SLOTS = 16
# Submissions in flight at once. Small pools are cheaper: httpcore checks every pooled
# connection each time it places a request, so with 1,000 futures in flight 16 connections per
# pool gave 222 futures/s and 3 ms client CPU per future, 32 gave 136/s, 64 gave 54/s.
SUBMIT_SLOTS = 16
# A future whose polls fail (transport errors, 429, 5xx) for this long without a single answer
# from the server is given up on, with an error, rather than polled forever.
POLL_STALL_LIMIT_S = 30 * 60.0
POLL_BACKOFF_CAP_S = 30.0


class APIFuture(Generic[T]):
    """The result of a server call, available later.

    - `result(timeout=None)` blocks; on timeout it raises `TimeoutError` and the operation keeps
      running (call `result` again later).
    - `await fut` / `await fut.result_async(timeout=None)` waits from any asyncio loop; a timeout
      raises `TimeoutError` and does not cancel the operation either.
    - `done()` says whether the result (or error) is in.
    """

    def __init__(
        self,
        future: concurrent.futures.Future[T],
        loop_thread: threading.Thread | None = None,
    ) -> None:
        self._future = future
        self._loop_thread = loop_thread

    @classmethod
    def completed(cls, value: T) -> APIFuture[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        future.set_result(value)
        return cls(future)

    def done(self) -> bool:
        return self._future.done()

    def future(self) -> concurrent.futures.Future[T]:
        """The underlying `concurrent.futures.Future`."""
        return self._future

    def result(self, timeout: float | None = None) -> T:
        if threading.current_thread() is self._loop_thread and not self._future.done():
            raise RuntimeError(
                "APIFuture.result() called on the SDK's own event loop thread, where it would "
                "deadlock; use `await future` there instead"
            )
        try:
            return self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"no result within {timeout} s (the operation continues)") from None

    async def result_async(self, timeout: float | None = None) -> T:  # noqa: ASYNC109
        # shield: a timeout or a cancelled caller must not cancel the operation itself.
        waiter = asyncio.shield(asyncio.wrap_future(self._future))
        try:
            return await asyncio.wait_for(waiter, timeout)
        except TimeoutError:
            raise TimeoutError(f"no result within {timeout} s (the operation continues)") from None

    def __await__(self) -> Generator[Any, None, T]:
        return self.result_async().__await__()

    def __repr__(self) -> str:
        return f"<APIFuture {'done' if self.done() else 'pending'}>"


class ClientHolder:
    """The event-loop thread, transport, client config and session shared by related clients."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run_loop, name="tuneloop-loop", daemon=True)
        self.thread.start()
        # Three connection pools, so that no kind of traffic can starve another: long-polls of
        # many in-flight futures would otherwise hold every connection while new submissions
        # (and the heartbeat that keeps the session alive) wait for one.
        self.http: HttpTransport = self.call(self._make_transport(api_key, transport, SUBMIT_SLOTS))
        self.poll_http: dict[str, HttpTransport] = {
            kind: self.call(self._make_transport(api_key, transport, POLL_SLOTS))
            for kind in ("sample", "train")
        }
        self.heartbeat_http: HttpTransport = self.call(self._make_transport(api_key, transport, 2))
        self.config = ClientConfigResponse()
        self.session_id: str | None = None
        self._counter_lock = threading.Lock()
        self._next_model_seq_id = 0
        self._next_sampling_session_seq_id = 0
        self._heartbeat: concurrent.futures.Future[None] | None = None
        self._tokenizers: dict[str, Any] = {}
        self.closed = False

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    async def _make_transport(
        self, api_key: str | None, transport: httpx.AsyncBaseTransport | None, connections: int
    ) -> HttpTransport:
        return HttpTransport(self.base_url, api_key, transport=transport, connections=connections)

    # ---- scheduling ---------------------------------------------------------------------------

    def submit(self, coro: Coroutine[Any, Any, T]) -> APIFuture[T]:
        """Schedule `coro` on the loop; returns at once."""
        if self.closed:
            coro.close()
            raise TuneloopError("this client is closed")
        return APIFuture(asyncio.run_coroutine_threadsafe(coro, self.loop), self.thread)

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the loop and block for its result."""
        return APIFuture(asyncio.run_coroutine_threadsafe(coro, self.loop), self.thread).result()

    def next_model_seq_id(self) -> int:
        with self._counter_lock:
            value = self._next_model_seq_id
            self._next_model_seq_id += 1
            return value

    def next_sampling_session_seq_id(self) -> int:
        with self._counter_lock:
            value = self._next_sampling_session_seq_id
            self._next_sampling_session_seq_id += 1
            return value

    def require_session(self) -> str:
        if self.session_id is None:
            raise TuneloopError("this operation needs a session; create clients via ServiceClient")
        return self.session_id

    # ---- startup, heartbeat, shutdown ----------------------------------------------------------

    async def fetch_config(self, sdk_version: str) -> ClientConfigResponse:
        response = await self.http.request(
            "POST", "/api/v1/client/config", json_body={"sdk_version": sdk_version}
        )
        self.config = parse_json_model(response, ClientConfigResponse)
        return self.config

    def start_heartbeat(self, interval_s: float | None = None) -> None:
        session_id = self.require_session()
        every = HEARTBEAT_INTERVAL_S if interval_s is None else interval_s
        self._heartbeat = asyncio.run_coroutine_threadsafe(
            self._heartbeat_loop(session_id, every), self.loop
        )

    async def _heartbeat_loop(self, session_id: str, interval_s: float) -> None:
        body = {"session_id": session_id, "type": "session_heartbeat"}
        failing_since: float | None = None
        warned = False
        while True:
            await asyncio.sleep(interval_s)
            problem: str | None = None
            try:
                response = await self.heartbeat_http.send_once(
                    "POST",
                    "/api/v1/session_heartbeat",
                    json_body=body,
                    timeout_s=HEARTBEAT_TIMEOUT_S,
                )
            except APIConnectionError as exc:
                problem = str(exc)
            else:
                if response.status_code == 410:
                    logger.info("session %s is finished; heartbeats stop", session_id)
                    return
                if response.status_code >= 400:
                    problem = str(error_from_response(response))
            if problem is None:
                failing_since, warned = None, False
                continue
            now = time.monotonic()
            failing_since = failing_since or now
            if not warned and now - failing_since >= HEARTBEAT_WARN_AFTER_S:
                logger.warning(
                    "session heartbeats failing for %.0f s: %s", now - failing_since, problem
                )
                warned = True

    def heartbeat_running(self) -> bool:
        return self._heartbeat is not None and not self._heartbeat.done()

    def stop_heartbeat(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()

    def close(self) -> None:
        """Stop the heartbeat, close the transport and end the loop thread. Idempotent."""
        if self.closed:
            return
        if threading.current_thread() is self.thread:
            raise RuntimeError("close() cannot run on the SDK's own event loop thread")
        self.closed = True
        self.stop_heartbeat()
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop).result(10)
        except Exception as exc:  # closing must not fail a program that is done anyway
            logger.warning("error while closing the client: %r", exc)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            if not self.thread.is_alive():
                self.loop.close()

    async def _shutdown(self) -> None:
        # Work still in flight is cancelled: its APIFutures raise CancelledError.
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=2.0)
        for http in (self.http, *self.poll_http.values(), self.heartbeat_http):
            await http.aclose()

    # ---- futures -------------------------------------------------------------------------------

    async def retrieve(
        self,
        request_id: str,
        *,
        decode_json: Callable[[Any], T] | None = None,
        decode_proto: Callable[[bytes], T] | None = None,
        request_type: str = "",
    ) -> T:
        """Poll retrieve_future until the result is in; the server long-polls each call.

        try_again (200 or 408) re-polls at once; transport errors, 409, 429 and 5xx back off and
        re-poll, up to POLL_STALL_LIMIT_S without any answer; a failure record raises
        RequestFailedError; other 4xx raise their APIStatusError.
        """
        body = {"request_id": request_id, "allow_metadata_only": False}
        kind = "sample" if request_type == "Sample" else "train"
        headers = {"X-Tinker-Request-Type": request_type} if request_type else {}
        if decode_proto is not None:
            headers["Accept"] = f"{PROTOBUF}, application/json"
        last_progress = time.monotonic()
        failures = 0
        iteration = 0
        while True:
            iteration += 1
            headers["X-Tinker-Request-Iteration"] = str(iteration)
            response: httpx.Response | None = None
            try:
                response = await self.poll_http[kind].send_once(
                    "POST",
                    "/api/v1/retrieve_future",
                    json_body=body,
                    headers=headers,
                    timeout_s=POLL_READ_TIMEOUT_S,
                )
            except APIConnectionError as exc:
                problem: Exception = exc
            else:
                status = response.status_code
                if status == 408:
                    last_progress, failures = time.monotonic(), 0
                    continue
                if status == 200:
                    last_progress, failures = time.monotonic(), 0
                    done, value = _parse_future_result(
                        request_id, response, decode_json, decode_proto
                    )
                    if done:
                        return value  # type: ignore[return-value]
                    continue
                problem = error_from_response(response)
                if not (status in (409, 429) or status >= 500):
                    raise problem
            stalled = time.monotonic() - last_progress
            if stalled > POLL_STALL_LIMIT_S:
                raise APIConnectionError(
                    f"gave up on request {request_id}: no answer from the server for "
                    f"{stalled / 60:.0f} min; last error: {problem}"
                ) from problem
            delay = min(retry_delay(failures, response), POLL_BACKOFF_CAP_S)
            failures += 1
            logger.info("polling %s: %s; retrying in %.2f s", request_id, problem, delay)
            await asyncio.sleep(delay)


def _parse_future_result(
    request_id: str,
    response: httpx.Response,
    decode_json: Callable[[Any], T] | None,
    decode_proto: Callable[[bytes], T] | None,
) -> tuple[bool, T | None]:
    """(True, result) when the future is resolved; (False, None) for try_again."""
    content_type = response.headers.get("content-type", "")
    if content_type.startswith(PROTOBUF):
        if decode_proto is None:
            raise APIResponseValidationError(f"request {request_id}: unexpected protobuf result")
        try:
            return True, decode_proto(response.content)
        except WireFormatError as exc:
            raise APIResponseValidationError(f"request {request_id}: {exc}") from exc
    try:
        payload = response.json()
    except ValueError as exc:
        raise APIResponseValidationError(
            f"request {request_id}: result is neither protobuf nor JSON ({content_type!r})"
        ) from exc
    if isinstance(payload, dict):
        if payload.get("type") == "try_again" or payload.get("status") == "complete_metadata":
            return False, None
        if "error" in payload:
            raise RequestFailedError(
                str(payload["error"]), request_id, str(payload.get("category", "unknown"))
            )
    if decode_json is None:
        raise APIResponseValidationError(
            f"request {request_id}: expected a protobuf result, got JSON {str(payload)[:200]}"
        )
    try:
        return True, decode_json(payload)
    except pydantic.ValidationError as exc:
        raise APIResponseValidationError(f"request {request_id}: {exc}") from exc


ModelT = TypeVar("ModelT", bound=pydantic.BaseModel)


def parse_json_model(response: httpx.Response, model: type[ModelT]) -> ModelT:
    """Validate a direct JSON response into `model`."""
    try:
        return model.model_validate(response.json())
    except (ValueError, pydantic.ValidationError) as exc:
        where = f"{response.request.method} {response.request.url.path}"
        raise APIResponseValidationError(f"{where}: unexpected response: {exc}") from exc
