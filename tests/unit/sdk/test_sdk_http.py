"""Transport and futures: error mapping, retries, long-poll loop, failure records, APIFuture."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

import tuneloop
from tuneloop import errors
from tuneloop._futures import APIFuture

STATUS_ERRORS = [
    (400, errors.BadRequestError),
    (401, errors.AuthenticationError),
    (403, errors.PermissionDeniedError),
    (404, errors.NotFoundError),
    (409, errors.ConflictError),
    (410, errors.GoneError),
    (413, errors.RequestTooLargeError),
    (415, errors.UnsupportedMediaTypeError),
    (422, errors.UnprocessableEntityError),
    (429, errors.RateLimitError),
    (500, errors.InternalServerError),
    (503, errors.InternalServerError),
]


@pytest.mark.parametrize(("status", "error_type"), STATUS_ERRORS)
def test_error_statuses_map_to_types_with_detail(service, server, status, error_type):
    body = {"detail": "rank must be <= 64", "field": "lora_config.rank", "type": "invalid"}
    # x-should-retry: false makes even the retryable statuses fail at once.
    server.queue(
        "GET",
        "/api/v1/get_server_capabilities",
        httpx.Response(status, json=body, headers={"x-should-retry": "false"}),
    )
    rest = service.create_rest_client()
    with pytest.raises(error_type) as info:
        rest.get_server_capabilities().result(timeout=5)
    exc = info.value
    assert isinstance(exc, errors.APIStatusError)
    assert isinstance(exc, tuneloop.TuneloopError)
    assert exc.status_code == status
    assert exc.body == body
    assert "rank must be <= 64" in str(exc)
    assert "lora_config.rank" in str(exc)


def test_non_retryable_4xx_is_not_retried(service, server):
    server.queue("POST", "/api/v1/create_model", httpx.Response(400, json={"detail": "bad model"}))
    with pytest.raises(errors.BadRequestError, match="bad model"):
        service.create_lora_training_client("nope")
    assert server.paths().count("/api/v1/create_model") == 1


def test_retries_503_and_429_honouring_retry_after(service, server):
    server.queue(
        "POST",
        "/api/v1/create_model",
        httpx.Response(503, json={"detail": "warming up"}, headers={"retry-after-ms": "20"}),
        httpx.Response(429, json={"detail": "slow down"}, headers={"retry-after": "0.02"}),
    )
    started = time.monotonic()
    tc = service.create_lora_training_client("tiny-base")
    assert tc.model_id == "sess-1:train:0"
    attempts = [r for r in server.requests if r.url.path == "/api/v1/create_model"]
    assert len(attempts) == 3
    # One idempotency key across the retries of one call.
    assert len({r.headers["x-idempotency-key"] for r in attempts}) == 1
    assert time.monotonic() - started >= 0.04
    # Same body, so the same model_seq_id / seq_id: the server deduplicates.
    assert len({r.content for r in attempts}) == 1


def test_connection_errors_are_retried(service, server):
    def refuse(request):
        raise httpx.ConnectError("refused", request=request)

    server.queue("POST", "/api/v1/create_model", refuse)
    server.queue(
        "GET", "/api/v1/get_server_capabilities", httpx.Response(200, json={"supported_models": []})
    )
    tc = service.create_lora_training_client("tiny-base")
    assert tc.model_id == "sess-1:train:0"


def test_headers(service, server):
    service.create_lora_training_client("tiny-base")
    request = next(r for r in server.requests if r.url.path == "/api/v1/create_model")
    assert request.headers["x-api-key"] == "tl-test-key"
    assert request.headers["user-agent"] == f"tuneloop/{tuneloop.__version__}"
    assert request.headers["accept"] == "application/json"
    assert request.headers["content-type"] == "application/json"
    assert request.headers["x-idempotency-key"]


def test_try_again_long_poll_loop_then_result(service, server):
    server.try_again_polls = 5
    tc = service.create_lora_training_client("tiny-base")
    out = tc.optim_step().result(timeout=5)
    assert out.metrics == {"lr": 1.0}
    assert max(server.polls.values()) == 6


def test_poll_backs_off_on_5xx_and_keeps_polling(service, server):
    tc = service.create_lora_training_client("tiny-base")
    server.queue(
        "POST",
        "/api/v1/retrieve_future",
        httpx.Response(502, json={"detail": "proxy"}, headers={"retry-after-ms": "5"}),
        httpx.Response(429, json={"detail": "busy"}, headers={"retry-after-ms": "5"}),
    )
    assert tc.optim_step().result(timeout=5).metrics == {"lr": 1.0}


def test_error_record_raises_request_failed(service, server):
    tc = service.create_lora_training_client("tiny-base")
    # Queued before the call: the future starts polling at once, so queueing after it races.
    server.queue(
        "POST",
        "/api/v1/retrieve_future",
        lambda request: httpx.Response(200, json={"error": "NaN in gradients", "category": "user"}),
    )
    fut = tc.optim_step()
    with pytest.raises(errors.RequestFailedError) as info:
        fut.result(timeout=5)
    assert info.value.category == "user"
    assert info.value.request_id.startswith("req-")
    assert "NaN in gradients" in str(info.value)


def test_unknown_future_is_fatal(service, server):
    tc = service.create_lora_training_client("tiny-base")
    server.queue(
        "POST", "/api/v1/retrieve_future", httpx.Response(404, json={"detail": "unknown future"})
    )
    with pytest.raises(errors.NotFoundError, match="unknown future"):
        tc.optim_step().result(timeout=5)


def test_result_timeout_raises_and_does_not_cancel(service, server):
    tc = service.create_lora_training_client("tiny-base")
    server.hold.add("req-2")  # the optim_step's future (req-1 created the model)
    fut = tc.optim_step()
    with pytest.raises(TimeoutError):
        fut.result(timeout=0.1)
    assert not fut.done()
    server.hold.clear()
    assert fut.result(timeout=5).metrics == {"lr": 1.0}
    assert fut.done()


async def test_await_from_user_asyncio_code(service, server):
    tc = await service.create_lora_training_client_async("tiny-base")
    fb = tc.forward_backward(
        [
            tuneloop.Datum(
                model_input=tuneloop.ModelInput.from_ints([1, 2]),
                loss_fn_inputs={"target_tokens": [2, 3], "weights": [1.0, 1.0]},
            )
        ],
        "cross_entropy",
    )
    opt = tc.optim_step()
    out, step = await asyncio.gather(fb, opt.result_async(timeout=5))
    assert out.metrics["loss:sum"] == pytest.approx(0.3 + 0.4)
    assert step.metrics == {"lr": 1.0}
    server.hold.add("req-4")
    slow = tc.optim_step()
    with pytest.raises(TimeoutError):
        await slow.result_async(timeout=0.05)
    server.hold.clear()
    assert (await slow).metrics == {"lr": 1.0}


def test_result_on_the_sdk_loop_thread_raises(service, server):
    holder = service._holder
    server.hold.add("req-2")
    tc = service.create_lora_training_client("tiny-base")
    pending = tc.optim_step()

    async def block_on_loop():
        return pending.result()

    with pytest.raises(RuntimeError, match="deadlock"):
        holder.submit(block_on_loop()).result(timeout=5)
    server.hold.clear()


def test_completed_future():
    fut = APIFuture.completed(3)
    assert fut.done()
    assert fut.result() == 3
    assert asyncio.run(fut.result_async()) == 3
