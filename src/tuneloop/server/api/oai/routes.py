"""The OpenAI-compatible routes: chat completions, completions, models, and readiness."""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import StreamingResponse

from tuneloop.server.api.deps import State, Tenant, json_body, off_loop
from tuneloop.server.api.errors import ApiError, bad_request, openai_error_body
from tuneloop.server.api.oai import shapes
from tuneloop.server.api.oai.models import SamplerCache, Target, resolve
from tuneloop.server.api.oai.params import (
    ChatCompletionRequest,
    CompletionRequest,
    Plan,
    chat_messages,
    chat_plan,
    completion_plan,
    prompts_of,
    read_body,
)
from tuneloop.server.api.oai.run import Finished, Generation
from tuneloop.server.api.oai.text import ChoiceText, ModelText, model_text
from tuneloop.server.api.state import ServerState, get_state


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    # Runs inside the app's own lifespan: the engine is up before and still up after.
    cache = SamplerCache(get_state_of(app).engine)
    app.state.oai_samplers = cache
    try:
        yield
    finally:
        await cache.close()


def get_state_of(app: FastAPI) -> ServerState:
    state: ServerState = app.state.tuneloop
    return state


router = APIRouter(prefix="/oai/api/v1", lifespan=_lifespan)


def _samplers(request: Request) -> SamplerCache:
    cache: SamplerCache = request.app.state.oai_samplers
    return cache


@router.get("/health")
async def health(request: Request) -> dict[str, Any]:
    """Readiness: 200 once the models are loaded and the engine runs (no key needed)."""
    state = get_state(request)
    return {"status": "ok", "models": sorted(state.models)}


@router.get("/models")
async def models(state: State, _tenant: Tenant) -> dict[str, Any]:
    """The base models served here (checkpoints and sampling sessions are also accepted)."""
    data = [
        {"id": name, "object": "model", "created": 0, "owned_by": "tuneloop"}
        for name in sorted(state.models)
    ]
    return {"object": "list", "data": data}


def _prompt_tokens(text: ModelText, prompt: str | list[int], field: str) -> list[int]:
    tokens = text.encode(prompt, special=True) if isinstance(prompt, str) else prompt
    if not tokens:
        raise bad_request(f"{field}: must hold at least one token", field)
    vocab = text.spec.vocab_size
    bad = [t for t in tokens if not 0 <= t < vocab]
    if bad:
        raise bad_request(
            f"{field}: token id {bad[0]} is outside the vocabulary [0, {vocab})", field
        )
    return tokens


def _max_tokens(plan: Plan, spec_context: int, prompt: list[int], field: str) -> int:
    room = spec_context - len(prompt)
    if room < 1:
        raise bad_request(
            f"{field}: {len(prompt)} tokens fill the context length {spec_context}", field
        )
    if plan.max_tokens is None:
        return room
    if plan.max_tokens > room:
        raise bad_request(
            f"max_tokens: the prompt ({len(prompt)} tokens) + max_tokens ({plan.max_tokens}) "
            f"exceeds the context length {spec_context}",
            "max_tokens",
        )
    return plan.max_tokens


async def _start(
    request: Request,
    state: ServerState,
    tenant: str,
    target: Target,
    text: ModelText,
    prompts: list[list[int]],
    plan: Plan,
    stop_ids: tuple[int, ...],
    field: str,
) -> tuple[Generation, Callable[[], None]]:
    """Submit the requests; returns the generation and what releases its sampler."""
    if plan.top_k >= target.spec.vocab_size:  # k >= V: no limit, as the engine expects it
        plan = dataclasses.replace(plan, top_k=-1)
    context = target.spec.max_context_length
    limits = [
        _max_tokens(plan, context, p, field if len(prompts) == 1 else f"{field}[{i}]")
        for i, p in enumerate(prompts)
    ]
    # Every prompt x choice counts against max_inflight, before anything is made for the
    # request. The engine request of a prompt is one future; its other n - 1 choices are held
    # as slots until the request ends.
    state.quotas.check_inflight(tenant, len(prompts) * plan.n)
    # Held at once, so that requests arriving while this one waits for its sampler see them.
    until_submitted = state.quotas.hold(tenant, len(prompts))
    unhold = state.quotas.hold(tenant, len(prompts) * (plan.n - 1))
    cache = _samplers(request)
    try:
        sampler_id = await cache.acquire(tenant, target)
    except BaseException:
        until_submitted()
        unhold()
        raise
    try:
        generation = Generation(state, tenant, sampler_id, text, prompts, plan, limits, stop_ids)
        generation.submit()
    except BaseException:
        unhold()
        cache.release(sampler_id)
        raise
    finally:
        until_submitted()  # the prompts' futures count for themselves now

    def release() -> None:
        unhold()
        cache.release(sampler_id)

    return generation, release


@router.post("/chat/completions", openapi_extra=json_body(ChatCompletionRequest))
async def chat_completions(request: Request, state: State, tenant: Tenant) -> Any:
    body = await read_body(request, ChatCompletionRequest)
    plan = chat_plan(body)
    messages = chat_messages(body)
    target = resolve(state, tenant, body.model)
    text = await model_text(target.spec)
    # Rendering and tokenizing a long conversation takes a worker thread, not the event loop.
    size = sum(len(m.get("content") or "") for m in messages)
    prompt = await off_loop(size, text.chat_prompt, messages)
    _prompt_tokens(text, prompt, "messages")
    generation, release = await _start(
        request, state, tenant, target, text, [prompt], plan, text.turn_ids, "messages"
    )
    reply = _Reply("chatcmpl", "chat.completion", body.model, generation, chat=True)
    return await _answer(reply, release)


