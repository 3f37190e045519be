"""The `tuneloop` command line: every command, its --json output and its exit codes."""

from __future__ import annotations

import asyncio
import json
import sys
import types
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner, Result

import tuneloop
import tuneloop.server.engine
from tests.unit.server.harness import datum, sample, sampler, serve
from tuneloop._local_server import live_server, stop
from tuneloop.cli import build_app, main
from tuneloop.server.storage.registry import Registry

runner = CliRunner()


def run(*args: str, app: typer.Typer | None = None) -> Result:
    return runner.invoke(app or build_app(with_demo=False), list(args), catch_exceptions=False)


def data(tmp_path: Path) -> tuple[str, str]:
    return "--data-dir", str(tmp_path)


def populated(tmp_path: Path) -> dict[str, Any]:
    return asyncio.run(populate(tmp_path))


async def populate(tmp_path: Path) -> dict[str, Any]:
    """alice: a trained run with a training and a sampler checkpoint, usage; bob: one run."""
    async with serve(tmp_path) as api:
        session_id = await api.session()
        model_id = await api.model(session_id, rank=4)
        await api.result(await api.forward_backward(model_id, 1, [datum([1, 2, 3, 4])]))
        saved = await api.result(
            await api.post("save_weights", {"model_id": model_id, "path": "w1", "seq_id": 2})
        )
        for_sampler = await api.result(
            await api.post(
                "save_weights_for_sampler", {"model_id": model_id, "path": "s1", "seq_id": 3}
            )
        )
        sampler_id = await sampler(api, session_id)
        response = await sample(api, sampler_id, [5, 6, 7], num_samples=2, max_tokens=3)
        generated = sum(len(s.tokens) for s in response.sequences)
    async with serve(tmp_path, tenant="bob") as bob:
        bob_session = await bob.session()
        bob_model = await bob.model(bob_session, rank=2)
    return {
        "session": session_id,
        "model": model_id,
        "weights": saved.json()["path"],
        "sampler_weights": for_sampler.json()["path"],
        "generated": generated,
        "bob_session": bob_session,
        "bob_model": bob_model,
    }


# ---- keys -------------------------------------------------------------------------------------


def test_keys_create_list_revoke(tmp_path: Path) -> None:
    created = run("keys", *data(tmp_path), "create", "--tenant", "alice")
    assert created.exit_code == 0, created.output
    key = created.stdout.strip()
    assert key.startswith("tml-")
    assert "key id key-" in created.stderr
    # The data folder may also follow the sub-command.
    assert run("keys", "create", "--tenant", "bob", "--admin", *data(tmp_path)).exit_code == 0

    listed = json.loads(run("keys", "list", *data(tmp_path), "--json").stdout)
    assert [(k["tenant"], k["admin"], k["revoked"]) for k in listed] == [
        ("alice", False, False),
        ("bob", True, False),
    ]
    assert key not in json.dumps(listed)
    rows = run("keys", *data(tmp_path), "list").stdout.splitlines()
    assert rows[0].split("\t")[1:2] == ["alice"]
    assert rows[0].endswith("\ttenant\tactive")
    assert rows[1].endswith("\tadmin\tactive")

    alice_id = listed[0]["key_id"]
    assert run("keys", *data(tmp_path), "revoke", alice_id).exit_code == 0
    assert json.loads(run("keys", *data(tmp_path), "list", "--json").stdout)[0]["revoked"]
    missing = run("keys", *data(tmp_path), "revoke", "key-nope")
    assert missing.exit_code == 1
    assert "no key key-nope" in missing.stderr
    bad = run("keys", *data(tmp_path), "create", "--tenant", "no spaces")
    assert bad.exit_code == 2
    assert "tenant" in bad.stderr
    assert run("keys", *data(tmp_path), "create").exit_code == 2  # --tenant is required


# ---- runs and checkpoints ---------------------------------------------------------------------


