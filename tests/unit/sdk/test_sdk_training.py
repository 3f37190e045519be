"""TrainingClient: ordering of submissions, chunking, metric merging, custom losses."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch

from tuneloop import AdamParams, Datum, ForwardBackwardOutput, ModelInput, TensorData, TuneloopError
from tuneloop.training_client import combine_fwdbwd_outputs


def datum(tokens: list[int], **extra: object) -> Datum:
    inputs: dict[str, object] = {"target_tokens": [*tokens[1:], 0], "weights": [1.0] * len(tokens)}
    inputs.update(extra)
    return Datum(model_input=ModelInput.from_ints(tokens), loss_fn_inputs=inputs)  # type: ignore[arg-type]


def test_create_lora_training_client_sends_create_model_and_get_info(service, server):
    tc = service.create_lora_training_client("tiny-base", rank=8, seed=3, train_unembed=False)
    assert tc.model_id == "sess-1:train:0"
    assert tc.get_info().model_data.model_name == "tiny-base"
    (body,) = server.bodies("/api/v1/create_model")
    assert body["lora_config"] == {
        "rank": 8,
        "seed": 3,
        "train_unembed": False,
        "train_mlp": True,
        "train_attn": True,
    }
    assert body["model_seq_id"] == 0
    assert body["type"] == "create_model"
    assert server.bodies("/api/v1/get_info") == [{"model_id": "sess-1:train:0", "type": "get_info"}]
    tc2 = service.create_lora_training_client("tiny-base")
    assert tc2.model_id == "sess-1:train:1"
    with pytest.raises(ValueError, match="train_mlp"):
        service.create_lora_training_client(
            "x", train_mlp=False, train_attn=False, train_unembed=False
        )


def test_train_experts_is_sent_only_when_given(service, server):
    """None (the default) leaves it out, so `train_mlp` covers the experts as in Tinker; a
    value sets the experts apart, and experts alone are a valid target set."""
    service.create_lora_training_client("moe", rank=4)
    service.create_lora_training_client("moe", rank=4, train_experts=False)
    service.create_lora_training_client(
        "moe", rank=4, train_mlp=False, train_attn=False, train_unembed=False, train_experts=True
    )
    sent = [body["lora_config"] for body in server.bodies("/api/v1/create_model")]
    assert "train_experts" not in sent[0]
    assert sent[1]["train_experts"] is False
    assert sent[1]["train_mlp"] is True
    assert sent[2] == {
        "rank": 4,
        "train_unembed": False,
        "train_mlp": False,
        "train_attn": False,
        "train_experts": True,
    }
    with pytest.raises(ValueError, match="train_experts"):
        service.create_lora_training_client(
            "x", train_mlp=False, train_attn=False, train_unembed=False, train_experts=False
        )


async def test_train_experts_reaches_the_body_from_the_async_call(service, server):
    await service.create_lora_training_client_async("moe", train_mlp=False, train_experts=True)
    [body] = server.bodies("/api/v1/create_model")
    assert (body["lora_config"]["train_mlp"], body["lora_config"]["train_experts"]) == (False, True)


def test_create_from_state_uses_create_via_load(service, server):
    tc = service.create_training_client_from_state_with_optimizer("tinker://r/weights/a")
    (body,) = server.bodies("/api/v1/load_weights")
    assert body == {
        "session_id": "sess-1",
        "model_seq_id": 0,
        "path": "tinker://r/weights/a",
        "optimizer": True,
        "type": "load_weights",
    }
    assert tc.model_id == "sess-1:train:0"
    tc2 = service.create_training_client_from_state("tinker://r/weights/a")
    assert server.bodies("/api/v1/load_weights")[1]["optimizer"] is False
    assert tc2.model_id == "sess-1:train:1"


def test_seq_ids_follow_call_order_and_submissions_never_overlap(service, server):
    tc = service.create_lora_training_client("tiny-base")
    rng = random.Random(0)
    # Later submissions are fast and earlier ones slow: only turn-taking keeps them in order.
    server.submit_delay = lambda seq: rng.uniform(0, 0.01)
    futures = []
    for _ in range(4):
        futures.append(tc.forward_backward([datum([1, 2, 3])], "cross_entropy"))
        futures.append(tc.optim_step(AdamParams(learning_rate=1e-3)))
    for fut in futures:
        fut.result(timeout=10)
    assert [seq for kind, seq in server.events if kind == "start"] == list(range(1, 9))
    # Each submission starts only after the previous one was answered.
    assert server.events == [(k, s) for s in range(1, 9) for k in ("start", "end")]
    opt = server.bodies("/api/v1/optim_step")[0]
    assert opt["adam_params"]["learning_rate"] == 1e-3
    assert opt["seq_id"] == 2
    assert opt["type"] == "optim_step"


def test_concurrent_callers_get_distinct_ordered_seq_ids(service, server):
    tc = service.create_lora_training_client("tiny-base")
    server.submit_delay = lambda seq: 0.02 if seq % 3 == 0 else 0.0
    futures = []
    lock = threading.Lock()

    def worker() -> None:
        for _ in range(5):
            fut = tc.forward_backward([datum([4, 5])], "cross_entropy")
            with lock:
                futures.append(fut)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    for fut in futures:
        fut.result(timeout=10)
    arrived = [seq for kind, seq in server.events if kind == "start"]
    assert arrived == list(range(1, 21))


def test_forward_sets_forward_only(service, server):
    tc = service.create_lora_training_client("tiny-base")
    out = tc.forward([datum([1, 2])], "cross_entropy").result(timeout=5)
    assert server.fwdbwd_requests[0].forward_only is True
    assert out.loss_fn_outputs[0]["logprobs"].tolist() == pytest.approx([-0.3, -0.1])


def test_forward_backward_is_chunked_and_metrics_merged(make_service, server):
    server.config["fwdbwd_max_chunk_len"] = 2
    service = make_service()
    tc = service.create_lora_training_client("tiny-base")

    def fwdbwd(request):
        n = len(request.data)
        outs = [{"logprobs": TensorData.from_numpy(np.full(2, float(request.seq_id)))}] * n
        metrics = {
            "loss:sum": 10.0 * request.seq_id,
            "acc:mean": float(request.seq_id),
            "lp:min": -float(request.seq_id),
            "lp:max": -float(request.seq_id),
        }
        return ForwardBackwardOutput("ArrayRecord", outs, metrics)

    server.fwdbwd = fwdbwd
    out = tc.forward_backward([datum([i, i + 1]) for i in range(5)], "ppo", {"clip": 0.2}).result(5)
    assert [r.seq_id for r in server.fwdbwd_requests] == [1, 2, 3]
    assert [len(r.data) for r in server.fwdbwd_requests] == [2, 2, 1]
    assert server.fwdbwd_requests[0].loss_fn_config == {"clip": 0.2}
    assert [o["logprobs"].tolist()[0] for o in out.loss_fn_outputs] == [1, 1, 2, 2, 3]
    assert out.metrics["loss:sum"] == pytest.approx(60.0)
    assert out.metrics["acc:mean"] == pytest.approx((1 * 2 + 2 * 2 + 3 * 1) / 5)
    assert out.metrics["lp:min"] == -3.0
    assert out.metrics["lp:max"] == -1.0
    # The next call continues after the three chunk seq_ids.
    tc.optim_step().result(5)
    assert server.bodies("/api/v1/optim_step")[0]["seq_id"] == 4


def test_combine_other_reductions():
    def out(metrics):
        return ForwardBackwardOutput("ArrayRecord", [{}], metrics)

    merged = combine_fwdbwd_outputs(
        [
            out({"t:slack": 4.0, "h:hash2": 3.0, "u:unique": 1.0}),
            out({"t:slack": 1.0, "h:hash2": 5.0, "u:unique": 2.0}),
        ],
        [1, 3],
    )
    assert merged.metrics["t:slack"] == pytest.approx(4.0 - (4.0 + 3.0) / 4)
    assert merged.metrics["h:hash2"] == 8.0
    assert merged.metrics["u:unique"] == 1.0
    assert merged.metrics["u:unique_2"] == 2.0
    assert len(merged.loss_fn_outputs) == 2


def test_forward_backward_custom_sends_minus_gradient_as_weights(service, server):
    tc = service.create_lora_training_client("tiny-base")
    data = [datum([1, 2, 3], advantages=[0.5, -1.0, 2.0]), datum([4, 5], advantages=[1.0, 1.0])]

    def loss_fn(batch, logprobs):
        total = torch.zeros(())
        for d, lp in zip(batch, logprobs, strict=True):
            adv = d.loss_fn_inputs["advantages"].to_torch()
            total = total + (torch.exp(lp) * adv).sum() + (lp**2).sum()
        return total, {"custom:mean": 7.0}

    out = tc.forward_backward_custom(data, loss_fn).result(timeout=10)
    first, second = server.fwdbwd_requests
    assert (first.seq_id, first.forward_only, first.loss_fn) == (1, True, "cross_entropy")
    assert (second.seq_id, second.forward_only, second.loss_fn) == (2, False, "cross_entropy")
    assert set(first.data[0].loss_fn_inputs) == {"target_tokens", "weights"}
    # Reference gradient, computed independently from the logprobs the fake server returned.
    expected_loss = 0.0
    for d, sent in zip(data, second.data, strict=True):
        targets = d.loss_fn_inputs["target_tokens"].to_numpy()
        lp = torch.tensor((-0.1 * (targets + 1)).astype(np.float32), requires_grad=True)
        adv = d.loss_fn_inputs["advantages"].to_torch()
        value = (torch.exp(lp) * adv).sum() + (lp**2).sum()
        (grad,) = torch.autograd.grad(value, lp)
        expected_loss += float(value.detach())
        np.testing.assert_allclose(
            sent.loss_fn_inputs["weights"].to_numpy(), -grad.numpy(), rtol=1e-6
        )
        assert sent.loss_fn_inputs["target_tokens"] == d.loss_fn_inputs["target_tokens"]
    assert out.metrics["loss:sum"] == pytest.approx(expected_loss, rel=1e-5)
    assert out.metrics["custom:mean"] == 7.0
    surrogate = sum(
        float(
            -(
                s.loss_fn_inputs["weights"].to_numpy()
                * (-0.1 * (s.loss_fn_inputs["target_tokens"].to_numpy() + 1))
            ).sum()
        )
        for s in second.data
    )
    assert out.metrics["surrogate_loss:sum"] == pytest.approx(surrogate, rel=1e-5)


def test_failed_custom_loss_poisons_the_client(service, server):
    tc = service.create_lora_training_client("tiny-base")

    def bad_loss(batch, logprobs):
        raise RuntimeError("boom")

    fut = tc.forward_backward_custom([datum([1, 2])], bad_loss)
    later = tc.optim_step()  # queued behind the custom call's reserved seq_ids
    with pytest.raises(RuntimeError, match="boom"):
        fut.result(timeout=5)
    with pytest.raises(TuneloopError, match="unusable"):
        later.result(timeout=5)
    with pytest.raises(TuneloopError, match="unusable"):
        tc.optim_step()
    assert server.bodies("/api/v1/optim_step") == []


def test_checkpoints_and_snapshot_sampling_client(service, server):
    tc = service.create_lora_training_client("tiny-base")
    saved = tc.save_state("step1").result(5)
    assert saved.path == "tinker://sess-1:train:0/weights/step1"
    sampler = tc.save_weights_for_sampler("s1", ttl_seconds=3600).result(5)
    assert sampler.path == "tinker://sess-1:train:0/sampler_weights/s1"
    tc.load_state("tinker://x/weights/a").result(5)
    tc.load_state_with_optimizer("tinker://x/weights/a").result(5)
    sc = tc.save_weights_and_get_sampling_client()
    assert sc.sampling_session_id == "sess-1:sample:0"
    assert sc.get_base_model() == "tiny-base"
    bodies = server.bodies("/api/v1/save_weights_for_sampler")
    assert bodies[0] == {
        "model_id": "sess-1:train:0",
        "path": "s1",
        "kind": "snapshot",
        "seq_id": 2,
        "ttl_seconds": 3600,
        "type": "save_weights_for_sampler",
    }
    assert bodies[1]["sampling_session_seq_id"] == 0
    assert bodies[1]["seq_id"] == 5
    assert "path" not in bodies[1]
    loads = server.bodies("/api/v1/load_weights")
    assert [(b["seq_id"], b["optimizer"], b["model_id"]) for b in loads] == [
        (3, False, "sess-1:train:0"),
        (4, True, "sess-1:train:0"),
    ]
    # The session-wide sampler counter is shared with create_sampling_client.
    sc2 = service.create_sampling_client(base_model="tiny-base")
    assert sc2.sampling_session_id == "sess-1:sample:1"


def test_a_request_failing_before_submission_does_not_block_later_ones(service, server):
    from tuneloop.types import ImageChunk

    tc = service.create_lora_training_client("tiny-base")
    broken = Datum(
        model_input=ModelInput(chunks=[ImageChunk(data="a", format="png")]),
        loss_fn_inputs={"target_tokens": [1], "weights": [1.0]},
    )
    bad = tc.forward_backward([broken], "cross_entropy")
    good = tc.optim_step()
    with pytest.raises(ValueError):  # noqa: PT011 - binascii.Error from the image bytes
        bad.result(timeout=5)
    assert good.result(timeout=5).metrics == {"lr": 1.0}
    assert server.bodies("/api/v1/optim_step")[0]["seq_id"] == 2
