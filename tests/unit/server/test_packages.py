"""Model packages: every saved checkpoint is a versioned package (name, version, kind, base
model, LoRA config, parent, training step, size, created, TTL); TTLs are set and expired
packages collected, files and all; registries of an older version are migrated forward."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import tinker
from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Integer,
    MetaData,
    String,
    Table,
    create_engine,
    insert,
)

import tuneloop
from tests.unit.server.harness import MODEL, Api, datum, expect_error, optim_step
from tuneloop._local_server import live_server, stop
from tuneloop.server.api.packages import run_package_gc
from tuneloop.server.storage.layout import TinkerPath
from tuneloop.server.storage.registry import Registry, UsageFilter, engine_url, merged_package


async def save(api: Api, model_id: str, seq_id: int, name: str, **extra: Any) -> dict[str, Any]:
    """save_weights (training state); returns the future's result body."""
    body = {"model_id": model_id, "path": name, "seq_id": seq_id, **extra}
    done = await api.result(await api.post("save_weights", body))
    result: dict[str, Any] = done.json()
    return result


async def save_sampler(api: Api, model_id: str, seq_id: int, name: str) -> dict[str, Any]:
    body = {"model_id": model_id, "path": name, "seq_id": seq_id}
    done = await api.result(await api.post("save_weights_for_sampler", body))
    result: dict[str, Any] = done.json()
    return result


async def packages(api: Api, run_id: str | None = None) -> dict[str, dict[str, Any]]:
    path = f"training_runs/{run_id}/checkpoints" if run_id else "checkpoints"
    response = await api.get(path)
    assert response.status_code == 200, response.text
    return {c["tinker_path"]: c for c in response.json()["checkpoints"]}


async def train_steps(api: Api, model_id: str, first_seq: int, steps: int) -> int:
    """`steps` rounds of forward_backward + optim_step; returns the next free seq_id."""
    seq = first_seq
    for _ in range(steps):
        await api.result(await api.forward_backward(model_id, seq, [datum([1, 2, 3])]))
        await optim_step(api, model_id, seq + 1)
        seq += 2
    return seq


async def test_versions_count_per_tenant_and_name_and_are_never_reused(
    api: Api, other_tenant: Api
) -> None:
    session_id = await api.session()
    first = await api.model(session_id, seq=0)
    second = await api.model(session_id, seq=1)
    v1 = (await save(api, first, 1, "final"))["path"]
    v2 = (await save_sampler(api, first, 2, "final"))["path"]
    v3 = (await save(api, second, 1, "final"))["path"]
    await save(api, first, 3, "other")
    listed = await packages(api)
    assert [(listed[p]["name"], listed[p]["version"]) for p in (v1, v2, v3)] == [
        ("final", 1),
        ("final", 2),
        ("final", 3),
    ]
    assert [listed[p]["kind"] for p in (v1, v2, v3)] == [
        "training-state",
        "sampler",
        "training-state",
    ]
    other = [c for c in listed.values() if c["name"] == "other"]
    assert [c["version"] for c in other] == [1]

    # overwrite=False refuses an existing name: the save fails and registers nothing.
    refused = await api.result(
        await api.post("save_weights", {"model_id": first, "path": "final", "seq_id": 4})
    )
    assert "already exists" in refused.text
    # overwrite=True replaces the files, so the row is replaced by a new version.
    assert (await save(api, first, 5, "final", overwrite=True))["path"] == v1
    listed = await packages(api)
    assert listed[v1]["version"] == 4
    assert len(listed) == 4

    # A deleted newest version leaves its number used.
    run_id, _, checkpoint_id = v3.removeprefix("tinker://").partition("/")
    gone = await api.http.delete(
        f"/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id}", headers=api.headers()
    )
    assert gone.status_code == 200, gone.text
    await save(api, second, 2, "later")
    await save(api, second, 3, "final")
    assert (await packages(api))[v3]["version"] == 5

    # Another tenant's names are its own.
    bob_model = await other_tenant.model(await other_tenant.session())
    bob_path = (await save(other_tenant, bob_model, 1, "final"))["path"]
    assert (await packages(other_tenant))[bob_path]["version"] == 1


