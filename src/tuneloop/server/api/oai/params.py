"""OpenAI request bodies, and the sampling settings they ask for, checked once.

Parameters OpenAI accepts fall in three groups:
- honoured: model, messages / prompt, temperature, top_p, max_tokens (max_completion_tokens for
  chat), stop, n, seed, logprobs / top_logprobs, stream, stream_options.include_usage; also the
  common extension `top_k`;
- ignored, since ignoring them changes no token: user, store, metadata, service_tier,
  parallel_tool_calls, prompt_cache_key, safety_identifier;
- refused with a 400 that names them unless they hold their no-op value (a penalty of 0, no
  tools, a text response format, ...): honouring them would need what the engine does not do,
  and silently ignoring them would return something other than what was asked for.
Anything else is not an OpenAI parameter: a 400 names it, as OpenAI's own API does. The
request models declare every parameter, so the OpenAPI document describes the bodies exactly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tuneloop.server.api.deps import off_loop, require_content_type
from tuneloop.server.api.errors import ApiError, bad_request
from tuneloop.types.fields import parse_json

MAX_N = 128
MAX_TOP_LOGPROBS = 20
MAX_STOP = 4  # OpenAI's limit on stop sequences
# Prompts of one /completions request. Each is an engine request counted against the tenant's
# max_inflight; past this a batch belongs in several requests (OpenAI's own limit is 2048,
# for an API whose quota counts tokens, not requests).
MAX_PROMPTS = 256
# /completions without max_tokens writes this many, as OpenAI's legacy endpoint does.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def _no_tools(value: Any) -> bool:
    return value in (None, "none", "auto")


# Accepted only while the value is a no-op (None: not sent).
NO_OP: dict[str, Any] = {
    "frequency_penalty": lambda v: v in (None, 0),
    "presence_penalty": lambda v: v in (None, 0),
    "logit_bias": lambda v: not v,
    "tools": lambda v: not v,
    "functions": lambda v: not v,
    "tool_choice": _no_tools,
    "function_call": _no_tools,
    "response_format": lambda v: v is None or v.get("type") == "text",
    "modalities": lambda v: v in (None, ["text"]),
    "audio": lambda v: v is None,
    "prediction": lambda v: v is None,
    "reasoning_effort": lambda v: v is None,
    "verbosity": lambda v: v is None,
    "web_search_options": lambda v: v is None,
    "echo": lambda v: v in (None, False),
    "suffix": lambda v: v in (None, ""),
    "best_of": lambda v: v in (None, 1),
}
_Object = dict[str, Any]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool | None = None


class _Common(BaseModel):
    # Every OpenAI parameter is declared (so the OpenAPI document describes the body); anything
    # else is refused by name, as OpenAI's own API does.
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=1024)
    n: int | None = Field(default=None, ge=1, le=MAX_N)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)  # an extension many servers take
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # Ignored: they change no token.
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # Refused unless a no-op (NO_OP).
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    # What a reply carries when a client sends it back; refused unless empty (no tool calls).
    refusal: str | None = None
    tool_calls: list[_Object] | None = None
    tool_call_id: str | None = None
    function_call: _Object | None = None
    audio: _Object | None = None
    annotations: list[_Object] | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[_Object] | None = None
    functions: list[_Object] | None = None
    tool_choice: str | _Object | None = None
    function_call: str | _Object | None = None
    response_format: _Object | None = None
    modalities: list[str] | None = None
    audio: _Object | None = None
    prediction: _Object | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: _Object | None = None


class CompletionRequest(_Common):
    # A string, a list of strings, a list of token ids, or a list of token-id lists.
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


M = TypeVar("M", bound=BaseModel)
# Where pydantic names the branch of a union that failed ("prompt.list[int][0]"): not a field.
_UNION_BRANCH = re.compile(r"^(str|int|float|bool|list\[.*\]|dict\[.*\]|[A-Z][A-Za-z]*)$")


async def read_body(request: Request, model: type[M]) -> M:
    """Parse the JSON body; a 400 names the parameter as OpenAI's clients send it."""
    raw = await request.body()
    require_content_type(request, "application/json")
    try:
        parsed: M = await off_loop(len(raw), parse_json, model, raw or b"{}")
        return parsed
    except ValidationError as exc:
        first = exc.errors()[0]
        if first.get("type") == "json_invalid":
            raise bad_request(f"body is not valid JSON: {first.get('msg')}", "body") from None
        message = str(first.get("msg"))
        field = ""
        for part in first.get("loc", ()):
            if isinstance(part, int):
                field += f"[{part}]"
            elif not _UNION_BRANCH.match(part):
                field += f".{part}" if field else part
        field = field or "body"
        if first.get("type") == "extra_forbidden":
            message = "unrecognized request argument"
        raise bad_request(f"{field}: {message}", field) from None


