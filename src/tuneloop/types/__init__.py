"""Wire types, defined once and shared by the SDK and the server."""

from tuneloop.types.codec import ForwardBackwardRequest, WireFormatError
from tuneloop.types.datum import LOSS_INPUT_DTYPES, Datum
from tuneloop.types.model_input import EncodedTextChunk, ImageChunk, ModelInput, ModelInputChunk
from tuneloop.types.requests import (
    ClientConfigRequest, CreateModelRequest, CreateSamplingSessionRequest, CreateSessionRequest,
    FinishSessionRequest, GetInfoRequest, LoadWeightsRequest, OptimStepRequest,
    RetrieveFutureRequest, SampleRequest, SaveWeightsForSamplerRequest, SaveWeightsRequest,
    SessionHeartbeatRequest, TelemetryRequest,
)
from tuneloop.types.responses import (
    Checkpoint, CheckpointsListResponse, ClientConfigResponse, CreateModelResponse,
    CreateSamplingSessionResponse, CreateSessionResponse, Cursor, GetInfoResponse,
    GetSamplerResponse, GetServerCapabilitiesResponse, GetSessionResponse, ListSessionsResponse,
    LoadWeightsResponse, ModelData, RequestFailedResponse, SaveWeightsForSamplerResponse,
    SaveWeightsResponse, SupportedModel, TrainingRun, TrainingRunsResponse, TryAgainResponse,
    UntypedFuture, WeightsInfoResponse,
)
from tuneloop.types.sampling import SampledSequence, SampleResponse, SamplingParams, StopReason
from tuneloop.types.tensor import TensorData, TensorDtype
from tuneloop.types.training import (
    AdamParams, ForwardBackwardOutput, LoraConfig, LossFnType, OptimizerConfig, OptimStepResponse,
)

__all__ = [
    "LOSS_INPUT_DTYPES", "AdamParams", "Checkpoint", "CheckpointsListResponse",
    "ClientConfigRequest", "ClientConfigResponse", "CreateModelRequest", "CreateModelResponse",
    "CreateSamplingSessionRequest", "CreateSamplingSessionResponse", "CreateSessionRequest",
    "CreateSessionResponse", "Cursor", "Datum", "EncodedTextChunk", "FinishSessionRequest",
    "ForwardBackwardOutput", "ForwardBackwardRequest", "GetInfoRequest", "GetInfoResponse",
    "GetSamplerResponse", "GetServerCapabilitiesResponse", "GetSessionResponse", "ImageChunk",
    "ListSessionsResponse", "LoadWeightsRequest", "LoadWeightsResponse", "LoraConfig",
    "LossFnType", "ModelData", "ModelInput", "ModelInputChunk", "OptimStepRequest",
    "OptimStepResponse", "OptimizerConfig", "RequestFailedResponse", "RetrieveFutureRequest",
    "SampleRequest", "SampleResponse", "SampledSequence", "SamplingParams",
    "SaveWeightsForSamplerRequest", "SaveWeightsForSamplerResponse", "SaveWeightsRequest",
    "SaveWeightsResponse", "SessionHeartbeatRequest", "StopReason", "SupportedModel",
    "TelemetryRequest", "TensorData", "TensorDtype", "TrainingRun", "TrainingRunsResponse",
    "TryAgainResponse", "UntypedFuture", "WeightsInfoResponse", "WireFormatError",
]
