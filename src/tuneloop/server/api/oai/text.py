"""A served model's tokenizer seen from the OpenAI routes: chat template, encode, decode.

The tokenizer files are the model's own (ModelSpec.tokenizer_dir), loaded with transformers
once per model. Chat prompts are the template's rendering with the generation prompt; sampling
stops at the template's end-of-turn token and at the end-of-sequence token.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tuneloop.server.api.errors import bad_request
from tuneloop.server.engine.types import ModelSpec

log = logging.getLogger(__name__)

_loaded: dict[str, ModelText] = {}


@dataclass
class ModelText:
    spec: ModelSpec
    tokenizer: Any
    eos_ids: tuple[int, ...] = ()  # end of sequence (/completions stops there)
    turn_ids: tuple[int, ...] = ()  # and the template's end of turn (chat stops at either)
    _token_text: dict[int, str] = field(default_factory=dict)

    @classmethod
    def load(cls, spec: ModelSpec) -> ModelText:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(spec.tokenizer_dir), local_files_only=True)
        text = cls(spec, tokenizer)
        eos = {spec.eos_token_id}
        if isinstance(tokenizer.eos_token_id, int):
            eos.add(tokenizer.eos_token_id)
        text.eos_ids = tuple(sorted(eos))
        text.turn_ids = tuple(sorted(eos | text._end_of_turn()))
        return text

    def _end_of_turn(self) -> set[int]:
        """The token the chat template closes an assistant turn with, if it is one token."""
        ids: set[int] = set()
        if getattr(self.tokenizer, "chat_template", None):
            try:
                probe = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"}]
                head = self.render_text(probe[:1])
                full = self._apply(probe, generation_prompt=False)
                marker = full[len(head) :].split("2", 1)[1].strip() if full.startswith(head) else ""
                end = self.encode(marker) if marker else []
                if len(end) == 1:  # e.g. <|im_end|>; a multi-token marker is no stop token
                    ids.add(end[0])
            except Exception:  # an unusual template: end of sequence must do
                log.info("no end-of-turn token found in %s's chat template", self.spec.name)
        return ids

    def _apply(self, messages: Sequence[dict[str, str]], *, generation_prompt: bool) -> str:
        return str(
            self.tokenizer.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=generation_prompt
            )
        )

    def render_text(self, messages: Sequence[dict[str, str]]) -> str:
        return self._apply(messages, generation_prompt=True)

    def chat_prompt(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """The conversation rendered by the model's template, ready for the reply."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise bad_request(
                f"messages: model {self.spec.name!r} has no chat template; use /completions",
                "messages",
            )
        try:
            text = self.render_text(messages)
        except Exception as exc:  # the template's own checks (jinja2 TemplateError and others)
            raise bad_request(
                f"messages: the chat template refused them: {exc}", "messages"
            ) from None
        # The template writes every special marker itself: the tokenizer must add none.
        return self.encode(text)

    def encode(self, text: str, *, special: bool = False) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=special)]

    def decode(self, tokens: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(tokens), skip_special_tokens=True))

    def token_text(self, token: int) -> str:
        """One token's own text (for logprobs), special tokens included."""
        text = self._token_text.get(token)
        if text is None:
            text = str(self.tokenizer.decode([token], skip_special_tokens=False))
            self._token_text[token] = text
        return text


async def model_text(spec: ModelSpec) -> ModelText:
    """The model's tokenizer, loaded once (on a worker thread: it reads files)."""
    key = f"{spec.name}\0{spec.tokenizer_dir}"
    text = _loaded.get(key)
    if text is None:
        text = await asyncio.to_thread(ModelText.load, spec)
        _loaded[key] = text
    return text


