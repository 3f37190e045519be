"""Adapter downloads: save_weights_external, signed expiring URLs, and the file route.

A URL is worth one file of one tenant's checkpoint until it expires: altered in any part it is a
403, expired a 410, and it never reaches outside the checkpoint's folder.
"""

from __future__ import annotations

import os
import threading
import urllib.parse
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.unit.server.harness import MODEL, Api, datum, expect_error, optim_step, serve
from tuneloop.server.api.downloads import _inside, checkpoint_files
from tuneloop.server.api.errors import ApiError
from tuneloop.server.api.signing import (
    SECRET_FILE,
    ExpiredError,
    Grant,
    SignatureError,
    UrlSigner,
    load_or_create_secret,
)
from tuneloop.server.storage.keys import KeyStore
from tuneloop.server.storage.layout import Layout, TinkerPath
from tuneloop.server.storage.registry import (
    MERGED_KIND,
    PACKAGE_KINDS,
    CheckpointRow,
    Registry,
    merged_package,
)

TOKENS = [5, 17, 33, 90, 120, 7]
SECRET = bytes(range(32))


class Clock:
    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# ---- signing ----------------------------------------------------------------------------------


def test_a_signature_covers_every_part_of_the_grant() -> None:
    clock = Clock(1000.0)
    signer = UrlSigner(SECRET, clock=clock)
    grant = Grant("alice", "tinker://s:train:0/external_weights/e1", "adapter_config.json", 1900)
    signature = signer.sign(grant)
    signer.verify(grant, signature)  # genuine, not expired: no error
    altered = [
        Grant("bob", grant.tinker_path, grant.file, grant.expires),
        Grant(grant.tenant, "tinker://s:train:1/external_weights/e1", grant.file, grant.expires),
        Grant(grant.tenant, "tinker://s:train:0/external_weights/e2", grant.file, grant.expires),
        Grant(grant.tenant, grant.tinker_path, "adapter_model.safetensors", grant.expires),
        Grant(grant.tenant, grant.tinker_path, grant.file, grant.expires + 1),
        # Shifting text between fields must not keep the message the same.
        Grant("alice", "tinker://s:train:0/external_weights/e1adapter", "_config.json", 1900),
    ]
    for other in altered:
        with pytest.raises(SignatureError):
            signer.verify(other, signature)
    for bad in (signature[:-1] + ("0" if signature[-1] != "0" else "1"), "", "é" * 64):
        with pytest.raises(SignatureError):
            signer.verify(grant, bad)
    with pytest.raises(SignatureError):  # another server's key
        UrlSigner(bytes(32), clock=clock).verify(grant, signature)


def test_a_genuine_signature_expires() -> None:
    clock = Clock(1000.0)
    signer = UrlSigner(SECRET, ttl_s=60, clock=clock)
    grant = Grant("alice", "tinker://r/external_weights/e", "f", signer.expiry())
    assert grant.expires == 1060
    signature = signer.sign(grant)
    clock.now = 1059.9
    signer.verify(grant, signature)
    clock.now = 1060.0
    with pytest.raises(ExpiredError):
        signer.verify(grant, signature)