@dataclass(frozen=True)
class Plan:
    """The checked sampling settings of one request (every prompt of it)."""

    n: int
    max_tokens: int | None  # None: up to the context length
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    logprobs: int | None  # None: none; k >= 0: the chosen token's, plus the top k
    stream: bool
    include_usage: bool


def check_no_ops(body: _Common) -> None:
    for name, is_no_op in NO_OP.items():
        if not is_no_op(getattr(body, name, None)):
            raise bad_request(f"{name}: not supported by this server", name)


def _stop(value: str | list[str] | None) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else list(value or [])
    if len(stops) > MAX_STOP:
        raise bad_request(f"stop: at most {MAX_STOP} sequences", "stop")
    if any(not s for s in stops):
        raise bad_request("stop: an empty stop sequence", "stop")
    return tuple(stops)


# Below this a temperature is greedy decoding (as vLLM takes it): dividing logits by 1e-300
# overflows to infinities.
GREEDY_BELOW = 1e-5


def _temperature(value: float | None) -> float:
    if value is None:
        return 1.0
    return 0.0 if value < GREEDY_BELOW else value


def _plan(body: _Common, max_tokens: int | None, logprobs: int | None) -> Plan:
    check_no_ops(body)
    if body.top_k == 0:
        raise bad_request("top_k: must be -1 (no limit) or >= 1", "top_k")
    stream = bool(body.stream)
    options = body.stream_options
    return Plan(
        n=body.n or 1,
        max_tokens=max_tokens,
        temperature=_temperature(body.temperature),
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=-1 if body.top_k is None else body.top_k,
        seed=body.seed,
        stop=_stop(body.stop),
        logprobs=logprobs,
        stream=stream,
        include_usage=bool(stream and options is not None and options.include_usage),
    )


def chat_plan(body: ChatCompletionRequest) -> Plan:
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs: needs logprobs set to true", "top_logprobs")
    max_tokens = body.max_completion_tokens or body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return _plan(body, max_tokens, logprobs)


def completion_plan(body: CompletionRequest) -> Plan:
    max_tokens = body.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS
    return _plan(body, max_tokens, body.logprobs)


def chat_messages(body: ChatCompletionRequest) -> list[dict[str, str]]:
    """The messages as the chat template takes them: role and text content."""
    out: list[dict[str, str]] = []
    for i, message in enumerate(body.messages):
        field = f"messages[{i}]"
        if message.role == "tool":
            raise bad_request(f"{field}.role: tool messages are not supported", f"{field}.role")
        # A client may send back a reply it got, with its empty fields (refusal, tool_calls).
        for name in ("tool_calls", "tool_call_id", "function_call", "audio", "refusal"):
            if getattr(message, name) not in (None, [], ""):
                raise bad_request(f"{field}.{name}: not supported", f"{field}.{name}")
        content = message.content
        if content is None:
            raise bad_request(f"{field}.content: required", f"{field}.content")
        text = content if isinstance(content, str) else "".join(part.text for part in content)
        # "developer" is OpenAI's newer name for the system role; templates know "system".
        role = "system" if message.role == "developer" else message.role
        entry = {"role": role, "content": text}
        if message.name is not None:
            entry["name"] = message.name
        out.append(entry)
    return out


def prompts_of(body: CompletionRequest) -> list[str | list[int]]:
    """Each prompt of a /completions request: text or token ids."""
    prompt = body.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt: must not be empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [[int(t) for t in prompt]]  # type: ignore[arg-type]
    if len(prompt) > MAX_PROMPTS:
        raise bad_request(
            f"prompt: {len(prompt)} prompts, at most {MAX_PROMPTS} per request", "prompt"
        )
    out: list[str | list[int]] = []
    for p in prompt:
        out.append(p if isinstance(p, str) else [int(t) for t in p])  # type: ignore[union-attr]
    return out


__all__ = [
    "MAX_PROMPTS",
    "ApiError",
    "ChatCompletionRequest",
    "CompletionRequest",
    "Plan",
    "chat_messages",
    "chat_plan",
    "completion_plan",
    "prompts_of",
]