def test_runs_list(tmp_path: Path) -> None:
    ids = populated(tmp_path)
    everything = json.loads(run("runs", "list", *data(tmp_path), "--json").stdout)
    assert {r["training_run_id"] for r in everything} == {ids["model"], ids["bob_model"]}
    alice = json.loads(run("runs", "list", "--tenant", "alice", *data(tmp_path), "--json").stdout)
    [run_row] = alice
    assert run_row["tenant"] == "alice"
    assert run_row["base_model"] == "tuneloop/fake-tiny"
    assert run_row["lora_rank"] == 4
    assert run_row["session_id"] == ids["session"]
    assert run_row["created_at"]
    assert run_row["last_request_time"]
    [row] = run("runs", *data(tmp_path), "list", "--tenant", "bob").stdout.splitlines()
    columns = row.split("\t")
    assert columns[:4] == [ids["bob_model"], "bob", "tuneloop/fake-tiny", "2"]
    assert len(columns) == 6
    assert (
        run("runs", "list", "--tenant", "carol", *data(tmp_path), "--json").stdout.strip() == "[]"
    )


def test_checkpoints_list(tmp_path: Path) -> None:
    ids = populated(tmp_path)
    listed = json.loads(run("checkpoints", "list", *data(tmp_path), "--json").stdout)
    assert {c["tinker_path"] for c in listed} == {ids["weights"], ids["sampler_weights"]}
    kinds = {c["tinker_path"]: c["checkpoint_type"] for c in listed}
    assert kinds == {ids["weights"]: "training", ids["sampler_weights"]: "sampler"}
    assert all(c["size_bytes"] > 0 and Path(c["directory"]).is_dir() for c in listed)
    packages = {c["tinker_path"]: c for c in listed}
    saved = (ids["weights"], ids["sampler_weights"])
    assert [(packages[p]["name"], packages[p]["kind"]) for p in saved] == [
        ("w1", "training-state"),
        ("s1", "sampler"),
    ]
    assert all(c["version"] == 1 and c["training_step"] == 0 for c in listed)
    assert all(c["base_model"] == "tuneloop/fake-tiny" and c["lora_rank"] == 4 for c in listed)
    by_run = run("checkpoints", "list", "--run", ids["model"], *data(tmp_path), "--json")
    assert len(json.loads(by_run.stdout)) == 2
    empty = run("checkpoints", "list", "--run", ids["bob_model"], *data(tmp_path), "--json")
    assert json.loads(empty.stdout) == []
    rows = run("checkpoints", "list", "--tenant", "alice", *data(tmp_path)).stdout.splitlines()
    assert sorted(r.split("\t")[0] for r in rows) == sorted(
        [ids["weights"], ids["sampler_weights"]]
    )
    unknown = run("checkpoints", "list", "--run", "nope:train:0", *data(tmp_path))
    assert unknown.exit_code == 1
    assert "no training run" in unknown.stderr
    wrong_tenant = run(
        "checkpoints", "list", "--run", ids["model"], "--tenant", "bob", *data(tmp_path)
    )
    assert wrong_tenant.exit_code == 1


def test_checkpoints_delete(tmp_path: Path) -> None:
    ids = populated(tmp_path)
    path = ids["weights"]
    [row] = [
        c
        for c in json.loads(run("checkpoints", "list", *data(tmp_path), "--json").stdout)
        if c["tinker_path"] == path
    ]
    assert (
        run("checkpoints", "delete", "tinker://bad", "--tenant", "alice", *data(tmp_path)).exit_code
        == 2
    )
    assert run("checkpoints", "delete", path, *data(tmp_path)).exit_code == 2  # no --tenant
    not_theirs = run("checkpoints", "delete", path, "--tenant", "bob", *data(tmp_path))
    assert not_theirs.exit_code == 1
    assert Path(row["directory"]).is_dir()
    deleted = run("checkpoints", "delete", path, "--tenant", "alice", *data(tmp_path))
    assert deleted.exit_code == 0, deleted.output
    assert not Path(row["directory"]).exists()
    left = json.loads(run("checkpoints", "list", *data(tmp_path), "--json").stdout)
    assert [c["tinker_path"] for c in left] == [ids["sampler_weights"]]
    assert run("checkpoints", "delete", path, "--tenant", "alice", *data(tmp_path)).exit_code == 1


