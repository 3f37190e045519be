"""`tuneloop demo`: reinforcement learning on a real model, on a laptop's CPU, in minutes.

The loop below is plain Python against the public SDK, the same code a user writes: sample on
the server, score here, `forward_backward` with the `importance_sampling` loss, `optim_step`,
take a sampler of the new weights, repeat. With no `--base-url` the SDK starts a local server
(CPU or GPU) for the run and stops it at the end.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

import tuneloop
from tuneloop import SamplingParams
from tuneloop.recipes import grpo
from tuneloop.recipes.report import (
    MetricsLog,
    StepRecord,
    before_after_table,
    plot,
    step_line,
    usage_table,
)
from tuneloop.recipes.tasks import Task

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
TASK_NAME = "chain_sum"


def _home() -> Path:
    home = os.environ.get("TUNELOOP_HOME")
    return Path(home).expanduser() if home else Path.home() / ".tuneloop"


def default_out() -> Path:
    """$TUNELOOP_HOME/demo, else ~/.tuneloop/demo: beside the local server's data, and never
    inside the user's checkout."""
    return _home() / "demo"


def console_hint(base_url: str, started_locally: bool) -> str:
    """Where to watch the run live: the server's web console, and the key to sign in with."""
    key = (
        f"the key in {_home() / 'embedded' / 'local-api-key'}"
        if started_locally
        else "your API key ($TUNELOOP_API_KEY)"
    )
    return f"watch it live at {base_url}/console (sign in with {key})"


def _wait_for_ctrl_c() -> None:
    while True:
        time.sleep(3600)


def _serve_until_interrupted(base_url: str, console: Console) -> None:
    console.print(f"the server stays up at {base_url}/console; Ctrl-C stops it")
    try:
        _wait_for_ctrl_c()
    except KeyboardInterrupt:
        console.print("stopping the server")


@dataclass
class DemoConfig:
    seed: int = 0
    steps: int = 10
    group_size: int = 8  # samples per problem; advantages are relative within a group
    problems: int = 8  # problems per step
    eval_problems: int = 50
    model: str = DEFAULT_MODEL
    out: Path = field(default_factory=default_out)
    base_url: str | None = None
    api_key: str | None = None
    learning_rate: float = 5e-4
    lora_rank: int = 16
    temperature: float = 1.0  # the sampler's logprobs are for T=1, which the loss assumes
    eval_every: int = 0  # also evaluate held-out accuracy every N steps (0: only at the end)
    keep_serving: bool = False  # leave the local server up after the run, until Ctrl-C


@dataclass
class DemoResult:
    config: DemoConfig
    before: grpo.EvalResult
    after: grpo.EvalResult
    steps: list[StepRecord]
    metrics_path: Path
    plot_path: Path
    state_path: str
    sampler_path: str
    usage: dict[str, Any]
    usage_source: str  # "server" (metered by the server) or "client" (counted by this loop)
    seconds: dict[str, float] = field(default_factory=dict)


@dataclass
class _Counts:
    """Tokens this loop sent and received, for when the server has no usage endpoint."""

    prompt_tokens_sampled: int = 0
    tokens_sampled: int = 0
    tokens_trained: int = 0

    def add_eval(self, result: grpo.EvalResult) -> None:
        self.prompt_tokens_sampled += result.prompt_tokens
        self.tokens_sampled += result.tokens_sampled


def _progress(console: Console) -> Progress:
    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )


def _server_usage(service: tuneloop.ServiceClient, console: Console) -> dict[str, Any] | None:
    """The server's metered usage for this session, on servers and SDKs that have it."""
    get_usage = getattr(service, "get_usage", None)
    if get_usage is None:
        return None
    try:
        usage = get_usage()
    except tuneloop.APIError as exc:  # an older server: this loop's own counts will do
        console.print(f"the server reports no usage ({exc}); showing this loop's counts")
        return None
    if hasattr(usage, "result"):  # a future
        usage = usage.result()
    if hasattr(usage, "model_dump"):
        usage = usage.model_dump(mode="json")
    return dict(usage) if isinstance(usage, dict) else {"usage": usage}


def _client_usage(counts: _Counts) -> dict[str, Any]:
    """This loop's own counts in the shape of a server usage report (requests not counted)."""
    zero = {"prefill_tokens": 0, "sampled_tokens": 0, "trained_tokens": 0, "requests": None}
    return {
        "by_operation": {
            "forward_backward": {**zero, "trained_tokens": counts.tokens_trained},
            "sample": {
                **zero,
                "prefill_tokens": counts.prompt_tokens_sampled,
                "sampled_tokens": counts.tokens_sampled,
            },
        }
    }