async def test_package_fields_step_parent_and_lora_config(api: Api) -> None:
    session_id = await api.session()
    body = {
        "session_id": session_id,
        "model_seq_id": 0,
        "base_model": MODEL,
        "lora_config": {"rank": 2, "seed": 0, "train_unembed": False},
    }
    model_id = (await api.result(await api.post("create_model", body))).json()["model_id"]
    seq = await train_steps(api, model_id, 1, 3)
    await api.result(await api.forward_backward(model_id, seq, [datum([4, 5, 6])]))  # no step
    saved = (await save(api, model_id, seq + 1, "s3", ttl_seconds=7200))["path"]
    package = (await packages(api, model_id))[saved]
    assert package["training_step"] == 3
    assert package["parent_tinker_path"] is None
    assert (package["base_model"], package["lora_rank"]) == (MODEL, 2)
    assert package["lora_targets"] == ["attn", "mlp"]
    assert package["size_bytes"] > 0
    assert package["checkpoint_type"] == "training"
    created = datetime.fromisoformat(package["time"])
    expires = datetime.fromisoformat(package["expires_at"])
    assert timedelta(seconds=7199) <= expires - created <= timedelta(seconds=7201)
    # The official SDK reads these listings: the extra fields must not break its types.
    parsed = tinker.types.Checkpoint.model_validate(package)
    assert parsed.tinker_path == saved

    # A run created from the package continues its step count; the package is its parent.
    session_two = await api.session()
    load = {
        "session_id": session_two,
        "model_seq_id": 0,
        "path": saved,
        "optimizer": True,
        "type": "load_weights",
    }
    loaded = (await api.result(await api.post("load_weights", load))).json()["model_id"]
    await train_steps(api, loaded, 1, 2)
    child = (await save_sampler(api, loaded, 5, "child"))["path"]
    child_package = (await packages(api, loaded))[child]
    assert child_package["training_step"] == 5
    assert child_package["parent_tinker_path"] == saved
    assert child_package["kind"] == "sampler"
    assert child_package["lora_targets"] == ["attn", "mlp"]

    # Loading into an existing run also sets its step and parent.
    fresh = await api.model(session_two, seq=1)
    await train_steps(api, fresh, 1, 1)
    legacy = {"model_id": fresh, "seq_id": 3, "path": saved, "optimizer": False}
    response = await api.post("load_weights", legacy)
    expect_error(response, 400, "path")  # rank 4 run, rank 2 package: refused, seq 3 consumed
    same_rank = await api.result(
        await api.post(
            "create_model",
            {**body, "session_id": session_two, "model_seq_id": 2},
        )
    )
    target = same_rank.json()["model_id"]
    await train_steps(api, target, 1, 1)
    load_into = {"model_id": target, "seq_id": 3, "path": saved, "optimizer": False}
    assert (await api.result(await api.post("load_weights", load_into))).status_code == 200
    again = (await save(api, target, 4, "after-load"))["path"]
    assert (await packages(api, target))[again]["training_step"] == 3
    assert (await packages(api, target))[again]["parent_tinker_path"] == saved


async def test_ttl_is_checked_set_and_cleared(api: Api, other_tenant: Api) -> None:
    session_id = await api.session()
    model_id = await api.model(session_id)
    short = await api.post(
        "save_weights", {"model_id": model_id, "path": "w", "seq_id": 1, "ttl_seconds": 60}
    )
    expect_error(short, 400, "ttl_seconds")
    path = (await save(api, model_id, 2, "w"))["path"]  # seq 1 was consumed by the rejection
    assert (await packages(api))[path]["expires_at"] is None
    run_id, _, checkpoint_id = path.removeprefix("tinker://").partition("/")
    ttl_url = f"training_runs/{run_id}/checkpoints/{checkpoint_id}/ttl"

    async def put(client: Api, url: str, body: Any) -> Any:
        return await client.http.put(f"/api/v1/{url}", json=body, headers=client.headers())

    before = datetime.now(UTC)
    response = await put(api, ttl_url, {"ttl_seconds": 86400})
    assert response.status_code == 200, response.text
    expires = datetime.fromisoformat((await packages(api))[path]["expires_at"])
    assert before + timedelta(days=1) <= expires <= datetime.now(UTC) + timedelta(days=1)
    assert response.json()["expires_at"] == (await packages(api))[path]["expires_at"]
    assert (await put(api, ttl_url, {"ttl_seconds": None})).status_code == 200
    assert (await packages(api))[path]["expires_at"] is None

    expect_error(await put(api, ttl_url, {"ttl_seconds": 10}), 400, "ttl_seconds")
    expect_error(await put(api, ttl_url, {"ttl_seconds": 11 * 365 * 86400}), 400, "ttl_seconds")
    expect_error(await put(api, ttl_url, {}), 400, "ttl_seconds")
    expect_error(await put(other_tenant, ttl_url, {"ttl_seconds": 7200}), 404, "checkpoint_id")
    missing = f"training_runs/{run_id}/checkpoints/weights/nope/ttl"
    expect_error(await put(api, missing, {"ttl_seconds": 7200}), 404, "checkpoint_id")
    bad = f"training_runs/{run_id}/checkpoints/bogus/w/ttl"
    expect_error(await put(api, bad, {"ttl_seconds": 7200}), 400, "checkpoint_id")


