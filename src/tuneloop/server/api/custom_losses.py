"""Server-side custom losses: `create_custom_loss` stores a checked graph per session, and a
forward_backward with `loss_fn="custom"` runs it per datum in one pass (no client-side forward,
backward and second forward_backward, as the SDK does otherwise).

The graph is checked here, at upload (engine/custom_loss_graph.py holds the allow-list): a graph
that calls anything but allowed tensor operations, reads attributes other than shapes, captures a
tensor, calls a module or is too large is refused with a 400 naming the node. Losses belong to
one session of one tenant (custom_loss_store.py).
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
from fastapi import APIRouter, Request

from tuneloop.server.api.custom_loss_store import CustomLossStore
from tuneloop.server.api.deps import State, Tenant, json_body, read_json
from tuneloop.server.api.errors import bad_request, not_found
from tuneloop.server.api.state import fingerprint
from tuneloop.server.api.validation import MAX_DATUMS_PER_REQUEST, tokens_of
from tuneloop.server.engine.custom_loss_graph import MAX_ELEMENTS, GraphError, compile_loss
from tuneloop.server.engine.types import Example, ForwardBackwardWork, ModelSpec
from tuneloop.server.scheduler.futures import Outcome
from tuneloop.types import CreateCustomLossRequest, ForwardBackwardRequest

__all__ = ["custom_loss_work", "router"]

router = APIRouter(prefix="/api/v1")


@router.post("/create_custom_loss", openapi_extra=json_body(CreateCustomLossRequest))
async def create_custom_loss(request: Request, state: State, tenant: Tenant) -> dict[str, Any]:
    body, raw = await read_json(request, CreateCustomLossRequest)
    state.live_session(body.session_id, tenant)
    names = [node.name for node in body.graph.nodes]
    try:
        loss = compile_loss(
            body.name,
            [(i.name, i.rank) for i in body.inputs],
            [node.model_dump() for node in body.graph.nodes],
        )
    except GraphError as exc:
        field = (
            f"graph.nodes[{names.index(exc.node)}]"
            if exc.node in names
            else ("inputs" if exc.node == "inputs" else "graph")
        )
        raise bad_request(f"{field}: {exc}", field) from None
    loss_id = f"{body.session_id}:loss:{body.custom_loss_seq_id}"
    state.custom_losses.add(tenant, body.session_id, loss_id, fingerprint(raw), loss)
    request_id = state.futures.create(tenant, "CreateCustomLoss")
    answer = {"loss_id": loss_id, "type": "create_custom_loss"}
    state.futures.resolve(request_id, Outcome(json.dumps(answer).encode(), "application/json"))
    return {"request_id": request_id}


def _input(tensor_array: np.ndarray, rank: int, field: str) -> np.ndarray:
    array = tensor_array
    if rank == 0:
        if array.size != 1:
            raise bad_request(
                f"{field}: the loss declared a scalar, got shape {list(array.shape)}", field
            )
        array = array.reshape(())
    elif array.ndim != rank:
        raise bad_request(
            f"{field}: the loss declared rank {rank}, got shape {list(array.shape)}", field
        )
    if array.size > MAX_ELEMENTS:
        raise bad_request(f"{field}: {array.size} elements, at most {MAX_ELEMENTS}", field)
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        raise bad_request(f"{field}: contains NaN or infinity", field)
    return array


def custom_loss_work(
    request: ForwardBackwardRequest,
    spec: ModelSpec,
    adapter_id: str,
    session_id: str,
    store: CustomLossStore,
    tenant: str,
) -> ForwardBackwardWork:
    """The engine work of a `loss_fn="custom"` request, every input checked against the loss."""
    for key in request.loss_fn_config:
        if key != "loss_id":
            field = f"loss_fn_config.{key}"
            raise bad_request(f"{field}: unknown key for custom (allowed: loss_id)", field)
    loss_id = request.loss_fn_config.get("loss_id")
    if not isinstance(loss_id, str):
        raise bad_request("loss_fn_config.loss_id: required, a string", "loss_fn_config.loss_id")
    found = store.get(tenant, loss_id)
    if found is None:
        raise not_found(f"custom loss {loss_id!r}", "loss_fn_config.loss_id")
    loss_session, loss = found
    if loss_session != session_id:
        raise bad_request(
            f"loss_fn_config.loss_id: {loss_id!r} belongs to another session",
            "loss_fn_config.loss_id",
        )
    if request.seq_id < 1:
        raise bad_request("seq_id: must be >= 1 (seq 0 is the model's creation)", "seq_id")
    if not request.data or len(request.data) > MAX_DATUMS_PER_REQUEST:
        raise bad_request(f"data: 1 to {MAX_DATUMS_PER_REQUEST} datums", "data")
    logprobs_rank = loss.inputs[0][1]
    examples = []
    for i, datum in enumerate(request.data):
        tokens = tokens_of(datum.model_input, spec, f"data[{i}].model_input")
        field = f"data[{i}].loss_fn_inputs.target_tokens"
        if "target_tokens" not in datum.loss_fn_inputs:
            raise bad_request(f"{field}: required", field)
        inputs: dict[str, np.ndarray] = {}
        targets_td = datum.loss_fn_inputs["target_tokens"]
        shape = targets_td.shape if targets_td.shape is not None else [targets_td.values.size]
        if (
            len(shape) != logprobs_rank
            or shape[0] != tokens.size
            or (len(shape) == 2 and not 0 < shape[1] <= spec.vocab_size)
        ):
            raise bad_request(
                f"{field}: shape {list(shape)}; the loss takes logprobs of rank {logprobs_rank} "
                f"over the {tokens.size} input tokens",
                field,
            )
        targets = targets_td.to_numpy().astype(np.int64)
        if ((targets < 0) | (targets >= spec.vocab_size)).any():
            raise bad_request(f"{field}: token ids must be in [0, {spec.vocab_size})", field)
        inputs["target_tokens"] = targets
        for name, rank in loss.inputs[1:]:
            where = f"data[{i}].loss_fn_inputs.{name}"
            if name not in datum.loss_fn_inputs:
                raise bad_request(f"{where}: required by custom loss {loss.name!r}", where)
            tensor = datum.loss_fn_inputs[name]
            declared = tensor.shape if tensor.shape is not None else [tensor.values.size]
            if math.prod(declared) > MAX_ELEMENTS:  # Python ints: no int64 overflow
                raise bad_request(f"{where}: more than {MAX_ELEMENTS} elements", where)
            inputs[name] = _input(tensor.to_numpy(), rank, where)
        examples.append(Example(tokens, inputs))
    return ForwardBackwardWork(
        adapter_id, tuple(examples), "custom", {}, request.forward_only, custom_loss=loss
    )
