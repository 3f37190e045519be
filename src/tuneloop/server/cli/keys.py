"""`tuneloop keys create|list|revoke`: the API key file (needs no database)."""

from __future__ import annotations

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

keys_app = typer.Typer(
    help="Manage API keys: each key belongs to one tenant; keys are stored hashed.",
    no_args_is_help=True,
)
keys_app.callback()(key_group_options)


def _key_store(ctx: typer.Context, data_dir: Path | None, keys_file: Path | None) -> KeyStore:
    config = where(ctx).merged(data_dir, keys_file=keys_file)
    return KeyStore(config.keys_file or Layout(config.data_dir).keys_file)


@keys_app.command("create")
def keys_create(
    ctx: typer.Context,
    tenant: Annotated[
        str, typer.Option(help="Tenant the key acts for (letters, digits, '-', '_').")
    ],
    data_dir: DataDirOption = None,
    keys_file: KeysFileOption = None,
) -> None:
    """Create a key for a tenant: the key on stdout (shown only now), its id on stderr."""
    try:
        key, record = _key_store(ctx, data_dir, keys_file).create(tenant)
    except ValueError as exc:
        fail(str(exc), EXIT_USAGE)
    typer.echo(key)
    typer.echo(f"key id {record.key_id} for tenant {record.tenant}", err=True)


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
