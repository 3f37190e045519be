"""`tuneloop recipe NAME [--option value ...]`: each recipe's config fields as options."""

from __future__ import annotations

import typer

from tuneloop.recipes.chat_sft import ChatSFTConfig, run_chat_sft
from tuneloop.recipes.run import command


def recipe_app() -> typer.Typer:
    app = typer.Typer(
        help="Training recipes on the public SDK (they run against any server; with no "
        "--base-url a local one is started for the run).",
        no_args_is_help=True,
    )
    app.command("chat-sft")(
        command(ChatSFTConfig, run_chat_sft, "Supervised fine-tuning on chat conversations.")
    )
    return app
