"""Every public method of the official SDK's clients, called against a tuneloop server:
`python -m tests.compat.official_parity URL KEY MODEL OTHER_TENANTS_KEY`. Prints one JSON line
per method (`PARITY {...}`) and a summary; the pytest side (test_official_parity.py) judges them.
The other tenant's key reads the first tenant's published checkpoints.

The methods are discovered by introspection, so a method a new SDK release adds has no recipe
here and is reported as `no_recipe` (and the test fails until one is written). The `_async`
variant of a method runs its plain recipe through the async method.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import pickle
import sys
import traceback
import urllib.request
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import tinker
import torch
from tinker import types
from tinker.lib.public_interfaces.admin_client import AdminClient

# Each class whose public methods are walked, by the name results are reported under.
CLASSES: dict[str, type[Any]] = {
    "ServiceClient": tinker.ServiceClient,
    "TrainingClient": tinker.TrainingClient,
    "SamplingClient": tinker.SamplingClient,
    "RestClient": tinker.RestClient,
    "AdminClient": AdminClient,
}
# Loss functions of forward_backward, walked too (the SDK's LossFnType literal).
LOSS_INPUTS = {
    "cross_entropy": {},
    "importance_sampling": {"logprobs": -2.0, "advantages": 1.0},
    "ppo": {"logprobs": -2.0, "advantages": 1.0},
    "cispo": {"logprobs": -2.0, "advantages": 1.0},
    "dro": {"logprobs": -2.0, "advantages": 1.0},
    "gspo": {"logprobs": -2.0, "advantages": 1.0},
}
TOKENS = [5, 17, 33, 90, 120, 7, 44, 61]


@dataclass
class World:
    url: str
    key: str
    model: str
    service: Any = None
    training: Any = None
    sampling: Any = None
    rest: Any = None
    admin: Any = None
    session_id: str = ""
    state_path: str = ""
    sampler_path: str = ""
    external_path: str = ""
    sampler_id: str = ""
    made: list[str] = field(default_factory=list)

    def datum(self, **inputs: float) -> Any:
        n = len(TOKENS) - 1
        values: dict[str, Any] = {"target_tokens": TOKENS[1:]}
        # Cross entropy's weights; the RL losses take logprobs and advantages instead.
        values |= {k: [v] * n for k, v in (inputs or {"weights": 1.0}).items()}
        return types.Datum(
            model_input=types.ModelInput.from_ints(TOKENS[:-1]), loss_fn_inputs=values
        )

    def name(self, prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex[:8]}"

    def fresh_checkpoint(self) -> str:
        return str(self.training.save_state(self.name("del")).result().path)


def build_world(url: str, key: str, model: str) -> World:
    w = World(url, key, model)
    w.service = tinker.ServiceClient(base_url=url, api_key=key, project_id="parity")
    w.training = w.service.create_lora_training_client(base_model=model, rank=4, seed=0).result()
    w.training.forward_backward([w.datum()], "cross_entropy").result()
    w.training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    w.state_path = w.training.save_state("state0").result().path
    w.sampler_path = w.training.save_weights_for_sampler("sampler0").result().path
    w.external_path = w.training.save_weights_external("external0").result().path
    w.sampling = w.service.create_sampling_client(model_path=w.sampler_path).result()
    w.rest = tinker.RestClient(base_url=url, api_key=key)
    w.admin = AdminClient(base_url=url, api_key=key)
    w.session_id = w.service.holder.get_session_id()
    w.sampler_id = w.rest.get_session(w.session_id).result().sampler_ids[0]
    return w


def custom_loss(data: list[Any], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict]:
    loss = sum((-lp).sum() for lp in logprobs)
    return loss, {"custom/nll:sum": float(loss)}


def per_datum_nll(logprobs: torch.Tensor, weights: torch.Tensor) -> tuple[Any, dict]:
    loss = -(logprobs * weights).sum()
    return loss, {"custom/nll:sum": loss}


def _hour() -> datetime:
    return datetime.now(UTC).replace(minute=0, second=0, microsecond=0)


def _fetch_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


Recipe = Callable[[World, Callable[..., Any]], Any]
PROMPT = types.ModelInput.from_ints([5, 7, 9, 11])
PARAMS = types.SamplingParams(max_tokens=4, seed=1, temperature=1.0)


def _sample_checked(result: Any) -> Any:
    assert len(result.sequences) == 2, result
    return result


# (class, method) -> how to call it: recipe(world, bound method) -> result to resolve.
RECIPES: dict[tuple[str, str], Recipe] = {
    # ---- ServiceClient
    ("ServiceClient", "close"): lambda w, m: m("success"),
    ("ServiceClient", "copy_weights"): lambda w, m: m(w.state_path),
    ("ServiceClient", "create_custom_loss"): lambda w, m: w.training.forward_backward_custom(
        [w.datum()],
        _resolve(m(per_datum_nll, input_ranks={"logprobs": 1, "weights": 1})),
    ),
    ("ServiceClient", "create_lora_training_client"): lambda w, m: m(w.model, rank=4),
    ("ServiceClient", "create_rest_client"): lambda w, m: m().list_sessions().result(),
    ("ServiceClient", "create_sampling_client"): lambda w, m: m(base_model=w.model),
    ("ServiceClient", "create_training_client_from_state"): lambda w, m: m(w.state_path),
    ("ServiceClient", "create_training_client_from_state_with_optimizer"): lambda w, m: m(
        w.state_path
    ),
    ("ServiceClient", "get_console_url"): lambda w, m: m(),
    ("ServiceClient", "get_server_capabilities"): lambda w, m: m(),
    ("ServiceClient", "get_telemetry"): lambda w, m: m(),
    # ---- TrainingClient
    ("TrainingClient", "create_sampling_client"): lambda w, m: m(w.sampler_path),
    ("TrainingClient", "forward"): lambda w, m: m([w.datum()], "cross_entropy"),
    ("TrainingClient", "forward_backward"): lambda w, m: m([w.datum()], "cross_entropy"),
    ("TrainingClient", "forward_backward_custom"): lambda w, m: m([w.datum()], custom_loss),
    ("TrainingClient", "get_console_url"): lambda w, m: m(),
    ("TrainingClient", "get_info"): lambda w, m: m(),
    ("TrainingClient", "get_telemetry"): lambda w, m: m(),
    ("TrainingClient", "get_tokenizer"): lambda w, m: m().encode("hello world"),
    ("TrainingClient", "load_state"): lambda w, m: m(w.state_path),
    ("TrainingClient", "load_state_with_optimizer"): lambda w, m: m(w.state_path),
    ("TrainingClient", "optim_step"): lambda w, m: m(types.AdamParams(learning_rate=1e-4)),
    ("TrainingClient", "save_state"): lambda w, m: m(w.name("state")),
    ("TrainingClient", "save_weights_and_get_sampling_client"): lambda w, m: _sample_checked(
        _resolve(m()).sample(PROMPT, 2, PARAMS).result()
    ),
    ("TrainingClient", "save_weights_external"): lambda w, m: m(w.name("external")),
    ("TrainingClient", "save_weights_for_sampler"): lambda w, m: m(w.name("sampler")),
    # ---- SamplingClient
    ("SamplingClient", "compute_logprobs"): lambda w, m: m(PROMPT),
    ("SamplingClient", "create"): lambda w, m: _resolve(
        m(w.service.holder, base_model=w.model)
    ).get_base_model(),
    ("SamplingClient", "from_sampler_handle"): lambda w, m: _sample_checked(
        m(w.sampling.get_sampler_handle(), api_key=w.key).sample(PROMPT, 2, PARAMS).result()
    ),
    ("SamplingClient", "get_base_model"): lambda w, m: m(),
    ("SamplingClient", "get_sampler_handle"): lambda w, m: m(),
    ("SamplingClient", "get_telemetry"): lambda w, m: m(),
    ("SamplingClient", "get_tokenizer"): lambda w, m: m().encode("hello world"),
    ("SamplingClient", "on_queue_state_change"): lambda w, m: m(
        tinker.lib.api_future_impl.QueueState.ACTIVE, None
    ),
    ("SamplingClient", "sample"): lambda w, m: _sample_checked(_resolve(m(PROMPT, 2, PARAMS))),
    # ---- RestClient (AdminClient's three are the same calls)
    ("RestClient", "assign_session_project"): lambda w, m: m(w.session_id, "parity"),
    ("RestClient", "copy_weights"): lambda w, m: m(w.state_path, "archive"),
    ("RestClient", "delete_checkpoint"): lambda w, m: m(
        *w.fresh_checkpoint().removeprefix("tinker://").split("/", 1)
    ),
    ("RestClient", "delete_checkpoint_from_tinker_path"): lambda w, m: m(w.fresh_checkpoint()),
    ("RestClient", "export_session_trace"): lambda w, m: _fetch_json(_resolve(m(w.session_id)))[
        "requests"
    ][:1],
    ("RestClient", "get_audit_log"): lambda w, m: m(),
    ("RestClient", "get_billing_usage"): lambda w, m: m(_hour(), _hour() + timedelta(hours=1)),
    ("RestClient", "get_current_checkpoint_storage_usage"): lambda w, m: m("parity"),
    ("RestClient", "get_external_weights_urls"): lambda w, m: m(w.external_path),
    ("RestClient", "get_sampler"): lambda w, m: m(w.sampler_id),
    ("RestClient", "get_server_capabilities"): lambda w, m: m(),
    ("RestClient", "get_session"): lambda w, m: m(w.session_id),
    ("RestClient", "get_telemetry"): lambda w, m: m(),
    ("RestClient", "get_training_run"): lambda w, m: m(w.training.model_id),
    ("RestClient", "get_training_run_by_tinker_path"): lambda w, m: m(w.state_path),
    ("RestClient", "get_weights_info_by_tinker_path"): lambda w, m: m(w.state_path),
    ("RestClient", "list_checkpoints"): lambda w, m: m(w.training.model_id),
    ("RestClient", "list_sessions"): lambda w, m: m(),
    ("RestClient", "list_training_runs"): lambda w, m: m(project_id="parity"),
    ("RestClient", "list_user_checkpoints"): lambda w, m: m(),
    ("RestClient", "publish_checkpoint_from_tinker_path"): lambda w, m: m(w.state_path),
    ("RestClient", "search_sessions"): lambda w, m: m(
        types.SessionSearchRequest(statuses=[{"type": "active"}])
    ),
    ("RestClient", "set_checkpoint_ttl_from_tinker_path"): lambda w, m: m(w.state_path, 86400),
    ("RestClient", "unpublish_checkpoint_from_tinker_path"): lambda w, m: m(w.state_path),
    ("RestClient", "whoami"): lambda w, m: m(),
}
for _name in (
    "get_audit_log",
    "get_billing_usage",
    "get_current_checkpoint_storage_usage",
    "get_telemetry",
):
    RECIPES[("AdminClient", _name)] = RECIPES[("RestClient", _name)]
# Objects whose methods run: a fresh one where the call ends it (close).
OWNERS: dict[str, Callable[[World, str], Any]] = {
    "ServiceClient": lambda w, name: (
        tinker.ServiceClient(base_url=w.url, api_key=w.key, project_id="parity")
        if name.startswith("close")
        else w.service
    ),
    "TrainingClient": lambda w, _n: w.training,
    "SamplingClient": lambda w, _n: w.sampling,
    "RestClient": lambda w, _n: w.rest,
    "AdminClient": lambda w, _n: w.admin,
}


def _resolve(value: Any) -> Any:
    """Wait for a value: await coroutines (in a loop of their own), `.result()` futures."""
    for _ in range(4):
        if inspect.isawaitable(value) and not hasattr(value, "result"):

            async def wait(v: Any = value) -> Any:
                return await v

            value = asyncio.run(wait())
        elif hasattr(value, "result") and callable(value.result) and not isinstance(value, type):
            value = value.result(timeout=180)
        else:
            return value
    return value


def public_methods(cls: type[Any]) -> list[str]:
    return sorted(n for n in dir(cls) if not n.startswith("_") and callable(getattr(cls, n, None)))


def http_status(exc: BaseException) -> int | None:
    while exc is not None:
        status = getattr(exc, "status_code", None)
        if isinstance(status, int):
            return status
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return None


def call(world: World, cls_name: str, method: str) -> dict[str, Any]:
    base = method.removesuffix("_async")
    recipe = RECIPES.get((cls_name, method)) or RECIPES.get((cls_name, base))
    report: dict[str, Any] = {"method": f"{cls_name}.{method}"}
    if recipe is None:
        return {**report, "outcome": "no_recipe"}
    owner = OWNERS[cls_name](world, method)
    bound = getattr(owner, method)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the deprecated _async variants warn
            value = _resolve(recipe(world, bound))
        return {**report, "outcome": "ok", "value": repr(value)[:120]}
    except BaseException as exc:
        return {
            **report,
            "outcome": "error",
            "status": http_status(exc),
            "error": f"{type(exc).__name__}: {exc}"[:600],
            "trace": traceback.format_exc()[-1500:],
        }


def stable_reinforce_datum(world: World) -> Any:
    """A datum as the cookbook builds it for stable_reinforce: tokens sampled with
    `record_stability_info`, named by their sequence through the provenance spans."""
    sampler = world.training.save_weights_and_get_sampling_client(record_stability_info=True)
    prompt = TOKENS[:4]
    params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=3, stop=[])
    seq = sampler.sample(types.ModelInput.from_ints(prompt), 1, params).result().sequences[0]
    full = prompt + list(seq.tokens)
    plain = types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={
            "target_tokens": full[1:],
            "logprobs": [0.0] * (len(prompt) - 1) + list(seq.logprobs),
            "advantages": [0.0] * (len(prompt) - 1) + [1.0] * len(seq.tokens),
        },
    )
    sid, n = seq.sequence_id, len(seq.tokens)
    return plain.with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id=sid, length=len(prompt)),
            types.SampledProvenanceSpan(sequence_id=sid, length=n - 1),
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=len(prompt) - 1),
            types.SampledProvenanceSpan(sequence_id=sid, length=n),
        ],
    )


def loss_reports(world: World) -> list[dict[str, Any]]:
    out = []
    names = list(getattr(types, "LossFnType").__args__)  # noqa: B009
    for loss in names:
        report: dict[str, Any] = {"method": f"TrainingClient.forward_backward[{loss}]"}
        if loss == "custom":  # not a loss of its own: forward_backward_custom's LossHandle
            continue
        inputs = LOSS_INPUTS.get(loss, {"logprobs": -2.0, "advantages": 1.0})
        try:
            if loss == "stable_reinforce":
                data = [stable_reinforce_datum(world)]
            else:
                data = [world.datum(**inputs)]
            world.training.forward_backward(data, loss).result(timeout=180)
            out.append({**report, "outcome": "ok"})
        except BaseException as exc:
            status = http_status(exc)
            out.append({**report, "outcome": "error", "status": status, "error": str(exc)[:300]})
    return out


def pickled_clone(world: World) -> dict[str, Any]:
    """An unpickled sampling client (a clone: join_sampling_session, its own feed)."""
    report: dict[str, Any] = {"method": "SamplingClient<unpickled>.sample"}
    try:
        clone = pickle.loads(pickle.dumps(world.sampling))
        _sample_checked(clone.sample(PROMPT, 2, PARAMS).result(timeout=180))
        return {**report, "outcome": "ok"}
    except BaseException as exc:
        return {**report, "outcome": "error", "status": http_status(exc), "error": str(exc)[:300]}


def published_reads(world: World, other_key: str) -> list[dict[str, Any]]:
    """Another tenant samples from and trains from the checkpoints once they are published,
    and cannot delete them."""
    reports: list[dict[str, Any]] = []
    world.rest.publish_checkpoint_from_tinker_path(world.state_path).result(timeout=60)
    world.rest.publish_checkpoint_from_tinker_path(world.sampler_path).result(timeout=60)
    other = tinker.ServiceClient(base_url=world.url, api_key=other_key)
    checks: dict[str, Callable[[], Any]] = {
        "create_training_client_from_state": lambda: (
            other.create_training_client_from_state(world.state_path)
            .result(timeout=180)
            .forward([world.datum()], "cross_entropy")
            .result(timeout=180)
        ),
        "create_sampling_client": lambda: _sample_checked(
            other.create_sampling_client(model_path=world.sampler_path)
            .result(timeout=180)
            .sample(PROMPT, 2, PARAMS)
            .result(timeout=180)
        ),
    }
    for name, check in checks.items():
        report: dict[str, Any] = {"method": f"other tenant: ServiceClient.{name}[published]"}
        try:
            check()
            reports.append({**report, "outcome": "ok"})
        except BaseException as exc:
            reports.append(
                {**report, "outcome": "error", "status": http_status(exc), "error": str(exc)[:300]}
            )
    report = {"method": "other tenant: RestClient.delete_checkpoint_from_tinker_path[published]"}
    try:
        tinker.RestClient(base_url=world.url, api_key=other_key).delete_checkpoint_from_tinker_path(
            world.state_path
        ).result(timeout=60)
        reports.append({**report, "outcome": "error", "error": "another tenant deleted it"})
    except tinker.NotFoundError:
        reports.append({**report, "outcome": "ok"})  # never writable by them
    return reports


def main(url: str, key: str, model: str, other_key: str) -> None:
    world = build_world(url, key, model)
    reports = []
    for cls_name, cls in CLASSES.items():
        for method in public_methods(cls):
            reports.append(call(world, cls_name, method))
    reports += loss_reports(world)
    reports.append(pickled_clone(world))
    reports += published_reads(world, other_key)
    for report in reports:
        print("PARITY " + json.dumps(report), flush=True)
    print(f"official parity: {len(reports)} calls", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:5])
