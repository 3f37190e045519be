"""Conversations -> tokens with per-token loss weights, and generation prompts.

A renderer turns a list of messages (`{"role": ..., "content": ...}`) into the tokens the model
sees and a weight per token: 1 on the assistant's tokens (its reply and its end-of-turn marker,
so it learns to stop), 0 on everything else, so supervised training never teaches the model to
write the user's or the system's text. The same renderer gives the generation prompt for
sampling and parses a sampled reply back, so training and sampling agree token for token.

`ChatTemplateRenderer` uses the model's own chat template (the tokenizer's). It renders the
conversation text up to each assistant turn and checks that every prefix extends the previous
one; a template that rewrites earlier turns (e.g. one that drops old reasoning) fails loudly
instead of training on tokens the model never sees at sampling time. Each piece of text between
two turn boundaries is tokenized on its own, and the generation prompt is built from the same
pieces, so the tokens of a prompt are exactly those of the training sequence's prefix.
`PlainRenderer` is the fallback for tokenizers without a template: `role: content` lines.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from tuneloop import Datum, ModelInput, TensorData

Message = dict[str, str]
ROLES = ("system", "user", "assistant", "tool")


class TemplateError(ValueError):
    """The chat template cannot be used to train on this conversation."""


@dataclass(frozen=True)
class Rendered:
    tokens: list[int]
    weights: list[float]  # one per token: 1.0 where the loss trains

    def datum(self) -> Datum:
        """A `cross_entropy` datum: input = tokens[:-1], target = tokens[1:], weighted."""
        if len(self.tokens) < 2:
            raise ValueError("a training sequence needs at least two tokens")
        return Datum(
            model_input=ModelInput.from_ints(self.tokens[:-1]),
            loss_fn_inputs={
                "target_tokens": TensorData.from_numpy(np.array(self.tokens[1:], dtype=np.int64)),
                "weights": TensorData.from_numpy(np.array(self.weights[1:], dtype=np.float32)),
            },
        )

    @property
    def trained_tokens(self) -> int:
        return int(sum(1 for w in self.weights[1:] if w > 0))


class Renderer(Protocol):
    def supervised(self, messages: Sequence[Message]) -> Rendered: ...

    def prompt(self, messages: Sequence[Message]) -> list[int]: ...

    def parse(self, tokens: Sequence[int]) -> str: ...

    @property
    def stop(self) -> list[str]: ...


def _check(messages: Sequence[Message]) -> None:
    if not messages:
        raise ValueError("a conversation needs at least one message")
    for i, m in enumerate(messages):
        if m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ValueError(
                f"message {i}: needs 'role' in {ROLES} and a string 'content', got {m!r}"
            )


class ChatTemplateRenderer:
    """The tokenizer's own chat template (Jinja, as `transformers` applies it)."""

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError("the tokenizer has no chat template: use PlainRenderer")
        self.tokenizer = tokenizer
        self._end = self._end_marker()

    def _text(self, messages: Sequence[Message], generation_prompt: bool) -> str:
        return str(
            self.tokenizer.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=generation_prompt
            )
        )

    def _encode(self, text: str) -> list[int]:
        # The template writes every special marker itself; the tokenizer must add none.
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]

    def _end_marker(self) -> str:
        """What the template writes after an assistant reply (e.g. "<|im_end|>\\n")."""
        probe = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"}]
        head = self._text(probe[:1], True)
        full = self._text(probe, False)
        if not full.startswith(head) or "2" not in full[len(head) :]:
            raise TemplateError("the chat template does not append replies after its prompt")
        return full[len(head) :].split("2", 1)[1]

    def _pieces(
        self, messages: Sequence[Message], generation_prompt: bool
    ) -> list[tuple[str, bool]]:
        """The conversation's text cut at turn boundaries: (text, trained) pieces."""
        _check(messages)
        pieces: list[tuple[str, bool]] = []
        done = ""
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self._text(messages[:i], True)
            after = self._text(messages[: i + 1], False)
            for prefix, text in ((done, before), (before, after)):
                if not text.startswith(prefix):
                    raise TemplateError(
                        f"the chat template rewrites earlier turns at message {i}: the "
                        "conversation cannot be trained turn by turn with it"
                    )
            pieces.append((before[len(done) :], False))
            pieces.append((after[len(before) :], True))
            done = after
        final = self._text(messages, generation_prompt)
        if not final.startswith(done):
            raise TemplateError("the chat template's full rendering differs from its turns")
        if final[len(done) :]:
            pieces.append((final[len(done) :], False))
        return [(text, trained) for text, trained in pieces if text]

    def supervised(self, messages: Sequence[Message]) -> Rendered:
        tokens: list[int] = []
        weights: list[float] = []
        for text, trained in self._pieces(messages, False):
            ids = self._encode(text)
            tokens += ids
            weights += [1.0 if trained else 0.0] * len(ids)
        return Rendered(tokens, weights)

    def prompt(self, messages: Sequence[Message]) -> list[int]:
        """Tokens of the conversation followed by the assistant's turn header."""
        if messages and messages[-1]["role"] == "assistant":
            raise ValueError(
                "the generation prompt ends with the assistant to answer, not its reply"
            )
        return [t for text, _ in self._pieces(messages, True) for t in self._encode(text)]

    def parse(self, tokens: Sequence[int]) -> str:
        text = str(self.tokenizer.decode(list(tokens), skip_special_tokens=False))
        marker = self._end.strip()
        if marker and marker in text:
            text = text.split(marker, 1)[0]
        eos = getattr(self.tokenizer, "eos_token", None)
        if eos and eos in text:
            text = text.split(eos, 1)[0]
        return text

    @property
    def stop(self) -> list[str]:
        return [self._end.strip()] if self._end.strip() else []


class PlainRenderer:
    """`role: content` lines; the reply ends with a blank line. For templateless tokenizers."""

    END = "\n\n"

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def _encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]

    def supervised(self, messages: Sequence[Message]) -> Rendered:
        _check(messages)
        tokens: list[int] = []
        weights: list[float] = []
        for m in messages:
            head = self._encode(f"{m['role']}:")
            body = self._encode(f" {m['content']}{self.END}")
            trained = 1.0 if m["role"] == "assistant" else 0.0
            tokens += head + body
            weights += [0.0] * len(head) + [trained] * len(body)
        return Rendered(tokens, weights)

    def prompt(self, messages: Sequence[Message]) -> list[int]:
        if messages and messages[-1]["role"] == "assistant":
            raise ValueError(
                "the generation prompt ends with the assistant to answer, not its reply"
            )
        return self.supervised(messages).tokens + self._encode("assistant:")

    def parse(self, tokens: Sequence[int]) -> str:
        text = str(self.tokenizer.decode(list(tokens), skip_special_tokens=True))
        return text.split(self.END, 1)[0].strip()

    @property
    def stop(self) -> list[str]:
        return [self.END]


def renderer_for(tokenizer: Any) -> ChatTemplateRenderer | PlainRenderer:
    """The model's own template when it has one, else the plain fallback."""
    if getattr(tokenizer, "chat_template", None):
        return ChatTemplateRenderer(tokenizer)
    return PlainRenderer(tokenizer)