@router.post("/completions", openapi_extra=json_body(CompletionRequest))
async def completions(request: Request, state: State, tenant: Tenant) -> Any:
    body = await read_body(request, CompletionRequest)
    plan = completion_plan(body)
    raw = prompts_of(body)
    target = resolve(state, tenant, body.model)
    text = await model_text(target.spec)

    def tokenized() -> list[list[int]]:
        return [
            _prompt_tokens(text, p, "prompt" if len(raw) == 1 else f"prompt[{i}]")
            for i, p in enumerate(raw)
        ]

    # Tokenizing long prompts takes a worker thread, not the event loop.
    prompts: list[list[int]] = await off_loop(sum(len(p) for p in raw), tokenized)
    generation, release = await _start(
        request, state, tenant, target, text, prompts, plan, text.eos_ids, "prompt"
    )
    reply = _Reply("cmpl", "text_completion", body.model, generation, chat=False)
    return await _answer(reply, release)


async def _answer(reply: _Reply, release: Callable[[], None]) -> Any:
    """The whole response, or a stream of chunks; either way the sampler is released after."""
    generation = reply.generation
    if generation.plan.stream:
        return _streaming(reply.stream(), generation, release)
    try:
        return await reply.whole()
    finally:  # a failed prompt or a cancelled handler: the other prompts need not run on
        generation.cancel()
        release()


def _streaming(
    events: AsyncIterator[bytes], generation: Generation, release: Callable[[], None]
) -> StreamingResponse:
    async def body() -> AsyncIterator[bytes]:
        try:
            async for event in events:
                yield event
        finally:  # also when the client goes away mid-stream: then its requests stop too
            generation.cancel()
            release()

    headers = {"cache-control": "no-cache", "x-accel-buffering": "no"}
    return StreamingResponse(body(), media_type="text/event-stream", headers=headers)


class _Reply:
    """Turns a generation into OpenAI's response, or its stream of chunks."""

    def __init__(
        self, prefix: str, kind: str, model: str, generation: Generation, *, chat: bool
    ) -> None:
        self.id = f"{prefix}-{secrets.token_hex(12)}"
        self.kind = kind
        self.model = model
        self.created = int(time.time())
        self.generation = generation
        self.chat = chat
        self.logprobs = generation.plan.logprobs is not None

    def _envelope(self, kind: str) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "object": kind, "created": self.created}
        out["model"] = self.model
        out["system_fingerprint"] = None
        return out

    def _usage(self) -> dict[str, int]:
        return shapes.usage(*self.generation.usage_counts())

    async def whole(self) -> dict[str, Any]:
        finished = await self.generation.results_all()
        for done in finished:
            if done.error is not None:
                raise done.error
        build = shapes.chat_choice if self.chat else shapes.completion_choice
        choices = [
            build(i, choice, self.generation.finish_reason(i), self.logprobs)
            for i, choice in enumerate(self.generation.choices)
        ]
        return {**self._envelope(self.kind), "choices": choices, "usage": self._usage()}

    def _chunk(self, choices: list[dict[str, Any]]) -> bytes:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        chunk = {**self._envelope(kind), "choices": choices}
        if self.generation.plan.include_usage:
            chunk["usage"] = None
        return shapes.sse(chunk)

    def _delta(
        self, index: int, choice: ChoiceText, final: bool, finish: str | None
    ) -> dict[str, Any] | None:
        new, start, end = choice.release(final)
        if not new and start == end and finish is None:
            return None
        with_logprobs = choice if self.logprobs else None
        if self.chat:
            return shapes.chat_delta(index, new or None, with_logprobs, (start, end), finish)
        return shapes.completion_delta(index, new, with_logprobs, (start, end), finish)

    async def stream(self) -> AsyncIterator[bytes]:
        generation = self.generation
        n = generation.plan.n
        if self.chat:  # the role comes first, as OpenAI sends it
            yield self._chunk(
                [shapes.chat_delta(i, "", role=True) for i in range(len(generation.choices))]
            )
        async for changed, finished in generation.events():
            errors = [done.error for done in finished if done.error is not None]
            if errors:
                yield shapes.sse(openai_error_body(errors[0].status, errors[0].detail, None))
                return
            done_choices = {done.prompt * n + j for done in finished for j in range(n)}
            deltas = []
            for index in sorted(changed | done_choices):
                finish = generation.finish_reason(index) if index in done_choices else None
                delta = self._delta(index, generation.choices[index], bool(finish), finish)
                if delta is not None:
                    deltas.append(delta)
            if deltas:
                yield self._chunk(deltas)
        if generation.plan.include_usage:
            usage = {**self._envelope(self._chunk_kind()), "choices": [], "usage": self._usage()}
            yield shapes.sse(usage)
        yield shapes.DONE

    def _chunk_kind(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"


__all__ = ["ApiError", "Finished", "router"]