def test_rest_client_sets_the_ttl(tmp_path: Path) -> None:
    """Our SDK's RestClient against a real server process (the official SDK: tests/compat)."""
    with live_server(tmp_path) as live:
        with tuneloop.ServiceClient(base_url=live.url, api_key=live.key) as service:
            training = service.create_lora_training_client("tuneloop/fake-tiny", rank=2)
            path = training.save_state("kept").result(60).path
            rest = service.create_rest_client()
            rest.set_checkpoint_ttl_from_tinker_path(path, 7200).result(30)
            [listed] = rest.list_checkpoints(training.model_id).result(30).checkpoints
            assert listed.expires_at is not None
            assert (listed.name, listed.version, listed.kind) == ("kept", 1, "training-state")
            rest.set_checkpoint_ttl_from_tinker_path(path, None).result(30)
            [again] = rest.list_checkpoints(training.model_id).result(30).checkpoints
            assert again.expires_at is None
        assert stop(live.process) == 0


async def test_expired_packages_are_collected_row_then_files(api: Api, server: Any) -> None:
    app, _keys = server
    registry: Registry = app.state.tuneloop.registry
    model_id = await api.model(await api.session())
    expiring = (await save(api, model_id, 1, "a", ttl_seconds=3600))["path"]
    later = (await save(api, model_id, 2, "b", ttl_seconds=3 * 3600))["path"]
    forever = (await save(api, model_id, 3, "c"))["path"]
    rows = {p: registry.checkpoint(p, "alice") for p in (expiring, later, forever)}
    directories = {p: Path(r.directory) for p, r in rows.items() if r is not None}
    assert all(d.is_dir() for d in directories.values())

    now = datetime.now(UTC)
    assert registry.collect_expired(now) == []
    removed = registry.collect_expired(now + timedelta(hours=2))
    assert [r.tinker_path for r in removed] == [expiring]
    assert not directories[expiring].exists()
    assert set(await packages(api)) == {later, forever}

    # The server's periodic task, with a clock set past the second expiry.
    task = asyncio.get_running_loop().create_task(
        run_package_gc(registry, interval_s=0.01, clock=lambda: now + timedelta(hours=4))
    )
    try:
        # The row goes first and its files a moment later in the collector's thread: wait
        # for both (the test checked the files as soon as the row went, and lost that race).
        for _ in range(500):
            if later not in await packages(api) and not directories[later].exists():
                break
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
    assert set(await packages(api)) == {forever}
    assert not directories[later].exists()
    assert directories[forever].is_dir()


async def test_a_merged_package_is_no_adapter_to_load_or_sample(api: Api, server: Any) -> None:
    app, _keys = server
    registry: Registry = app.state.tuneloop.registry
    model_id = await api.model(await api.session())
    source = (await save(api, model_id, 1, "w"))["path"]
    row = registry.checkpoint(source, "alice")
    assert row is not None
    merged_dir = Path(row.directory).parent / "merged-out"
    merged_dir.mkdir()
    (merged_dir / "model.safetensors").write_bytes(b"12345")
    target = TinkerPath(model_id, "external_weights", "w-merged")
    package = registry.register_package(merged_package(row, target, merged_dir))
    assert (package.kind, package.version, package.size_bytes) == ("merged", 1, 5)
    listed = (await packages(api))[str(target)]
    assert listed["checkpoint_type"] == "external"
    assert listed["parent_tinker_path"] == source
    load = {"model_id": model_id, "seq_id": 2, "path": str(target), "optimizer": False}
    expect_error(await api.post("load_weights", load), 400, "path")
    session_id = model_id.split(":")[0]
    as_sampler = {"session_id": session_id, "sampling_session_seq_id": 0, "model_path": str(target)}
    expect_error(await api.post("create_sampling_session", as_sampler), 400, "model_path")


