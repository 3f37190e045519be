"""The batched draw against the previous sampler on the two recipe workloads that moved with it.

Each column is one engine tree (`--before-src`: a checkout of the previous sampler; the other is
this tree) serving the tiny built-in model on 127.0.0.1 in its own process, driven through the
SDK exactly as the recipes drive it. Four measurements, each over `--seeds` seeds:

- `direct`: the distillation recipe's sampling (8 prompts x 8 samples x 10 tokens, temperature 1,
  its stop strings, seeds `seed * 1000 + j`) from an untrained student, with the test's earlier
  teacher (token 7). Per column: the largest gap between the sampler's logprobs and the
  student's `compute_logprobs` of the same sequences, lengths and stops, and, for the first 3
  seeds, the probability integral transform of every sampled token under the model's full
  distribution at its position (uniform, and independent across a group's rows, whose seeds are
  consecutive, and across a row's positions, when the draw is right), the mean of log p(x) + H,
  and the reverse KL estimate per seed.
- `distill`: tests/recipes/test_distill.py's run (4 steps, 2 prompts x 8, lr 5e-3) at each seed,
  toward a teacher of `--teacher-targets` (token 7 by default, the test's earlier teacher): the
  recipe's held-out estimates, whether the earlier criterion (mean after < 0.85 x first) held,
  and the exact reverse KL before and after on fixed sequences (forward passes scoring every
  token at the held-out prompts' greedy base replies).
- `eval`: the distillation validation's first estimate (untrained student) at `--seeds` seeds in
  place of its one fixed seed, `--eval-samples` per prompt: the spread of the value that every
  run at the fixed seed shares.
- `demo`: tests/recipes/test_demo.py's run (2 steps x 3 problems x 4 samples) at each seed:
  tokens trained (0 where every group scored alike), and, from the untrained model, the share
  of samples with a reward above 0 and of groups that train at all.

    python bench/recipe_sampler_ab.py --before-src /tmp/before/src --seeds 8 [--only direct]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from columns import run_column, this_tree_src  # siblings: a script's folder is on sys.path
from shared_prefix import cpu_model

TINY = "tuneloop/tiny-qwen3"
MODES = ("direct", "distill", "demo", "eval")
VOCAB = 259  # the tiny model's vocabulary


def _teacher(service: Any, targets: tuple[int, ...] = (7,)) -> tuple[str, Any]:
    """tests/recipes/test_distill.py's teacher, an adapter trained 3 steps toward `targets`
    (cycled): its sampler weights' path and its training client."""
    from tuneloop import AdamParams, Datum, ModelInput, TensorData

    training = service.create_lora_training_client(TINY, rank=8, seed=0)
    data = []
    for i in range(4):
        sequence = [targets[(i + k) % len(targets)] for k in range(12)]
        data.append(
            Datum(
                model_input=ModelInput.from_ints([3 + i, *sequence[:-1]]),
                loss_fn_inputs={
                    "target_tokens": TensorData.from_numpy(np.array(sequence, dtype=np.int64))
                },
            )
        )
    for _ in range(3):
        training.forward_backward(data, "cross_entropy").result()
        training.optim_step(AdamParams(learning_rate=1e-2)).result()
    path = training.save_weights_for_sampler("teacher").result().path
    assert path is not None
    return str(path), training


def _distributions(training: Any, sequences: list[tuple[list[int], int]]) -> list[np.ndarray]:
    """The log-probabilities [len(tokens) - start, V] of every vocabulary token at positions
    start.. of each (tokens, start), from a forward pass of `training`'s current weights with
    every token as a target (cross_entropy takes [N, K] targets)."""
    from tuneloop import Datum, ModelInput, TensorData

    out: list[np.ndarray] = []
    for chunk in range(0, len(sequences), 8):
        part = sequences[chunk : chunk + 8]
        data = [
            Datum(
                model_input=ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": TensorData.from_numpy(
                        np.tile(np.arange(VOCAB, dtype=np.int64), (len(tokens) - 1, 1))
                    )
                },
            )
            for tokens, _ in part
        ]
        result = training.forward(data, "cross_entropy").result()
        for (_, start), output in zip(part, result.loss_fn_outputs, strict=True):
            out.append(np.asarray(output["logprobs"].to_numpy())[start - 1 :])
    return out


