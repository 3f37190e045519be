"""`tuneloop recipe NAME [--option value ...]`: each recipe's config fields as options."""

from __future__ import annotations

import typer

from tuneloop.recipes.chat_sft import ChatSFTConfig, run_chat_sft
from tuneloop.recipes.code_rl import CodeRLConfig, run_code_rl
from tuneloop.recipes.distill import DistillConfig, run_distill
from tuneloop.recipes.kto import KTOConfig, run_kto
from tuneloop.recipes.math_rl import MathRLConfig, run_math_rl
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
    app.command("math-rl")(
        command(MathRLConfig, run_math_rl, "GRPO on grade-school math, evaluated on GSM8K.")
    )
    app.command("code-rl")(
        command(CodeRLConfig, run_code_rl, "RL on HumanEval with a code sandbox, two turns.")
    )
    app.command("kto")(
        command(KTOConfig, run_kto, "KTO from the model's own answers labelled by a verifier.")
    )
    app.command("distill")(
        command(
            DistillConfig,
            run_distill,
            "On-policy distillation from a teacher (reverse-KL per-token advantages).",
        )
    )
    return app
