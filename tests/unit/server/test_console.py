"""The web console on the fake backend: sign-in and its cookie, pages and data routes, per-step
curves, checkpoint download and delete (CSRF), the playground, and the operator view.

Isolation: every console page and data route is walked with tenant B's cookie while tenant A has
sessions, runs, curves, checkpoints, samplers and usage, and nothing of A's may appear.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.routing import APIRoute, iter_route_contexts
from typer.testing import CliRunner

from tests.unit.server.harness import MODEL, Api, datum, sampler
from tuneloop.cli import build_app
from tuneloop.server.api.console.auth import COOKIE
from tuneloop.server.storage.keys import KeyStore
from tuneloop.server.storage.run_metrics import RunMetricsStore
from tuneloop.types.codec import decode_forward_backward_output

TOKENS = [5, 17, 33, 90, 120, 7, 44]


async def sign_in(api: Api, key: str | None = None) -> str:
    """Sign `api`'s client in with its key (or `key`); returns the page's CSRF token."""
    response = await api.http.post(
        "/console/sign-in", data={"api_key": key or api.key}, follow_redirects=False
    )
    assert response.status_code == 303, response.text
    assert response.headers["location"] == "/console"
    return csrf_of(await api.http.get("/console"))


def csrf_of(page: httpx.Response) -> str:
    assert page.status_code == 200, page.text
    match = re.search(r'<meta name="csrf-token" content="([0-9a-f]+)">', page.text)
    assert match is not None, page.text
    return match.group(1)


async def train_steps(api: Api, model_id: str, steps: int, first_seq: int = 1) -> list[float]:
    """`steps` x (forward_backward + optim_step); the loss:sum each forward_backward returned."""
    losses = []
    seq = first_seq
    for _ in range(steps):
        done = await api.result(await api.forward_backward(model_id, seq, [datum(TOKENS)]))
        losses.append(decode_forward_backward_output(done.content).metrics["loss:sum"])
        body = {"model_id": model_id, "seq_id": seq + 1, "adam_params": {"learning_rate": 0.05}}
        optim = await api.result(await api.post("optim_step", body))
        assert optim.status_code == 200, optim.text
        seq += 2
    return losses


async def export(api: Api, model_id: str, name: str, seq_id: int) -> str:
    body = {"model_id": model_id, "path": name, "seq_id": seq_id}
    done = await api.result(await api.post("save_weights_external", body))
    assert done.status_code == 200, done.text
    return str(done.json()["path"])


async def points(api: Api, run_id: str, after: int = 0) -> dict[str, Any]:
    quoted = urllib.parse.quote(run_id, safe="")
    response = await api.http.get(f"/console/data/runs/{quoted}/points", params={"after": after})
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


# ---- sign-in ---------------------------------------------------------------------------------


async def test_sign_in_sets_a_strict_httponly_cookie_and_the_key_never_shows(api: Api) -> None:
    response = await api.http.post(
        "/console/sign-in", data={"api_key": api.key}, follow_redirects=False
    )
    assert response.status_code == 303
    cookie = response.headers["set-cookie"]
    assert cookie.startswith(f"{COOKIE}=")
    flags = {part.strip().lower() for part in cookie.split(";")[1:]}
    assert "httponly" in flags
    assert "samesite=strict" in flags
    assert "path=/console" in flags
    assert "secure" not in flags  # plain http here: a Secure cookie would never come back
    assert api.key not in response.headers["location"]
    for page in ("/console", "/console/checkpoints", "/console/usage", "/console/playground"):
        shown = await api.http.get(page)
        assert shown.status_code == 200, page
        assert api.key not in shown.text, page
        assert "default-src 'self'" in shown.headers["content-security-policy"]
        assert shown.headers["x-frame-options"] == "DENY"


async def test_over_https_the_cookie_is_secure(server: tuple[Any, KeyStore]) -> None:
    app, keys = server
    key, _ = keys.create("alice")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="https://tuneloop") as http:
        response = await http.post("/console/sign-in", data={"api_key": key})
    flags = {p.strip().lower() for p in response.headers["set-cookie"].split(";")[1:]}
    assert {"secure", "httponly", "samesite=strict"} <= flags


async def test_a_wrong_key_is_refused_and_a_key_in_the_url_signs_nothing_in(api: Api) -> None:
    bad = await api.http.post("/console/sign-in", data={"api_key": "tml-nope"})
    assert bad.status_code == 401
    assert "set-cookie" not in bad.headers
    assert "unknown or revoked" in bad.text
    in_url = await api.http.get("/console/sign-in", params={"api_key": api.key})
    assert "set-cookie" not in in_url.headers
    home = await api.http.get("/console", follow_redirects=False)
    assert (home.status_code, home.headers["location"]) == (303, "/console/sign-in")
    data = await api.http.get("/console/data/usage")
    assert data.status_code == 401
    assert data.json()["field"] == COOKIE
    not_form = await api.http.post("/console/sign-in", json={"api_key": api.key})
    assert not_form.status_code == 415
    # Another site's page posting the form (a forged sign-in) is refused; the console's own is not.
    forged = await api.http.post(
        "/console/sign-in",
        data={"api_key": api.key},
        headers={"origin": "https://evil.example"},
    )
    assert forged.status_code == 403
    assert forged.json()["field"] == "origin"
    assert "set-cookie" not in forged.headers
    own = await api.http.post(
        "/console/sign-in", data={"api_key": api.key}, headers={"origin": "http://tuneloop"}
    )
    assert own.status_code == 303


async def test_a_revoked_key_is_signed_out_at_once(api: Api) -> None:
    await sign_in(api)
    record = next(r for r in api.keys.list() if r.tenant == "alice")
    api.keys.revoke(record.key_id)
    home = await api.http.get("/console", follow_redirects=False)
    assert home.status_code == 303
    assert (await api.http.get("/console/fragments/overview")).status_code == 401


async def test_sign_out_needs_the_csrf_token_and_clears_the_cookie(api: Api) -> None:
    token = await sign_in(api)
    refused = await api.http.post("/console/sign-out", data={})
    assert refused.status_code == 403
    assert (await api.http.get("/console")).status_code == 200  # still signed in
    out = await api.http.post(
        "/console/sign-out", data={"csrf_token": token}, follow_redirects=False
    )
    assert out.status_code == 303
    assert (
        f'{COOKIE}=""' in out.headers["set-cookie"]
        or "max-age=0" in out.headers["set-cookie"].lower()
    )
    assert (await api.http.get("/console", follow_redirects=False)).status_code == 303


# ---- overview, runs and curves ---------------------------------------------------------------


async def test_the_overview_lists_sessions_runs_samplers_and_quota(api: Api) -> None:
    session_id = await api.session()
    model_id = await api.model(session_id)
    sampler_id = await sampler(api, session_id, seq=1)
    finished = await api.session()
    assert (await api.post("session_finish", {"session_id": finished})).status_code in (200, 404)
    await sign_in(api)
    page = (await api.http.get("/console")).text
    for shown in (session_id, model_id, sampler_id, MODEL, "rank 4"):
        assert shown in page
    assert "Live sessions: <strong>" in page
    fragment = await api.http.get("/console/fragments/overview")
    assert fragment.status_code == 200
    assert model_id in fragment.text
    assert "<html" not in fragment.text  # a fragment for htmx to swap in, not a page


async def test_each_optim_step_records_a_point_with_the_engines_metrics(
    api: Api, server: tuple[Any, KeyStore]
) -> None:
    session_id = await api.session()
    model_id = await api.model(session_id)
    losses = await train_steps(api, model_id, 3)
    await sign_in(api)
    body = await points(api, model_id)
    assert body["training_step"] == 3
    got = body["points"]
    assert [p["step"] for p in got] == [1, 2, 3]
    assert [p["metrics"]["loss:sum"] for p in got] == pytest.approx(losses)
    assert all(p["trained_tokens"] == len(TOKENS) - 1 for p in got)
    assert all("grad_norm" in p["metrics"] and "learning_rate" in p["metrics"] for p in got)
    assert got[0]["step_s"] is None  # no earlier step to measure from
    assert all(p["step_s"] > 0 for p in got[1:])
    # Live polling: only what was added after the last answer.
    after = body["next_after"]
    assert (await points(api, model_id, after))["points"] == []
    await train_steps(api, model_id, 1, first_seq=7)
    newer = await points(api, model_id, after)
    assert [p["step"] for p in newer["points"]] == [4]
    page = await api.http.get(f"/console/runs/{urllib.parse.quote(model_id, safe='')}")
    assert page.status_code == 200
    assert 'id="curves"' in page.text
    assert "/points" in page.text


async def test_forward_only_and_accumulated_steps(api: Api) -> None:
    session_id = await api.session()
    model_id = await api.model(session_id)
    # Two forward_backward calls in one step: loss:sum adds up, tokens add up.
    first = await api.result(await api.forward_backward(model_id, 1, [datum(TOKENS)]))
    second = await api.result(await api.forward_backward(model_id, 2, [datum(TOKENS[:4])]))
    forward = await api.forward_backward(model_id, 3, [datum(TOKENS)], forward_only=True)
    await api.result(forward)
    optim = {"model_id": model_id, "seq_id": 4, "adam_params": {"learning_rate": 0.05}}
    await api.result(await api.post("optim_step", optim))
    await sign_in(api)
    (point,) = (await points(api, model_id))["points"]
    expected = sum(
        decode_forward_backward_output(r.content).metrics["loss:sum"] for r in (first, second)
    )
    assert point["metrics"]["loss:sum"] == pytest.approx(expected)
    assert point["trained_tokens"] == (len(TOKENS) - 1) + 3  # the forward-only call trains none


async def test_curves_survive_a_restart(tmp_path: Path, db_url: str) -> None:
    from tests.unit.server.harness import serve

    async with serve(tmp_path, db_url=db_url) as api:
        session_id = await api.session()
        model_id = await api.model(session_id)
        await train_steps(api, model_id, 2)
        key = api.key
    async with serve(tmp_path, tenant="other", db_url=db_url) as again:
        await sign_in(again, key)
        body = await points(again, model_id)
        assert [p["step"] for p in body["points"]] == [1, 2]


def test_the_store_keeps_only_the_last_points_of_each_run(tmp_path: Path) -> None:
    from sqlalchemy import create_engine

    store = RunMetricsStore(create_engine(f"sqlite:///{tmp_path / 'm.db'}"), keep=3)
    for step in range(1, 8):
        store.record("r1", "alice", step, trained_tokens=step, step_s=0.5, metrics={"x": step})
    store.record("r2", "alice", 1, trained_tokens=1, step_s=None, metrics={"bad": float("nan")})
    assert [p.step for _, p in store.points("r1", "alice")] == [5, 6, 7]
    assert [p.metrics for _, p in store.points("r2", "alice")] == [{}]  # NaN: left out
    assert store.points("r1", "bob") == []
    assert store.last_step("r1") == 7
    with pytest.raises(ValueError, match="keep"):
        RunMetricsStore(create_engine("sqlite://"), keep=0)


# ---- checkpoints -----------------------------------------------------------------------------


async def test_download_links_are_signed_urls_that_fetch_the_adapter(api: Api) -> None:
    session_id = await api.session()
    model_id = await api.model(session_id)
    await train_steps(api, model_id, 1)
    path = await export(api, model_id, "e1", 3)
    await sign_in(api)
    listing = (await api.http.get("/console/checkpoints")).text
    assert path in listing
    assert "adapter" in listing
    page = await api.http.get("/console/checkpoints/download", params={"path": path})
    assert page.status_code == 200, page.text
    links = re.findall(r'<a href="(http[^"]+/api/v1/downloads/[^"]+)"', page.text)
    assert links
    for link in links:
        url = link.replace("&amp;", "&")
        # No key, no cookie: the signature is the credential.
        async with httpx.AsyncClient(transport=api.http._transport, base_url="http://x") as bare:
            got = await bare.get(url)
        assert got.status_code == 200, got.text
        assert len(got.content) > 0
    training = await api.result(
        await api.post("save_weights", {"model_id": model_id, "path": "w1", "seq_id": 4})
    )
    not_downloadable = await api.http.get(
        "/console/checkpoints/download", params={"path": training.json()["path"]}
    )
    assert not_downloadable.status_code == 400
    assert not_downloadable.json()["field"] == "path"


async def test_delete_needs_confirmation_and_the_csrf_token(api: Api) -> None:
    session_id = await api.session()
    model_id = await api.model(session_id)
    path = await export(api, model_id, "e1", 1)
    token = await sign_in(api)
    confirm = await api.http.get("/console/checkpoints/delete", params={"path": path})
    assert confirm.status_code == 200
    assert 'name="csrf_token"' in confirm.text
    assert path in confirm.text
    for data in ({"path": path}, {"path": path, "csrf_token": "0" * 64}):
        refused = await api.http.post("/console/checkpoints/delete", data=data)
        assert refused.status_code == 403, data
        assert refused.json()["field"] == "csrf_token"
    assert path in (await api.http.get("/console/checkpoints")).text
    # A cross-site JSON post is not a form, and carries no token either.
    assert (
        await api.http.post("/console/checkpoints/delete", json={"path": path})
    ).status_code in (
        403,
        415,
    )
    done = await api.http.post(
        "/console/checkpoints/delete",
        data={"path": path, "csrf_token": token},
        follow_redirects=False,
    )
    assert done.status_code == 303
    assert path not in (await api.http.get("/console/checkpoints")).text
    assert (await api.get("checkpoints")).json()["checkpoints"] == []


# ---- usage, playground, operator ---------------------------------------------------------------


async def test_usage_page_and_data_show_tokens_per_hour_and_operation(api: Api) -> None:
    session_id = await api.session()
    model_id = await api.model(session_id)
    await train_steps(api, model_id, 2)
    await sign_in(api)
    data = (await api.http.get("/console/data/usage", params={"since": "24h"})).json()
    assert data["totals"]["trained_tokens"] == 2 * (len(TOKENS) - 1)
    assert data["buckets"]
    assert data["bucket"] == "hour"
    page = await api.http.get("/console/usage")
    assert page.status_code == 200
    assert "forward_backward" in page.text
    assert str(2 * (len(TOKENS) - 1)) in page.text
    bad = await api.http.get("/console/data/usage", params={"since": "yesterday"})
    assert bad.status_code == 400
    assert bad.json()["field"] == "since"


async def test_the_playground_chats_through_the_openai_route_with_logprobs(api: Api) -> None:
    token = await sign_in(api)
    page = await api.http.get("/console/playground")
    assert MODEL in page.text
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "logprobs": True,
        "top_logprobs": 2,
        "seed": 1,
    }
    refused = await api.http.post("/console/data/chat", json=body)
    assert refused.status_code == 403
    cross_site = await api.http.post(
        "/console/data/chat",
        json=body,
        headers={"x-csrf-token": token, "origin": "https://evil.example"},
    )
    assert cross_site.status_code == 403
    reply = await api.http.post("/console/data/chat", json=body, headers={"x-csrf-token": token})
    assert reply.status_code == 200, reply.text
    content = reply.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == reply.json()["usage"]["completion_tokens"]
    assert all(len(t["top_logprobs"]) == 2 for t in content)
    unknown = await api.http.post(
        "/console/data/chat", json={**body, "model": "nope"}, headers={"x-csrf-token": token}
    )
    assert unknown.status_code == 404
    streamed = await api.http.post(
        "/console/data/chat", json={**body, "stream": True}, headers={"x-csrf-token": token}
    )
    assert streamed.status_code == 400
    assert streamed.json()["field"] == "stream"


async def test_the_operator_view_needs_an_admin_key(api: Api, other_tenant: Api) -> None:
    session_id = await other_tenant.session()
    await other_tenant.model(session_id)
    await train_steps(api, await api.model(await api.session()), 1)
    await sign_in(api)
    assert (await api.http.get("/console/operator")).status_code == 403
    assert (await api.http.get("/console/data/engine")).status_code == 403
    assert (await api.http.get("/console/fragments/operator")).status_code == 403
    assert "/console/operator" not in (await api.http.get("/console")).text
    admin_key, record = api.keys.create("ops", admin=True)
    assert record.admin
    await sign_in(api, admin_key)
    page = await api.http.get("/console/operator")
    assert page.status_code == 200
    for shown in ("alice", "bob", "ops", "FakeBackend", "Tokens/s"):
        assert shown in page.text
    alice_row = re.search(r'<th scope="row">alice</th>(.*?)</tr>', page.text, re.DOTALL)
    assert alice_row is not None
    cells = re.findall(r'<td class="num">([^<]*)</td>', alice_row.group(1))
    # sessions (live), runs, checkpoints, in flight / max, max sessions, prefill, sampled, trained
    assert cells[:3] == ["1 (1)", "1", "0 (0 B)"]
    assert cells[5:8] == ["0", "0", str(len(TOKENS) - 1)]
    engine = (await api.http.get("/console/data/engine")).json()
    assert engine["models"] == [MODEL]
    assert engine["samples_waiting"] == 0
    assert engine["running"] is None
    assert engine["workers"] is None  # a single-process backend
    assert set(engine["tokens_per_s"]) == {"prefill", "sampled", "trained"}


def test_an_admin_flag_is_stored_with_the_key(tmp_path: Path) -> None:
    keys = KeyStore(tmp_path / "keys.json")
    plain, _ = keys.create("alice")
    made = CliRunner().invoke(
        build_app(with_demo=False),
        ["keys", "--data-dir", str(tmp_path), "create", "--tenant", "ops", "--admin"],
        catch_exceptions=False,
    )
    assert made.exit_code == 0, made.output
    admin = made.stdout.strip()
    assert "for tenant ops (admin)" in made.stderr
    assert keys.record_of(plain).admin is False  # type: ignore[union-attr]
    assert keys.record_of(admin).admin is True  # type: ignore[union-attr]
    assert keys.tenant_of(admin) == "ops"
    assert keys.record_of("tml-unknown") is None


async def test_static_files_are_vendored_and_only_those(api: Api) -> None:
    for name in ("htmx.min.js", "uPlot.iife.min.js", "uPlot.min.css", "console.js"):
        response = await api.http.get(f"/console/static/{name}")
        assert response.status_code == 200, name
        assert len(response.content) > 1000
    for name in ("README.md", "..%2Froutes.py", "LICENSE.htmx"):
        assert (await api.http.get(f"/console/static/{name}")).status_code == 404


# ---- isolation -------------------------------------------------------------------------------


@dataclass
class AliceWorld:
    session_id: str
    model_id: str
    exported: str
    sampler_id: str
    token: str

    def secrets(self) -> list[str]:
        return [self.session_id, self.model_id, self.exported, self.sampler_id, "alice-export"]


def _q(value: str) -> str:
    return urllib.parse.quote(value, safe="")


Walk = Callable[[Api, AliceWorld, str], Awaitable[httpx.Response]]
# Every console route, called by bob (signed in, his CSRF token given) on alice's things where
# the route takes one. test_every_console_route_is_walked keeps this table complete.
WALK: dict[tuple[str, str], Walk] = {
    ("GET", "/console/sign-in"): lambda b, _a, _t: b.http.get("/console/sign-in"),
    ("POST", "/console/sign-in"): lambda b, _a, _t: b.http.post(
        "/console/sign-in", data={"api_key": b.key}
    ),
    ("GET", "/console"): lambda b, _a, _t: b.http.get("/console"),
    ("GET", "/console/fragments/overview"): lambda b, _a, _t: b.http.get(
        "/console/fragments/overview"
    ),
    ("GET", "/console/runs/{run_id}"): lambda b, a, _t: b.http.get(
        f"/console/runs/{_q(a.model_id)}"
    ),
    ("GET", "/console/data/runs/{run_id}/points"): lambda b, a, _t: b.http.get(
        f"/console/data/runs/{_q(a.model_id)}/points"
    ),
    ("GET", "/console/checkpoints"): lambda b, _a, _t: b.http.get("/console/checkpoints"),
    ("GET", "/console/checkpoints/download"): lambda b, a, _t: b.http.get(
        "/console/checkpoints/download", params={"path": a.exported}
    ),
    ("GET", "/console/checkpoints/delete"): lambda b, a, _t: b.http.get(
        "/console/checkpoints/delete", params={"path": a.exported}
    ),
    # With bob's own valid token: still not found, and alice's checkpoint stays.
    ("POST", "/console/checkpoints/delete"): lambda b, a, t: b.http.post(
        "/console/checkpoints/delete", data={"path": a.exported, "csrf_token": t}
    ),
    ("GET", "/console/usage"): lambda b, _a, _t: b.http.get("/console/usage?since=30d"),
    ("GET", "/console/data/usage"): lambda b, _a, _t: b.http.get("/console/data/usage?since=30d"),
    ("GET", "/console/playground"): lambda b, _a, _t: b.http.get("/console/playground"),
    ("POST", "/console/data/chat"): lambda b, a, t: b.http.post(
        "/console/data/chat",
        json={"model": a.exported, "messages": [{"role": "user", "content": "x"}]},
        headers={"x-csrf-token": t},
    ),
    ("GET", "/console/operator"): lambda b, _a, _t: b.http.get("/console/operator"),
    ("GET", "/console/fragments/operator"): lambda b, _a, _t: b.http.get(
        "/console/fragments/operator"
    ),
    ("GET", "/console/data/engine"): lambda b, _a, _t: b.http.get("/console/data/engine"),
    ("GET", "/console/static/{name}"): lambda b, _a, _t: b.http.get("/console/static/console.js"),
    # Last: bob is signed out after it.
    ("POST", "/console/sign-out"): lambda b, _a, t: b.http.post(
        "/console/sign-out", data={"csrf_token": t}
    ),
}
# What bob gets where alice's thing is named: not found (or, for the operator, forbidden).
EXPECTED = {
    ("GET", "/console/runs/{run_id}"): 404,
    ("GET", "/console/data/runs/{run_id}/points"): 404,
    ("GET", "/console/checkpoints/download"): 404,
    ("GET", "/console/checkpoints/delete"): 404,
    ("POST", "/console/checkpoints/delete"): 404,
    ("POST", "/console/data/chat"): 404,
    ("GET", "/console/operator"): 403,
    ("GET", "/console/fragments/operator"): 403,
    ("GET", "/console/data/engine"): 403,
}


def console_routes(app: Any) -> set[tuple[str, str]]:
    out = set()
    for context in iter_route_contexts(app.routes):
        route = context.original_route
        if isinstance(route, APIRoute) and (context.path or "").startswith("/console"):
            out |= {(method, str(context.path)) for method in route.methods}
    return out


async def test_every_console_route_is_walked(server: tuple[Any, KeyStore]) -> None:
    # A new console route fails here until the isolation walk below calls it.
    assert console_routes(server[0]) == set(WALK), console_routes(server[0]) ^ set(WALK)


async def test_tenant_b_sees_nothing_of_tenant_a(api: Api, other_tenant: Api) -> None:
    alice = api
    session_id = await alice.session()
    model_id = await alice.model(session_id)
    await train_steps(alice, model_id, 2)
    exported = await export(alice, model_id, "alice-export", 5)
    sampler_id = await sampler(alice, session_id, seq=1)
    world = AliceWorld(session_id, model_id, exported, sampler_id, await sign_in(alice))

    bob = other_tenant
    bob_token = await sign_in(bob)
    assert bob_token != world.token
    for route, call in WALK.items():
        response = await call(bob, world, bob_token)
        expected = EXPECTED.get(route)
        if expected is None:
            assert response.status_code in (200, 303), (route, response.status_code)
        else:
            assert response.status_code == expected, (route, response.status_code)
        # A 404 may repeat what bob asked for (alice's id, typed by bob); nothing else of hers.
        text = response.text
        if response.status_code == 404:
            body = response.json()
            if "error" in body:  # the playground forwards the OpenAI route's own error shape
                body = {"type": body["error"]["code"]}
            assert body["type"] == "not_found", route
            text = text.replace(exported, "").replace(model_id, "")
        for secret in world.secrets():
            assert secret not in text, (route, secret)
    # alice's token is worthless with bob's cookie.
    await sign_in(bob)
    forged = await bob.http.post(
        "/console/checkpoints/delete", data={"path": exported, "csrf_token": world.token}
    )
    assert forged.status_code == 403
    assert exported in (await alice.http.get("/console/checkpoints")).text
    assert len((await points(alice, model_id))["points"]) == 2


async def test_a_deployment_serves_the_playground_and_not_the_training_pages(
    tmp_path: Path,
) -> None:
    from tests.unit.server.harness import serve

    async with serve(tmp_path, openai_only=True) as api:
        token = await sign_in_to(api, "/console/playground")
        home = await api.http.get("/console", follow_redirects=False)
        assert (home.status_code, home.headers["location"]) == (303, "/console/playground")
        for page in ("/console/checkpoints", "/console/fragments/overview", "/console/runs/x"):
            response = await api.http.get(page)
            assert response.status_code == 404, page
        playground = await api.http.get("/console/playground")
        assert 'href="/console/checkpoints"' not in playground.text
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        reply = await api.http.post(
            "/console/data/chat", json=body, headers={"x-csrf-token": token}
        )
        assert reply.status_code == 200, reply.text


async def sign_in_to(api: Api, landing: str) -> str:
    response = await api.http.post(
        "/console/sign-in", data={"api_key": api.key}, follow_redirects=True
    )
    assert response.status_code == 200, response.text  # followed to `landing`
    assert str(response.url).endswith(landing)
    return csrf_of(response)
