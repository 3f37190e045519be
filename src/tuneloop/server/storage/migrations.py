"""Forward migration of a registry an older tuneloop wrote: run on every open, a no-op once done.

`create_all` makes missing tables but never changes an existing one, so this adds the columns
newer code declares (nullable, or with their server default), moves the per-kind usage totals of
the old `usage` table into the hourly `usage_hourly` table, and gives checkpoints saved before
model packages existed their package name, kind, model, LoRA config and version. Only portable
SQL (ALTER TABLE ... ADD COLUMN, plain selects and inserts), so SQLite and PostgreSQL both work.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine, MetaData, Table, inspect, select, text, update

# Old usage kind -> (operation, token column, whether its requests count). A sample request had
# a "sample_prompt" and a "sample_generated" row with one request each: count it once.
_LEGACY_KINDS = {
    "train": ("forward_backward", "trained_tokens", True),
    "forward": ("forward", "prefill_tokens", True),
    "sample_prompt": ("sample", "prefill_tokens", True),
    "sample_generated": ("sample", "sampled_tokens", False),
}
# Kinds of checkpoints saved before packages existed. Then the only external checkpoints were
# merged exports (`checkpoints export --merged`): save_weights_external, whose PEFT adapters are
# kind "adapter" (registry.PACKAGE_KINDS), came later and always writes its kind.
_SEGMENT_KINDS = {"training": "training-state", "sampler": "sampler", "external": "merged"}


def upgrade(engine: Engine, metadata: MetaData) -> None:
    _add_missing_columns(engine, metadata)
    _move_legacy_usage(engine, metadata)
    _fill_packages(engine, metadata)


def _add_missing_columns(engine: Engine, metadata: MetaData) -> None:
    present = inspect(engine)
    for table in metadata.sorted_tables:
        if not present.has_table(table.name):
            continue
        have = {c["name"] for c in present.get_columns(table.name)}
        for column in table.columns:
            if column.name in have:
                continue
            sql = (
                f"ALTER TABLE {table.name} ADD COLUMN {column.name} "
                f"{column.type.compile(dialect=engine.dialect)}"
            )
            default = column.server_default
            if default is not None:
                sql += f" DEFAULT {getattr(default, 'arg', '')}"
            with engine.begin() as conn:
                conn.execute(text(sql))


def _hour(value: Any) -> int:
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    if not isinstance(value, datetime):
        value = datetime.now(UTC)
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    seconds = int(value.timestamp())
    return seconds - seconds % 3600


def _move_legacy_usage(engine: Engine, metadata: MetaData) -> None:
    present = inspect(engine)
    if not present.has_table("usage"):
        return
    if "kind" not in {c["name"] for c in present.get_columns("usage")}:
        return
    legacy = Table("usage", MetaData(), autoload_with=engine)
    hourly = metadata.tables["usage_hourly"]
    with engine.begin() as conn:
        merged: dict[tuple[str, int, str, str, str], dict[str, int]] = {}
        for row in conn.execute(select(legacy)).mappings():
            mapped = _LEGACY_KINDS.get(row["kind"])
            if mapped is None:
                continue
            operation, column, counts_requests = mapped
            key = (row["tenant"], _hour(row["updated_at"]), row["session_id"], row["model_id"])
            sums = merged.setdefault((*key, operation), {})
            sums[column] = sums.get(column, 0) + int(row["tokens"] or 0)
            if counts_requests:
                sums["requests"] = sums.get("requests", 0) + int(row["requests"] or 0)
        now = datetime.now(UTC)
        for (tenant, hour, session_id, model_id, operation), sums in merged.items():
            conn.execute(
                hourly.insert().values(
                    tenant=tenant,
                    hour=hour,
                    session_id=session_id,
                    model_id=model_id,
                    operation=operation,
                    prefill_tokens=sums.get("prefill_tokens", 0),
                    sampled_tokens=sums.get("sampled_tokens", 0),
                    trained_tokens=sums.get("trained_tokens", 0),
                    requests=sums.get("requests", 0),
                    updated_at=now,
                )
            )
        # In the same transaction as the copy: a crash leaves either the old table or the new rows.
        conn.execute(text("DROP TABLE usage"))


def _fill_packages(engine: Engine, metadata: MetaData) -> None:
    """Package fields of checkpoints saved before packages existed (version IS NULL)."""
    checkpoints = metadata.tables["checkpoints"]
    runs = metadata.tables["training_runs"]
    names = metadata.tables["package_names"]
    with engine.begin() as conn:
        old = list(
            conn.execute(
                select(checkpoints)
                .where(checkpoints.c.version.is_(None))
                .order_by(checkpoints.c.created_at)
            ).mappings()
        )
        if not old:
            return
        last = {
            (r["tenant"], r["name"]): r["last_version"]
            for r in conn.execute(select(names)).mappings()
        }
        seen = set(last)
        for row in old:
            name = row["checkpoint_id"].split("/", 1)[-1]
            key = (row["tenant"], name)
            last[key] = last.get(key, 0) + 1
            run = conn.execute(select(runs).where(runs.c.id == row["training_run_id"])).first()
            fields: dict[str, Any] = {
                "name": name,
                "version": last[key],
                "kind": _SEGMENT_KINDS.get(row["checkpoint_type"], row["checkpoint_type"]),
            }
            if run is not None:
                targets = (("attn", run.train_attn), ("mlp", run.train_mlp))
                fields |= {
                    "base_model": run.base_model,
                    "lora_rank": run.lora_rank,
                    "lora_targets": [
                        n for n, on in (*targets, ("unembed", run.train_unembed)) if on
                    ],
                }
            conn.execute(
                update(checkpoints)
                .where(checkpoints.c.tinker_path == row["tinker_path"])
                .values(**fields)
            )
        for (tenant, name), version in last.items():
            if (tenant, name) in seen:
                conn.execute(
                    update(names)
                    .where(names.c.tenant == tenant, names.c.name == name)
                    .values(last_version=version)
                )
            else:
                conn.execute(names.insert().values(tenant=tenant, name=name, last_version=version))