class Detokenizer:
    """Text of a growing token sequence, one token at a time, in O(1) decodes per token.

    Each token's text is the difference between decoding a short window ending with it and the
    same window without it (so tokenizers that drop a word's leading space when it starts a
    decode still get it right). A token that ends inside a UTF-8 character yields "" and the
    character comes with the token that completes it.
    """

    def __init__(self, text: ModelText) -> None:
        self.text = text
        self.tokens: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # tokens whose text was given out

    def push(self, token: int) -> str:
        self.tokens.append(token)
        before = self.text.decode(self.tokens[self._prefix : self._read])
        after = self.text.decode(self.tokens[self._prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # nothing yet, or half a character: wait for the rest
        self._prefix, self._read = self._read, len(self.tokens)
        return after[len(before) :]

    def flush(self) -> str:
        """At the end: whatever text is still held back (a character its bytes never completed
        comes out as U+FFFD, as a whole decode gives it)."""
        before = self.text.decode(self.tokens[self._prefix : self._read])
        after = self.text.decode(self.tokens[self._prefix :])
        self._prefix = self._read = len(self.tokens)
        return after[len(before) :] if len(after) > len(before) else ""


@dataclass
class ChoiceText:
    """One choice's reply as tokens arrive: its text, the offset where each token's text starts,
    and the cut at the first stop sequence (which is not part of the reply)."""

    model: ModelText
    stops: tuple[str, ...]
    stop_ids: tuple[int, ...]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    topk: list[list[tuple[int, float]] | None] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    text: str = ""
    stopped_at: int | None = None  # the cut, once a stop sequence appeared
    released: int = 0  # tokens handed out (streaming)
    sent: int = 0  # characters handed out (streaming)
    detok: Detokenizer | None = None
    seen: int = 0  # tokens pushed, stop tokens included

    def push(self, token: int, logprob: float, topk: list[tuple[int, float]] | None) -> None:
        self.seen += 1
        if self.stopped_at is not None or token in self.stop_ids:
            return  # past the end: a stop token ends the reply and is not part of it
        if self.detok is None:
            self.detok = Detokenizer(self.model)
        self.tokens.append(token)
        self.logprobs.append(logprob)
        self.topk.append(topk)
        self.offsets.append(len(self.text))
        self.text += self.detok.push(token)
        self._find_stop(self.offsets[-1])

    def finish(self) -> None:
        """No more tokens: take in any text still held back."""
        if self.detok is not None and self.stopped_at is None:
            since = len(self.text)
            self.text += self.detok.flush()
            self._find_stop(since)

    def _find_stop(self, since: int) -> None:
        """A stop sequence ending in the text added since `since` (earlier text was searched)."""
        if not self.stops:
            return
        start = max(0, since - max(len(s) for s in self.stops))
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            self.stopped_at = min(hits)

    @property
    def reply(self) -> str:
        return self.text if self.stopped_at is None else self.text[: self.stopped_at]

    def kept_tokens(self) -> int:
        """Tokens whose text starts inside the reply (what logprobs report)."""
        if self.stopped_at is None:
            return len(self.tokens)
        return sum(1 for offset in self.offsets if offset < self.stopped_at)

    def release(self, final: bool) -> tuple[str, int, int]:
        """For streaming: (new text, first token, end token) safe to hand out now. Text that may
        still turn out to begin a stop sequence is held back until it cannot."""
        if final or self.stopped_at is not None:
            limit = len(self.reply)
            end = self.kept_tokens()
        else:
            hold = max((len(s) - 1 for s in self.stops), default=0)
            limit = len(self.text) - hold
            end = self.released
            while end < len(self.tokens) and self._token_end(end) <= limit:
                end += 1
            limit = self._token_end(end - 1) if end > self.released else self.sent
        start = self.released
        new = self.reply[self.sent : limit] if limit > self.sent else ""
        self.sent = max(self.sent, limit)
        self.released = max(self.released, end)
        return new, start, self.released

    def _token_end(self, index: int) -> int:
        if index < 0:
            return 0
        if index + 1 < len(self.offsets):
            return self.offsets[index + 1]
        return len(self.text)
