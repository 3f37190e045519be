"""ServiceClient: the entry point. Opens a session and creates the other clients.

Creation methods (`create_lora_training_client`, `create_training_client_from_state*`,
`create_sampling_client`) block and return the client itself; each has an `*_async` twin to
`await` from asyncio code. Work on the clients (`forward_backward`, `sample`, ...) returns an
`APIFuture` at once.
"""

from __future__ import annotations

import logging
import urllib.parse
from types import TracebackType
from typing import Any, Literal

import httpx

from tuneloop._futures import APIFuture, ClientHolder, parse_json_model
from tuneloop._http import VERSION, env_api_key, env_base_url
from tuneloop.errors import APIError, TuneloopError
from tuneloop.rest_client import RestClient
from tuneloop.sampling_client import SamplingClient, start_sampling_client
from tuneloop.training_client import TrainingClient, open_training_client
from tuneloop.types import (
    CreateModelRequest,
    CreateModelResponse,
    CreateSessionRequest,
    CreateSessionResponse,
    FinishSessionRequest,
    GetServerCapabilitiesResponse,
    LoadWeightsRequest,
    LoadWeightsResponse,
    LoraConfig,
    UntypedFuture,
    UsageResponse,
)
from tuneloop.types.requests import FinishReason

__all__ = ["ServiceClient", "resolve_base_url"]

logger = logging.getLogger("tuneloop")

SDK_VERSION = f"tuneloop-{VERSION}"
# close() should not hang a process on exit when the server is gone.
FINISH_RETRY_BUDGET_S = 10.0


def resolve_base_url(base_url: str | None) -> str:
    """The server address: the argument, else $TUNELOOP_BASE_URL, else a clear error."""
    url = base_url or env_base_url()
    if not url:
        raise TuneloopError(
            "no tuneloop server address: pass base_url='http://host:port' or set the "
            "TUNELOOP_BASE_URL environment variable (a ServiceClient given neither starts a "
            "local server)"
        )
    return url.rstrip("/")


