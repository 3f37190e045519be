"""`code_rl`: RL on HumanEval with the answers run in a sandbox; two turns with a check tool.

The model gets the function to complete and answers with a Python code block. With
`--tool-mode env` (the default: a small model does not call tools reliably) the environment runs
turn 1's code against the problem's tests through the `check_solution` tool; with
`--tool-mode model` the prompt offers the tool and it runs only when the reply calls it (a
`<tool_call>` naming `check_solution`, or a line `check_solution()`); a reply without the call is
the final answer. Either way, passing ends the episode with reward 1; otherwise the tool's report
(the failing assertion or the error, cut short) comes back as a `tool` message and the model may
revise once. The final answer's reward: 1 if all tests pass, else 0, minus 0.1
when it has no code block. Code runs in the local sandbox (recipes/sandbox.py: its own process,
temp dir, time and memory limits, no network) or, with `--sandbox-url`, on a SandboxFusion
server. Sampling overlaps training (`--max-staleness 3` by default: samples up to 3 optimizer
steps old are kept, the `cispo` loss corrects for their age), and gradients go in sub-batches.

    tuneloop recipe code-rl --steps 10 --log-dir runs/code
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from tuneloop.recipes import rl
from tuneloop.recipes.datasets import CodeProblem, humaneval, split
from tuneloop.recipes.rl_train import RLConfig, train_rl
from tuneloop.recipes.run import started
from tuneloop.recipes.sandbox import NO_CODE_PENALTY, CodeRunner, extract_code, run_python

PROMPT = (
    "Complete this Python function. Reply with the whole function in one ```python code block."
    "\n\n```python\n{prompt}```"
)
TOOL_PROMPT = (
    "\n\nYou may test your function before you commit to it: end your reply with "
    '<tool_call>{"name": "check_solution"}</tool_call> to run it against the unit tests and see '
    "the results. A reply without that call is your final answer."
)
# The Hermes/Qwen tool-call form naming the tool, or the tool written as a bare call on its line.
TOOL_CALL = re.compile(
    r"<tool_call>[^<]*\bcheck_solution\b[^<]*</tool_call>|^\s*check_solution\(\)\s*$", re.M
)
REPORT_CHARS = 600


@dataclass
class CodeRLConfig(RLConfig):
    log_dir: str = "runs/code_rl"
    loss: str = "cispo"
    max_staleness: int = 3
    max_turns: int = 2
    # env: the environment checks turn 1's answer; model: only when the reply calls the tool.
    tool_mode: Literal["env", "model"] = "env"
    max_tokens: int = 384
    eval_problems: int = 32
    sandbox_url: str | None = None  # a SandboxFusion server; default: the local sandbox
    timeout_s: float = 10.0
    memory_mb: int = 512


class CodeEnv:
    def __init__(self, problem: CodeProblem, runner: CodeRunner, config: CodeRLConfig) -> None:
        self.problem, self.runner, self.config = problem, runner, config

    def initial(self) -> list[dict[str, str]]:
        content = PROMPT.format(prompt=self.problem.prompt)
        if self.config.tool_mode == "model" and self.config.max_turns > 1:
            content += TOOL_PROMPT
        return [{"role": "user", "content": content}]

    def _may_revise(self, reply: str, turn: int) -> bool:
        if turn + 1 >= self.config.max_turns:
            return False  # the last turn's answer is final whatever it asks for
        return self.config.tool_mode == "env" or TOOL_CALL.search(reply) is not None

    def judge(self, reply: str, turn: int) -> rl.Judgement:
        code = extract_code(reply)
        if code is None:
            metrics = {"passed": 0.0, "has_code": 0.0, "turns": turn + 1.0}
            return rl.Judgement(-NO_CODE_PENALTY, done=True, metrics=metrics)
        # HumanEval's prompt holds imports the body may need; a full function redefines it.
        result = self.runner(
            f"{self.problem.prompt}\n    pass\n\n{code}\n",
            self.problem.tests,
            timeout_s=self.config.timeout_s,
            memory_mb=self.config.memory_mb,
        )
        metrics = {"passed": float(result.passed), "has_code": 1.0, "turns": turn + 1.0}
        if result.passed or not self._may_revise(reply, turn):
            return rl.Judgement(float(result.passed), done=True, metrics=metrics)
        report = (result.stderr or result.details or result.status)[-REPORT_CHARS:]
        follow_up = [
            {
                "role": "tool",
                "content": f"check_solution: {result.status}\n{report}\nFix the code and reply "
                "with the whole function again.",
            }
        ]
        return rl.Judgement(0.0, done=False, follow_up=follow_up, metrics=metrics)


def _runner(config: CodeRLConfig) -> CodeRunner:
    if config.sandbox_url:
        from tuneloop.recipes.sandbox_fusion import SandboxFusionClient

        return SandboxFusionClient(config.sandbox_url).run_python
    return run_python


def run_code_rl(config: CodeRLConfig) -> dict[str, Any]:
    with started(config) as session:
        train, held = split(humaneval(), 0.2, key=lambda p: p.task_id, salt="code_rl")
        evaluation = held[: config.eval_problems]
        runner = _runner(config)
        session.run.console.print(
            f"code_rl: {len(train)} training / {len(evaluation)} held-out problems"
        )
        return train_rl(
            config,
            session,
            train,
            evaluation,
            lambda p, n: [CodeEnv(p, runner, config) for _ in range(n)],
        )
