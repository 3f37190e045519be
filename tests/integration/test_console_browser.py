"""The web console in a real browser: headless Chromium (Debian's, installed by `make browser`)
driven by Playwright, against a real `tuneloop serve` process training the built-in tiny Llama.

It signs in, opens the run while its loop trains, watches the loss curve gain points without a
reload, exports the adapter and downloads a file of it through the console's signed link, and
saves screenshots of every page it visits (the folder is printed; set TUNELOOP_TEST_ARTIFACTS to
keep them somewhere). With TUNELOOP_CONSOLE_SCREENSHOT=PATH it also writes the run page's
screenshot there (docs/console.png is made this way).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import sync_playwright

import tuneloop
from tuneloop import AdamParams, Datum, ModelInput
from tuneloop._local_server import LiveServer, live_server

pytestmark = pytest.mark.integration

CHROMIUM = Path(os.environ.get("TUNELOOP_CHROMIUM", "/usr/bin/chromium"))
MODEL = "tuneloop/tiny-llama"
MAX_STEPS = 200  # the loop stops by itself at the latest here
WAIT_MS = 60_000


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    data_dir = Path(tmp_path_factory.mktemp("console-live"))
    with live_server(data_dir, backend="torch", models=(MODEL,)) as live:
        yield live


@pytest.fixture
def artifacts(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("TUNELOOP_TEST_ARTIFACTS") or tmp_path / "screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    print(f"console screenshots: {folder}")
    return folder


class TrainingLoop:
    """forward_backward + optim_step, over and over, on a thread, until stopped."""

    def __init__(self, training: tuneloop.TrainingClient, tokens: list[int]) -> None:
        self.training = training
        self.data = [
            Datum(
                model_input=ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:]},
            )
        ]
        self.steps = 0
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            while not self.stop.is_set() and self.steps < MAX_STEPS:
                self.training.forward_backward(self.data, "cross_entropy").result(timeout=60)
                self.training.optim_step(AdamParams(learning_rate=0.005)).result(timeout=60)
                self.steps += 1
                self.stop.wait(0.4)  # a pace a person could watch
        except BaseException as exc:  # surfaced by the test
            self.error = exc

    def __enter__(self) -> TrainingLoop:
        self.thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=120)
        assert not self.thread.is_alive()


def test_the_console_shows_a_live_run_and_downloads_its_adapter(
    server: LiveServer, artifacts: Path
) -> None:
    assert CHROMIUM.exists(), f"{CHROMIUM} is missing: run `make browser` (installs chromium)"
    service = tuneloop.ServiceClient(base_url=server.url, api_key=server.key)
    try:
        training = service.create_lora_training_client(MODEL, rank=4, seed=0)
        tokens = training.get_tokenizer().encode("the console draws the loss as the run trains")
        run_page = f"{server.url}/console/runs/{urllib.parse.quote(training.model_id, safe='')}"
        with sync_playwright() as pw:
            browser = pw.chromium.launch(
                executable_path=str(CHROMIUM),
                headless=True,
                # As root (CI) Chromium refuses its sandbox; /dev/shm may be small in containers.
                args=["--no-sandbox", "--disable-dev-shm-usage"],
            )
            try:
                page = browser.new_page(
                    viewport={"width": 1360, "height": 900}, accept_downloads=True
                )
                page.set_default_timeout(WAIT_MS)
                # Script errors and blocked resources (a CSP violation, a missing vendored file)
                # show up here; the sign-in page's expected 401 is a response, not an error.
                errors: list[str] = []
                page.on("pageerror", lambda exc: errors.append(f"page error: {exc}"))
                page.on(
                    "console",
                    lambda msg: (
                        errors.append(f"console: {msg.text}") if msg.type == "error" else None
                    ),
                )
                page.goto(f"{server.url}/console")
                assert page.url.endswith("/console/sign-in")
                page.screenshot(path=str(artifacts / "01-sign-in.png"))
                page.get_by_label("API key").fill(server.key)
                page.get_by_role("button", name="Sign in").click()
                page.wait_for_url(f"{server.url}/console")
                assert server.key not in page.url
                cookie = next(c for c in page.context.cookies() if c["name"] == "tuneloop_console")
                assert cookie["httpOnly"]
                assert cookie["sameSite"] == "Strict"
                assert page.evaluate("document.cookie") == ""  # scripts cannot read the key

                with TrainingLoop(training, tokens) as loop:
                    page.goto(run_page)
                    loss = page.locator('figure[data-series="loss:sum"]')
                    page.wait_for_function(
                        "() => Number(document.getElementById('curves').dataset.points || 0) >= 2"
                    )
                    seen = int(page.locator("#curves").get_attribute("data-points") or 0)
                    loss.wait_for()
                    page.screenshot(path=str(artifacts / "02-run-curves-early.png"), full_page=True)
                    # The same page, not reloaded, gains points as the loop trains.
                    page.wait_for_function(
                        "n => Number(document.getElementById('curves').dataset.points) >= n",
                        arg=seen + 3,
                    )
                    later = int(page.locator("#curves").get_attribute("data-points") or 0)
                    assert later >= seen + 3
                    assert int(loss.get_attribute("data-points") or 0) >= seen + 3
                    assert page.locator("canvas").count() >= 4  # loss, per token, tokens, time
                    page.wait_for_timeout(2500)  # one more poll, for a screenshot with a full curve
                    page.screenshot(path=str(artifacts / "03-run-curves-later.png"), full_page=True)
                    shot = os.environ.get("TUNELOOP_CONSOLE_SCREENSHOT")
                    if shot:
                        page.screenshot(path=shot)
                assert loop.error is None, loop.error
                assert loop.steps >= later

                export = training.save_weights_external("browser-export").result(timeout=60)
                page.goto(f"{server.url}/console/checkpoints")
                row = page.locator("tr", has_text=export.path)
                row.wait_for()
                page.screenshot(path=str(artifacts / "04-checkpoints.png"), full_page=True)
                row.get_by_role("link", name="Download").click()
                page.wait_for_url("**/console/checkpoints/download**")
                page.screenshot(path=str(artifacts / "05-download.png"), full_page=True)
                link = page.get_by_role("link", name="adapter_model.safetensors")
                with page.expect_download() as waiting:
                    link.click()
                download = waiting.value
                saved = artifacts / "adapter_model.safetensors"
                download.save_as(str(saved))
                on_server = _checkpoint_file(server, export.path, "adapter_model.safetensors")
                assert _sha256(saved) == _sha256(on_server)

                page.goto(f"{server.url}/console/usage")
                page.locator("#usage-chart canvas").nth(1).wait_for()  # by class, by operation
                page.screenshot(path=str(artifacts / "06-usage.png"), full_page=True)
                page.goto(f"{server.url}/console/playground")
                page.get_by_label("Model").select_option(export.path)
                page.get_by_label("Message").fill("What is 2 + 3?")
                page.get_by_label("Max tokens").fill("12")
                page.get_by_role("button", name="Send").click()
                page.locator("#chat-log .tok").first.wait_for()
                assert page.locator("#chat-log .error").count() == 0
                assert page.locator("#chat-log .tok").count() >= 1
                assert "logprob" in (
                    page.locator("#chat-log .tok").first.get_attribute("title") or ""
                )
                page.screenshot(path=str(artifacts / "07-playground.png"), full_page=True)
                page.goto(f"{server.url}/console")
                page.get_by_role("link", name=training.model_id).wait_for()
                page.screenshot(path=str(artifacts / "08-overview.png"), full_page=True)

                # An operator's key (`keys create --admin`) also sees every tenant and the engine.
                page.get_by_role("button", name="Sign out").click()
                page.wait_for_url("**/console/sign-in")
                page.get_by_label("API key").fill(_admin_key(server))
                page.get_by_role("button", name="Sign in").click()
                page.get_by_role("link", name="Operator").click()
                page.wait_for_url("**/console/operator")
                assert page.get_by_role("row", name="alice").count() == 1
                assert MODEL in page.locator("main").inner_text()
                page.screenshot(path=str(artifacts / "09-operator.png"), full_page=True)
                assert errors == []
            finally:
                browser.close()
    finally:
        service.close()


def _admin_key(server: LiveServer) -> str:
    command = [sys.executable, "-m", "tuneloop", "keys", "--data-dir", str(server.data_dir)]
    out = subprocess.run(
        [*command, "create", "--tenant", "ops", "--admin"],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "(admin)" in out.stderr
    return out.stdout.strip()


def _checkpoint_file(server: LiveServer, tinker_path: str, name: str) -> Path:
    found = [p for p in server.data_dir.rglob(name) if "browser-export" in str(p)]
    assert len(found) == 1, (tinker_path, found)
    return found[0]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