def test_checkpoints_gc(tmp_path: Path) -> None:
    ids = populated(tmp_path)
    listed = json.loads(run("checkpoints", "list", *data(tmp_path), "--json").stdout)
    directories = {c["tinker_path"]: Path(c["directory"]) for c in listed}
    registry = Registry(f"sqlite:///{tmp_path / 'registry.sqlite3'}")
    past = datetime.now(UTC) - timedelta(minutes=1)
    future = datetime.now(UTC) + timedelta(hours=1)
    assert registry.set_checkpoint_expiry(ids["weights"], "alice", past) is not None
    assert registry.set_checkpoint_expiry(ids["sampler_weights"], "alice", future) is not None
    registry.close()

    dry = run("checkpoints", "gc", "--dry-run", *data(tmp_path), "--json")
    assert dry.exit_code == 0, dry.output
    assert [c["tinker_path"] for c in json.loads(dry.stdout)] == [ids["weights"]]
    assert "would delete 1" in dry.stderr
    assert directories[ids["weights"]].is_dir()
    done = run("checkpoints", "gc", *data(tmp_path))
    assert done.exit_code == 0, done.output
    assert done.stdout.split("\t")[0] == ids["weights"]
    assert "deleted 1 expired" in done.stderr
    assert not directories[ids["weights"]].exists()
    assert directories[ids["sampler_weights"]].is_dir()
    left = json.loads(run("checkpoints", "list", *data(tmp_path), "--json").stdout)
    assert [c["tinker_path"] for c in left] == [ids["sampler_weights"]]
    assert json.loads(run("checkpoints", "gc", *data(tmp_path), "--json").stdout) == []


def test_checkpoints_export_copies_the_adapter(tmp_path: Path) -> None:
    ids = populated(tmp_path / "data")
    where = data(tmp_path / "data")
    out = tmp_path / "export"
    exported = run("checkpoints", "export", ids["weights"], "--out", str(out), *where)
    assert exported.exit_code == 0, exported.output
    [source] = [
        c["directory"]
        for c in json.loads(run("checkpoints", "list", *where, "--json").stdout)
        if c["tinker_path"] == ids["weights"]
    ]
    names = sorted(p.name for p in Path(source).iterdir())
    assert names
    assert sorted(p.name for p in out.iterdir()) == names
    for name in names:
        assert (out / name).read_bytes() == (Path(source) / name).read_bytes()

    again = run("checkpoints", "export", ids["weights"], "--out", str(out), *where)
    assert again.exit_code == 2  # never overwrites
    assert "exists" in again.stderr
    other = tmp_path / "other"
    missing = run("checkpoints", "export", f"{ids['weights']}x", "--out", str(other), *where)
    assert missing.exit_code == 1
    not_bobs = run(
        "checkpoints", "export", ids["weights"], "--out", str(other), "--tenant", "bob", *where
    )
    assert not_bobs.exit_code == 1
    assert run("checkpoints", "export", "nope", "--out", str(other), *where).exit_code == 2
    assert not other.exists()


def test_checkpoints_export_merged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = populated(tmp_path / "data")
    where = data(tmp_path / "data")
    calls: list[tuple[Path, Path, Path]] = []

    def export_merged(adapter_dir: Path, out_dir: Path, *, cache_dir: Path) -> Path:
        calls.append((adapter_dir, out_dir, cache_dir))
        if out_dir.name == "fails":
            raise ValueError("base model has no such layer")
        out_dir.mkdir()
        (out_dir / "model.safetensors").write_bytes(b"merged")
        return out_dir

    # A stand-in for the engine's merge (which needs torch and a real base model).
    fake = types.ModuleType("tuneloop.server.engine.merge")
    fake.export_merged = export_merged  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tuneloop.server.engine.merge", fake)
    monkeypatch.setattr(tuneloop.server.engine, "merge", fake, raising=False)
    out = tmp_path / "merged"
    cache = tmp_path / "cache"
    done = run(
        "checkpoints", "export", ids["weights"], "--out", str(out), "--merged",
        "--cache-dir", str(cache), *where,
    )  # fmt: skip
    assert done.exit_code == 0, done.output
    assert (out / "model.safetensors").read_bytes() == b"merged"
    [(adapter_dir, out_dir, cache_dir)] = calls
    assert out_dir == out
    assert cache_dir == cache
    assert (adapter_dir / "adapter_config.json").is_file()
    # Registered as a package of kind merged, its source as parent.
    listed = json.loads(run("checkpoints", "list", *where, "--json").stdout)
    [package] = [c for c in listed if c["kind"] == "merged"]
    run_id = ids["weights"].split("/")[2]
    assert package["tinker_path"] == f"tinker://{run_id}/external_weights/w1-merged"
    assert package["parent_tinker_path"] == ids["weights"]
    assert (package["name"], package["version"], package["checkpoint_type"]) == (
        "w1-merged", 1, "external",
    )  # fmt: skip
    assert package["size_bytes"] == len(b"merged")
    assert Path(package["directory"]) == out.resolve()
    taken = run(
        "checkpoints", "export", ids["weights"], "--out", str(tmp_path / "again"), "--merged",
        *where,
    )  # fmt: skip
    assert taken.exit_code == 2
    assert "already registered" in taken.stderr
    failed = run(
        "checkpoints", "export", ids["weights"], "--out", str(tmp_path / "fails"), "--merged",
        "--name", "other", *where,
    )  # fmt: skip
    assert failed.exit_code == 1
    assert "ValueError: base model has no such layer" in failed.stderr
    listed = json.loads(run("checkpoints", "list", *where, "--json").stdout)
    assert [c["name"] for c in listed if c["kind"] == "merged"] == ["w1-merged"]
    deleted = run("checkpoints", "delete", package["tinker_path"], "--tenant", "alice", *where)
    assert deleted.exit_code == 0
    assert not out.exists()  # deleting the package removes its files


