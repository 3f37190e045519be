"""Server-side custom losses: `POST /api/v1/create_custom_loss` uploads a torch.fx graph as
plain data (the official SDK's encoding, node for node); the server rebuilds it from its own
allow-list and runs it in forward_backward under `loss_fn="custom"`, `loss_id` in the config."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from tuneloop.types._base import ResponseBase, StrictBase

__all__ = [
    "CreateCustomLossRequest",
    "CreateCustomLossResponse",
    "CustomLossGraph",
    "CustomLossInput",
    "CustomLossNode",
]

# Far above any real loss (the official SDK's DPO loss is ~40 nodes), far below a cost problem.
MAX_GRAPH_NODES = 512


class CustomLossInput(StrictBase):
    """`logprobs` (first) or a `loss_fn_inputs` key, with the rank every datum's value has."""

    name: str = Field(max_length=64)
    rank: Literal[0, 1, 2]


class CustomLossNode(StrictBase):
    """One torch.fx node: args/kwargs hold JSON scalars, lists and one-key objects
    (`{"ref": node}`, `{"tuple": [...]}`, `{"dict": {...}}`, `{"slice": [a, b, c]}`, ...)."""

    op: Literal["placeholder", "get_attr", "call_function", "call_method", "call_module", "output"]
    name: str = Field(max_length=128)
    target: str = Field(max_length=256)
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)


class CustomLossGraph(StrictBase):
    format: Literal[1] = 1
    nodes: list[CustomLossNode] = Field(min_length=1, max_length=MAX_GRAPH_NODES)


class CreateCustomLossRequest(StrictBase):
    session_id: str
    custom_loss_seq_id: int = Field(ge=0, le=2**31 - 1)
    name: str = Field(max_length=128)
    inputs: list[CustomLossInput] = Field(min_length=1, max_length=16)
    graph: CustomLossGraph
    type: Literal["create_custom_loss"] = "create_custom_loss"


class CreateCustomLossResponse(ResponseBase):
    loss_id: str
    type: Literal["create_custom_loss"] = "create_custom_loss"