class ServiceClient:
    """A session on a tuneloop server.

    The server is `base_url`, else $TUNELOOP_BASE_URL, else a local server this process starts
    in a child process and stops when the last client closes or the process exits (the key is
    made for it; extra `tuneloop serve` flags come from $TUNELOOP_SERVE_ARGS).

    Startup (blocking): `POST /api/v1/client/config`, `POST /api/v1/create_session`, then a
    heartbeat every 10 s until `close()`. Use it as a context manager to close it reliably.
    """

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        user_metadata: dict[str, Any] | None = None,
        project_id: str | None = None,
        *,
        _transport: httpx.AsyncBaseTransport | None = None,
        _heartbeat_interval_s: float | None = None,
    ) -> None:
        self._embedded = False
        self._project_id = project_id
        if base_url is None and env_base_url() is None and _transport is None:
            # The embedded default: a local server in a child process (see tuneloop._embedded).
            from tuneloop import _embedded

            local = _embedded.acquire()
            self._embedded = True
            base_url, api_key = local.url, api_key or local.key
        try:
            self._holder = ClientHolder(
                resolve_base_url(base_url), api_key or env_api_key(), transport=_transport
            )
            try:
                self.session_id: str = self._holder.call(self._start(user_metadata, project_id))
            except BaseException:
                self._holder.close()
                raise
        except BaseException:
            self._release_embedded()
            raise
        self._holder.start_heartbeat(_heartbeat_interval_s)
        self._closed = False

    def copy_weights(self, path: str, *, ttl_seconds: int | None = None) -> APIFuture[str]:
        """Copy a checkpoint (yours, or one published) into this client's project; the copy's
        path. The bytes are shared; the copy is a run that cannot be trained on."""
        if self._project_id is None:
            raise ValueError("copy_weights needs the ServiceClient's project_id")
        rest = RestClient(self._holder)
        return rest.copy_weights(path, self._project_id, ttl_seconds=ttl_seconds)

    async def _start(self, user_metadata: dict[str, Any] | None, project_id: str | None) -> str:
        await self._holder.fetch_config(SDK_VERSION)
        request = CreateSessionRequest(
            user_metadata=user_metadata, sdk_version=SDK_VERSION, project_id=project_id
        )
        response = await self._holder.http.request(
            "POST",
            "/api/v1/create_session",
            json_body=request.model_dump(mode="json", exclude_none=True),
        )
        created = parse_json_model(response, CreateSessionResponse)
        for level, message in (
            (logging.INFO, created.info_message),
            (logging.WARNING, created.warning_message),
            (logging.ERROR, created.error_message),
        ):
            if message:
                logger.log(level, "server: %s", message)
        self._holder.session_id = created.session_id
        return created.session_id

    def __repr__(self) -> str:
        return f"ServiceClient(base_url={self._holder.base_url!r}, session_id={self.session_id!r})"

    # ---- training clients ----------------------------------------------------------------------

    def create_lora_training_client(
        self,
        base_model: str,
        rank: int = 32,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
        user_metadata: dict[str, Any] | None = None,
        *,
        train_experts: bool | None = None,
    ) -> TrainingClient:
        """Create a LoRA adapter on `base_model` and return its TrainingClient (blocks).

        `train_mlp` covers dense MLPs and MoE experts alike (Tinker's meaning);
        `train_experts`, a tuneloop extension, sets the experts apart: None follows `train_mlp`,
        True / False trains them or not whatever `train_mlp` says. On a model without experts it
        changes nothing. `get_info().model_data.lora_groups` says what the adapter covers.
        """
        return self._start_lora(
            base_model,
            rank,
            seed,
            train_mlp,
            train_attn,
            train_unembed,
            user_metadata,
            train_experts,
        ).result()

    async def create_lora_training_client_async(
        self,
        base_model: str,
        rank: int = 32,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
        user_metadata: dict[str, Any] | None = None,
        *,
        train_experts: bool | None = None,
    ) -> TrainingClient:
        return await self._start_lora(
            base_model,
            rank,
            seed,
            train_mlp,
            train_attn,
            train_unembed,
            user_metadata,
            train_experts,
        )

    def _start_lora(
        self,
        base_model: str,
        rank: int,
        seed: int | None,
        train_mlp: bool,
        train_attn: bool,
        train_unembed: bool,
        user_metadata: dict[str, Any] | None,
        train_experts: bool | None,
    ) -> APIFuture[TrainingClient]:
        if not (train_mlp or train_attn or train_unembed or train_experts):
            raise ValueError(
                "one of train_mlp, train_attn, train_unembed, train_experts must be True"
            )
        lora = LoraConfig(
            rank=rank,
            seed=seed,
            train_mlp=train_mlp,
            train_attn=train_attn,
            train_unembed=train_unembed,
            train_experts=train_experts,  # None is left out of the body: the server's default
        )
        request = CreateModelRequest(
            session_id=self.session_id,
            model_seq_id=self._holder.next_model_seq_id(),
            base_model=base_model,
            user_metadata=user_metadata,
            lora_config=lora,
        )
        return self._holder.submit(self._create_model(request))

    async def _create_model(self, request: CreateModelRequest) -> TrainingClient:
        future = await self._post_future(
            "/api/v1/create_model", request.model_dump(mode="json", exclude_none=True)
        )
        created = await self._holder.retrieve(
            future.request_id,
            decode_json=CreateModelResponse.model_validate,
            request_type="CreateModel",
        )
        return await open_training_client(self._holder, created.model_id, request.base_model)

    def create_training_client_from_state(self, path: str) -> TrainingClient:
        """A new TrainingClient with the weights of a `tinker://` checkpoint and a fresh
        optimizer (blocks)."""
        return self._start_from_state(path, optimizer=False).result()

    async def create_training_client_from_state_async(self, path: str) -> TrainingClient:
        return await self._start_from_state(path, optimizer=False)

    def create_training_client_from_state_with_optimizer(self, path: str) -> TrainingClient:
        """A new TrainingClient with the weights and optimizer state of a `tinker://`
        checkpoint (blocks)."""
        return self._start_from_state(path, optimizer=True).result()

    async def create_training_client_from_state_with_optimizer_async(
        self, path: str
    ) -> TrainingClient:
        return await self._start_from_state(path, optimizer=True)

    def _start_from_state(self, path: str, *, optimizer: bool) -> APIFuture[TrainingClient]:
        request = LoadWeightsRequest(
            session_id=self.session_id,
            model_seq_id=self._holder.next_model_seq_id(),
            path=path,
            optimizer=optimizer,
        )
        return self._holder.submit(self._load_model(request))

    async def _load_model(self, request: LoadWeightsRequest) -> TrainingClient:
        future = await self._post_future(
            "/api/v1/load_weights", request.model_dump(mode="json", exclude_none=True)
        )
        await self._holder.retrieve(
            future.request_id,
            decode_json=LoadWeightsResponse.model_validate,
            request_type="LoadWeights",
        )
        # The protocol fixes the id of a model created by loading (the server must agree).
        model_id = f"{self.session_id}:train:{request.model_seq_id}"
        return await open_training_client(self._holder, model_id)

    async def _post_future(self, path: str, body: dict[str, Any]) -> UntypedFuture:
        response = await self._holder.http.request("POST", path, json_body=body)
        return parse_json_model(response, UntypedFuture)

    # ---- sampling, REST ------------------------------------------------------------------------

    def create_sampling_client(
        self,
        model_path: str | None = None,
        base_model: str | None = None,
        *,
        record_stability_info: bool = False,
    ) -> SamplingClient:
        """A SamplingClient for saved sampler weights (`tinker://.../sampler_weights/...`) or a
        plain base model (blocks). `record_stability_info`: its samples can train with
        `stable_reinforce` (see `SamplingClient`)."""
        return start_sampling_client(
            self._holder, model_path, base_model, record_stability_info=record_stability_info
        ).result()

    async def create_sampling_client_async(
        self,
        model_path: str | None = None,
        base_model: str | None = None,
        *,
        record_stability_info: bool = False,
    ) -> SamplingClient:
        return await start_sampling_client(
            self._holder, model_path, base_model, record_stability_info=record_stability_info
        )

    def create_rest_client(self) -> RestClient:
        """A RestClient sharing this client's connection."""
        return RestClient(self._holder)

    def get_server_capabilities(self) -> GetServerCapabilitiesResponse:
        """The models the server offers (blocks)."""
        return self.create_rest_client().get_server_capabilities().result()

    async def get_server_capabilities_async(self) -> GetServerCapabilitiesResponse:
        return await self.create_rest_client().get_server_capabilities()

    def get_usage(self) -> UsageResponse:
        """Tokens (prefill, sampled, trained) and requests metered for this session so far, in
        total and per operation (blocks)."""
        return self.create_rest_client().get_usage(self.session_id).result()

    async def get_usage_async(self) -> UsageResponse:
        return await self.create_rest_client().get_usage(self.session_id)

    # ---- shutdown ------------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        """The server this client talks to (the local one's address, when it started one)."""
        return self._holder.base_url

    def close(
        self,
        reason: Literal["success", "errored", "interrupted"] = "success",
        detail: str | None = None,
    ) -> None:
        """Finish the session on the server, stop heartbeats and release the connection.

        Clients created from this one stop working. Safe to call twice.
        """
        if self._closed:
            return
        self._closed = True
        self._holder.stop_heartbeat()
        body = FinishSessionRequest(reason=FinishReason(type=reason), detail=detail)
        try:
            self._holder.call(
                self._holder.http.request(
                    "POST",
                    f"/api/v1/sessions/{urllib.parse.quote(self.session_id, safe=':')}/finish",
                    json_body=body.model_dump(mode="json", exclude_none=True),
                    retry_budget_s=FINISH_RETRY_BUDGET_S,
                )
            )
        except APIError as exc:
            logger.warning("could not finish session %s: %s", self.session_id, exc)
        finally:
            self._holder.close()
            self._release_embedded()

    def _release_embedded(self) -> None:
        if self._embedded:
            from tuneloop import _embedded

            self._embedded = False
            _embedded.release()

    def __enter__(self) -> ServiceClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close("success")
        elif issubclass(exc_type, KeyboardInterrupt):
            self.close("interrupted")
        else:
            self.close("errored", detail=repr(exc))