# ---- usage ------------------------------------------------------------------------------------


def test_usage(tmp_path: Path) -> None:
    ids = populated(tmp_path)
    report = json.loads(run("usage", *data(tmp_path), "--json").stdout)
    assert [r["tenant"] for r in report] == ["alice"]  # bob did no metered work
    [alice] = report
    assert alice["session_id"] is None
    sample_counts = {
        "prefill_tokens": 3,
        "sampled_tokens": ids["generated"],
        "trained_tokens": 0,
        "requests": 1,
    }
    assert alice["by_operation"] == {
        "forward_backward": {
            "prefill_tokens": 0, "sampled_tokens": 0, "trained_tokens": 3, "requests": 1,
        },
        "forward": {"prefill_tokens": 0, "sampled_tokens": 0, "trained_tokens": 0, "requests": 0},
        "sample": sample_counts,
    }  # fmt: skip
    assert alice["totals"] == {
        "prefill_tokens": 3, "sampled_tokens": ids["generated"], "trained_tokens": 3,
        "requests": 2,
    }  # fmt: skip
    session = run("usage", "--session", ids["session"], *data(tmp_path), "--json")
    assert json.loads(session.stdout) == [{**alice, "session_id": ids["session"]}]
    bob = json.loads(run("usage", "--tenant", "bob", *data(tmp_path), "--json").stdout)
    assert bob[0]["totals"] == dict.fromkeys(alice["totals"], 0)
    by_run = json.loads(run("usage", "--run", ids["model"], *data(tmp_path), "--json").stdout)
    assert by_run[0]["totals"]["trained_tokens"] == 3
    assert by_run[0]["totals"]["sampled_tokens"] == 0
    hourly = json.loads(run("usage", "--bucket", "hour", *data(tmp_path), "--json").stdout)
    [bucket] = hourly[0]["buckets"]  # all of it ran within this test, in one hour (or two)
    assert bucket["totals"] == alice["totals"] or len(hourly[0]["buckets"]) == 2
    recent = json.loads(run("usage", "--since", "2h", *data(tmp_path), "--json").stdout)
    assert recent[0]["totals"] == alice["totals"]
    future = run("usage", "--since", "2999-01-01", *data(tmp_path), "--json")
    assert json.loads(future.stdout) == []  # no usage from then: no tenant listed

    table = run("usage", "--tenant", "alice", *data(tmp_path)).stdout
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in table.splitlines()]
    assert ["alice", "total", "3", f"{ids['generated']:,}", "3", "2"] in rows
    assert ["alice", "forward_backward", "0", "0", "3", "1"] in rows
    assert "forward_backward" in table
    assert "sample" in table

    assert run("usage", "--session", "nope", *data(tmp_path)).exit_code == 1
    not_bobs = run("usage", "--session", ids["session"], "--tenant", "bob", *data(tmp_path))
    assert not_bobs.exit_code == 1
    assert "no session" in not_bobs.stderr
    assert run("usage", "--run", "nope:train:0", *data(tmp_path)).exit_code == 1
    bad_since = run("usage", "--since", "yesterday", *data(tmp_path))
    assert bad_since.exit_code == 2
    assert "--since" in bad_since.stderr
    assert run("usage", "--bucket", "week", *data(tmp_path)).exit_code == 2


