"""Every Registry method, on SQLite and on PostgreSQL (a fresh schema per test, tests/db.py).

Beyond what the methods return, what differs between the two databases: aware datetimes, JSON
columns, enforced string lengths, and concurrent writers of one usage or package-name row.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.db import schema_of
from tests.unit.server.harness import MODEL, Api, expect_error
from tuneloop.server.storage.layout import TinkerPath
from tuneloop.server.storage.registry import (
    CheckpointRow,
    Registry,
    SamplerRow,
    SessionRow,
    TrainingRunRow,
    UsageCount,
    UsageFilter,
    engine_url,
    utcnow,
)

HOUR = 3600 * 480_000  # an hour-aligned epoch second


@pytest.fixture
def registry(db_url: str) -> Iterator[Registry]:
    reg = Registry(db_url)
    yield reg
    reg.close()


def _session(reg: Registry, session_id: str, tenant: str = "alice", **kw: Any) -> None:
    reg.add(SessionRow(id=session_id, tenant=tenant, **kw))


def _run(reg: Registry, run_id: str, session_id: str, tenant: str = "alice", **kw: Any) -> None:
    reg.add(
        TrainingRunRow(
            id=run_id,
            tenant=tenant,
            session_id=session_id,
            base_model="tuneloop/fake-tiny",
            lora_rank=4,
            lora_seed=0,
            train_mlp=True,
            train_attn=True,
            train_unembed=False,
            **kw,
        )
    )


def _checkpoint(
    tmp_path: Path, run_id: str, name: str, tenant: str = "alice", **kw: Any
) -> CheckpointRow:
    path = TinkerPath(run_id, "weights", name)
    directory = tmp_path / "ckpt" / tenant / name
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter.safetensors").write_bytes(b"x" * 10)
    return CheckpointRow(
        tinker_path=str(path),
        tenant=tenant,
        training_run_id=run_id,
        checkpoint_id=path.checkpoint_id,
        checkpoint_type="training",
        directory=str(directory),
        size_bytes=10,
        name=name,
        **kw,
    )


def test_engine_url_gives_postgres_urls_the_psycopg_driver() -> None:
    assert engine_url("postgresql://u@h:5432/db") == "postgresql+psycopg://u@h:5432/db"
    assert engine_url("postgres://u@h/db?x=1") == "postgresql+psycopg://u@h/db?x=1"
    for unchanged in ("postgresql+psycopg://u@h/db", "sqlite:////tmp/r.sqlite3", "sqlite://"):
        assert engine_url(unchanged) == unchanged


def test_plain_postgresql_urls_work(db_url: str) -> None:
    if db_url.startswith("sqlite"):
        pytest.skip("a PostgreSQL URL form")
    assert db_url.startswith("postgresql://")  # no driver named: psycopg 3 is chosen
    reg = Registry(db_url.replace("postgresql://", "postgres://", 1))
    try:
        with reg.engine.connect() as conn:
            assert conn.exec_driver_sql("SHOW search_path").scalar() == schema_of(db_url)
        assert reg.engine.dialect.driver == "psycopg"
    finally:
        reg.close()


def test_sessions(registry: Registry) -> None:
    metadata = {"team": "rl", "nested": {"k": [1, 2.5, None, "é"]}}
    _session(registry, "s1", user_metadata=metadata, tags=["a", "b"], sdk_version="0.1")
    _session(registry, "s2")
    _session(registry, "s3", tenant="bob")
    row = registry.session("s1", "alice")
    assert row is not None
    assert row.user_metadata == metadata
    assert row.tags == ["a", "b"]
    assert row.created_at.tzinfo is not None
    assert abs(row.created_at - utcnow()) < timedelta(minutes=1)
    assert registry.session("s1", "bob") is None  # another tenant's row is not found
    assert registry.session("nope", "alice") is None
    assert registry.session_any_tenant("s3") is not None

    before = row.last_heartbeat
    registry.touch_session("s1")
    registry.touch_session("nope")  # unknown: nothing happens
    after = registry.session("s1", "alice")
    assert after is not None
    assert after.last_heartbeat >= before

    assert set(registry.list_sessions("alice", 10, 0)) == {"s1", "s2"}
    assert len(registry.list_sessions("alice", 1, 0) + registry.list_sessions("alice", 1, 1)) == 2
    assert registry.list_sessions("alice", 10, 2) == []

    assert registry.count_live_sessions("alice", None) == 2
    assert registry.finish_session("s2", "success") is True
    assert registry.finish_session("s2", "errored") is False  # the first finish wins
    assert registry.finish_session("nope", "success") is False
    finished = registry.session("s2", "alice")
    assert finished is not None
    assert finished.finish_reason == "success"
    assert finished.finished_at is not None
    assert finished.finished_at.tzinfo is not None
    assert registry.count_live_sessions("alice", None) == 1
    assert registry.count_live_sessions("alice", utcnow() + timedelta(hours=1)) == 0
    oldest = registry.oldest_live_activity("alice")
    assert oldest is not None
    assert oldest.tzinfo is not None
    assert registry.oldest_live_activity("carol") is None
    assert set(registry.stale_sessions(utcnow() + timedelta(seconds=1))) == {"s1", "s3"}
    assert registry.stale_sessions(utcnow() - timedelta(hours=1)) == []


def test_training_runs_and_samplers(registry: Registry) -> None:
    _session(registry, "s1")
    _run(registry, "s1:train:0", "s1", user_metadata={"x": "y"})
    _run(registry, "s1:train:1", "s1")
    _session(registry, "b1", tenant="bob")
    _run(registry, "b1:train:0", "b1", tenant="bob")
    registry.add(
        SamplerRow(
            id="s1:sample:0", tenant="alice", session_id="s1", base_model="m", model_path=None
        )
    )

    run = registry.training_run("s1:train:0", "alice")
    assert run is not None
    assert run.user_metadata == {"x": "y"}
    assert (run.lora_rank, run.train_mlp, run.train_unembed) == (4, True, False)
    assert registry.training_run("s1:train:0", "bob") is None
    assert registry.training_run_any_tenant("b1:train:0") is not None

    registry.touch_training_run("s1:train:0")
    touched = registry.training_run("s1:train:0", "alice")
    assert touched is not None
    assert touched.last_request_time >= run.last_request_time
    registry.advance_training_step("s1:train:0")
    registry.advance_training_step("s1:train:0")
    stepped = registry.training_run("s1:train:0", "alice")
    assert stepped is not None
    assert stepped.training_step == 2
    registry.set_training_origin("s1:train:1", "tinker://x/weights/y", 7)
    origin = registry.training_run("s1:train:1", "alice")
    assert origin is not None
    assert (origin.parent_path, origin.training_step) == ("tinker://x/weights/y", 7)

    rows, total = registry.list_training_runs("alice", 1, 0)
    assert total == 2
    assert len(rows) == 1
    assert {r.id for r in registry.all_training_runs("alice")} == {"s1:train:0", "s1:train:1"}
    assert len(registry.all_training_runs()) == 3
    runs, samplers = registry.session_children("s1")
    assert (sorted(runs), samplers) == (["s1:train:0", "s1:train:1"], ["s1:sample:0"])
    assert registry.session_children("nope") == ([], [])

    sampler = registry.sampler("s1:sample:0", "alice")
    assert sampler is not None
    assert sampler.created_at.tzinfo is not None
    assert registry.sampler("s1:sample:0", "bob") is None
    assert registry.usage_owner("s1:sample:0") == "alice"
    assert registry.usage_owner("b1:train:0") == "bob"
    assert registry.usage_owner("nope") is None


def test_checkpoints_and_packages(registry: Registry, tmp_path: Path) -> None:
    _session(registry, "s1")
    _run(registry, "s1:train:0", "s1")
    first = registry.register_package(_checkpoint(tmp_path, "s1:train:0", "ckpt"))
    again = registry.register_package(_checkpoint(tmp_path, "s1:train:0", "ckpt"))  # overwrite
    other = registry.register_package(
        _checkpoint(tmp_path, "s1:train:0", "other", user_metadata={"step": "3"})
    )
    assert (first.version, again.version, other.version) == (1, 2, 1)
    bobs = registry.register_package(_checkpoint(tmp_path, "b:train:0", "ckpt", tenant="bob"))
    assert bobs.version == 1  # versions count per tenant

    row = registry.checkpoint(first.tinker_path, "alice")
    assert row is not None
    assert row.version == 2
    assert row.created_at.tzinfo is not None
    assert registry.checkpoint(first.tinker_path, "bob") is None
    assert registry.checkpoint_any_tenant(bobs.tinker_path) is not None
    rows, total = registry.list_checkpoints("alice")
    assert total == 2
    assert {r.name for r in rows} == {"ckpt", "other"}
    rows, total = registry.list_checkpoints("alice", training_run_id="none", limit=5)
    assert (rows, total) == ([], 0)
    assert len(registry.list_checkpoints("alice", limit=1, offset=1)[0]) == 1
    assert len(registry.all_checkpoints()) == 3
    assert len(registry.all_checkpoints("alice", "s1:train:0")) == 2

    past = utcnow() - timedelta(minutes=1)
    assert registry.set_checkpoint_expiry(other.tinker_path, "bob", past) is None
    expiring = registry.set_checkpoint_expiry(other.tinker_path, "alice", past)
    assert expiring is not None
    assert [r.tinker_path for r in registry.expired_checkpoints(utcnow())] == [other.tinker_path]
    stored = registry.checkpoint(other.tinker_path, "alice")
    assert stored is not None
    assert stored.expires_at is not None
    assert stored.expires_at.tzinfo is not None
    assert abs(stored.expires_at - past) < timedelta(milliseconds=1)
    removed = registry.collect_expired()
    assert [r.tinker_path for r in removed] == [other.tinker_path]
    assert not Path(other.directory).exists()
    assert registry.set_checkpoint_expiry(first.tinker_path, "alice", None) is not None
    assert registry.collect_expired(utcnow() + timedelta(days=999)) == []

    assert registry.delete_checkpoint(first.tinker_path, "bob") is None
    assert registry.remove_checkpoint(first.tinker_path, "alice") is not None
    assert not Path(first.directory).exists()
    assert registry.remove_checkpoint(first.tinker_path, "alice") is None
    assert registry.delete_checkpoint(bobs.tinker_path, "bob") is not None
    assert registry.all_checkpoints() == []


def test_usage_sums(registry: Registry) -> None:
    registry.add_usage(
        [
            UsageCount(
                "alice", HOUR, "s1", "s1:train:0", "forward_backward", trained_tokens=10, requests=1
            ),
            UsageCount(
                "alice",
                HOUR,
                "s1",
                "s1:sample:0",
                "sample",
                prefill_tokens=3,
                sampled_tokens=7,
                requests=1,
            ),
            UsageCount(
                "alice",
                HOUR + 3600,
                "s2",
                "s2:train:0",
                "forward_backward",
                trained_tokens=5,
                requests=1,
            ),
            UsageCount(
                "bob", HOUR, "b1", "b1:train:0", "forward_backward", trained_tokens=1, requests=1
            ),
        ]
    )
    registry.add_usage(
        [
            UsageCount(
                "alice",
                HOUR,
                "s1",
                "s1:train:0",
                "forward_backward",
                trained_tokens=2**40,
                requests=1,
            )
        ]
    )
    sums = registry.usage_sums(UsageFilter(tenant="alice"))
    assert [(s.hour, s.operation, s.trained_tokens, s.requests) for s in sums] == [
        (HOUR, "forward_backward", 10 + 2**40, 2),
        (HOUR, "sample", 0, 1),
        (HOUR + 3600, "forward_backward", 5, 1),
    ]
    assert all(isinstance(s.trained_tokens, int) for s in sums)  # not Decimal (PostgreSQL sum)
    only_s2 = registry.usage_sums(UsageFilter(tenant="alice", session_id="s2"))
    assert [s.trained_tokens for s in only_s2] == [5]
    sampler = registry.usage_sums(UsageFilter(tenant="alice", model_id="s1:sample:0"))
    assert [(s.prefill_tokens, s.sampled_tokens) for s in sampler] == [(3, 7)]
    window = UsageFilter(tenant="alice", since_hour=HOUR + 3600, until_hour=HOUR + 7200)
    assert [s.trained_tokens for s in registry.usage_sums(window)] == [5]
    everyone = registry.usage_sums(UsageFilter())
    assert [s.tenant for s in everyone] == ["alice", "alice", "alice", "bob"]


def _together(count: int, work: Callable[[int], None]) -> list[BaseException]:
    """Run `work(i)` on `count` threads released at once; the errors they raised."""
    barrier = threading.Barrier(count)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait(10)
            work(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return errors


def test_concurrent_writers_of_one_usage_row_lose_nothing(db_url: str) -> None:
    """Several server processes (one Registry each) adding to a row none of them has seen."""
    registries = [Registry(db_url) for _ in range(4)]
    try:

        def add(i: int) -> None:
            count = UsageCount(
                "alice", HOUR, "s1", "m", "forward_backward", trained_tokens=1, requests=1
            )
            for _ in range(5):
                registries[i].add_usage([count])

        assert _together(4, add) == []
        [total] = registries[0].usage_sums(UsageFilter(tenant="alice"))
        assert (total.trained_tokens, total.requests) == (20, 20)
    finally:
        for reg in registries:
            reg.close()


def test_concurrent_packages_of_one_name_get_distinct_versions(db_url: str, tmp_path: Path) -> None:
    registries = [Registry(db_url) for _ in range(4)]
    try:

        def register(i: int) -> None:
            registries[i].register_package(_checkpoint(tmp_path, f"s1:train:{i}", "same"))

        assert _together(4, register) == []
        rows = registries[0].all_checkpoints("alice")
        assert sorted(r.version or 0 for r in rows) == [1, 2, 3, 4]
    finally:
        for reg in registries:
            reg.close()


def test_records_survive_reopening(db_url: str, tmp_path: Path) -> None:
    first = Registry(db_url)
    _session(first, "s1", user_metadata={"a": 1})
    _run(first, "s1:train:0", "s1")
    first.register_package(_checkpoint(tmp_path, "s1:train:0", "ckpt"))
    first.add_usage(
        [UsageCount("alice", HOUR, "s1", "s1:train:0", "forward_backward", trained_tokens=3)]
    )
    first.close()
    second = Registry(db_url)  # creating the tables again is a no-op
    try:
        session = second.session("s1", "alice")
        assert session is not None
        assert session.user_metadata == {"a": 1}
        assert second.training_run("s1:train:0", "alice") is not None
        assert [r.name for r in second.all_checkpoints("alice")] == ["ckpt"]
        assert second.usage_sums(UsageFilter(tenant="alice"))[0].trained_tokens == 3
    finally:
        second.close()


def test_times_come_back_aware_and_equal(registry: Registry) -> None:
    when = datetime(2026, 3, 1, 12, 30, 15, 123456, tzinfo=UTC)
    _session(registry, "s1", created_at=when, last_heartbeat=when)
    row = registry.session("s1", "alice")
    assert row is not None
    assert row.created_at == when
    assert row.created_at.utcoffset() == timedelta(0)


async def test_fields_longer_than_their_columns_are_400s_not_database_errors(api: Api) -> None:
    """SQLite ignores VARCHAR lengths, PostgreSQL enforces them: the API checks them first."""
    create = {"tags": [], "sdk_version": "v" * 33}
    expect_error(await api.post("create_session", create), 400, "sdk_version")
    session_id = await api.session()
    too_big = 2**63
    model = {"session_id": session_id, "model_seq_id": too_big, "base_model": MODEL}
    expect_error(await api.post("create_model", model), 400, "model_seq_id")
    sampler = {"session_id": session_id, "sampling_session_seq_id": too_big, "base_model": MODEL}
    expect_error(await api.post("create_sampling_session", sampler), 400, "sampling_session_seq_id")
    biggest = {**sampler, "sampling_session_seq_id": too_big - 1}
    assert (await api.post("create_sampling_session", biggest)).status_code == 200


def test_add_never_overwrites_a_row(registry: Registry) -> None:
    from tuneloop.server.storage.registry import RowExistsError

    _session(registry, "s1")
    _run(registry, "s1:train:0", "s1")
    with pytest.raises(RowExistsError, match="s1:train:0"):
        _run(registry, "s1:train:0", "s1", user_metadata={"second": True})
    row = registry.training_run("s1:train:0", "alice")
    assert row is not None
    assert row.user_metadata is None  # unchanged
    registry.add(SamplerRow(id="s1:sample:0", tenant="alice", session_id="s1", base_model=MODEL))
    with pytest.raises(RowExistsError):
        registry.add(
            SamplerRow(id="s1:sample:0", tenant="alice", session_id="s1", base_model="other")
        )
    sampler = registry.sampler("s1:sample:0", "alice")
    assert sampler is not None
    assert sampler.base_model == MODEL


def test_sqlite_registry_files_are_private(tmp_path: Path) -> None:
    import stat

    reg = Registry(f"sqlite:///{tmp_path / 'registry.sqlite3'}")
    try:
        _session(reg, "s1")
        files = sorted(tmp_path.glob("registry.sqlite3*"))
        assert files
        for path in files:
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    finally:
        reg.close()
