"""`tuneloop keys create|list|revoke|limits`: API keys and per-tenant quotas (no database)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer

from tuneloop.server.cli.common import (
    EXIT_NOT_FOUND,
    EXIT_USAGE,
    DataDirOption,
    JsonOption,
    KeysFileOption,
    fail,
    key_group_options,
    print_json,
    print_rows,
    where,
)
from tuneloop.server.storage.keys import KeyStore
from tuneloop.server.storage.layout import Layout
from tuneloop.server.storage.limits import LimitStore, TenantLimits

keys_app = typer.Typer(
    help="Manage API keys: each key belongs to one tenant; keys are stored hashed.",
    no_args_is_help=True,
)
keys_app.callback()(key_group_options)


def _key_store(ctx: typer.Context, data_dir: Path | None, keys_file: Path | None) -> KeyStore:
    config = where(ctx).merged(data_dir, keys_file=keys_file)
    return KeyStore(config.keys_file or Layout(config.data_dir).keys_file)


def _limit_store(ctx: typer.Context, data_dir: Path | None, keys_file: Path | None) -> LimitStore:
    return LimitStore(where(ctx).merged(data_dir, keys_file=keys_file).limits_path)


def _limit_value(value: str, name: str) -> int | None:
    """A limit option's value: an integer >= 0 (0: unlimited), or "default" (None)."""
    if value == "default":
        return None
    if not value.isdigit():
        fail(f"--{name.replace('_', '-')}: an integer >= 0 or 'default', got {value!r}", EXIT_USAGE)
    return int(value)


MaxSessionsOption = Annotated[
    str | None,
    typer.Option(
        "--max-sessions",
        metavar="N|default",
        help="The tenant's live sessions at once (0: unlimited; default: the server's).",
        show_default=False,
    ),
]
MaxInflightOption = Annotated[
    str | None,
    typer.Option(
        "--max-inflight",
        metavar="N|default",
        help="The tenant's requests in flight at once (0: unlimited; default: the server's).",
        show_default=False,
    ),
]


def _limit_changes(max_sessions: str | None, max_inflight: str | None) -> dict[str, int | None]:
    """The limit options given, parsed (an option not given leaves that limit unchanged)."""
    return {
        name: _limit_value(raw, name)
        for name, raw in (("max_sessions", max_sessions), ("max_inflight", max_inflight))
        if raw is not None
    }


def _limits_row(tenant: str, limits: TenantLimits) -> dict[str, object]:
    return {"tenant": tenant, **asdict(limits)}


@keys_app.command("create")
def keys_create(
    ctx: typer.Context,
    tenant: Annotated[
        str, typer.Option(help="Tenant the key acts for (letters, digits, '-', '_').")
    ],
    max_sessions: MaxSessionsOption = None,
    max_inflight: MaxInflightOption = None,
    admin: Annotated[
        bool,
        typer.Option(
            "--admin",
            help="An operator's key: its web console also shows every tenant and the engine.",
        ),
    ] = False,
    data_dir: DataDirOption = None,
    keys_file: KeysFileOption = None,
) -> None:
    """Create a key for a tenant: the key on stdout (shown only now), its id on stderr.

    --max-sessions / --max-inflight set the tenant's quotas (for all its keys), as
    `keys limits` does.
    """
    changes = _limit_changes(max_sessions, max_inflight)  # bad values fail before any key
    try:
        key, record = _key_store(ctx, data_dir, keys_file).create(tenant, admin=admin)
    except ValueError as exc:
        fail(str(exc), EXIT_USAGE)
    typer.echo(key)
    role = " (admin)" if record.admin else ""
    typer.echo(f"key id {record.key_id} for tenant {record.tenant}{role}", err=True)
    if changes:
        limits = _limit_store(ctx, data_dir, keys_file).set(tenant, **changes)
        typer.echo(f"limits for tenant {tenant}: {_describe(limits)}", err=True)


def _describe(limits: TenantLimits) -> str:
    def one(value: int | None) -> str:
        return "server default" if value is None else ("unlimited" if value == 0 else str(value))

    return f"max_sessions {one(limits.max_sessions)}, max_inflight {one(limits.max_inflight)}"


@keys_app.command("limits")
def keys_limits(
    ctx: typer.Context,
    tenant: Annotated[
        str | None,
        typer.Argument(
            help="The tenant (default: list every tenant's overrides).", show_default=False
        ),
    ] = None,
    max_sessions: MaxSessionsOption = None,
    max_inflight: MaxInflightOption = None,
    reset: Annotated[
        bool, typer.Option("--reset", help="Drop the tenant's overrides: server defaults again.")
    ] = False,
    data_dir: DataDirOption = None,
    keys_file: KeysFileOption = None,
    as_json: JsonOption = False,
) -> None:
    """Show or set a tenant's quotas. A running server applies a change from its next request.

    Rows: tenant, max sessions, max in flight ("-": the server default, 0: unlimited).
    """
    store = _limit_store(ctx, data_dir, keys_file)
    if tenant is None:
        if reset or max_sessions is not None or max_inflight is not None:
            fail("name the tenant whose limits to change", EXIT_USAGE)
        overrides = sorted(store.all().items())
    else:
        if reset:
            if max_sessions is not None or max_inflight is not None:
                fail("--reset takes no limits", EXIT_USAGE)
            store.reset(tenant)
        elif changes := _limit_changes(max_sessions, max_inflight):
            store.set(tenant, **changes)
        overrides = [(tenant, store.get(tenant))]
    if as_json:
        rows = [_limits_row(t, v) for t, v in overrides]
        print_json(rows if tenant is None else rows[0])
        return
    print_rows(
        ("TENANT", "MAX_SESSIONS", "MAX_INFLIGHT"),
        [(t, v.max_sessions, v.max_inflight) for t, v in overrides],
    )


@keys_app.command("list")
def keys_list(
    ctx: typer.Context,
    data_dir: DataDirOption = None,
    keys_file: KeysFileOption = None,
    as_json: JsonOption = False,
) -> None:
    """List keys, never the keys themselves. Rows: key id, tenant, created, active|revoked."""
    records = _key_store(ctx, data_dir, keys_file).list()
    if as_json:
        print_json(
            [
                {
                    "key_id": r.key_id,
                    "tenant": r.tenant,
                    "created_at": r.created_at,
                    "revoked": r.revoked,
                }
                for r in records
            ]
        )
        return
    print_rows(
        ("KEY_ID", "TENANT", "CREATED", "STATE"),
        [(r.key_id, r.tenant, r.created_at, "revoked" if r.revoked else "active") for r in records],
    )


@keys_app.command("revoke")
def keys_revoke(
    ctx: typer.Context,
    key_id: Annotated[str, typer.Argument(help="The key's id, as `keys list` shows it.")],
    data_dir: DataDirOption = None,
    keys_file: KeysFileOption = None,
) -> None:
    """Revoke a key by its id; a running server refuses it from the next request on."""
    if not _key_store(ctx, data_dir, keys_file).revoke(key_id):
        fail(f"no key {key_id}", EXIT_NOT_FOUND)
