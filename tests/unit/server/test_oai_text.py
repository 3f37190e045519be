"""Replies as tokens arrive: text per token (characters split across tokens), the cut at stop
sequences, the logprobs kept, and what streaming may hand out before a stop could begin."""

from __future__ import annotations

import pytest

from tuneloop.server.api.oai.text import ChoiceText, Detokenizer, ModelText
from tuneloop.server.engine.fake import FakeBackend


@pytest.fixture(scope="module")
def text() -> ModelText:
    return ModelText.load(FakeBackend().models()[0])


def _choice(text: ModelText, stops: tuple[str, ...] = (), reply: str = "") -> ChoiceText:
    choice = ChoiceText(text, stops, text.eos_ids)
    for i, token in enumerate(text.encode(reply)):
        choice.push(token, -float(i), None)
    return choice


def test_a_character_split_across_tokens_comes_with_its_last_byte(text: ModelText) -> None:
    ids = text.encode("aé!")
    assert len(ids) == 4  # é is two bytes, two tokens
    detok = Detokenizer(text)
    assert [detok.push(t) for t in ids] == ["a", "", "é", "!"]
    # A character never completed comes out at the end as the replacement character.
    cut = Detokenizer(text)
    assert [cut.push(t) for t in ids[:2]] == ["a", ""]
    assert cut.flush() == "\ufffd"


def test_the_end_of_turn_token_is_no_text(text: ModelText) -> None:
    choice = _choice(text, reply="hi")
    choice.push(text.eos_ids[0], -0.1, None)
    assert choice.reply == "hi"
    assert choice.tokens == text.encode("hi")
    assert choice.seen == 3


def test_a_stop_sequence_cuts_the_reply_and_the_logprobs(text: ModelText) -> None:
    choice = _choice(text, ("ab", "zz"), "xyab more")
    assert choice.reply == "xy"
    assert choice.kept_tokens() == 2
    assert choice.logprobs[:2] == [0.0, -1.0]
    # Only the first occurrence of any stop counts, also one that spans tokens.
    assert _choice(text, ("b c", "a"), "xb cya").reply == "x"


def test_streaming_holds_back_what_may_begin_a_stop(text: ModelText) -> None:
    choice = ChoiceText(text, ("abc",), text.eos_ids)
    handed: list[tuple[str, int, int]] = []
    for token in text.encode("xab"):
        choice.push(token, -1.0, None)
        handed.append(choice.release(final=False))
    assert "".join(h[0] for h in handed) == "x"  # "ab" may be the start of "abc"
    choice.push(text.encode("d")[0], -1.0, None)
    assert choice.release(final=False) == ("a", 1, 2)  # tokens [1, 2): "a" is safe now
    assert choice.release(final=True) == ("bd", 2, 4)
    # A stop that completes: what was held back is dropped, nothing after is handed out.
    stopped = ChoiceText(text, ("abc",), text.eos_ids)
    out = ""
    for token in text.encode("xxabcyy"):
        stopped.push(token, -1.0, None)
        out += stopped.release(final=False)[0]
    out += stopped.release(final=True)[0]
    assert out == "xx" == stopped.reply
    assert stopped.released == 2


def test_without_stops_every_complete_token_is_handed_out_at_once(text: ModelText) -> None:
    choice = ChoiceText(text, (), text.eos_ids)
    pieces = []
    for token in text.encode("aé"):
        choice.push(token, -1.0, None)
        pieces.append(choice.release(final=False))
    assert pieces == [("a", 0, 1), ("", 1, 2), ("é", 2, 3)]
