"""Protobuf codec round trips, byte-level compatibility with the official SDK, TensorData."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tinker.proto import tinker_public_pb2 as official

from tuneloop.types import Datum, ModelInput, WireFormatError
from tuneloop.types.codec import (
    DecodeLimits,
    ForwardBackwardRequest,
    decode_forward_backward_output,
    decode_forward_backward_request,
    decode_sample_response,
    encode_forward_backward_output,
    encode_forward_backward_request,
    encode_sample_response,
)
from tuneloop.types.model_input import EncodedTextChunk
from tuneloop.types.sampling import TOPK_SENTINEL, SampledSequence, SampleResponse
from tuneloop.types.tensor import TensorData
from tuneloop.types.training import ForwardBackwardOutput


def topk_targets() -> tuple[np.ndarray, np.ndarray]:
    """2-D [N, K] top-K targets and weights, mostly padding, as soft distillation sends them."""
    targets = np.zeros((6, 4), dtype=np.int64)
    weights = np.zeros((6, 4), dtype=np.float32)
    targets[:, 0] = [3, 4, 5, 6, 7, 8]
    weights[:, 0] = 1.0
    targets[2, 1], weights[2, 1] = 42, 0.25
    return targets, weights


def sample_request() -> ForwardBackwardRequest:
    targets, weights = topk_targets()
    sparse_targets = TensorData.from_numpy_sparse(targets)
    sparse_weights = TensorData.from_numpy_sparse(weights)
    assert sparse_targets.is_sparse
    assert sparse_weights.is_sparse
    data = [
        Datum(
            ModelInput.from_ints([1, 2, 3, 4, 5, 6]),
            {
                "target_tokens": np.array([2, 3, 4, 5, 6, 7]),
                "weights": np.array([0, 0, 1, 1, 1, -0.5], dtype=np.float32),
                "advantages": np.linspace(-1, 1, 6).astype(np.float32),
            },
        ),
        Datum(
            ModelInput(
                chunks=[EncodedTextChunk(tokens=[9, 10, 11]), EncodedTextChunk(tokens=[12, 13, 14])]
            ),
            {"target_tokens": sparse_targets, "weights": sparse_weights},
        ),
    ]
    return ForwardBackwardRequest(
        model_id="s:train:0",
        seq_id=7,
        data=data,
        loss_fn="ppo",
        loss_fn_config={"clip_low_threshold": 0.7, "clip_high_threshold": 1.3, "loss_id": "abc"},
        forward_only=True,
    )


def assert_requests_equal(a: ForwardBackwardRequest, b: ForwardBackwardRequest) -> None:
    assert (a.model_id, a.seq_id, a.loss_fn, a.forward_only) == (
        b.model_id,
        b.seq_id,
        b.loss_fn,
        b.forward_only,
    )
    assert a.loss_fn_config == b.loss_fn_config
    assert len(a.data) == len(b.data)
    for x, y in zip(a.data, b.data, strict=True):
        assert x.model_input.to_ints() == y.model_input.to_ints()
        assert set(x.loss_fn_inputs) == set(y.loss_fn_inputs)
        for key in x.loss_fn_inputs:
            assert x.loss_fn_inputs[key] == y.loss_fn_inputs[key], key


# ---- round trips -------------------------------------------------------------------------------


def test_forward_backward_request_round_trip() -> None:
    request = sample_request()
    decoded = decode_forward_backward_request(encode_forward_backward_request(request))
    assert_requests_equal(decoded, request)
    # Chunk boundaries survive; sparse stays sparse and densifies to the original.
    assert [c.tokens for c in decoded.data[1].model_input.chunks] == [[9, 10, 11], [12, 13, 14]]  # type: ignore[union-attr]
    sparse = decoded.data[1].loss_fn_inputs["target_tokens"]
    assert sparse.is_sparse
    np.testing.assert_array_equal(sparse.to_numpy(), topk_targets()[0])
    np.testing.assert_array_equal(
        decoded.data[1].loss_fn_inputs["weights"].to_numpy(), topk_targets()[1]
    )
    assert decoded.data[0].loss_fn_inputs["target_tokens"].dtype == "int64"
    assert decoded.data[0].loss_fn_inputs["weights"].dtype == "float32"


def test_dense_2d_tensor_round_trip() -> None:
    targets = np.arange(12, dtype=np.int64).reshape(6, 2)
    request = ForwardBackwardRequest(
        "m", 1, [Datum(ModelInput.from_ints(range(6)), {"target_tokens": targets})], "cross_entropy"
    )
    decoded = decode_forward_backward_request(encode_forward_backward_request(request))
    tensor = decoded.data[0].loss_fn_inputs["target_tokens"]
    assert not tensor.is_sparse
    assert tensor.shape == [6, 2]
    np.testing.assert_array_equal(tensor.to_numpy(), targets)


def test_config_strings_go_only_to_v2_and_v2_wins() -> None:
    raw = encode_forward_backward_request(sample_request())
    msg = official.ForwardBackwardRequest()
    msg.ParseFromString(raw)
    assert dict(msg.loss_fn_config) == {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3}
    assert msg.loss_fn_config_v2["loss_id"].text == "abc"
    assert msg.loss_fn_config_v2["clip_low_threshold"].number == 0.7
    # A legacy value disagreeing with v2 loses; a legacy-only key is still read.
    msg.loss_fn_config["clip_low_threshold"] = 0.1
    msg.loss_fn_config["legacy_only"] = 2.0
    decoded = decode_forward_backward_request(msg.SerializeToString())
    assert decoded.loss_fn_config["clip_low_threshold"] == 0.7
    assert decoded.loss_fn_config["legacy_only"] == 2.0
    assert decoded.loss_fn_config["loss_id"] == "abc"


def test_forward_backward_output_round_trip_1d_and_2d() -> None:
    one_d = [np.array([-0.5, -1.25, -2.0], dtype=np.float32), np.array([-3.0], dtype=np.float32)]
    two_d = [-np.arange(8, dtype=np.float32).reshape(4, 2), -np.ones((1, 2), dtype=np.float32)]
    for arrays in (one_d, two_d):
        output = ForwardBackwardOutput(
            "ArrayRecord",
            [{"logprobs": TensorData.from_numpy(a)} for a in arrays],
            {"loss:sum": 4.75, "tokens:sum": 4.0},
        )
        decoded = decode_forward_backward_output(encode_forward_backward_output(output))
        assert decoded.metrics == output.metrics
        assert decoded.loss_fn_output_type == "ArrayRecord"
        assert len(decoded.loss_fn_outputs) == len(arrays)
        for got, want in zip(decoded.loss_fn_outputs, arrays, strict=True):
            np.testing.assert_array_equal(got["logprobs"].to_numpy(), want)
            assert got["logprobs"].to_numpy().shape == want.shape


def test_empty_forward_backward_output() -> None:
    output = ForwardBackwardOutput("ArrayRecord", [], {"loss:sum": 0.0})
    decoded = decode_forward_backward_output(encode_forward_backward_output(output))
    assert decoded.loss_fn_outputs == []
    assert decoded.metrics == {"loss:sum": 0.0}


def sample_response() -> SampleResponse:
    return SampleResponse(
        sequences=[
            SampledSequence(
                "stop",
                [4, 5, 258],
                [-0.5, -1.0, -0.25],
                [[(4, -0.5), (7, -1.5)], [(5, -1.0)], None],
            ),
            SampledSequence("length", [1, 2], [-2.0, -3.0]),
        ],
        prompt_logprobs=[None, -1.5, -2.5, None],
        topk_prompt_logprobs=[None, [(3, -0.75), (9, -1.75)], [(2, -2.5), (1, -3.0)], None],
        prompt_cache_hit_tokens=2,
    )


def test_sample_response_round_trip_with_sentinels() -> None:
    response = sample_response()
    raw = encode_sample_response(response)
    decoded = decode_sample_response(raw)
    assert decoded.prompt_logprobs == [None, -1.5, -2.5, None]
    assert decoded.topk_prompt_logprobs == response.topk_prompt_logprobs
    assert decoded.prompt_cache_hit_tokens == 2
    first, second = decoded.sequences
    assert (first.stop_reason, first.tokens, first.logprobs) == (
        "stop",
        [4, 5, 258],
        [-0.5, -1.0, -0.25],
    )
    # Short rows are padded with sentinels, which read back as absent.
    assert first.topk_logprobs == [[(4, -0.5), (7, -1.5)], [(5, -1.0)], None]
    assert (second.stop_reason, second.tokens, second.topk_logprobs) == ("length", [1, 2], None)

    msg = official.SampleResponse()
    msg.ParseFromString(raw)
    prompt = np.frombuffer(msg.prompt_logprobs, dtype="<f4")
    assert math.isnan(prompt[0])
    assert math.isnan(prompt[3])
    topk = msg.sequences[0].topk_sampled_logprobs
    assert (topk.length, topk.k) == (3, 2)
    ids = np.frombuffer(topk.token_ids, dtype="<i4").reshape(3, 2)
    lps = np.frombuffer(topk.logprobs, dtype="<f4").reshape(3, 2)
    assert (ids[1, 1], lps[1, 1]) == TOPK_SENTINEL
    assert (ids[2] == TOPK_SENTINEL[0]).all()
    assert (lps[2] == TOPK_SENTINEL[1]).all()


def test_no_prompt_logprobs_decodes_to_none() -> None:
    response = SampleResponse(sequences=[SampledSequence("length", [1], [-1.0])])
    decoded = decode_sample_response(encode_sample_response(response))
    assert decoded.prompt_logprobs is None
    assert decoded.topk_prompt_logprobs is None


def test_malformed_bodies_raise_wire_format_error() -> None:
    for decode in (
        decode_forward_backward_request,
        decode_forward_backward_output,
        decode_sample_response,
    ):
        with pytest.raises(WireFormatError) as info:
            decode(b"\xff\xff\xff\xff")
        assert info.value.field == "body"


def test_ragged_tensor_bytes_name_the_field() -> None:
    msg = official.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy")
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = np.array([1, 2], dtype="<i4").tobytes()
    tensor = datum.loss_fn_inputs["target_tokens"]
    tensor.dtype = official.DTYPE_INT64
    tensor.dense = b"\x01\x02\x03"
    with pytest.raises(WireFormatError) as info:
        decode_forward_backward_request(msg.SerializeToString())
    assert info.value.field == "data[0].loss_fn_inputs['target_tokens']"
    tensor.dense = np.array([1, 2, 3], dtype="<i8").tobytes()
    tensor.shape.extend([2])
    with pytest.raises(WireFormatError):
        decode_forward_backward_request(msg.SerializeToString())


def test_a_negative_image_token_count_names_the_field() -> None:
    # expected_tokens is an int32 on the wire; -1 once reached the pydantic model as a 500.
    msg = official.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy")
    image = msg.data.add().model_input.add().image
    image.format, image.data, image.expected_tokens = "png", b"", -1
    with pytest.raises(WireFormatError) as info:
        decode_forward_backward_request(msg.SerializeToString())
    assert info.value.field == "data[0].model_input[0].expected_tokens"


# ---- compatibility with the official SDK's schema ---------------------------------------------


def test_our_request_parses_with_the_official_schema() -> None:
    raw = encode_forward_backward_request(sample_request())
    msg = official.ForwardBackwardRequest()
    msg.ParseFromString(raw)
    assert (msg.model_id, msg.seq_id, msg.loss_fn, msg.forward_only) == (
        "s:train:0",
        7,
        "ppo",
        True,
    )
    assert len(msg.data) == 2
    first = msg.data[0]
    assert np.frombuffer(first.model_input[0].encoded_text.tokens, "<i4").tolist() == [
        1,
        2,
        3,
        4,
        5,
        6,
    ]
    targets = first.loss_fn_inputs["target_tokens"]
    assert targets.dtype == official.DTYPE_INT64
    assert list(targets.shape) == [6]
    assert np.frombuffer(targets.dense, "<i8").tolist() == [2, 3, 4, 5, 6, 7]
    sparse = msg.data[1].loss_fn_inputs["weights"]
    assert sparse.WhichOneof("encoding") == "sparse_csr"
    assert list(sparse.shape) == [6, 4]
    assert sparse.dtype == official.DTYPE_FLOAT32
    crow = np.frombuffer(sparse.sparse_csr.crow_indices, "<i8")
    assert crow.tolist() == [0, 1, 2, 4, 5, 6, 7]
    # Every byte is a field the official schema knows.
    msg.DiscardUnknownFields()
    assert msg.ByteSize() == len(raw)


def test_official_request_parses_with_ours() -> None:
    msg = official.ForwardBackwardRequest(
        model_id="sess:train:3", seq_id=12, loss_fn="cross_entropy", forward_only=False
    )
    msg.loss_fn_config["beta"] = 0.5
    msg.loss_fn_config_v2["beta"].number = 0.5
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = np.array([10, 20, 30], "<i4").tobytes()
    datum.model_input.add().encoded_text.tokens = np.array([40], "<i4").tobytes()
    targets = datum.loss_fn_inputs["target_tokens"]
    targets.dtype = official.DTYPE_INT64
    targets.shape.append(4)
    targets.dense = np.array([20, 30, 40, 50], "<i8").tobytes()
    weights = datum.loss_fn_inputs["weights"]
    weights.dtype = official.DTYPE_FLOAT32
    weights.shape.extend([4, 3])
    weights.sparse_csr.values = np.array([1.0, 0.5, 0.5], "<f4").tobytes()
    weights.sparse_csr.crow_indices = np.array([0, 1, 1, 3, 3], "<i8").tobytes()
    weights.sparse_csr.col_indices = np.array([0, 1, 2], "<i8").tobytes()
    int32 = datum.loss_fn_inputs["mask32"]
    int32.dtype = official.DTYPE_INT32
    int32.dense = np.array([1, 0, 1, 1], "<i4").tobytes()

    decoded = decode_forward_backward_request(msg.SerializeToString())
    assert (decoded.model_id, decoded.seq_id, decoded.loss_fn) == (
        "sess:train:3",
        12,
        "cross_entropy",
    )
    assert decoded.forward_only is False
    assert decoded.loss_fn_config == {"beta": 0.5}
    got = decoded.data[0]
    assert got.model_input.to_ints() == [10, 20, 30, 40]
    np.testing.assert_array_equal(got.loss_fn_inputs["target_tokens"].to_numpy(), [20, 30, 40, 50])
    expected = np.zeros((4, 3), dtype=np.float32)
    expected[0, 0], expected[2, 1], expected[2, 2] = 1.0, 0.5, 0.5
    np.testing.assert_array_equal(got.loss_fn_inputs["weights"].to_numpy(), expected)
    np.testing.assert_array_equal(got.loss_fn_inputs["mask32"].to_numpy(), [1, 0, 1, 1])
    assert got.loss_fn_inputs["mask32"].dtype == "int64"


def test_our_output_parses_with_the_official_schema_and_back() -> None:
    arrays = [-np.arange(6, dtype=np.float32).reshape(3, 2), -np.ones((2, 2), dtype=np.float32)]
    output = ForwardBackwardOutput(
        "ArrayRecord", [{"logprobs": TensorData.from_numpy(a)} for a in arrays], {"loss:sum": 1.5}
    )
    raw = encode_forward_backward_output(output)
    msg = official.ForwardBackwardOutput()
    msg.ParseFromString(raw)
    assert msg.loss_fn_output_type == "ArrayRecord"
    assert dict(msg.metrics) == {"loss:sum": 1.5}
    record = msg.loss_fn_outputs[0]
    assert record.num_datums == 2
    field = record.fields["logprobs"]
    assert field.dtype == official.DTYPE_FLOAT32
    assert list(field.trailing_shape) == [2]
    assert np.frombuffer(field.offsets, "<i8").tolist() == [0, 24, 40]
    np.testing.assert_array_equal(
        np.frombuffer(field.data, "<f4"), np.concatenate([a.reshape(-1) for a in arrays])
    )
    decoded = decode_forward_backward_output(msg.SerializeToString())
    for got, want in zip(decoded.loss_fn_outputs, arrays, strict=True):
        np.testing.assert_array_equal(got["logprobs"].to_numpy(), want)


def test_sample_response_both_ways() -> None:
    raw = encode_sample_response(sample_response())
    msg = official.SampleResponse()
    msg.ParseFromString(raw)
    assert msg.sequences[0].stop_reason == official.STOP_REASON_STOP
    assert msg.sequences[1].stop_reason == official.STOP_REASON_LENGTH
    assert np.frombuffer(msg.sequences[0].tokens, "<i4").tolist() == [4, 5, 258]
    assert msg.prompt_cache_hit_tokens == 2
    msg.DiscardUnknownFields()
    assert msg.ByteSize() == len(raw)

    built = official.SampleResponse()
    seq = built.sequences.add(stop_reason=official.STOP_REASON_LENGTH)
    seq.tokens = np.array([7, 8], "<i4").tobytes()
    seq.logprobs = np.array([-0.1, -0.2], "<f4").tobytes()
    built.prompt_logprobs = np.array([np.nan, -1.0], "<f4").tobytes()
    topk = built.topk_prompt_logprobs
    topk.k, topk.length = 1, 2
    topk.token_ids = np.array([0, 3], "<i4").tobytes()
    topk.logprobs = np.array([-99999.0, -1.0], "<f4").tobytes()
    decoded = decode_sample_response(built.SerializeToString())
    assert decoded.sequences[0].stop_reason == "length"
    assert decoded.sequences[0].tokens == [7, 8]
    assert decoded.sequences[0].logprobs == pytest.approx([-0.1, -0.2])
    assert decoded.prompt_logprobs == [None, -1.0]
    assert decoded.topk_prompt_logprobs == [None, [(3, -1.0)]]


# ---- TensorData --------------------------------------------------------------------------------


def test_tensor_data_numpy_round_trip() -> None:
    for array in (
        np.arange(6, dtype=np.int64).reshape(2, 3),
        np.array([1.5, -2.0], dtype=np.float32),
        np.array([True, False]),
        np.arange(4, dtype=np.int32),
        np.array([0.25], dtype=np.float64),
    ):
        tensor = TensorData.from_numpy(array)
        assert tensor.dtype == ("float32" if array.dtype.kind == "f" else "int64")
        assert tensor.shape == list(array.shape)
        np.testing.assert_array_equal(tensor.to_numpy(), array)
        assert TensorData.from_json(tensor.to_json()) == tensor
    with pytest.raises(ValueError, match="float32 and int64"):
        TensorData.from_numpy(np.array(["a"]))


def test_tensor_data_torch_round_trip() -> None:
    for tensor in (
        torch.arange(6).reshape(3, 2),
        torch.tensor([0.5, -1.0]),
        torch.tensor([1.0, 2.5], dtype=torch.bfloat16),
    ):
        data = TensorData.from_torch(tensor)
        back = data.to_torch()
        assert back.shape == tensor.shape
        assert back.dtype == (torch.int64 if not tensor.is_floating_point() else torch.float32)
        assert torch.equal(back, tensor.to(back.dtype))


def test_sparse_densify_and_pad_value() -> None:
    dense = np.array([[0, 0, 3.0], [0, 0, 0], [1.0, 0, 0], [0, 2.0, 0]], dtype=np.float32)
    sparse = TensorData.from_numpy_sparse(dense)
    assert sparse.is_sparse
    assert sparse.sparse_crow_indices == [0, 1, 1, 2, 3]
    assert sparse.sparse_col_indices == [2, 0, 1]
    assert sparse.data == [3.0, 1.0, 2.0]
    np.testing.assert_array_equal(sparse.to_numpy(), dense)
    padded = sparse.to_numpy(pad_value=-1)
    assert padded[1].tolist() == [-1, -1, -1]
    assert padded[0, 2] == 3.0
    from_torch = TensorData.from_torch_sparse(torch.from_numpy(dense))
    assert from_torch == sparse
    assert torch.equal(from_torch.to_torch(), torch.from_numpy(dense))
    # Not worth it when dense enough: stays dense.
    assert not TensorData.from_numpy_sparse(np.ones((2, 2), dtype=np.float32)).is_sparse
    assert not TensorData.from_numpy_sparse(np.zeros(5, dtype=np.float32)).is_sparse


def test_tensor_data_rejects_inconsistent_shapes() -> None:
    with pytest.raises(ValueError, match="shape"):
        TensorData([1, 2, 3], "int64", [2, 2])
    with pytest.raises(ValueError, match="2-D"):
        TensorData([1.0], "float32", [1], [0, 1], [0])
    with pytest.raises(ValueError, match="crow"):
        TensorData([1.0], "float32", [2, 2], [0, 1], [0])
    with pytest.raises(ValueError, match="together"):
        TensorData([1.0], "float32", [1, 1], [0, 1], None)


def test_sparse_densifies_like_a_loop_over_rows() -> None:
    rng = np.random.default_rng(3)
    dense = np.where(rng.random((40, 9)) < 0.2, rng.integers(1, 50, (40, 9)), 0)
    dense[5] = 0  # an empty row
    sparse = TensorData.from_numpy_sparse(dense)
    assert sparse.is_sparse
    crow, cols = sparse.sparse_crow_indices, sparse.sparse_col_indices
    assert crow is not None
    assert cols is not None
    reference = np.zeros_like(dense)
    for row in range(dense.shape[0]):
        for i in range(crow[row], crow[row + 1]):
            reference[row, cols[i]] = sparse.values[i]
    np.testing.assert_array_equal(sparse.to_numpy(), reference)
    np.testing.assert_array_equal(sparse.to_numpy(), dense)


def _hostile(shape: list[int]) -> bytes:
    """A forward_backward body whose only loss input is an empty CSR tensor of `shape`."""
    empty = np.zeros(0, dtype=np.int64)
    tensor = TensorData(empty, "int64", shape, np.zeros(shape[0] + 1, dtype=np.int64), empty)
    datum = Datum(ModelInput.from_ints([1, 2, 3]), {"target_tokens": tensor})
    return encode_forward_backward_request(ForwardBackwardRequest("m", 1, [datum], "cross_entropy"))


@pytest.mark.parametrize(
    ("shape", "says"),
    [
        ([200_000, 259], "context length"),
        ([3, 10**6], "vocabulary"),
        ([2000, 259], "expand"),
    ],
)
def test_declared_shapes_are_bounded_before_decoding(shape: list[int], says: str) -> None:
    limits = DecodeLimits(max_rows=2048, max_columns=259, max_dense_cells=100_000)
    with pytest.raises(WireFormatError, match=says) as exc:
        decode_forward_backward_request(_hostile(shape), limits)
    assert exc.value.field == "data[0].loss_fn_inputs['target_tokens']"
    # Without limits (a client decoding its own bodies) the shape alone is no error.
    if len(shape) == 2 and shape[0] < 10_000:
        decode_forward_backward_request(_hostile(shape))


def test_sparse_budget_is_shared_by_the_request() -> None:
    limits = DecodeLimits(max_rows=2048, max_columns=259, max_dense_cells=1000)
    limits.check_shape([3, 300 // 3], sparse=True, where="a")
    limits.check_shape([700], sparse=True, where="b")
    with pytest.raises(WireFormatError, match="expand"):
        limits.check_shape([2], sparse=True, where="c")
    limits.check_shape([2000], sparse=False, where="d")  # dense: it came in the body
