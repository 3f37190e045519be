"""tuneloop: your Python writes the training loop, a tuneloop server runs the model.

import tuneloop

service = tuneloop.ServiceClient(base_url="http://127.0.0.1:8000")
training = service.create_lora_training_client("Qwen/Qwen3-0.6B", rank=16)
fb = training.forward_backward(data, "cross_entropy")
opt = training.optim_step(tuneloop.AdamParams(learning_rate=1e-4))
print(fb.result().metrics["loss:sum"], opt.result())
"""

from tuneloop._futures import APIFuture
from tuneloop.errors import (
    APIConnectionError,
    APIError,
    APIResponseValidationError,
    APIStatusError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    GoneError,
    InternalServerError,
    NotFoundError,
    PermissionDeniedError,
    RateLimitError,
    RequestFailedError,
    RequestTooLargeError,
    TuneloopError,
    UnprocessableEntityError,
    UnsupportedMediaTypeError,
)
from tuneloop.rest_client import RestClient
from tuneloop.sampling_client import SamplingClient
from tuneloop.service_client import ServiceClient
from tuneloop.training_client import TrainingClient
from tuneloop.types import (
    AdamParams,
    Datum,
    EncodedTextChunk,
    ForwardBackwardOutput,
    LoraConfig,
    ModelInput,
    PromptProvenanceSpan,
    SampledProvenanceSpan,
    SampledSequence,
    SampleResponse,
    SamplingParams,
    TensorData,
)

__version__ = "0.1.0"

__all__ = [
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
]
