"""Adapter downloads: signed, expiring URLs for external-weights checkpoints, served by the
server itself (no cloud storage needed).

`GET .../checkpoints/external_weights/<name>/external_weights_urls` (the caller's API key) lists
one signed URL per file; each URL is a plain GET with no key, the signature being the credential
(signing.py). The URLs are built on the request's base URL: behind a reverse proxy, pass the
Host header through and let uvicorn apply X-Forwarded-Proto (its proxy headers, on by default
for a proxy on 127.0.0.1), or clients get URLs of the inner address (docs/exports.md).
"""

from __future__ import annotations

import os
import urllib.parse
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse

from tuneloop.server.api.deps import State, Tenant
from tuneloop.server.api.errors import ApiError, bad_request, not_found
from tuneloop.server.api.signing import (
    SECRET_FILE,
    ExpiredError,
    Grant,
    SignatureError,
    UrlSigner,
    load_or_create_secret,
)
from tuneloop.server.api.state import ServerState
from tuneloop.server.storage.layout import TinkerPath
from tuneloop.server.storage.registry import CheckpointRow, utcnow
from tuneloop.types import ExternalWeightsUrlsResponse

router = APIRouter(prefix="/api/v1")

DOWNLOADABLE = "external_weights"
_WHY_NOT = {
    "sampler_weights": "sampler checkpoints cannot be downloaded (they are for sampling); "
    "export the model with save_weights_external",
    "weights": "a training checkpoint is downloaded through an export: load it "
    "(create_training_client_from_state), save_weights_external, then ask for its URLs; "
    "`tinker checkpoint download` does this, and the operator's "
    "`tuneloop checkpoints export` writes the same adapter folder",
}


def url_signer(request: Request, state: ServerState) -> UrlSigner:
    """The app's signer, made on first use from the key in the data dir (tests may replace it)."""
    signer: UrlSigner | None = getattr(request.app.state, "url_signer", None)
    if signer is None:
        signer = UrlSigner(load_or_create_secret(state.layout.data_dir / SECRET_FILE))
        request.app.state.url_signer = signer
    return signer


def checkpoint_files(directory: Path) -> list[str]:
    """Every regular file under `directory`, "/"-separated and relative to it; symbolic links
    (to files or folders) are left out, so a download never leaves the folder."""
    found = []
    for root, dirs, files in os.walk(directory, followlinks=False):
        here = Path(root)
        dirs[:] = sorted(d for d in dirs if not (here / d).is_symlink())
        for name in files:
            path = here / name
            if path.is_file() and not path.is_symlink():
                found.append(path.relative_to(directory).as_posix())
    return sorted(found)


def _live(row: CheckpointRow | None) -> CheckpointRow | None:
    """The row, unless it is past its expiry (the GC removes such a package within a minute)."""
    if row is not None and row.expires_at is not None and row.expires_at <= utcnow():
        return None
    return row


@router.get("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/external_weights_urls")
def external_weights_urls(
    run_id: str, checkpoint_id: str, request: Request, state: State, tenant: Tenant
) -> dict[str, Any]:
    """A signed URL per file of one of the caller's external-weights checkpoints.

    A plain `def`: FastAPI runs it in a worker thread, so walking the folder blocks no one."""
    segment, _, name = checkpoint_id.partition("/")
    try:
        path = TinkerPath.parse(f"tinker://{run_id}/{segment}/{name}")
    except ValueError as exc:
        raise bad_request(f"checkpoint_id: {exc}", "checkpoint_id") from None
    if path.segment != DOWNLOADABLE:
        raise bad_request(f"checkpoint_id: {_WHY_NOT[path.segment]}", "checkpoint_id")
    row = _live(state.registry.checkpoint(str(path), tenant))
    if row is None:
        raise not_found(f"checkpoint {path}", "checkpoint_id")
    directory = Path(row.directory)
    if not directory.is_dir():
        raise not_found(f"the files of checkpoint {path}", "checkpoint_id")
    signer = url_signer(request, state)
    expires = signer.expiry()
    base = str(request.base_url).rstrip("/")
    urls = {
        file: signed_url(signer, base, tenant, path, file, expires)
        for file in checkpoint_files(directory)
    }
    return ExternalWeightsUrlsResponse(
        urls=urls, expires=datetime.fromtimestamp(expires, UTC)
    ).model_dump(mode="json")


def signed_url(
    signer: UrlSigner, base: str, tenant: str, path: TinkerPath, file: str, expires: int
) -> str:
    """The download URL of one file of `tenant`'s external-weights checkpoint `path`."""
    signature = signer.sign(Grant(tenant, str(path), file, expires))
    query = urllib.parse.urlencode({"tenant": tenant, "expires": expires, "signature": signature})
    prefix = f"{base}/api/v1/downloads/{_q(path.training_run_id)}/{_q(path.name)}"
    return f"{prefix}/{_q(file, safe='/')}?{query}"


def _q(part: str, safe: str = ":") -> str:
    return urllib.parse.quote(part, safe=safe)


@router.get("/downloads/{run_id}/{name}/{file_path:path}")
def download_file(
    run_id: str,
    name: str,
    file_path: str,
    request: Request,
    state: State,
    tenant: str,
    expires: int,
    signature: str,
) -> FileResponse:
    """One file of an external-weights checkpoint, for a URL external_weights_urls signed.

    No API key: the signature is the credential. 403 if the URL was altered in any part, 410
    once it has expired, 404 if the checkpoint or file is gone since.
    """
    tinker_path = f"tinker://{run_id}/{DOWNLOADABLE}/{name}"
    # Checked before anything is looked up: a URL that is not genuine gets the same 403 whether
    # or not the checkpoint exists. The tenant is part of what was signed, so a URL can never
    # verify for another tenant's checkpoint, and the lookup below is within that tenant.
    grant = Grant(tenant, tinker_path, file_path, expires)
    try:
        url_signer(request, state).verify(grant, signature)
    except SignatureError as exc:
        raise ApiError(403, f"signature: {exc}", "signature") from None
    except ExpiredError:
        when = datetime.fromtimestamp(expires, UTC).isoformat()
        raise ApiError(
            410,
            f"expires: this download URL expired at {when}; ask external_weights_urls for new ones",
            "expires",
        ) from None
    row = _live(state.registry.checkpoint(tinker_path, tenant))
    if row is None:
        raise not_found(f"checkpoint {tinker_path} (deleted or expired)", "name")
    target = _inside(Path(row.directory), file_path)
    return FileResponse(
        target,
        media_type="application/octet-stream",
        filename=target.name,
        headers={"cache-control": "private, no-store"},
    )


def _inside(directory: Path, relative: str) -> Path:
    """`directory / relative` if it is a regular file inside the folder, reached without a
    symbolic link. The signature already pins `relative` to a name the listing gave out; this
    holds even if the folder changed since (a link planted in it, a file removed)."""
    parts = relative.split("/")
    unsafe = relative.startswith("/") or "\\" in relative or "\x00" in relative
    if unsafe or any(p in ("", ".", "..") for p in parts):
        raise ApiError(403, f"file: {relative!r} is not a path inside the checkpoint", "file")
    current = directory
    for part in parts:
        current = current / part
        if current.is_symlink():
            raise ApiError(403, "file: symbolic links are not served", "file")
    if not current.resolve().is_relative_to(directory.resolve()):
        raise ApiError(403, "file: outside the checkpoint", "file")
    if not current.is_file():
        raise not_found(f"file {relative!r} of the checkpoint", "file")
    return current