# ---- errors, the bare install, the demo -------------------------------------------------------


def test_a_folder_without_a_registry_is_not_found(tmp_path: Path) -> None:
    for command in (("runs", "list"), ("checkpoints", "list"), ("usage",)):
        result = run(*command, *data(tmp_path / "nothing"))
        assert result.exit_code == 1
        assert "no tuneloop registry" in result.stderr
        assert result.stdout == ""


def test_bad_usage_exits_2() -> None:
    assert run("runs", "lst").exit_code == 2
    assert run("frobnicate").exit_code == 2
    assert run("serve", "--backend", "gpu").exit_code == 2
    assert run("serve", "--port", "eighty").exit_code == 2
    assert main(["keys", "frob"]) == 2
    assert main(["--version"]) == 0


def test_help_explains_every_command() -> None:
    top = run("--help")
    assert top.exit_code == 0
    for command in ("serve", "keys", "runs", "checkpoints", "usage"):
        assert command in top.stdout
    for command in (
        ("serve",),
        ("keys", "create"),
        ("keys", "list"),
        ("keys", "revoke"),
        ("runs", "list"),
        ("checkpoints", "list"),
        ("checkpoints", "delete"),
        ("checkpoints", "export"),
        ("usage",),
    ):
        result = run(*command, "--help")
        assert result.exit_code == 0, command
        assert "--data-dir" in result.stdout


def test_without_the_server_extra_the_commands_say_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A module mapped to None in sys.modules fails to import, as a missing package does.
    monkeypatch.setitem(sys.modules, "uvicorn", None)
    served = run("serve", "--backend", "fake", *data(tmp_path))
    assert served.exit_code == 2
    assert "tuneloop[server]" in served.stderr
    monkeypatch.setitem(sys.modules, "tuneloop.server.storage.registry", None)
    listed = run("runs", "list", *data(tmp_path))
    assert listed.exit_code == 2
    assert "tuneloop[server]" in listed.stderr
    monkeypatch.setitem(sys.modules, "tuneloop.server.cli", None)
    bare = run("serve", "--port", "0", app=build_app())
    assert bare.exit_code == 2
    assert "tuneloop[server]" in bare.stderr


def test_demo_is_registered_when_the_recipes_are_installed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "tuneloop.recipes.demo", None)
    assert "demo" not in run("--help", app=build_app()).stdout

    def demo_command(steps: int = 3) -> None:
        """Train a tiny model for a few steps."""
        typer.echo(f"demo ran {steps} steps")

    fake = types.ModuleType("tuneloop.recipes.demo")
    fake.demo_command = demo_command  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tuneloop.recipes.demo", fake)
    app = build_app()
    assert "demo" in run("--help", app=app).stdout
    assert run("demo", "--steps", "2", app=app).stdout.strip() == "demo ran 2 steps"
    assert "demo" not in run("--help", app=build_app(with_demo=False)).stdout


@pytest.mark.integration
def test_serve_then_usage_of_what_a_client_did(tmp_path: Path) -> None:
    """`tuneloop serve` as a child process, as clients start it; its usage outlives it."""
    with live_server(tmp_path) as live:
        with tuneloop.ServiceClient(base_url=live.url, api_key=live.key) as service:
            training = service.create_lora_training_client("tuneloop/fake-tiny", rank=2)
            example = tuneloop.Datum(
                model_input=tuneloop.ModelInput.from_ints([1, 2, 3]),
                loss_fn_inputs={"target_tokens": [2, 3, 4]},
            )
            training.forward_backward([example], "cross_entropy").result(60)
            training.forward([example], "cross_entropy").result(60)
            usage = service.get_usage()
            assert usage.session_id == service.session_id
            assert usage.by_operation["forward_backward"].trained_tokens == 3
            assert usage.by_operation["forward"].prefill_tokens == 3
            session_id = service.session_id
        assert stop(live.process) == 0
    report = run("usage", "--session", session_id, *data(tmp_path), "--json")
    assert json.loads(report.stdout)[0]["totals"] == usage.totals.model_dump()


