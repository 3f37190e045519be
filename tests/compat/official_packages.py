"""Model packages through the official `tinker` SDK: `python -m` this module URL KEY MODEL.

Saved checkpoints list with tuneloop's package fields, which the SDK's strict types must accept;
`set_checkpoint_ttl_from_tinker_path` sets and clears an expiry; a range error is a 400 the SDK
raises; deleting a checkpoint removes it.
"""

from __future__ import annotations

import sys
from typing import Any

import tinker

types = tinker.types


def _datum(tokens: list[int]) -> Any:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:]},
    )


def run(url: str, key: str, model: str) -> None:
    service = tinker.ServiceClient(base_url=url, api_key=key)
    training = service.create_lora_training_client(base_model=model, rank=4, seed=1)
    training.forward_backward([_datum([5, 17, 33, 90])], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=0.01)).result()
    state = training.save_state("pkg", ttl_seconds=7200).result().path
    sampler = training.save_weights_for_sampler("pkg").result().path
    rest = service.create_rest_client()

    listed = {
        c.tinker_path: c for c in rest.list_checkpoints(training.model_id).result().checkpoints
    }
    assert set(listed) == {state, sampler}, listed
    assert listed[state].expires_at is not None
    assert listed[sampler].expires_at is None
    # The listing carried tuneloop's package fields too (name, version, ...): the SDK's types
    # parsed it above without complaint, which is what this checks.

    rest.set_checkpoint_ttl_from_tinker_path(state, None).result()
    rest.set_checkpoint_ttl_from_tinker_path(sampler, 86400).result()
    listed = {c.tinker_path: c for c in rest.list_user_checkpoints().result().checkpoints}
    assert listed[state].expires_at is None
    assert listed[sampler].expires_at is not None
    try:
        rest.set_checkpoint_ttl_from_tinker_path(state, 5).result()
    except tinker.BadRequestError:
        pass
    else:
        raise AssertionError("a 5 s TTL was accepted")

    rest.delete_checkpoint_from_tinker_path(sampler).result()
    remaining = rest.list_checkpoints(training.model_id).result().checkpoints
    assert [c.tinker_path for c in remaining] == [state], remaining
    service.close("success").result()
    print("official SDK packages flow: OK")


if __name__ == "__main__":
    run(*sys.argv[1:4])
