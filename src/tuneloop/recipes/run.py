"""What every recipe shares: its typed config and command line, the run folder (config, metrics,
checkpoint index), checkpoint + exact resume, MLflow, progress bars.

A run folder holds:
- `config.json`: the recipe's config as run (written at start; a resumed run must match it in
  everything that shapes the training, see `RecipeConfig.RESUME_MAY_CHANGE`);
- `metrics.jsonl`: one JSON object per step (and per validation), appended across resumes;
- `checkpoints.jsonl`: one line per `save_state`: the step it ends, its `tinker://` path, and the
  data position to continue from. Resuming loads the last one with its optimizer state
  (`create_training_client_from_state_with_optimizer`) and continues at the next step with the
  same data, so a resumed run computes what an uninterrupted one does.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import time
import typing
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

import tuneloop

C = TypeVar("C", bound="RecipeConfig")


@dataclass
class RecipeConfig:
    """Fields every recipe has; recipes subclass it with their own."""

    log_dir: str = "runs/recipe"
    base_url: str | None = None  # None: start a local server for the run
    api_key: str | None = None
    model: str = "HuggingFaceTB/SmolLM2-135M-Instruct"
    lora_rank: int = 16
    learning_rate: float = 1e-4
    steps: int = 10
    seed: int = 0
    save_every: int = 5  # save_state every N steps (and at the end); 0: only at the end
    eval_every: int = 5  # validation every N steps (and before the first); 0: never
    resume: bool = True  # continue from the run folder's last checkpoint if there is one
    mlflow_uri: str | None = None  # also log metrics and params to this MLflow tracking server
    progress: bool = True

    # Fields a resumed run may change (where to reach the server, logging): the rest must match.
    RESUME_MAY_CHANGE: typing.ClassVar[frozenset[str]] = frozenset(
        {"base_url", "api_key", "resume", "mlflow_uri", "progress", "steps", "log_dir"}
    )


@dataclass
class Checkpoint:
    step: int  # steps completed
    state_path: str
    position: dict[str, Any]


class Run:
    """A recipe run's folder, logs and checkpoints (see the module docstring)."""

    def __init__(self, config: RecipeConfig, console: Console | None = None) -> None:
        self.config = config
        self.console = console or Console()
        self.dir = Path(config.log_dir).expanduser()
        self.dir.mkdir(parents=True, exist_ok=True)
        self._metrics_path = self.dir / "metrics.jsonl"
        self._checkpoints_path = self.dir / "checkpoints.jsonl"
        self.resumed_from = self._last_checkpoint() if config.resume else None
        if self.resumed_from is None and not config.resume:
            for path in (self._metrics_path, self._checkpoints_path):
                path.unlink(missing_ok=True)
        self._check_config()
        (self.dir / "config.json").write_text(
            json.dumps({"recipe": type(config).__name__, **asdict(config)}, indent=2, default=str)
        )
        self._mlflow: Any = None
        if config.mlflow_uri:
            self._start_mlflow(config.mlflow_uri)

    # ---- config and MLflow --------------------------------------------------------------------

    def _check_config(self) -> None:
        previous = self.dir / "config.json"
        if self.resumed_from is None or not previous.is_file():
            return
        old = json.loads(previous.read_text())
        now = asdict(self.config)
        changed = [
            k
            for k in now
            if k not in self.config.RESUME_MAY_CHANGE and k in old and old[k] != now[k]
        ]
        if changed:
            raise ValueError(
                f"{self.dir} holds a run with other settings ({', '.join(changed)}): resuming "
                "it with these would not continue the same run; use another --log-dir or "
                "--no-resume"
            )

    def _start_mlflow(self, uri: str) -> None:
        try:
            import mlflow
        except ImportError as exc:
            raise ImportError("--mlflow-uri needs mlflow: pip install 'tuneloop[mlflow]'") from exc
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment(type(self.config).__name__)
        run_id_file = self.dir / "mlflow_run_id"
        run_id = (
            run_id_file.read_text().strip() if self.resumed_from and run_id_file.is_file() else None
        )
        active = mlflow.start_run(run_id=run_id, run_name=self.dir.name)
        run_id_file.write_text(active.info.run_id)
        if run_id is None:
            mlflow.log_params({k: str(v) for k, v in asdict(self.config).items() if k != "api_key"})
        self._mlflow = mlflow

    # ---- metrics --------------------------------------------------------------------------------

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        record = {"step": step, "time": time.time(), **metrics}
        with self._metrics_path.open("a") as f:
            f.write(json.dumps(record, default=float) + "\n")
        if self._mlflow is not None:
            numeric = {
                k: float(v)
                for k, v in metrics.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)
            }
            self._mlflow.log_metrics(numeric, step=step)

    def metrics(self) -> list[dict[str, Any]]:
        if not self._metrics_path.is_file():
            return []
        return [json.loads(line) for line in self._metrics_path.read_text().splitlines() if line]

    # ---- checkpoints ----------------------------------------------------------------------------

    def _last_checkpoint(self) -> Checkpoint | None:
        if not self._checkpoints_path.is_file():
            return None
        lines = [line for line in self._checkpoints_path.read_text().splitlines() if line.strip()]
        return Checkpoint(**json.loads(lines[-1])) if lines else None

    def save(self, training: tuneloop.TrainingClient, step: int, position: dict[str, Any]) -> str:
        """save_state (weights + optimizer) after `step` steps, and where the data continues."""
        path = training.save_state(f"step-{step:06d}").result().path
        with self._checkpoints_path.open("a") as f:
            f.write(json.dumps(asdict(Checkpoint(step, path, position))) + "\n")
        return path

    def training_client(
        self, service: tuneloop.ServiceClient
    ) -> tuple[tuneloop.TrainingClient, int, dict[str, Any]]:
        """(client, first step to run, data position): fresh, or loaded from the last checkpoint."""
        if self.resumed_from is not None:
            ckpt = self.resumed_from
            self.console.print(f"resuming after step {ckpt.step} from {ckpt.state_path}")
            training = service.create_training_client_from_state_with_optimizer(ckpt.state_path)
            return training, ckpt.step, dict(ckpt.position)
        training = service.create_lora_training_client(
            self.config.model, rank=self.config.lora_rank, seed=self.config.seed
        )
        return training, 0, {}

    def due(self, every: int, step: int) -> bool:
        """True after `step` steps when a periodic action (save, eval) is due."""
        return every > 0 and step % every == 0

    def end_step(
        self,
        training: tuneloop.TrainingClient,
        step: int,
        position: dict[str, Any],
        validate: Callable[[int], None] | None = None,
    ) -> None:
        """After step `step`: validate every `eval_every` steps, save every `save_every` steps
        and after the last."""
        if validate is not None and self.due(self.config.eval_every, step):
            validate(step)
        if self.due(self.config.save_every, step) or step == self.config.steps:
            self.save(training, step, position)

    @contextmanager
    def progress(self) -> Iterator[Progress]:
        bars = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.console,
            disable=not self.config.progress,
            transient=True,
        )
        with bars:
            yield bars

    def close(self) -> None:
        if self._mlflow is not None:
            self._mlflow.end_run()
            self._mlflow = None


