"""Our SDK's RestClient methods for projects, publishing, copies, search, traces, audit and
billing, against a real `tuneloop serve` process (the same names as the official SDK's)."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

import tuneloop
from tuneloop import AdamParams, Datum, ModelInput
from tuneloop._local_server import LiveServer, create_key, live_server

pytestmark = pytest.mark.integration
MODEL = "tuneloop/fake-tiny"
TOKENS = [5, 17, 33, 90, 120, 7]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(Path(tmp_path_factory.mktemp("live"))) as live:
        yield live


def test_rest_admin_methods_of_our_sdk(server: LiveServer) -> None:
    with tuneloop.ServiceClient(base_url=server.url, api_key=server.key) as service:
        training = service.create_lora_training_client(MODEL, rank=4, seed=0)
        datum = Datum(
            model_input=ModelInput.from_ints(TOKENS[:-1]),
            loss_fn_inputs={"target_tokens": TOKENS[1:]},
        )
        training.forward_backward([datum], "cross_entropy").result(timeout=60)
        training.optim_step(AdamParams(learning_rate=1e-3)).result(timeout=60)
        path = training.save_state("w1").result(timeout=60).path
        session_id = service.session_id
        rest = service.create_rest_client()
        rest.assign_session_project(session_id, "research").result(timeout=30)
        runs = rest.list_training_runs(project_id="research").result(timeout=30).training_runs
        assert [r.training_run_id for r in runs] == [training.model_id]

        assert rest.publish_checkpoint_from_tinker_path(path).result(timeout=30)["changed"]
        key = create_key(server.data_dir, "bob")
        with tuneloop.RestClient(base_url=server.url, api_key=key) as bob:
            # Bob reads alice's published weights, copies them into a project of his own.
            assert bob.get_weights_info_by_tinker_path(path).result(timeout=30).base_model == MODEL
            copied = bob.copy_weights(path, "mine").result(timeout=30)
            assert copied.endswith("/weights/w1")
            usage = bob.get_current_checkpoint_storage_usage().result(timeout=30)["data"]
            assert [(u["project_id"], u["checkpoint_count"]) for u in usage] == [("mine", 1)]
        assert not rest.unpublish_checkpoint_from_tinker_path(path).result(timeout=30)["public"]

        found = rest.search_sessions(project_ids=["research"]).result(timeout=30)["sessions"]
        assert [s["session_id"] for s in found] == [session_id]
        url = rest.export_session_trace(session_id).result(timeout=30)
        with urllib.request.urlopen(url, timeout=30) as response:
            trace = json.loads(response.read())
        assert [r["type"] for r in trace["requests"]][:3] == [
            "CreateModel",
            "ForwardBackward",
            "OptimStep",
        ]
        events = {e["event"] for e in rest.get_audit_log().result(timeout=30)["entries"]}
        assert {
            "checkpoint_published",
            "checkpoint_unpublished",
            "project_session_assigned",
        } <= events
        with tuneloop.ServiceClient(
            base_url=server.url, api_key=server.key, project_id="archive"
        ) as archive:
            copy = archive.copy_weights(path).result(timeout=30)
            archived = rest.list_training_runs(project_id="archive").result(timeout=30)
            assert copy.removeprefix("tinker://").split("/")[0] in {
                r.training_run_id for r in archived.training_runs
            }
        hour = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
        billing = rest.get_billing_usage(hour, hour + timedelta(hours=1)).result(timeout=30)
        assert {e["event_info"]["type"] for e in billing["data"]} >= {"training", "checkpoint"}