def test_the_secret_is_made_once_private_and_kept(tmp_path: Path) -> None:
    path = tmp_path / "data" / SECRET_FILE
    secrets: list[bytes] = []
    threads = [
        threading.Thread(target=lambda: secrets.append(load_or_create_secret(path)))
        for _ in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert len(secrets) == 8
    assert len(set(secrets)) == 1  # concurrent first uses agree on one key
    assert len(secrets[0]) == 32
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert load_or_create_secret(path) == secrets[0]
    assert [p.name for p in path.parent.iterdir()] == [SECRET_FILE]  # no temporary left
    path.write_text("not hex")
    with pytest.raises(ValueError, match="URL-signing key"):
        load_or_create_secret(path)


# ---- the folder rules -------------------------------------------------------------------------


def test_only_regular_files_inside_the_folder_are_listed_and_served(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.json").write_text("{}")
    (folder / "sub" / "b.bin").write_bytes(b"b")
    outside = tmp_path / "secret.txt"
    outside.write_text("secret")
    (folder / "link.txt").symlink_to(outside)
    (folder / "linked_dir").symlink_to(tmp_path)
    assert checkpoint_files(folder) == ["a.json", "sub/b.bin"]
    assert _inside(folder, "sub/b.bin") == folder / "sub" / "b.bin"
    for bad in ("../secret.txt", "/etc/passwd", "sub/../../secret.txt", "a\\b", "", "./a.json",
                "sub//b.bin", "a\x00.json", "link.txt", "linked_dir/secret.txt"):  # fmt: skip
        with pytest.raises(ApiError) as err:
            _inside(folder, bad)
        assert (err.value.status, err.value.field) == (403, "file"), bad
    with pytest.raises(ApiError) as err:
        _inside(folder, "missing.bin")
    assert (err.value.status, err.value.field) == (404, "file")


# ---- the routes -------------------------------------------------------------------------------


async def trained(api: Api, seq: int = 0) -> str:
    """A model of a new session with one forward_backward and optim_step (seq 1, 2)."""
    model_id = await api.model(await api.session(), seq=seq)
    await api.result(await api.forward_backward(model_id, 1, [datum(TOKENS)]))
    await optim_step(api, model_id, 2)
    return model_id


async def export(api: Api, model_id: str, name: str, seq_id: int, **body: Any) -> dict[str, Any]:
    request = {"model_id": model_id, "path": name, "seq_id": seq_id, **body}
    done = await api.result(await api.post("save_weights_external", request))
    assert done.status_code == 200, done.text
    result: dict[str, Any] = done.json()
    return result


def urls_route(tinker_path: str) -> str:
    path = TinkerPath.parse(tinker_path)
    return (
        f"training_runs/{path.training_run_id}/checkpoints/{path.checkpoint_id}"
        "/external_weights_urls"
    )


async def signed_urls(api: Api, tinker_path: str) -> dict[str, Any]:
    response = await api.get(urls_route(tinker_path))
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def altered(url: str, **changes: str) -> str:
    """The URL with its path segments (run, name, file) or query values replaced."""
    parts = urllib.parse.urlsplit(url)
    segments = parts.path.split("/")  # "", api, v1, downloads, run, name, file...
    query = dict(urllib.parse.parse_qsl(parts.query))
    for key, value in changes.items():
        if key in ("run", "name"):
            segments[4 if key == "run" else 5] = urllib.parse.quote(value, safe=":")
        elif key == "file":
            segments[6:] = [value]
        else:
            query[key] = value
    path = "/".join(segments)
    return urllib.parse.urlunsplit(parts._replace(path=path, query=urllib.parse.urlencode(query)))


async def test_export_download_and_package(api: Api, server: tuple[Any, KeyStore]) -> None:
    model_id = await trained(api)
    saved = await export(api, model_id, "e1", 3, ttl_seconds=7200)
    path = f"tinker://{model_id}/external_weights/e1"
    assert saved["path"] == path
    assert saved["type"] == "save_weights_external"
    listed = {c["tinker_path"]: c for c in (await api.get("checkpoints")).json()["checkpoints"]}
    package = listed[path]
    assert (package["checkpoint_type"], package["kind"]) == ("external", "adapter")
    assert package["name"] == "e1"
    assert package["training_step"] == 1
    assert package["base_model"] == MODEL
    assert saved["size_bytes"] == package["size_bytes"] > 0
    expires_at = datetime.fromisoformat(package["expires_at"])
    assert abs((expires_at - datetime.now(UTC)) - timedelta(seconds=7200)) < timedelta(minutes=1)

    registry: Registry = server[0].state.tuneloop.registry
    row = registry.checkpoint(path, "alice")
    assert row is not None
    folder = Path(row.directory)
    body = await signed_urls(api, path)
    files = checkpoint_files(folder)
    assert sorted(body["urls"]) == files
    assert "adapter_config.json" in files
    expires = datetime.fromisoformat(body["expires"])
    assert timedelta(minutes=59) < expires - datetime.now(UTC) <= timedelta(hours=1)
    for name, url in body["urls"].items():
        assert url.startswith("http://tuneloop/api/v1/downloads/")  # the request's base URL
        got = await api.http.get(url)  # no API key: the signature is the credential
        assert "x-api-key" not in got.request.headers
        assert got.status_code == 200, got.text
        assert got.content == (folder / name).read_bytes()
    # The adapter export loads into a new model, as a training or sampler checkpoint does.
    loaded = await api.result(
        await api.post(
            "load_weights",
            {"session_id": await api.session(), "model_seq_id": 0, "path": path},
        )
    )
    assert loaded.status_code == 200, loaded.text


async def test_an_altered_url_is_refused(
    api: Api, other_tenant: Api, server: tuple[Any, KeyStore]
) -> None:
    model_id = await trained(api)
    await export(api, model_id, "e1", 3)
    await export(api, model_id, "e2", 4)
    other_model = await trained(api, seq=0)
    await export(api, other_model, "e1", 3)
    bob_model = await trained(other_tenant)
    await export(other_tenant, bob_model, "e1", 3)
    urls = (await signed_urls(api, f"tinker://{model_id}/external_weights/e1"))["urls"]
    url = urls["adapter_config.json"]
    signature = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)["signature"][0]
    flipped = signature[:-1] + ("0" if signature[-1] != "0" else "1")
    expires = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)["expires"][0]
    for change in (
        {"file": "weights.npz"},  # another file of the same checkpoint
        {"name": "e2"},  # another checkpoint of the same run
        {"run": other_model},  # the same name in another run of the same tenant
        {"run": bob_model},  # another tenant's checkpoint
        {"tenant": "bob"},
        {"run": bob_model, "tenant": "bob"},
        {"expires": str(int(expires) + 3600)},
        {"signature": flipped},
        {"signature": signature.upper()},
        {"file": "../e2/adapter_config.json"},
        {"file": "%2e%2e/e2/adapter_config.json"},
    ):
        response = await api.http.get(altered(url, **change))
        body = expect_error(response, 403, "signature")
        assert model_id not in response.text
        assert body["type"] == "permission", change
    # Bob's own URL, aimed at alice's checkpoint: the same 403.
    bob_url = (await signed_urls(other_tenant, f"tinker://{bob_model}/external_weights/e1"))[
        "urls"
    ]["adapter_config.json"]
    for change in ({"run": model_id}, {"run": model_id, "tenant": "alice"}):
        expect_error(await other_tenant.http.get(altered(bob_url, **change)), 403, "signature")
    # The genuine URL still works.
    assert (await api.http.get(url)).status_code == 200


