"""The public surface, pinned: names exported and the signatures users call."""

from __future__ import annotations

import inspect
import subprocess
import sys

import tuneloop
from tuneloop import errors

EXPECTED_ALL = {
    "APIConnectionError",
    "APIError",
    "APIFuture",
    "APIResponseValidationError",
    "APIStatusError",
    "APITimeoutError",
    "AdamParams",
    "AuthenticationError",
    "BadRequestError",
    "ConflictError",
    "Datum",
    "EncodedTextChunk",
    "ForwardBackwardOutput",
    "GoneError",
    "InternalServerError",
    "LoraConfig",
    "ModelInput",
    "NotFoundError",
    "PermissionDeniedError",
    "PromptProvenanceSpan",
    "RateLimitError",
    "RequestFailedError",
    "RequestTooLargeError",
    "RestClient",
    "SampleResponse",
    "SampledProvenanceSpan",
    "SampledSequence",
    "SamplingClient",
    "SamplingParams",
    "ServiceClient",
    "TensorData",
    "TrainingClient",
    "TuneloopError",
    "UnprocessableEntityError",
    "UnsupportedMediaTypeError",
    "__version__",
}

SIGNATURES = {
    tuneloop.ServiceClient.__init__: (
        "(self, base_url: 'str | None' = None, api_key: 'str | None' = None, "
        "user_metadata: 'dict[str, Any] | None' = None, project_id: 'str | None' = None, *, "
        "_transport: 'httpx.AsyncBaseTransport | None' = None, "
        "_heartbeat_interval_s: 'float | None' = None) -> 'None'"
    ),
    tuneloop.ServiceClient.create_lora_training_client: (
        "(self, base_model: 'str', rank: 'int' = 32, seed: 'int | None' = None, "
        "train_mlp: 'bool' = True, train_attn: 'bool' = True, train_unembed: 'bool' = True, "
        "user_metadata: 'dict[str, Any] | None' = None, *, "
        "train_experts: 'bool | None' = None) -> 'TrainingClient'"
    ),
    tuneloop.ServiceClient.create_training_client_from_state: (
        "(self, path: 'str') -> 'TrainingClient'"
    ),
    tuneloop.ServiceClient.create_training_client_from_state_with_optimizer: (
        "(self, path: 'str') -> 'TrainingClient'"
    ),
    tuneloop.ServiceClient.create_sampling_client: (
        "(self, model_path: 'str | None' = None, base_model: 'str | None' = None, *, "
        "record_stability_info: 'bool' = False) -> 'SamplingClient'"
    ),
    tuneloop.ServiceClient.create_sampling_client_async: (
        "(self, model_path: 'str | None' = None, base_model: 'str | None' = None, *, "
        "record_stability_info: 'bool' = False) -> 'SamplingClient'"
    ),
    tuneloop.TrainingClient.save_weights_and_get_sampling_client: (
        "(self, *, record_stability_info: 'bool' = False) -> 'SamplingClient'"
    ),
    tuneloop.TrainingClient.save_weights_and_get_sampling_client_async: (
        "(self, *, record_stability_info: 'bool' = False) -> 'SamplingClient'"
    ),
    tuneloop.TrainingClient.create_sampling_client: (
        "(self, model_path: 'str', *, record_stability_info: 'bool' = False) -> 'SamplingClient'"
    ),
    tuneloop.Datum.with_provenance: (
        "(self, model_input: 'Sequence[ProvenanceSpan]', "
        "loss_fn_inputs: 'Sequence[ProvenanceSpan]') -> 'Datum'"
    ),
    tuneloop.PromptProvenanceSpan.__init__: (
        "(self, *, sequence_id: 'str', length: 'int', offset: 'int' = 0) -> None"
    ),
    tuneloop.SampledProvenanceSpan.__init__: (
        "(self, *, sequence_id: 'str', length: 'int', offset: 'int' = 0) -> None"
    ),
    tuneloop.TrainingClient.forward_backward: (
        "(self, data: 'Sequence[Datum]', loss_fn: 'str', "
        "loss_fn_config: 'Mapping[str, float | str] | None' = None) "
        "-> 'APIFuture[ForwardBackwardOutput]'"
    ),
    tuneloop.TrainingClient.forward_backward_custom: (
        "(self, data: 'Sequence[Datum]', loss_fn: 'CustomLossFn') "
        "-> 'APIFuture[ForwardBackwardOutput]'"
    ),
    tuneloop.TrainingClient.optim_step: (
        "(self, adam_params: 'AdamParams | None' = None) -> 'APIFuture[OptimStepResponse]'"
    ),
    tuneloop.TrainingClient.save_state: (
        "(self, name: 'str', ttl_seconds: 'int | None' = None) -> 'APIFuture[SaveWeightsResponse]'"
    ),
    tuneloop.SamplingClient.sample: (
        "(self, prompt: 'ModelInput', num_samples: 'int', sampling_params: 'SamplingParams', "
        "include_prompt_logprobs: 'bool' = False, topk_prompt_logprobs: 'int' = 0) "
        "-> 'APIFuture[SampleResponse]'"
    ),
    tuneloop.SamplingClient.compute_logprobs: (
        "(self, prompt: 'ModelInput') -> 'APIFuture[list[float | None]]'"
    ),
    tuneloop.APIFuture.result: "(self, timeout: 'float | None' = None) -> 'T'",
    tuneloop.APIFuture.result_async: "(self, timeout: 'float | None' = None) -> 'T'",
    tuneloop.RestClient.list_training_runs: (
        "(self, limit: 'int' = 20, offset: 'int' = 0, project_id: 'str | None' = None)"
        " -> 'APIFuture[TrainingRunsResponse]'"
    ),
    tuneloop.RequestFailedError.__init__: (
        "(self, message: 'str', request_id: 'str', category: 'str' = 'unknown') -> 'None'"
    ),
}

