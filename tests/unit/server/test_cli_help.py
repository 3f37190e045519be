"""Every option and argument of every `tuneloop` command (server commands, demo, recipes) has a
help line that says what it does, not only its name, and names its unit when its name has one.

Walks the click command tree typer builds, so a new option without help fails here.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import typer

from tuneloop.cli import build_app

# Words that carry no meaning of their own in a help line.
_FILLER = frozenset({"the", "a", "an", "of", "to", "in", "for", "and", "or", "on", "is", "its"})
# A name suffix -> what its help must mention (the unit).
_UNITS = {"_s": re.compile(r"\bseconds?\b", re.IGNORECASE), "_mb": re.compile(r"\bMB\b")}


def _commands(command: Any, path: tuple[str, ...]) -> Iterator[tuple[str, Any]]:
    yield " ".join(path), command
    for name, sub in sorted(getattr(command, "commands", {}).items()):
        yield from _commands(sub, (*path, name))


def _parameters() -> list[tuple[str, Any]]:
    root = typer.main.get_command(build_app())
    return [
        (f"{where} {param.name}", param)
        for where, command in _commands(root, ("tuneloop",))
        for param in command.params
    ]


PARAMETERS = _parameters()


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", text.lower()))


def test_the_walk_reaches_every_command_group() -> None:
    names = {name.rsplit(" ", 1)[0] for name, _ in PARAMETERS}
    for expected in (
        "tuneloop serve",
        "tuneloop deploy",
        "tuneloop usage",
        "tuneloop demo",
        "tuneloop keys create",
        "tuneloop checkpoints export",
        "tuneloop recipe chat-sft",
        "tuneloop recipe math-rl",
        "tuneloop recipe code-rl",
        "tuneloop recipe kto",
        "tuneloop recipe distill",
    ):
        assert expected in names
    assert len(PARAMETERS) > 150


@pytest.mark.parametrize(("name", "param"), PARAMETERS, ids=[n for n, _ in PARAMETERS])
def test_every_option_has_a_help_line_that_says_more_than_its_name(name: str, param: Any) -> None:
    text = (getattr(param, "help", None) or "").strip()
    assert text, f"{name} has no help"
    assert "\n" not in text, f"{name}: the help is one line"
    said = _words(text) - _words(param.name.replace("_", " ")) - _FILLER
    assert len(said) >= 2, f"{name}: {text!r} only repeats the option's name"
    for suffix, unit in _UNITS.items():
        if param.name.endswith(suffix):
            assert unit.search(text), f"{name}: {text!r} does not name its unit"


def test_recipe_commands_refuse_a_field_without_help() -> None:
    from dataclasses import dataclass

    from tuneloop.recipes.run import RecipeConfig, command

    @dataclass
    class Odd(RecipeConfig):
        undocumented: int = 1

    with pytest.raises(TypeError, match=r"Odd\.undocumented needs a help line"):
        command(Odd, lambda _config: None, "odd")
    documented = command(Odd, lambda _config: None, "odd", {"undocumented": "Counts nothing."})
    assert documented.__doc__ == "odd"
