"""OpenAI's response, chunk and logprob objects, and server-sent-event framing."""

from __future__ import annotations

import json
from typing import Any

from tuneloop.server.api.oai.text import ChoiceText, ModelText


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


DONE = sse("[DONE]")


def _entry(model: ModelText, token: int, logprob: float) -> dict[str, Any]:
    text = model.token_text(token)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(choice: ChoiceText, start: int, end: int) -> dict[str, Any]:
    """`choices[i].logprobs` of a chat completion for the choice's tokens [start, end)."""
    content = []
    for i in range(start, end):
        entry = _entry(choice.model, choice.tokens[i], choice.logprobs[i])
        entry["top_logprobs"] = [_entry(choice.model, t, lp) for t, lp in choice.topk[i] or []]
        content.append(entry)
    return {"content": content, "refusal": None}


def completion_logprobs(choice: ChoiceText, start: int, end: int) -> dict[str, Any]:
    """`choices[i].logprobs` of a (legacy) completion for the choice's tokens [start, end)."""
    model = choice.model
    top: list[dict[str, float]] = []
    for i in range(start, end):
        # Keyed by text, which two tokens may share (bytes of one character): keep the likelier.
        row: dict[str, float] = {}
        for t, lp in choice.topk[i] or []:
            row.setdefault(model.token_text(t), lp)
        top.append(row)
    return {
        "tokens": [model.token_text(t) for t in choice.tokens[start:end]],
        "token_logprobs": choice.logprobs[start:end],
        "top_logprobs": top,
        "text_offset": choice.offsets[start:end],
    }


def chat_choice(
    index: int, choice: ChoiceText, finish_reason: str, logprobs: bool
) -> dict[str, Any]:
    return {
        "index": index,
        "message": {"role": "assistant", "content": choice.reply, "refusal": None},
        "logprobs": chat_logprobs(choice, 0, choice.kept_tokens()) if logprobs else None,
        "finish_reason": finish_reason,
    }


def completion_choice(
    index: int, choice: ChoiceText, finish_reason: str, logprobs: bool
) -> dict[str, Any]:
    return {
        "index": index,
        "text": choice.reply,
        "logprobs": completion_logprobs(choice, 0, choice.kept_tokens()) if logprobs else None,
        "finish_reason": finish_reason,
    }


def chat_delta(
    index: int,
    text: str | None,
    choice: ChoiceText | None = None,
    span: tuple[int, int] = (0, 0),
    finish_reason: str | None = None,
    role: bool = False,
) -> dict[str, Any]:
    """One choice of a chat.completion.chunk: new text (and its tokens' logprobs if `choice`)."""
    delta: dict[str, Any] = {"role": "assistant"} if role else {}
    if text is not None:
        delta["content"] = text
    return {
        "index": index,
        "delta": delta,
        "logprobs": chat_logprobs(choice, *span) if choice is not None else None,
        "finish_reason": finish_reason,
    }


def completion_delta(
    index: int,
    text: str,
    choice: ChoiceText | None = None,
    span: tuple[int, int] = (0, 0),
    finish_reason: str | None = None,
) -> dict[str, Any]:
    return {
        "index": index,
        "text": text,
        "logprobs": completion_logprobs(choice, *span) if choice is not None else None,
        "finish_reason": finish_reason,
    }