def direct(server: Any, seeds: int, pit_seeds: int = 3) -> dict[str, Any]:
    from tuneloop import ModelInput, ServiceClient
    from tuneloop.recipes.distill import (
        DistillConfig,
        reverse_kl,
        scored_rollouts,
        teacher_client,
    )
    from tuneloop.recipes.math_rl import MathRLConfig, problems
    from tuneloop.recipes.renderers import renderer_for

    service = ServiceClient(base_url=server.url, api_key=server.key)
    teacher = teacher_client(service, _teacher(service)[0])
    training = service.create_lora_training_client(TINY, rank=16, seed=0)
    student = training.save_weights_and_get_sampling_client()
    renderer = renderer_for(training.get_tokenizer())
    train, _ = problems(MathRLConfig(train_problems=8, eval_problems=8, seed=0))
    config = DistillConfig(max_tokens=10, temperature=1.0)
    n, group = len(train), 8
    # The probability integral transform of every sampled token under its own distribution
    # (cdf in token order below it + half its probability): uniform on (0, 1) and independent
    # across rows and positions when the draw is right, whatever the model.
    pit = np.full((pit_seeds, n, group, config.max_tokens), np.nan)
    surprise: list[float] = []  # log p(x) + H: mean 0 when x ~ p
    gap, lengths, stops, kls = 0.0, [], 0, []
    for seed in range(seeds):
        groups = scored_rollouts(student, teacher, renderer, train, config, group, seed)
        kls.append(reverse_kl(groups))
        pending = []
        for j, trajectories in enumerate(groups):
            for r, trajectory in enumerate(trajectories):
                turn = trajectory.turns[0]
                lengths.append(len(turn.completion))
                stops += len(turn.completion) < config.max_tokens
                tokens = turn.prompt + turn.completion
                forward = student.compute_logprobs(ModelInput.from_ints(tokens))
                pending.append((j, r, turn, forward))
        pending = [x for x in pending if x[2].completion]
        for _, _, turn, future in pending:
            forward = [float(x) for x in future.result()[len(turn.prompt) :]]
            gap = max(gap, float(np.max(np.abs(np.subtract(forward, turn.logprobs)))))
        if seed >= pit_seeds:
            continue
        sequences = [(t.prompt + t.completion, len(t.prompt)) for _, _, t, _ in pending]
        for (j, r, turn, _), lp in zip(pending, _distributions(training, sequences), strict=True):
            probs = np.exp(lp)
            for k, token in enumerate(turn.completion):
                pit[seed, j, r, k] = probs[k, :token].sum() + probs[k, token] / 2
                entropy = -(probs[k] * np.where(probs[k] > 0, lp[k], 0.0)).sum()
                surprise.append(float(lp[k, token]) + entropy)
    values = pit[~np.isnan(pit)]
    counts = np.histogram(values, bins=10, range=(0.0, 1.0))[0]
    expect = len(values) / 10
    rows = pit.transpose(0, 1, 3, 2).reshape(-1, group)  # [draws at one position, row]
    rows = rows[~np.isnan(rows).any(1)]
    row_corr = np.corrcoef(rows.T)[~np.eye(group, dtype=bool)]
    steps = pit.reshape(-1, config.max_tokens)
    pairs = np.stack([steps[:, :-1].ravel(), steps[:, 1:].ravel()])
    pairs = pairs[:, ~np.isnan(pairs).any(0)]
    return {
        "max_sampler_vs_forward": gap,
        "mean_length": float(np.mean(lengths)),
        "stopped_share": stops / len(lengths),
        "pit_draws": len(values),
        "pit_chi2_9dof": float(((counts - expect) ** 2 / expect).sum()),
        "pit_mean": float(values.mean()),
        "pit_row_corr_mean": float(row_corr.mean()),
        "pit_row_corr_max_abs": float(np.abs(row_corr).max()),
        "pit_row_corr_draws": len(rows),
        "pit_next_position_corr": float(np.corrcoef(pairs)[0, 1]),
        "surprise_mean": float(np.mean(surprise)),
        "surprise_se": float(np.std(surprise, ddof=1) / np.sqrt(len(surprise))),
        "reverse_kl_per_seed": kls,
    }