def service_for(config: RecipeConfig) -> tuneloop.ServiceClient:
    """The server at `base_url`, or a local one started for the run."""
    return tuneloop.ServiceClient(base_url=config.base_url, api_key=config.api_key)


@dataclass
class Started:
    run: Run
    service: tuneloop.ServiceClient
    training: tuneloop.TrainingClient
    step: int  # steps already done: 0, or the resumed checkpoint's
    position: dict[str, Any]  # where the data continues (empty when fresh)


@contextmanager
def started(config: RecipeConfig) -> Iterator[Started]:
    """A recipe's run folder, server connection and training client (fresh or resumed from the
    folder's last checkpoint); all closed when the block ends."""
    run = Run(config)
    service = service_for(config)
    try:
        training, step, position = run.training_client(service)
        yield Started(run, service, training, step, position)
    finally:
        run.close()
        service.close()


# ---- command lines from configs ---------------------------------------------------------------

# The --help line of every RecipeConfig field: what it does and its unit. A recipe's own fields
# get theirs from its command (recipes/cli.py); `command` refuses a field without one.
COMMON_HELP: dict[str, str] = {
    "log_dir": "Run folder: config.json, metrics.jsonl, checkpoints.jsonl (a run there resumes).",
    "base_url": "URL of a running server (key from --api-key or $TUNELOOP_API_KEY); "
    "default: $TUNELOOP_BASE_URL, else a local server started for the run.",
    "api_key": "API key for --base-url (default: $TUNELOOP_API_KEY).",
    "model": "Base model to train a LoRA on (a name the server serves).",
    "lora_rank": "LoRA rank r of the adapter (its A and B matrices have r columns / rows).",
    "learning_rate": "Adam learning rate of the LoRA weights.",
    "steps": "Optimizer steps to run in all (a resumed run continues up to this many).",
    "seed": "Seed of the LoRA init, the data order and the sampling.",
    "save_every": "Save a checkpoint (weights + optimizer) every N steps, and after the last; "
    "0: only after the last.",
    "eval_every": "Validate every N steps (and before the first); 0: never.",
    "resume": "Continue from the run folder's last checkpoint if it has one (--no-resume: start "
    "over, clearing its metrics).",
    "mlflow_uri": "Also log params and metrics to this MLflow tracking server URI.",
    "progress": "Show progress bars on the terminal.",
}


def _option_type(annotation: Any) -> Any:
    hints = {"str": str, "int": int, "float": float, "bool": bool, "str | None": str | None}
    return hints.get(annotation, annotation) if isinstance(annotation, str) else annotation


def command(
    config_type: type[C],
    run: Callable[[C], Any],
    help_text: str,
    option_help: Mapping[str, str] | None = None,
) -> Callable[..., Any]:
    """A typer command whose options are the config's fields (`--steps 10`, `--no-resume`),
    each with its --help line from `option_help` or COMMON_HELP."""
    resolved = typing.get_type_hints(config_type)
    helps = {**COMMON_HELP, **(option_help or {})}
    params = []
    for f in fields(config_type):
        if f.name not in helps:
            raise TypeError(f"{config_type.__name__}.{f.name} needs a help line to be an option")
        if f.default is not dataclasses.MISSING:
            default: Any = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            raise TypeError(f"{config_type.__name__}.{f.name} needs a default to be an option")
        params.append(
            inspect.Parameter(
                f.name,
                inspect.Parameter.KEYWORD_ONLY,
                default=typer.Option(default, help=helps[f.name]),
                annotation=_option_type(resolved.get(f.name, str)),
            )
        )

    def cli(**values: Any) -> None:
        run(config_type(**values))

    cli.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    cli.__doc__ = help_text
    return cli