def _check_dependencies() -> None:
    """Fail before the server starts, not after ten minutes of training at the plot."""
    missing = [m for m in ("reasoning_gym", "matplotlib") if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(f"the demo needs {', '.join(missing)}: pip install 'tuneloop[recipes]'")


def run_demo(config: DemoConfig, console: Console | None = None) -> DemoResult:
    """Evaluate, train with GRPO-style RL, evaluate again, save; returns what it measured."""
    _check_dependencies()
    console = console or Console()
    started = time.monotonic()
    seconds: dict[str, float] = {}
    task = Task(TASK_NAME)
    train, held_out = task.splits(config.steps * config.problems, config.eval_problems, config.seed)
    out = config.out
    out.mkdir(parents=True, exist_ok=True)
    log = MetricsLog(out / "metrics.jsonl")
    counts = _Counts()
    records: list[StepRecord] = []
    console.print(
        f"[bold]tuneloop demo[/]: {config.model} learns single-digit sums ({task.name}) by RL"
    )
    console.print(
        f"seed {config.seed}: {config.steps} steps x {config.problems} problems x "
        f"{config.group_size} samples, {len(held_out)} held-out problems"
    )
    keep = False
    with _progress(console) as progress:
        phase = progress.add_task(
            "starting the server and loading the model"
            if config.base_url is None
            else "connecting",
            total=None,
        )
        service = tuneloop.ServiceClient(base_url=config.base_url, api_key=config.api_key)
        try:
            training = service.create_lora_training_client(
                config.model, rank=config.lora_rank, seed=config.seed
            )
            tokenizer = training.get_tokenizer()
            sampler = training.save_weights_and_get_sampling_client()
            progress.remove_task(phase)
            seconds["start"] = time.monotonic() - started
            console.print(f"server ready and model loaded in {seconds['start']:.1f} s")
            started_locally = config.base_url is None and not os.environ.get("TUNELOOP_BASE_URL")
            console.print(console_hint(service.base_url, started_locally), soft_wrap=True)

            def held_out_eval(label: str) -> grpo.EvalResult:
                bar = progress.add_task(label, total=len(held_out))
                result = grpo.evaluate(
                    sampler, tokenizer, task, held_out, functools.partial(progress.advance, bar)
                )
                progress.remove_task(bar)
                counts.add_eval(result)
                return result

            t = time.monotonic()
            before = held_out_eval("held-out accuracy before training")
            seconds["eval_before"] = time.monotonic() - t
            console.print(
                f"before training: {before.accuracy:.1%} of {len(held_out)} held-out problems "
                f"right (greedy), {seconds['eval_before']:.1f} s"
            )
            log.write({"event": "eval", "step": 0, **asdict(before)})

            t_train = time.monotonic()
            steps_bar = progress.add_task("RL steps", total=config.steps)
            for step in range(1, config.steps + 1):
                t = time.monotonic()
                problems = train[(step - 1) * config.problems : step * config.problems]
                sampling_bar = progress.add_task(f"step {step}: sampling", total=len(problems))

                def params(i: int, step: int = step) -> SamplingParams:
                    # Its own seed per (run, step, problem): reruns draw the same samples.
                    return SamplingParams(
                        max_tokens=task.max_tokens,
                        temperature=config.temperature,
                        seed=(config.seed * 1_000_003 + step * 1_009 + i) % 2**31,
                    )

                outcome = grpo.rl_step(
                    training,
                    sampler,
                    tokenizer,
                    task,
                    problems,
                    config.group_size,
                    params,
                    config.learning_rate,
                    functools.partial(progress.advance, sampling_bar),
                )
                progress.remove_task(sampling_bar)
                sampler = outcome.sampler
                step_seconds = time.monotonic() - t  # the held-out check is not the step's cost
                held = None
                if config.eval_every and step % config.eval_every == 0 and step < config.steps:
                    held = held_out_eval(f"step {step}: held-out accuracy").accuracy
                rollouts = outcome.rollouts
                record = StepRecord(
                    step=step,
                    reward=sum(r.score.reward for r in rollouts) / len(rollouts),
                    accuracy=sum(r.score.correct for r in rollouts) / len(rollouts),
                    held_out_accuracy=held,
                    datums=outcome.datums,
                    tokens_trained=outcome.tokens_trained,
                    tokens_sampled=sum(len(r.completion) for r in rollouts),
                    loss=outcome.loss,
                    seconds=step_seconds,
                )
                counts.tokens_trained += record.tokens_trained
                counts.tokens_sampled += record.tokens_sampled
                # One prompt per problem: a group's samples share it on the server.
                counts.prompt_tokens_sampled += sum(
                    len(r.prompt) for r in rollouts[:: config.group_size]
                )
                records.append(record)
                log.write({"event": "step", **asdict(record)})
                progress.console.print(step_line(record, config.steps))
                progress.update(steps_bar, advance=1, description="RL steps")
            progress.remove_task(steps_bar)
            seconds["train"] = time.monotonic() - t_train

            t = time.monotonic()
            after = held_out_eval("held-out accuracy after training")
            seconds["eval_after"] = time.monotonic() - t
            log.write({"event": "eval", "step": config.steps, **asdict(after)})

            saving = progress.add_task("saving checkpoints", total=None)
            name = f"demo-seed{config.seed}"
            state_path = training.save_state(name).result().path
            sampler_path = training.save_weights_for_sampler(name).result().path or ""
            progress.remove_task(saving)

            server_usage = _server_usage(service, console)
            keep = config.keep_serving  # the run succeeded: leave the server up after it
        finally:
            log.close()
            if not keep:
                service.close()

    usage_source = "server" if server_usage is not None else "client"
    usage = server_usage if server_usage is not None else _client_usage(counts)
    plot_path = plot(
        records,
        before.accuracy,
        after.accuracy,
        out / "reward_accuracy.png",
        f"{config.model.split('/')[-1]} on {task.name}, seed {config.seed}",
    )
    seconds["total"] = time.monotonic() - started
    result = DemoResult(
        config=config,
        before=before,
        after=after,
        steps=records,
        metrics_path=log.path,
        plot_path=plot_path,
        state_path=state_path,
        sampler_path=sampler_path,
        usage=usage,
        usage_source=usage_source,
        seconds=seconds,
    )
    _write_summary(result)
    _show(result, console)
    if keep:
        try:
            _serve_until_interrupted(service.base_url, console)
        finally:
            service.close()
    return result


def _write_summary(result: DemoResult) -> None:
    summary = {
        "before": asdict(result.before),
        "after": asdict(result.after),
        "state_path": result.state_path,
        "sampler_path": result.sampler_path,
        "usage": result.usage,
        "usage_source": result.usage_source,
        "seconds": result.seconds,
        "config": {
            k: str(v) if isinstance(v, Path) else v for k, v in asdict(result.config).items()
        },
    }
    (result.config.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def _show(result: DemoResult, console: Console) -> None:
    console.print()
    console.print(
        before_after_table(
            TASK_NAME,
            result.config.eval_problems,
            (result.before.accuracy, result.before.clean),
            (result.after.accuracy, result.after.clean),
        )
    )
    source = "metered by the server" if result.usage_source == "server" else "counted by this loop"
    console.print(usage_table(result.usage, source))
    # soft_wrap: a path broken over two lines cannot be copied.
    for label, value in (
        ("plot", result.plot_path),
        ("metrics (JSONL)", result.metrics_path),
        ("training state", result.state_path),
        ("sampler weights", result.sampler_path),
    ):
        console.print(f"{label + ':':<18} {value}", soft_wrap=True)
    console.print(
        f"wall time:          {result.seconds['total']:.0f} s "
        f"(server start {result.seconds['start']:.0f} s, RL {result.seconds['train']:.0f} s)"
    )


def demo_command(
    seed: Annotated[
        int, typer.Option(help="Seed of the problems, the samples and the LoRA init.")
    ] = 0,
    steps: Annotated[int, typer.Option(help="RL steps (sample, score, train, refresh).")] = 10,
    group_size: Annotated[int, typer.Option(help="Samples per problem.")] = 8,
    problems: Annotated[int, typer.Option(help="Problems per step.")] = 8,
    eval_problems: Annotated[int, typer.Option(help="Held-out problems, scored greedy.")] = 50,
    model: Annotated[str, typer.Option(help="Base model on the server.")] = DEFAULT_MODEL,
    out: Annotated[
        Path | None,
        typer.Option(
            help="Folder for the metrics, the plot and the summary "
            "[default: $TUNELOOP_HOME/demo, else ~/.tuneloop/demo]."
        ),
    ] = None,
    base_url: Annotated[
        str | None,
        typer.Option(
            help="A running tuneloop server (key from $TUNELOOP_API_KEY); default: start one."
        ),
    ] = None,
    learning_rate: Annotated[float, typer.Option(help="Adam learning rate of the LoRA.")] = 5e-4,
    eval_every: Annotated[
        int, typer.Option(help="Also measure held-out accuracy every N steps (0: only at the end).")
    ] = 0,
    keep_serving: Annotated[
        bool,
        typer.Option(
            help="Leave the server (and its web console at /console) up after the run, "
            "until Ctrl-C."
        ),
    ] = False,
) -> None:
    """Train SmolLM2-135M-Instruct with RL on single-digit sums and show that it learned.

    Measures greedy accuracy on held-out problems, runs a GRPO-style loop (groups of samples per
    problem, reward minus group mean, importance_sampling loss on a LoRA), measures again, and
    saves the training state and sampler weights. About two to three minutes on 2 CPU cores; with no
    --base-url a local server is started for the run and stopped at the end.
    """
    run_demo(
        DemoConfig(
            seed=seed,
            steps=steps,
            group_size=group_size,
            problems=problems,
            eval_problems=eval_problems,
            model=model,
            out=out or default_out(),
            base_url=base_url,
            learning_rate=learning_rate,
            eval_every=eval_every,
            keep_serving=keep_serving,
        )
    )


if __name__ == "__main__":
    typer.run(demo_command)