async def test_a_url_expires_and_new_urls_can_be_asked_for(
    api: Api, server: tuple[Any, KeyStore]
) -> None:
    clock = Clock(float(int(datetime.now(UTC).timestamp())))
    server[0].state.url_signer = UrlSigner(SECRET, ttl_s=3600, clock=clock)
    model_id = await trained(api)
    path = (await export(api, model_id, "e1", 3))["path"]
    body = await signed_urls(api, path)
    assert datetime.fromisoformat(body["expires"]).timestamp() == clock.now + 3600
    url = body["urls"]["adapter_config.json"]
    clock.now += 3599
    assert (await api.http.get(url)).status_code == 200
    clock.now += 1
    gone = expect_error(await api.http.get(url), 410, "expires")
    assert "external_weights_urls" in gone["detail"]
    fresh = (await signed_urls(api, path))["urls"]["adapter_config.json"]
    assert fresh != url
    assert (await api.http.get(fresh)).status_code == 200


async def test_a_url_outlives_a_restart_and_not_its_checkpoint(tmp_path: Path) -> None:
    async with serve(tmp_path) as api:
        model_id = await trained(api)
        path = (await export(api, model_id, "e1", 3))["path"]
        await export(api, model_id, "e2", 4)
        urls = (await signed_urls(api, path))["urls"]
        other = (await signed_urls(api, f"tinker://{model_id}/external_weights/e2"))["urls"]
    async with serve(tmp_path, tenant="bob") as restarted:
        got = await restarted.http.get(urls["adapter_config.json"])
        assert got.status_code == 200, got.text  # the same key, read back from the data dir
        registry = Registry(Layout(tmp_path).database_url)
        registry.remove_checkpoint(path, "alice")
        expect_error(await restarted.http.get(urls["adapter_config.json"]), 404, "name")
        # A package past its expiry is gone for downloads before the GC removes it.
        e2 = f"tinker://{model_id}/external_weights/e2"
        registry.set_checkpoint_expiry(e2, "alice", datetime.now(UTC) - timedelta(seconds=1))
        expect_error(await restarted.http.get(other["adapter_config.json"]), 404, "name")
        registry.close()