def test_serve_refuses_a_worker_group_without_the_torch_engine(tmp_path: Path) -> None:
    for flags in (("--workers", "2"), ("--ray-address", "auto")):
        result = run("serve", "--backend", "fake", *data(tmp_path), *flags)
        assert result.exit_code == 2
        assert "need the torch backend" in result.output


def test_serve_hands_the_compile_switch_to_the_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--compile-norms` / `--no-compile-norms` reach the server config; neither leaves the
    engine its default (compiled.wanted)."""
    import tuneloop.server.app as app_module

    seen: list[bool | None] = []

    def capture(config: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(config.compile_norms)
        raise ValueError("captured")  # serve answers a usage error: nothing starts

    monkeypatch.setattr(app_module, "create_app", capture)
    for flags in ((), ("--compile-norms",), ("--no-compile-norms",)):
        assert run("serve", "--backend", "fake", *flags, *data(tmp_path)).exit_code == 2
    assert seen == [None, True, False]


def _switch_reaches_the_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flag: str, field: str, engine_kwarg: str
) -> None:
    """`--flag` / `--no-flag` reach the server config's `field`, and the config the torch
    engine's `engine_kwarg` (None: the engine's default)."""
    pytest.importorskip("torch")
    import tuneloop.server.app as app_module
    import tuneloop.server.engine.torch_backend as torch_backend
    from tuneloop.server.config import ServerConfig

    seen: list[bool | None] = []

    def capture(config: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(getattr(config, field))
        raise ValueError("captured")

    monkeypatch.setattr(app_module, "create_app", capture)
    for flags in ((), (f"--{flag}",), (f"--no-{flag}",)):
        assert run("serve", "--backend", "fake", *flags, *data(tmp_path)).exit_code == 2
    assert seen == [None, True, False]

    made: list[dict[str, Any]] = []
    monkeypatch.setattr(torch_backend, "TorchBackend", lambda *a, **k: made.append(k))
    for choice in (None, True, False):
        config = ServerConfig(tmp_path, backend="torch", **{field: choice})
        app_module.build_backend(config)
    assert [k[engine_kwarg] for k in made] == [None, True, False]


def test_serve_hands_the_merged_sampling_switch_to_the_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """merge_lone_adapter None: the engine's default, by dtype."""
    _switch_reaches_the_engine(
        tmp_path, monkeypatch, "merged-sampling", "merged_sampling", "merge_lone_adapter"
    )


def test_serve_hands_the_decode_graphs_switch_to_the_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """decode_graphs None: CUDA graphs on a GPU, none on a CPU."""
    _switch_reaches_the_engine(
        tmp_path, monkeypatch, "decode-graphs", "decode_graphs", "decode_graphs"
    )


def test_serve_hands_the_kv_cache_size_to_the_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--kv-cache-tokens (or TUNELOOP_KV_CACHE_TOKENS) reaches the config and the engine's
    sample_token_budget; unset, None (sized from free memory); below 1, a usage error."""
    pytest.importorskip("torch")
    import tuneloop.server.app as app_module
    import tuneloop.server.engine.torch_backend as torch_backend
    from tuneloop.server.config import ServerConfig

    seen: list[int | None] = []

    def capture(config: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(config.kv_cache_tokens)
        raise ValueError("captured")

    monkeypatch.setattr(app_module, "create_app", capture)
    for flags in ((), ("--kv-cache-tokens", "200000")):
        assert run("serve", "--backend", "fake", *flags, *data(tmp_path)).exit_code == 2
    monkeypatch.setenv("TUNELOOP_KV_CACHE_TOKENS", "65536")
    assert run("serve", "--backend", "fake", *data(tmp_path)).exit_code == 2
    assert seen == [None, 200000, 65536]
    refused = run("serve", "--backend", "fake", "--kv-cache-tokens", "0", *data(tmp_path))
    assert refused.exit_code == 2
    assert "kv-cache-tokens" in refused.output
    with pytest.raises(ValueError, match="kv_cache_tokens"):
        ServerConfig(tmp_path, kv_cache_tokens=0)

    made: list[dict[str, Any]] = []
    monkeypatch.setattr(torch_backend, "TorchBackend", lambda *a, **k: made.append(k))
    for choice in (None, 4096):
        app_module.build_backend(ServerConfig(tmp_path, backend="torch", kv_cache_tokens=choice))
    assert [k["sample_token_budget"] for k in made] == [None, 4096]