def _legacy_tables(metadata: MetaData) -> tuple[Table, Table, Table]:
    """The registry tables as tuneloop wrote them before packages and hourly usage."""
    runs = Table(
        "training_runs", metadata,
        Column("id", String(128), primary_key=True), Column("tenant", String(64)),
        Column("session_id", String(64)), Column("base_model", String(256)),
        Column("lora_rank", Integer), Column("lora_seed", Integer),
        Column("train_mlp", Boolean), Column("train_attn", Boolean),
        Column("train_unembed", Boolean), Column("user_metadata", JSON, nullable=True),
        Column("created_at", DateTime(timezone=True)),
        Column("last_request_time", DateTime(timezone=True)),
    )  # fmt: skip
    checkpoints = Table(
        "checkpoints", metadata,
        Column("tinker_path", String(512), primary_key=True), Column("tenant", String(64)),
        Column("training_run_id", String(128)), Column("checkpoint_id", String(256)),
        Column("checkpoint_type", String(16)), Column("directory", String(1024)),
        Column("size_bytes", Integer), Column("created_at", DateTime(timezone=True)),
        Column("expires_at", DateTime(timezone=True), nullable=True),
        Column("user_metadata", JSON, nullable=True),
    )  # fmt: skip
    usage = Table(
        "usage", metadata,
        Column("tenant", String(64), primary_key=True),
        Column("session_id", String(64), primary_key=True),
        Column("model_id", String(128), primary_key=True),
        Column("kind", String(32), primary_key=True),
        Column("tokens", BigInteger), Column("requests", BigInteger),
        Column("updated_at", DateTime(timezone=True)),
    )  # fmt: skip
    return runs, checkpoints, usage


def test_an_older_registry_is_migrated_forward(db_url: str) -> None:
    metadata = MetaData()
    runs, checkpoints, usage = _legacy_tables(metadata)
    engine = create_engine(engine_url(db_url))
    metadata.create_all(engine)
    t0 = datetime(2025, 5, 1, 10, 20, tzinfo=UTC)
    with engine.begin() as conn:
        conn.execute(
            insert(runs).values(
                id="s:train:0", tenant="alice", session_id="s", base_model=MODEL, lora_rank=8,
                lora_seed=1, train_mlp=True, train_attn=False, train_unembed=True,
                created_at=t0, last_request_time=t0,
            )
        )  # fmt: skip
        for i, (segment, kind) in enumerate(
            (("weights", "training"), ("sampler_weights", "sampler"))
        ):
            conn.execute(
                insert(checkpoints).values(
                    tinker_path=f"tinker://s:train:0/{segment}/step1", tenant="alice",
                    training_run_id="s:train:0", checkpoint_id=f"{segment}/step1",
                    checkpoint_type=kind, directory="/nowhere", size_bytes=10,
                    created_at=t0 + timedelta(minutes=i),
                )
            )  # fmt: skip
        for kind, tokens in (("train", 7), ("forward", 3), ("sample_prompt", 4),
                             ("sample_generated", 9)):  # fmt: skip
            model = "s:sample:0" if kind.startswith("sample") else "s:train:0"
            conn.execute(
                insert(usage).values(
                    tenant="alice", session_id="s", model_id=model, kind=kind, tokens=tokens,
                    requests=1, updated_at=t0,
                )
            )  # fmt: skip
    engine.dispose()

    registry = Registry(db_url)
    try:
        [sampler_row, training_row] = registry.all_checkpoints("alice")  # newest first
        assert (training_row.name, training_row.version, training_row.kind) == (
            "step1", 1, "training-state",
        )  # fmt: skip
        assert (sampler_row.version, sampler_row.kind) == (2, "sampler")
        assert training_row.lora_targets == ["mlp", "unembed"]
        assert (training_row.base_model, training_row.lora_rank) == (MODEL, 8)
        assert training_row.training_step is None  # not known for old checkpoints
        run = registry.training_run("s:train:0", "alice")
        assert run is not None
        assert run.training_step == 0
        sums = {s.operation: s for s in registry.usage_sums(UsageFilter("alice"))}
        assert sums["forward_backward"].trained_tokens == 7
        assert sums["forward"].prefill_tokens == 3
        assert (sums["sample"].prefill_tokens, sums["sample"].sampled_tokens) == (4, 9)
        assert sums["sample"].requests == 1  # one request, not one per old kind
        assert {s.hour for s in sums.values()} == {int(t0.timestamp()) // 3600 * 3600}
    finally:
        registry.close()
    # Opening it again changes nothing (the migration is done) and versions carry on.
    registry = Registry(db_url)
    try:
        assert [r.version for r in registry.all_checkpoints("alice")] == [2, 1]
        assert len(registry.usage_sums(UsageFilter("alice"))) == 3
    finally:
        registry.close()
