"""`tuneloop recipe NAME [--option value ...]`: each recipe's config fields as options."""

from __future__ import annotations

import typer

from tuneloop.recipes.chat_sft import ChatSFTConfig, run_chat_sft
from tuneloop.recipes.code_rl import CodeRLConfig, run_code_rl
from tuneloop.recipes.distill import DistillConfig, run_distill
from tuneloop.recipes.kto import KTOConfig, run_kto
from tuneloop.recipes.math_rl import MathRLConfig, run_math_rl
from tuneloop.recipes.run import command

# The --help line of each recipe's own fields (the shared ones are run.COMMON_HELP).
RL_HELP = {
    "problems_per_step": "Training problems per step (each sampled --group-size times).",
    "group_size": "Samples per problem; advantages are rewards minus the group's mean.",
    "max_tokens": "Most tokens sampled per reply.",
    "temperature": "Sampling temperature of the training samples (1: the policy as it is).",
    "loss": "Policy loss: stable_reinforce (samplers record what they draw, the server weighs "
    "against it), importance_sampling, ppo or cispo (the latter two clip the ratio).",
    "kl_coef": "Weight of a KL penalty against the base model, per token (0: off, no "
    "reference pass).",
    "max_staleness": "Optimizer steps a sample may lag behind the weights (>0: sample step k+1 "
    "while step k trains; older samples are dropped); 0: no overlap.",
    "sub_batch": "Datums per forward_backward request (a step's batch goes in several).",
    "max_turns": "Turns per episode (model reply, environment answer) before it ends.",
    "eval_problems": "Held-out problems per validation, answered greedy.",
}
CHAT_SFT_HELP = {
    "data": "Conversations: sharegpt (shipped offline), tulu3 or ultrachat (from the hub, "
    "needs `datasets`), or a path to a JSONL file of conversations.",
    "limit": "Most conversations read from --data.",
    "eval_fraction": "Share of the conversations held out for validation (0 to 1).",
    "eval_batches": "Held-out batches (of --batch-size conversations) per validation.",
    "batch_size": "Conversations per training step.",
    "max_length": "Tokens per conversation; longer ones are cut.",
}
MATH_RL_HELP = {
    **RL_HELP,
    "train_source": "Training problems: gsm_symbolic (reasoning-gym's generator) or gsm8k "
    "(the never-evaluated part of its test split).",
    "train_problems": "Distinct training problems, cycled through step by step.",
    "format_bonus": "Reward added for a reply that ends with the '#### N' line (0: none).",
}
CODE_RL_HELP = {
    **RL_HELP,
    "tool_mode": "env: the environment checks turn 1's code; model: only when the reply calls "
    "the check_solution tool.",
    "sandbox_url": "A SandboxFusion server to run code on; default: the local sandbox.",
    "timeout_s": "Seconds a solution may run in the sandbox before it is stopped.",
    "memory_mb": "Memory limit of a sandboxed solution, in MB.",
}
KTO_HELP = {
    "train_problems": "Training problems, each answered --samples times by the base model.",
    "eval_problems": "Held-out problems per validation, answered greedy.",
    "samples": "Base-model answers per training problem, each labelled by the verifier.",
    "batch_size": "Labelled examples per training step.",
    "beta": "KTO's beta: how sharply the loss saturates in the policy/reference log-ratio.",
    "desirable_weight": "KTO's lambda_D: weight of the desirable (right) examples' loss.",
    "undesirable_weight": "KTO's lambda_U: weight of the undesirable (wrong) examples' loss.",
}
DISTILL_HELP = {
    "teacher": "The teacher: a base model name or a tinker:// checkpoint, with the student's "
    "tokenizer.",
    "prompts_per_step": "Training prompts per step (each sampled --group-size times).",
    "group_size": "Student samples per prompt.",
    "max_tokens": "Most tokens sampled per student reply.",
    "temperature": "Sampling temperature of the student's samples.",
    "kl_coef": "Scale of the per-token advantage, teacher minus student logprob.",
    "loss": "Policy loss: importance_sampling, ppo or cispo.",
    "sub_batch": "Datums per forward_backward request (a step's batch goes in several).",
    "train_prompts": "Distinct training prompts, cycled through step by step.",
    "eval_prompts": "Held-out prompts per validation.",
    "eval_samples": "Student samples per held-out prompt (more: a less noisy KL estimate).",
}


def recipe_app() -> typer.Typer:
    app = typer.Typer(
        help="Training recipes on the public SDK (they run against any server; with no "
        "--base-url a local one is started for the run).",
        no_args_is_help=True,
    )
    app.command("chat-sft")(
        command(
            ChatSFTConfig,
            run_chat_sft,
            "Supervised fine-tuning on chat conversations.",
            CHAT_SFT_HELP,
        )
    )
    app.command("math-rl")(
        command(
            MathRLConfig,
            run_math_rl,
            "GRPO on grade-school math, evaluated on GSM8K.",
            MATH_RL_HELP,
        )
    )
    app.command("code-rl")(
        command(
            CodeRLConfig,
            run_code_rl,
            "RL on HumanEval with a code sandbox, two turns.",
            CODE_RL_HELP,
        )
    )
    app.command("kto")(
        command(
            KTOConfig,
            run_kto,
            "KTO from the model's own answers labelled by a verifier.",
            KTO_HELP,
        )
    )
    app.command("distill")(
        command(
            DistillConfig,
            run_distill,
            "On-policy distillation from a teacher (reverse-KL per-token advantages).",
            DISTILL_HELP,
        )
    )
    return app