async def test_a_planted_link_is_not_served(api: Api, server: tuple[Any, KeyStore]) -> None:
    model_id = await trained(api)
    path = (await export(api, model_id, "e1", 3))["path"]
    urls = (await signed_urls(api, path))["urls"]
    row = server[0].state.tuneloop.registry.checkpoint(path, "alice")
    folder = Path(row.directory)
    outside = folder.parent / "outside.txt"
    outside.write_text("not part of the checkpoint")
    (folder / "adapter_config.json").unlink()
    (folder / "adapter_config.json").symlink_to(outside)
    expect_error(await api.http.get(urls["adapter_config.json"]), 403, "file")
    assert "adapter_config.json" not in (await signed_urls(api, path))["urls"]
    os.unlink(folder / "adapter_config.json")
    expect_error(await api.http.get(urls["adapter_config.json"]), 404, "file")


async def test_what_cannot_be_downloaded(api: Api, other_tenant: Api) -> None:
    model_id = await trained(api)
    for segment, seq in (("weights", 3), ("sampler_weights", 4)):
        route = "save_weights" if segment == "weights" else "save_weights_for_sampler"
        await api.result(await api.post(route, {"model_id": model_id, "path": "c", "seq_id": seq}))
        body = expect_error(
            await api.get(urls_route(f"tinker://{model_id}/{segment}/c")), 400, "checkpoint_id"
        )
        assert ("sampler checkpoints cannot be downloaded" in body["detail"]) == (
            segment == "sampler_weights"
        )
        assert "save_weights_external" in body["detail"]
    path = (await export(api, model_id, "e1", 5))["path"]
    # Another tenant's checkpoint, or none: 404, naming nothing of alice's.
    for who, target in ((other_tenant, path), (api, path + "x")):
        response = await who.get(urls_route(target))
        expect_error(response, 404, "checkpoint_id")
    for bad in ("external_weights", "external_weights/", "bogus/e1", "external_weights/a/b"):
        expect_error(
            await api.get(f"training_runs/{model_id}/checkpoints/{bad}/external_weights_urls"),
            400,
            "checkpoint_id",
        )
    # The list needs a key.
    expect_error(await api.http.get(f"/api/v1/{urls_route(path)}"), 401, "X-API-Key")


async def test_bad_exports_name_the_field_and_free_their_seq_id(api: Api) -> None:
    model_id = await trained(api)
    seq = 3
    for body, field in (
        ({"path": "e1", "age_encryption_recipients": ["age1xyz"]}, "age_encryption_recipients"),
        ({"path": "e1", "ttl_seconds": 5}, "ttl_seconds"),
        ({"path": "a/b"}, "path"),
        ({}, "path"),
        ({"path": "e1", "overwrite": True}, "overwrite"),
        ({"path": "e1", "ttl_seconds": "soon"}, "ttl_seconds"),
    ):
        response = await api.post(
            "save_weights_external", {"model_id": model_id, "seq_id": seq, **body}
        )
        expect_error(response, 400, field)
        seq += 1
    expect_error(
        await api.post("save_weights_external", {"model_id": model_id, "path": "e1"}), 400, "seq_id"
    )
    expect_error(
        await api.post("save_weights_external", {"model_id": "nope", "path": "e", "seq_id": 1}),
        404,
        "model_id",
    )
    # The rejected requests consumed their seq_ids: the next one runs at once.
    assert (await export(api, model_id, "e1", seq, age_encryption_recipients=[]))["path"]
    # The file route's query, checked before anything else.
    url = (await signed_urls(api, f"tinker://{model_id}/external_weights/e1"))["urls"][
        "adapter_config.json"
    ]
    expect_error(await api.http.get(altered(url, expires="soon")), 400, "expires")
    expect_error(await api.http.get(url.split("?")[0]), 400, "tenant")
    expect_error(await api.http.get(url.split("&signature=")[0]), 400, "signature")
    expect_error(await api.http.get(altered(url, tenant="")), 403, "signature")


def test_package_kinds(tmp_path: Path) -> None:
    assert PACKAGE_KINDS["external"] == "adapter"
    source = CheckpointRow(
        tinker_path="tinker://r/weights/w1",
        tenant="alice",
        training_run_id="r",
        checkpoint_id="weights/w1",
        checkpoint_type="training",
        directory=str(tmp_path),
        name="w1",
        kind="training-state",
    )
    merged = merged_package(source, TinkerPath("r", "external_weights", "w1-merged"), tmp_path)
    assert (merged.checkpoint_type, merged.kind) == ("external", MERGED_KIND)
    assert MERGED_KIND == "merged"