def exact_kl(student: Any, teacher: Any, sequences: list[tuple[list[int], int]]) -> float:
    """KL(student || teacher) summed over the whole vocabulary, averaged over the reply positions
    of fixed sequences (tokens, reply start): no sampling noise in the estimate."""
    s, t = _distributions(student, sequences), _distributions(teacher, sequences)
    return float(
        np.mean(np.concatenate([(np.exp(a) * (a - b)).sum(-1) for a, b in zip(s, t, strict=True)]))
    )


def greedy_replies(sampler: Any, prompts: list[list[int]], n: int) -> list[tuple[list[int], int]]:
    """Each prompt with the base model's greedy reply of `n` tokens: sequences both samplers
    produce alike (an argmax draws no random number)."""
    from tuneloop import ModelInput, SamplingParams

    out = []
    for prompt in prompts:
        seq = (
            sampler.sample(
                ModelInput.from_ints(prompt), 1, SamplingParams(max_tokens=n, temperature=0.0)
            )
            .result()
            .sequences[0]
        )
        out.append(([*prompt, *seq.tokens], len(prompt)))
    return out


def distill(server: Any, seeds: int, targets: tuple[int, ...] = (7,)) -> dict[str, Any]:
    from tuneloop import ServiceClient
    from tuneloop.recipes.distill import DistillConfig, PromptEnv, run_distill
    from tuneloop.recipes.math_rl import MathRLConfig, problems
    from tuneloop.recipes.renderers import renderer_for

    service = ServiceClient(base_url=server.url, api_key=server.key)
    teacher, teacher_training = _teacher(service, targets)
    base = service.create_sampling_client(base_model=TINY)
    untrained = service.create_lora_training_client(TINY, rank=16, seed=0)  # B = 0: the base
    runs = []
    for seed in range(seeds):
        with tempfile.TemporaryDirectory() as tmp:
            config = DistillConfig(
                log_dir=str(Path(tmp) / "distill"),
                base_url=server.url,
                api_key=server.key,
                model=TINY,
                teacher=teacher,
                learning_rate=5e-3,
                steps=4,
                prompts_per_step=2,
                group_size=8,
                max_tokens=10,
                train_prompts=8,
                eval_prompts=8,
                eval_samples=4,
                eval_every=2,
                save_every=2,
                seed=seed,
                progress=False,
            )
            run_distill(config)
            lines = (Path(tmp) / "distill" / "metrics.jsonl").read_text().splitlines()
            records = [json.loads(x) for x in lines]
            last = json.loads(
                (Path(tmp) / "distill" / "checkpoints.jsonl").read_text().splitlines()[-1]
            )
        evals = [r["eval_reverse_kl"] for r in records if "eval_reverse_kl" in r]
        trained = service.create_training_client_from_state(last["state_path"])
        renderer = renderer_for(trained.get_tokenizer())
        _, held = problems(MathRLConfig(train_problems=8, eval_problems=8, seed=seed))
        prompts = [renderer.prompt(PromptEnv(p).initial()) for p in held]
        sequences = greedy_replies(base, prompts, 10)
        kl = [
            exact_kl(untrained, teacher_training, sequences),
            exact_kl(trained, teacher_training, sequences),
        ]
        runs.append({"seed": seed, "evals": evals, "exact_kl": kl})
    return {"runs": runs}


