"""Which model an OpenAI request names, and the engine samplers kept for those models.

`model` may be:
- a base model the server keeps resident (also by its folder's name, for a model served from a
  local folder, as `tuneloop deploy` does);
- a checkpoint of the caller: `tinker://<run>/sampler_weights/<name>`, `.../weights/<name>`, or
  an adapter export `.../external_weights/<name>` (not a merged model: `tuneloop deploy` serves
  those);
- `"<base model>;<checkpoint path>"` (the base must be the checkpoint's);
- a sampling session of the caller (`<session>:sample:<n>`), used as it is.
Anything else, another tenant's checkpoint or sampler included, is a 404 that names nothing
but what the caller sent.

Creating a sampler reads the adapter from disk, too slow to do per request: samplers are kept
per (tenant, model) and reused, up to MAX_CACHED_SAMPLERS, the least recently used unused one
freed first; all of them are freed on shutdown.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
from dataclasses import dataclass
from pathlib import Path

from tuneloop.server.api.errors import ApiError, bad_request
from tuneloop.server.api.restarts import require_held
from tuneloop.server.api.state import ServerState
from tuneloop.server.engine.operations import CreateSampler, DeleteSampler
from tuneloop.server.engine.types import EngineError, ModelSpec
from tuneloop.server.scheduler.loop import EngineLoop
from tuneloop.server.storage.registry import MERGED_KIND

# An adapter of LoRA rank 32 on SmolLM2-135M is ~20 MB; 16 of them stay well under a GB.
MAX_CACHED_SAMPLERS = 16
# Usage of the samplers kept here is metered under this session id (see api/metering.py).
SESSION = "oai"


@dataclass(frozen=True)
class Target:
    """A resolved `model`: the base model, and either the caller's sampler to use as it is or
    what a cached sampler is made of (`key` names it among the caller's)."""

    spec: ModelSpec
    sampler_id: str | None = None
    key: str = ""
    weights_dir: Path | None = None


def model_not_found(model: str) -> ApiError:
    return ApiError(404, f"model {model!r} not found", "model")


def _base(state: ServerState, name: str) -> ModelSpec | None:
    spec = state.models.get(name)
    if spec is not None:
        return spec
    # A model served from a folder answers to the folder's name too.
    named = [s for s in state.models.values() if Path(s.name).name == name and "/" in s.name]
    return named[0] if len(named) == 1 else None


async def resolve(state: ServerState, tenant: str, model: str) -> Target:
    base_name, sep, path = model.partition(";")
    if sep:
        spec = _base(state, base_name.strip())
        if spec is None:
            raise model_not_found(model)
        target = await _checkpoint(state, tenant, path.strip(), model)
        if target.spec.name != spec.name:
            raise bad_request(
                f"model: {path.strip()!r} was trained on {target.spec.name!r}, not {spec.name!r}",
                "model",
            )
        return target
    if model.startswith("tinker://"):
        return await _checkpoint(state, tenant, model, model)
    if ":sample:" in model:
        return await _sampler(state, tenant, model)
    spec = _base(state, model)
    if spec is None:
        raise model_not_found(model)
    return Target(spec, key=f"base\0{spec.name}")


async def _checkpoint(state: ServerState, tenant: str, path: str, model: str) -> Target:
    _parsed, row = await state.checkpoint(tenant, path, "model")
    if row.kind == MERGED_KIND:  # every other package (a PEFT export too) holds an adapter
        raise bad_request(
            f"model: {path} is a merged model, not an adapter: serve it with `tuneloop deploy`",
            "model",
        )
    run = await state.db(state.registry.training_run, row.training_run_id, tenant)
    spec = state.models.get(run.base_model) if run is not None else None
    if spec is None:
        raise model_not_found(model)
    # The time it was written: a checkpoint saved again under the same path gets a new sampler.
    key = f"ckpt\0{row.tinker_path}\0{row.created_at.isoformat()}"
    return Target(spec, key=key, weights_dir=Path(row.directory))


async def _sampler(state: ServerState, tenant: str, model: str) -> Target:
    row, session = await state.db(state.sampler_activity, model, tenant)
    if row is None:
        raise model_not_found(model)
    state.check_live(row.session_id, session)
    require_held(
        row.created_at,
        state.futures.started_at,
        f"sampler {row.id!r}",
        "model",
        "create a new sampling client (from a saved checkpoint or the base model)",
    )
    spec = state.models.get(row.base_model)
    if spec is None:
        raise model_not_found(model)
    return Target(spec, sampler_id=row.id)


@dataclass
class _Entry:
    sampler_id: str
    users: int = 0


class SamplerCache:
    """Engine samplers per (tenant, model key), least recently used first."""

    def __init__(self, engine: EngineLoop, limit: int = MAX_CACHED_SAMPLERS) -> None:
        self.engine = engine
        self.limit = limit
        self._entries: collections.OrderedDict[tuple[str, str], _Entry] = collections.OrderedDict()
        self._creating = asyncio.Lock()
        self._deleting: set[asyncio.Future[None]] = set()

    def __len__(self) -> int:
        return len(self._entries)

    def sampler_ids(self) -> list[str]:
        return [e.sampler_id for e in self._entries.values()]

    async def acquire(self, tenant: str, target: Target) -> str:
        """The sampler for `target`, created if needed; hold it until `release`."""
        if target.sampler_id is not None:  # the caller's own sampling session
            return target.sampler_id
        key = (tenant, target.key)
        entry = self._entries.get(key)
        if entry is None:
            # One creation at a time, so two requests never make two samplers for one model.
            # Requests for models already here never wait on it: creating runs on the engine
            # thread, which may be busy with a decode batch for a while.
            async with self._creating:
                entry = self._entries.get(key) or await self._create(key, target)
        entry.users += 1
        self._entries.move_to_end(key)
        self._evict()
        return entry.sampler_id

    async def _create(self, key: tuple[str, str], target: Target) -> _Entry:
        digest = hashlib.sha256("\0".join(key).encode()).hexdigest()[:20]
        sampler_id = f"{SESSION}:{digest}"
        try:
            await self.engine.perform(
                CreateSampler(sampler_id, target.spec.name, weights_dir=target.weights_dir)
            )
        except EngineError as exc:
            status = 400 if exc.category == "user" else 500
            raise ApiError(status, f"model: {exc}", "model") from None
        entry = self._entries[key] = _Entry(sampler_id)
        return entry

    def release(self, sampler_id: str) -> None:
        for entry in self._entries.values():
            if entry.sampler_id == sampler_id:
                entry.users = max(0, entry.users - 1)
                return

    def _evict(self) -> None:
        """Free the least recently used samplers nobody holds, down to the limit. The deletion
        runs on the engine thread after what is queued there (a later creation of the same
        sampler included, which comes after it), and nobody waits for it."""
        idle = [k for k, e in self._entries.items() if e.users == 0]
        for key in idle[: max(0, len(self._entries) - self.limit)]:
            entry = self._entries.pop(key)
            task = asyncio.ensure_future(self.engine.perform(DeleteSampler(entry.sampler_id)))
            self._deleting.add(task)
            task.add_done_callback(self._deleting.discard)

    async def close(self) -> None:
        await asyncio.gather(*self._deleting, return_exceptions=True)
        entries, self._entries = list(self._entries.values()), collections.OrderedDict()
        for entry in entries:
            await self.engine.perform(DeleteSampler(entry.sampler_id))