TRAINING_METHODS = {
    "forward",
    "forward_backward",
    "forward_backward_custom",
    "optim_step",
    "save_state",
    "load_state",
    "load_state_with_optimizer",
    "save_weights_for_sampler",
    "save_weights_and_get_sampling_client",
    "save_weights_and_get_sampling_client_async",
    "get_info",
    "get_tokenizer",
    "create_sampling_client",
}
REST_METHODS = {
    "get_training_run",
    "get_training_run_by_tinker_path",
    "list_training_runs",
    "list_checkpoints",
    "list_user_checkpoints",
    "delete_checkpoint",
    "delete_checkpoint_from_tinker_path",
    "get_sampler",
    "get_session",
    "list_sessions",
    "get_weights_info_by_tinker_path",
    "get_server_capabilities",
    "publish_checkpoint_from_tinker_path",
    "unpublish_checkpoint_from_tinker_path",
    "assign_session_project",
    "copy_weights",
    "search_sessions",
    "export_session_trace",
    "get_audit_log",
    "get_billing_usage",
    "get_current_checkpoint_storage_usage",
}


def test_all_is_pinned():
    assert set(tuneloop.__all__) == EXPECTED_ALL
    assert len(tuneloop.__all__) == len(EXPECTED_ALL)
    for name in tuneloop.__all__:
        assert hasattr(tuneloop, name)
    assert tuneloop.__version__ == "0.1.0"


def test_errors_module_exports_every_error():
    for name in errors.__all__:
        if name != "status_error":
            assert issubclass(getattr(errors, name), errors.TuneloopError)
            assert getattr(tuneloop, name) is getattr(errors, name)
    assert issubclass(errors.APITimeoutError, errors.APIConnectionError)
    assert issubclass(errors.InternalServerError, errors.APIStatusError)


def test_signatures_are_pinned():
    for func, expected in SIGNATURES.items():
        assert str(inspect.signature(func)) == expected, func.__qualname__


def test_methods_exist():
    assert set(dir(tuneloop.TrainingClient)) >= TRAINING_METHODS
    assert set(dir(tuneloop.RestClient)) >= REST_METHODS
    assert inspect.iscoroutinefunction(tuneloop.ServiceClient.create_lora_training_client_async)


def test_import_pulls_in_no_server_torch_or_transformers():
    code = (
        "import sys, tuneloop\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'transformers', 'fastapi', 'sqlalchemy', 'uvicorn') "
        "or m.startswith('tuneloop.server')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