def first_eval(
    server: Any, seeds: int, targets: tuple[int, ...] = (7,), samples: int = 4
) -> dict[str, Any]:
    """The distillation validation's first estimate (8 held-out prompts x `samples` samples from
    the untrained student) at `seeds` seeds in place of its one fixed seed: the noise every run at
    that seed shares."""
    from tuneloop import ServiceClient
    from tuneloop.recipes.distill import DistillConfig, reverse_kl, scored_rollouts, teacher_client
    from tuneloop.recipes.math_rl import MathRLConfig, problems
    from tuneloop.recipes.renderers import renderer_for

    service = ServiceClient(base_url=server.url, api_key=server.key)
    teacher = teacher_client(service, _teacher(service, targets)[0])
    training = service.create_lora_training_client(TINY, rank=16, seed=0)
    student = training.save_weights_and_get_sampling_client()
    renderer = renderer_for(training.get_tokenizer())
    _, held = problems(MathRLConfig(train_problems=8, eval_problems=8))
    config = DistillConfig(max_tokens=10, temperature=1.0)
    kls = [
        reverse_kl(scored_rollouts(student, teacher, renderer, held, config, samples, 999_983 + k))
        for k in range(seeds)
    ]
    return {"first_eval_per_seed": kls}


def demo(server: Any, seeds: int) -> dict[str, Any]:
    from rich.console import Console

    from tuneloop import SamplingParams, ServiceClient
    from tuneloop.recipes import grpo
    from tuneloop.recipes.demo import DemoConfig, run_demo
    from tuneloop.recipes.tasks import Task

    runs = []
    for seed in range(seeds):
        with tempfile.TemporaryDirectory() as tmp:
            config = DemoConfig(
                seed=seed,
                steps=2,
                group_size=4,
                problems=3,
                eval_problems=5,
                model=TINY,
                out=Path(tmp) / "demo",
                eval_every=1,
                base_url=server.url,
                api_key=server.key,
            )
            result = run_demo(config, Console(file=io.StringIO(), width=120))
        runs.append({"seed": seed, "tokens_trained": [s.tokens_trained for s in result.steps]})
    # The untrained model's rewards on the demo's training problems, many groups of 4.
    service = ServiceClient(base_url=server.url, api_key=server.key)
    training = service.create_lora_training_client(TINY, rank=16, seed=0)
    sampler = training.save_weights_and_get_sampling_client()
    task = Task()
    train, _ = task.splits(8 * seeds, 5, 0)
    rewarded = groups_training = samples = 0
    for chunk in range(seeds):
        problems = train[chunk * 8 : (chunk + 1) * 8]

        def params(i: int, chunk: int = chunk) -> SamplingParams:
            return SamplingParams(max_tokens=task.max_tokens, seed=chunk * 1_009 + i)

        groups = grpo.sample_groups(sampler, training.get_tokenizer(), task, problems, 4, params)
        for group in groups:
            rewards = [r.score.reward for r in group]
            rewarded += sum(r > 0 for r in rewards)
            samples += len(rewards)
            groups_training += len(set(rewards)) > 1
    return {
        "runs": runs,
        "rewarded_share": rewarded / samples,
        "groups_that_train_share": groups_training / (samples / 4),
        "groups_sampled": samples // 4,
    }


def worker(args: argparse.Namespace) -> dict[str, Any]:
    from tuneloop._local_server import live_server

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp)
        extra = ("--cache-dir", str(data / "cache"))
        with live_server(data, *extra, backend="torch", models=(TINY,)) as server:
            start = time.perf_counter()
            if args.worker == "distill":
                out = distill(server, args.seeds, tuple(args.teacher_targets))
            elif args.worker == "eval":
                targets = tuple(args.teacher_targets)
                out = first_eval(server, args.seeds, targets, args.eval_samples)
            else:
                out = {"direct": direct, "demo": demo}[args.worker](server, args.seeds)
            out["wall_s"] = time.perf_counter() - start
            return out


