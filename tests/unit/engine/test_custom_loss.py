"""Server-side custom losses: graphs the official SDK traces and uploads are rebuilt from the
allow-list and give the function's own value and gradient; hostile graphs are refused."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tinker = pytest.importorskip("tinker")

import torch.nn.functional as F  # noqa: E402, N812
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss  # noqa: E402
from torch.fx.node import _get_qualified_name  # noqa: E402

from tuneloop.server.engine.custom_loss import (  # noqa: E402
    MAX_ELEMENTS,
    functions,
    input_tensors,
    run_custom_loss,
    value_and_grad,
)
from tuneloop.server.engine.custom_loss_graph import (  # noqa: E402
    FUNCTIONS,
    METHODS,
    CustomLoss,
    GraphError,
    compile_loss,
    reduce_metrics,
)
from tuneloop.server.engine.types import EngineError  # noqa: E402

BETA = 0.1


def dpo_style(logprobs, ref_logprobs, weights, sign):  # type: ignore[no-untyped-def]
    """A per-datum DPO-style loss: -log sigmoid(beta * sign * sum w (lp - ref))."""
    margin = ((logprobs - ref_logprobs) * weights).sum()
    loss = -F.logsigmoid(BETA * sign * margin)
    n = logprobs.shape[0]
    return loss, {
        "custom/reward:mean": (BETA * margin).detach(),
        "custom/tokens:sum": weights.sum(),
        "custom/length:mean": n,
    }


DPO_RANKS = {"logprobs": 1, "ref_logprobs": 1, "weights": 1, "sign": 0}


def upload(fn: Any, ranks: dict[str, int]) -> tuple[str, list[tuple[str, int]], list[dict]]:
    """What the official SDK sends: trace, then encode node for node."""
    handle = trace_loss(fn, ranks, "session")
    graph = encode_graph(handle)
    return (
        handle.name,
        [(i.name, i.rank) for i in handle.inputs],
        [n.model_dump() for n in graph.nodes],
    )


def dpo_loss() -> CustomLoss:
    return compile_loss(*upload(dpo_style, DPO_RANKS))


def dpo_inputs(seed: int, n: int = 9) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    lp = np.log(rng.uniform(0.05, 1.0, size=n)).astype(np.float32)
    return lp, {
        "ref_logprobs": (lp + rng.normal(0, 0.3, size=n)).astype(np.float32),
        "weights": (rng.uniform(size=n) > 0.3).astype(np.float32),
        "sign": np.asarray(1.0 if seed % 2 else -1.0, dtype=np.float32),
    }


@pytest.mark.parametrize("seed", range(4))
def test_uploaded_graph_gives_the_functions_value_and_gradient(seed: int) -> None:
    loss = dpo_loss()
    lp, inputs = dpo_inputs(seed)
    lp_t = torch.tensor(lp, requires_grad=True)
    value, metrics = run_custom_loss(loss, lp_t, input_tensors(loss, inputs))
    (grad,) = torch.autograd.grad(value, lp_t)

    direct_lp = torch.tensor(lp, requires_grad=True)
    expected, expected_metrics = dpo_style(
        direct_lp, *(torch.as_tensor(inputs[k]) for k in ("ref_logprobs", "weights", "sign"))
    )
    (expected_grad,) = torch.autograd.grad(expected, direct_lp)
    assert value.shape == ()
    np.testing.assert_allclose(value.item(), expected.item(), rtol=1e-6)
    np.testing.assert_allclose(grad.numpy(), expected_grad.numpy(), rtol=1e-6, atol=1e-8)
    assert metrics == pytest.approx({k: float(v) for k, v in expected_metrics.items()})
    assert metrics["custom/length:mean"] == len(lp)
    # the NumPy engines' entry point: same numbers
    value_np, grad_np, metrics_np = value_and_grad(loss, lp, inputs)
    assert value_np == pytest.approx(value.item(), rel=1e-6)
    np.testing.assert_allclose(grad_np, grad.numpy(), rtol=1e-6)
    assert metrics_np == pytest.approx(metrics)


def test_mean_metrics_average_over_datums() -> None:
    sums = {"custom/a:mean": 6.0, "custom/b:sum": 6.0}
    assert reduce_metrics(sums, 3) == {"custom/a:mean": 2.0, "custom/b:sum": 6.0}


def test_every_allowed_function_resolves_and_matches_fx_names() -> None:
    table = functions()
    assert set(table) == set(FUNCTIONS)
    for name, fn in table.items():
        qualified = _get_qualified_name(fn).replace("_operator.", "operator.", 1)
        assert qualified in FUNCTIONS, (name, qualified)
    assert all(hasattr(torch.Tensor, m) for m in METHODS)
    assert not any(m.endswith("_") for m in METHODS)  # nothing in place


def test_scalar_integer_inputs_keep_their_dtype() -> None:
    def pick(logprobs, index):  # type: ignore[no-untyped-def]
        return -logprobs[index], {}

    loss = compile_loss(*upload(pick, {"logprobs": 1, "index": 0}))
    tensors = input_tensors(loss, {"index": np.asarray(2, dtype=np.int64)})
    assert tensors["index"].dtype == torch.int64
    value, _ = run_custom_loss(loss, torch.tensor([0.5, 1.5, 2.5]), tensors)
    assert value.item() == -2.5


# ---- hostile graphs ------------------------------------------------------------------------


def nodes_of(*calls: dict[str, Any], output: Any = None) -> list[dict[str, Any]]:
    placeholder = {"op": "placeholder", "name": "logprobs", "target": "logprobs"}
    last = calls[-1]["name"] if calls else "logprobs"
    result = output or [{"tuple": [{"ref": last}, {"dict": {}}]}]
    return [
        placeholder,
        *calls,
        {"op": "output", "name": "output", "target": "output", "args": result},
    ]


def call(name: str, target: str, *args: Any, op: str = "call_function", **kwargs: Any) -> dict:
    return {"op": op, "name": name, "target": target, "args": list(args), "kwargs": kwargs}


LP = {"ref": "logprobs"}
HOSTILE = {
    "os_system": (call("system", "os.system", "rm -rf /"), "system"),
    "posix_system": (call("system", "posix.system", "id"), "system"),
    "builtins_eval": (call("ev", "builtins.eval", "1"), "ev"),
    "import": (call("imp", "builtins.__import__", "os"), "imp"),
    "getattr_dunder": (call("cls", "getattr", LP, "__class__"), "cls"),
    "getattr_chain": (call("g", "builtins.getattr", {"ref": "logprobs"}, "__init__"), "g"),
    "getattr_module": (call("g", "getattr", "torch", "shape"), "g"),
    "torch_ones_huge": (call("big", "torch.ones", 10**9), "big"),
    "torch_empty": (call("big", "torch.empty", 1 << 40), "big"),
    "torch_load": (call("ld", "torch.load", "/etc/passwd"), "ld"),
    "torch_save": (call("sv", "torch.save", LP, "/tmp/x"), "sv"),
    "nested_module_path": (call("f", "torch.nn.functional.torch.load", "x"), "f"),
    "unknown_target": (call("f", "numpy.exp", LP), "f"),
    "method_numpy": (call("m", "numpy", LP, op="call_method"), "m"),
    "method_inplace": (call("m", "add_", LP, 1.0, op="call_method"), "m"),
    "method_repeat": (call("m", "repeat", LP, 10**6, op="call_method"), "m"),
    "method_to_device": (call("m", "to", LP, "cuda", op="call_method"), "m"),
    "method_on_constant": (call("m", "sum", "logprobs", op="call_method"), "m"),
    "get_attr": ({"op": "get_attr", "name": "w", "target": "weight"}, "w"),
    "call_module": ({"op": "call_module", "name": "lin", "target": "linear", "args": [LP]}, "lin"),
    "huge_int": (call("m", "operator.mul", LP, 1 << 80), "m"),
    "device_arg": (call("z", "torch.zeros_like", LP, device={"device": "cuda"}), "z"),
    "forward_ref": (call("m", "operator.mul", {"ref": "later"}, 2.0), "m"),
    "long_list": (call("m", "torch.stack", [LP] * 65), "m"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_graphs_are_refused_naming_the_node(case: str) -> None:
    node, name = HOSTILE[case]
    with pytest.raises(GraphError) as info:
        compile_loss("evil", [("logprobs", 1)], nodes_of(node))
    assert info.value.node == name


def test_too_many_nodes_and_bad_outputs_are_refused() -> None:
    chain = [
        call(f"n{i}", "operator.neg", {"ref": f"n{i - 1}" if i else "logprobs"}) for i in range(600)
    ]
    with pytest.raises(GraphError, match="at most 512"):
        compile_loss("long", [("logprobs", 1)], nodes_of(*chain))
    bad_metric = [{"tuple": [LP, {"dict": {"loss:sum": LP}}]}]
    with pytest.raises(GraphError, match="custom/<name>"):
        compile_loss("m", [("logprobs", 1)], nodes_of(output=bad_metric))
    with pytest.raises(GraphError, match="placeholders"):
        compile_loss("m", [("logprobs", 1), ("weights", 1)], nodes_of())
    with pytest.raises(GraphError, match="first input"):
        compile_loss("m", [("weights", 1)], nodes_of())


def test_broadcast_blowup_is_refused_before_it_allocates() -> None:
    def outer(logprobs):  # type: ignore[no-untyped-def]
        return (logprobs.unsqueeze(0) * logprobs.unsqueeze(1)).sum(), {}

    loss = compile_loss(*upload(outer, {"logprobs": 1}))
    small, _ = run_custom_loss(loss, torch.ones(8), {})
    assert small.item() == 64.0
    n = int(MAX_ELEMENTS**0.5) + 1  # n x n just over the bound: 64 MiB of floats
    with pytest.raises(EngineError, match="would make") as info:
        run_custom_loss(loss, torch.ones(n), {})
    assert info.value.category == "user"


def test_integer_power_towers_are_refused() -> None:
    nodes = nodes_of(
        call("s", "getattr", LP, "shape"),
        call("n", "operator.getitem", {"ref": "s"}, 0),
        call("p", "operator.pow", {"ref": "n"}, 1 << 40),
        call("m", "operator.mul", LP, {"ref": "p"}),
    )
    loss = compile_loss("tower", [("logprobs", 1)], nodes)
    with pytest.raises(EngineError, match="exponent above 64"):
        run_custom_loss(loss, torch.ones(3), {})


def test_a_runtime_failure_names_the_node() -> None:
    nodes = nodes_of(call("bad", "operator.getitem", LP, 99))
    loss = compile_loss("oob", [("logprobs", 1)], nodes)
    with pytest.raises(EngineError, match="'bad'"):
        run_custom_loss(loss, torch.ones(3), {})
    vector = compile_loss("vec", [("logprobs", 1)], nodes_of(call("v", "operator.mul", LP, 2.0)))
    with pytest.raises(EngineError, match="scalar loss"):
        run_custom_loss(vector, torch.ones(3), {})


# ---- in the engines: one pass equals the SDK's two-pass client-side protocol ---------------


def dpo_examples(n_datums: int = 3) -> list[Any]:
    from tests.unit.engine.conftest import example, seq

    out = []
    for i in range(n_datums):
        tokens = seq(10 + 3 * i, 40 + i)
        _, inputs = dpo_inputs(i, len(tokens) - 1)
        out.append(
            example(tokens, inputs["weights"], **{k: inputs[k] for k in ("ref_logprobs", "sign")})
        )
    return out


def client_side_weights(
    examples: list[Any], logprobs: list[np.ndarray]
) -> tuple[float, list[np.ndarray]]:
    """The official SDK's protocol (spec 3.9): run the handle client-side on the forward
    logprobs, backward, and send w = -dC/dlp as cross-entropy weights."""
    from tinker.lib.public_interfaces.custom_loss import run_loss_handle

    handle = trace_loss(dpo_style, DPO_RANKS, "session")
    datums = [
        tinker.types.Datum(
            model_input=tinker.types.ModelInput.from_ints(ex.tokens.tolist()),
            loss_fn_inputs={
                k: tinker.types.TensorData.from_numpy(np.asarray(v)) for k, v in ex.inputs.items()
            },
        )
        for ex in examples
    ]
    lps = [torch.tensor(lp, requires_grad=True) for lp in logprobs]
    total, _ = run_loss_handle(handle, datums, lps)
    total.backward()
    return float(total.detach()), [-lp.grad.numpy() for lp in lps]


@pytest.mark.parametrize("engine", ["torch", "fake"])
def test_one_server_pass_equals_the_client_side_protocol(engine: str, tmp_path: Any) -> None:
    from tests.unit.engine.conftest import TINY, adapter_spec, example, grads, ok, work
    from tuneloop.server.engine.types import ForwardBackwardWork

    if engine == "torch":
        pytest.importorskip("transformers")
        from tuneloop.server.engine.torch_backend import TorchBackend

        backend: Any = TorchBackend([TINY], cache_dir=tmp_path / "cache", device="cpu")
        spec_a, spec_b = adapter_spec("A", seed=5), adapter_spec("B", seed=5)
    else:
        from tuneloop.server.engine.fake import FakeBackend
        from tuneloop.server.engine.types import AdapterSpec

        backend = FakeBackend()
        model = backend.models()[0].name
        spec_a, spec_b = AdapterSpec("A", model, 4, 5), AdapterSpec("B", model, 4, 5)
    backend.create_adapter(spec_a)
    backend.create_adapter(spec_b)
    examples = dpo_examples()
    loss = dpo_loss()
    [server] = backend.forward_backward(
        [ForwardBackwardWork("A", tuple(examples), "custom", {}, False, custom_loss=loss)]
    )
    server = ok(server)

    [forward] = backend.forward_backward([work("B", examples, forward_only=True)])
    value, weights = client_side_weights(examples, ok(forward).logprobs)
    surrogate = [
        example(np.concatenate([ex.tokens, ex.inputs["target_tokens"][-1:]]), w)
        for ex, w in zip(examples, weights, strict=True)
    ]
    ok(backend.forward_backward([work("B", surrogate)])[0])

    assert server.metrics["loss:sum"] == pytest.approx(value, rel=1e-5, abs=1e-6)
    assert set(server.metrics) == {
        "loss:sum",
        "custom/reward:mean",
        "custom/tokens:sum",
        "custom/length:mean",
    }
    assert server.metrics["custom/tokens:sum"] == pytest.approx(
        sum(float(ex.inputs["weights"].sum()) for ex in examples)
    )
    assert server.metrics["custom/length:mean"] == pytest.approx(
        np.mean([len(ex.tokens) for ex in examples])
    )
    if engine == "torch":
        got, want = grads(backend, "A"), grads(backend, "B")
        scale = max(float(w.abs().max()) for w in want)
        assert scale > 0
        for g, w in zip(got, want, strict=True):
            assert float((g - w).abs().max()) <= 1e-5 * max(1.0, scale)
    else:
        a, b = backend._adapter("A"), backend._adapter("B")
        assert np.abs(b.grad_b).max() > 0
        np.testing.assert_allclose(a.grad_a, b.grad_a, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(a.grad_b, b.grad_b, rtol=1e-5, atol=1e-7)
    backend.close()