def summarise(mode: str, name: str, result: dict[str, Any]) -> None:
    print(f"--- {mode}, {name} ({result['wall_s']:.0f} s)")
    if mode == "direct":
        kls = result["reverse_kl_per_seed"]
        print(json.dumps({k: v for k, v in result.items() if k != "reverse_kl_per_seed"}, indent=1))
        print(f"reverse KL per seed: mean {np.mean(kls):.4f} sd {np.std(kls, ddof=1):.4f}")
    elif mode == "eval":
        kls = result["first_eval_per_seed"]
        print(f"first validation estimate: mean {np.mean(kls):.4f} sd {np.std(kls, ddof=1):.4f}")
        print(f"per seed {[round(x, 3) for x in kls]}")
    elif mode == "distill":
        starts = [r["evals"][0] for r in result["runs"]]
        ends = [float(np.mean(r["evals"][1:])) for r in result["runs"]]
        passed = [e < 0.85 * s for s, e in zip(starts, ends, strict=True)]
        for r, ok in zip(result["runs"], passed, strict=True):
            kl = [round(x, 4) for x in r["exact_kl"]]
            print(f"seed {r['seed']}: evals {[round(x, 3) for x in r['evals']]} {ok}; exact {kl}")
        drops = [s - e for s, e in zip(starts, ends, strict=True)]
        exact = np.array([r["exact_kl"] for r in result["runs"]])
        ratio = exact[:, 1] / exact[:, 0]
        print(
            f"exact KL before {exact[:, 0].mean():.4f}, after {exact[:, 1].mean():.4f} "
            f"sd {exact[:, 1].std(ddof=1):.4f}, after / before worst {ratio.max():.3f}"
        )
        print(
            f"start {np.mean(starts):.3f} sd {np.std(starts, ddof=1):.3f}; "
            f"mean after {np.mean(ends):.3f} sd {np.std(ends, ddof=1):.3f}; "
            f"drop {np.mean(drops):.3f} sd {np.std(drops, ddof=1):.3f}; "
            f"criterion held {sum(passed)}/{len(passed)}"
        )
    else:
        trained = [sum(r["tokens_trained"]) for r in result["runs"]]
        print(f"tokens trained per seed: {trained}; zero at {sum(t == 0 for t in trained)} seeds")
        share, train = result["rewarded_share"], result["groups_that_train_share"]
        print(
            f"untrained model, {result['groups_sampled']} groups of 4: rewarded share "
            f"{share:.3f}, groups that train {train:.3f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before-src", required=False, help="src/ of the previous sampler's tree")
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--only", choices=MODES, action="append")
    ap.add_argument("--column", choices=("before", "after"), action="append")
    ap.add_argument(
        "--teacher-targets", type=int, nargs="+", default=[7], help="the teacher's tokens"
    )
    ap.add_argument("--eval-samples", type=int, default=4, help="samples per prompt (eval)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    if args.worker:
        print(json.dumps(worker(args)))
        return
    if not args.before_src:
        ap.error("--before-src is required")
    print(f"CPU: {cpu_model()}; load average {os.getloadavg()}")
    results: dict[str, dict[str, Any]] = {}
    for mode in args.only or MODES:
        for name, src in (("before", args.before_src), ("after", this_tree_src())):
            if args.column and name not in args.column:
                continue
            flags = ["--worker", mode, "--seeds", str(args.seeds), "--teacher-targets"]
            flags += [str(t) for t in args.teacher_targets]
            flags += ["--eval-samples", str(args.eval_samples)]
            result = run_column(__file__, src, flags)
            results[f"{mode}/{name}"] = result
            summarise(mode, name, result)
            print(f"load average {os.getloadavg()}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
