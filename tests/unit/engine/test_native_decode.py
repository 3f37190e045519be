"""The native decode attention (kv/native_decode.py): as exact as the gather + SDPA and
inductor's kernel it stands in for, blind to stale memory and to the rows beside it, and
picked by the engine for bf16 models where the CPU has AVX512-BF16 and for fp32 models where
it has AVX2 and FMA. Skipped where a kernel is not built (inductor's is tested in
test_decode_attention.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from tuneloop.server.engine.kv import decode_attention, native_decode  # noqa: E402

CPU = torch.device("cpu")
BUILT = native_decode.available(4, 2, 64, 64, torch.bfloat16, CPU)
BUILT_FP32 = native_decode.available(4, 2, 64, 64, torch.float32, CPU)
bf16_kernel = pytest.mark.skipif(not BUILT, reason="no AVX512-BF16 or no C++ compiler here")
fp32_kernel = pytest.mark.skipif(not BUILT_FP32, reason="no AVX2 + FMA or no C++ compiler here")

# (query heads, key heads, key size, value size): SmolLM2's 9/3 x 64, Llama/Qwen3-8B's groups of
# 4 x 128, plain multi-head, and values narrower than the keys (MLA's shape)
SHAPES = [(9, 3, 64, 64), (8, 2, 128, 128), (4, 4, 32, 32), (6, 2, 64, 32)]
# a decode row has two slots or more; 16 keys are scored at a time (17, 33, 300: partial chunks)
LENGTHS = [[2], [5, 1, 17, 9], [40, 3, 33], [300, 16, 2]]


def _layout(
    shape: tuple[int, int, int, int],
    lengths: list[int],
    seed: int,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, ...]:
    """bf16 pools whose slots nobody attends to hold NaNs (a poisoned request's stale keys),
    a zero pad slot last, rows of `lengths` scattered slots padded to the longest."""
    heads, kv_heads, dim, dim_v = shape
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths) + 9
    k_pool = torch.full((total + 1, kv_heads, dim), float("nan"))
    v_pool = torch.full((total + 1, kv_heads, dim_v), float("nan"))
    k_pool[total], v_pool[total] = 0, 0
    order = torch.randperm(total, generator=gen)
    slots = torch.full((len(lengths), max(lengths)), total, dtype=torch.long)
    mask = torch.zeros(slots.shape, dtype=torch.bool)
    start = 0
    for row, length in enumerate(lengths):
        picked = order[start : start + length]
        start += length
        slots[row, :length], mask[row, :length] = picked, True
        k_pool[picked] = torch.randn(length, kv_heads, dim, generator=gen)
        v_pool[picked] = torch.randn(length, kv_heads, dim_v, generator=gen)
    q = torch.randn(len(lengths), heads, dim, generator=gen).mul(2)
    return q.to(dtype), k_pool.to(dtype), v_pool.to(dtype), slots, mask


def _fp64(q, k_pool, v_pool, slots, mask, scale: float) -> torch.Tensor:
    groups = q.shape[1] // k_pool.shape[1]
    out = []
    for row in range(q.shape[0]):
        picked = slots[row][mask[row]]
        k = k_pool[picked].double().repeat_interleave(groups, 1)  # [ctx, heads, dim]
        v = v_pool[picked].double().repeat_interleave(groups, 1)
        probs = (torch.einsum("hd,chd->hc", q[row].double(), k) * scale).softmax(-1)
        out.append(torch.einsum("hc,chd->hd", probs, v))
    return torch.stack(out)


def _sdpa(q, k_pool, v_pool, slots, mask, scale: float) -> torch.Tensor:
    """The reference path's decode rows: slots gathered, query heads folded, bf16 SDPA."""
    rows, heads, dim = q.shape
    kv_heads = k_pool.shape[1]
    k = k_pool.nan_to_num(0)[slots].permute(0, 2, 1, 3)  # SDPA's 0 x NaN would leak
    v = v_pool.nan_to_num(0)[slots].permute(0, 2, 1, 3)
    folded = q.reshape(rows, kv_heads, heads // kv_heads, dim)
    out = torch.nn.functional.scaled_dot_product_attention(
        folded, k, v, attn_mask=mask[:, None, None, :], scale=scale
    )
    return out.reshape(rows, heads, v_pool.shape[-1])


def _native_error(
    shape: tuple[int, ...], lengths: list[int], dtype: torch.dtype
) -> tuple[list[torch.Tensor], float, torch.Tensor, torch.Tensor]:
    """The native kernel on a layout of `shape` and `lengths` in `dtype`: its result checked
    for dtype, shape and finiteness; (inputs, scale, the fp64 result, its largest error)."""
    inputs = _layout(shape, lengths, seed=len(lengths) + shape[0], dtype=dtype)
    scale = shape[2] ** -0.5
    expected = _fp64(*inputs, scale)
    out = native_decode.attend(*inputs, scale)
    assert out.dtype == dtype
    assert out.shape == (len(lengths), shape[0], shape[3])
    assert torch.isfinite(out).all()
    return list(inputs), scale, expected, (out.double() - expected).abs().max()


@pytest.fixture(autouse=True)
def _no_grad() -> Iterator[None]:
    with torch.no_grad():
        yield


@bf16_kernel
@pytest.mark.parametrize("lengths", LENGTHS)
@pytest.mark.parametrize("shape", SHAPES)
def test_rows_are_as_exact_as_gather_and_sdpa(shape: tuple[int, ...], lengths: list[int]) -> None:
    """fp32 scores and sums: no farther from fp64 than the bf16 SDPA path, beyond the rounding
    of the result to bf16 itself; NaNs in slots nobody attends to never reach a result."""
    inputs, scale, expected, error = _native_error(shape, lengths, torch.bfloat16)
    sdpa = (_sdpa(*inputs, scale).double() - expected).abs().max()
    rounding = expected.abs().max() * 2.0**-8
    assert error <= max(1.25 * sdpa, rounding), (error, sdpa, rounding)


def _call(name: str, q, k_pool, v_pool, slots, mask, scale: float) -> torch.Tensor:
    kernel = native_decode.native_kernel(name)
    out = torch.empty((q.shape[0], q.shape[1], v_pool.shape[-1]), dtype=torch.bfloat16)
    code = kernel(
        q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), slots.data_ptr(), mask.data_ptr(),
        q.shape[0], slots.shape[1], q.shape[1], k_pool.shape[1], q.shape[2], v_pool.shape[-1],
        scale, out.data_ptr(), 2,
    )  # fmt: skip
    assert code == 0
    return out


# The common shapes' loop (head sizes 64 and 128, 1 to 8 query heads per key head, the 64
# value dims of a head at a time up to 4 of them and 32 beyond): SmolLM2, Qwen3-8B, GPT-OSS's
# groups of 8, multi-head, Qwen2.5-0.5B's 7.
FIXED_SHAPES = [
    (9, 3, 64, 64),
    (8, 2, 128, 128),
    (16, 2, 64, 64),
    (3, 3, 128, 128),
    (14, 2, 64, 64),
]


@bf16_kernel
@pytest.mark.parametrize("shape", FIXED_SHAPES)
def test_the_common_shapes_loop_gives_the_generic_loops_bits(shape: tuple[int, ...]) -> None:
    """attend_row_fixed (queries in registers, values widened by unpacks, other prefetches)
    makes the generic loop's sums in its order: the same bits, on rows with partial chunks of
    16 keys, masked keys inside a row, and NaNs in slots nobody attends to."""
    q, k_pool, v_pool, slots, mask = _layout(shape, [1, 2, 17, 40, 300, 33], seed=shape[0])
    mask[4, 100:140] = False  # a window inside a long row
    fixed = _call("decode_attention_bf16", q, k_pool, v_pool, slots, mask, shape[2] ** -0.5)
    generic = _call(
        "decode_attention_bf16_generic", q, k_pool, v_pool, slots, mask, shape[2] ** -0.5
    )
    assert torch.isfinite(fixed).all()
    assert torch.equal(fixed, generic)


DTYPES = [
    pytest.param(torch.bfloat16, marks=bf16_kernel),
    pytest.param(torch.float32, marks=fp32_kernel),
]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_never_depends_on_the_rows_beside_it(dtype: torch.dtype) -> None:
    """A row alone and among longer ones (more padding, other rows' threads): the same bits."""
    q, k_pool, v_pool, slots, mask = _layout((9, 3, 64, 64), [6, 70, 2, 33], 5, dtype)
    together = native_decode.attend(q, k_pool, v_pool, slots, mask, 0.125)
    for row in range(4):
        width = int(mask[row].sum())
        alone = native_decode.attend(
            q[row : row + 1],
            k_pool,
            v_pool,
            slots[row, :width].reshape(1, width),
            mask[row, :width].reshape(1, width),
            0.125,
        )
        assert torch.equal(alone[0], together[row])


@bf16_kernel
def test_masked_keys_inside_a_row_are_never_read() -> None:
    """A sliding window masks slots at the start of a row's context, here holding NaNs: the
    same result as the row given only the slots it attends to."""
    q, k_pool, v_pool, slots, mask = _layout((9, 3, 64, 64), [40], seed=6)
    kept = native_decode.attend(q, k_pool, v_pool, slots[:, 25:], mask[:, 25:], 0.125)
    windowed = mask.clone()
    windowed[0, :25] = False
    k_pool[slots[0, :25]], v_pool[slots[0, :25]] = float("nan"), float("nan")
    out = native_decode.attend(q, k_pool, v_pool, slots, windowed, 0.125)
    assert torch.equal(out, kept)


@bf16_kernel
def test_it_agrees_with_inductors_kernel() -> None:
    inputs = _layout((9, 3, 64, 64), [5, 1, 17, 9, 64], seed=7)
    assert decode_attention.warm_up(9, 3, 64, 64, 0.125, torch.bfloat16, CPU)
    compiled = decode_attention.compiled()(*inputs, 0.125)
    native = native_decode.attend(*inputs, 0.125)
    torch.testing.assert_close(native.float(), compiled.float(), atol=2e-2, rtol=2e-2)


@bf16_kernel
def test_what_it_does_not_take() -> None:
    assert not native_decode.available(9, 3, 64, 64, torch.float16, CPU)
    assert not native_decode.available(9, 3, 48, 48, torch.bfloat16, CPU)  # not 32 | head size
    assert not native_decode.available(9, 2, 64, 64, torch.bfloat16, CPU)  # no whole groups
    assert not native_decode.available(9, 3, 64, 64, torch.bfloat16, torch.device("cuda"))
    inputs = _layout((4, 2, 64, 64), [3, 5], seed=8)
    with pytest.raises(ValueError, match="bf16"):
        native_decode.attend(inputs[0].float(), *inputs[1:], 0.125)
    q, k_pool, v_pool, slots, mask = inputs
    for wrong in (k_pool.shape[0], -1):  # the kernel reads raw memory: never past the pool
        outside = slots.clone()
        outside[1, 0] = wrong
        with pytest.raises(ValueError, match="outside the pool"):
            native_decode.attend(q, k_pool, v_pool, outside, mask, 0.125)
    # head sizes a model's check would have refused (MLA's values): the eager sums instead
    q, k_pool, v_pool, slots, mask = _layout((4, 2, 64, 48), [3, 5], seed=9)
    out = native_decode.attend(q, k_pool, v_pool, slots, mask, 0.125)
    assert torch.equal(out, decode_attention.attend(q, k_pool, v_pool, slots, mask, 0.125))


@pytest.mark.parametrize(
    ("dtype", "built", "apart"), [(torch.bfloat16, BUILT, 0.05), (torch.float32, BUILT_FP32, 1e-4)]
)
def test_a_backend_samples_through_it_as_through_inductors_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, built: bool, apart: float
) -> None:
    """The tiny Qwen3 (head size 32) in bf16 and fp32 with its kernels compiled: the engine
    picks the native kernel, and a sampling call gives the tokens inductor's kernel gives,
    logprobs within the dtype's rounding (`apart`)."""
    if not built:
        pytest.skip(f"no native decode attention for {dtype} here")
    from tuneloop.server.engine.torch_backend import TorchBackend
    from tuneloop.server.engine.types import AdapterSpec, SampleWork

    def sample(backend: TorchBackend) -> list[tuple[list[int], list[float]]]:
        backend.create_adapter(AdapterSpec("A", "tuneloop/tiny-qwen3", rank=8, seed=3))
        backend.create_sampler("s", "tuneloop/tiny-qwen3", adapter_id="A")
        prompt = torch.arange(3, 12).numpy()
        [result] = backend.sample([SampleWork("s", prompt, 3, 12, 1.0, -1, 1.0, 5, (), ())])
        assert not isinstance(result, Exception)
        return [(list(s.tokens), list(s.logprobs)) for s in result.sequences]

    def backend() -> TorchBackend:
        return TorchBackend(
            ["tuneloop/tiny-qwen3"],
            cache_dir=tmp_path / "cache",
            device="cpu",
            dtype=dtype,
            compile_norms=True,
        )

    native = backend()
    [runtime] = native._runtimes.values()
    assert runtime.decode_kernel is native_decode.attend
    ours = sample(native)
    native.close()
    monkeypatch.setattr(native_decode, "available", lambda *args: False)
    inductor = backend()
    [runtime] = inductor._runtimes.values()
    assert runtime.compiled_decode
    assert runtime.decode_kernel is not native_decode.attend
    theirs = sample(inductor)
    inductor.close()
    assert [t for t, _ in ours] == [t for t, _ in theirs]
    for (_, a), (_, b) in zip(ours, theirs, strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < apart


# fp32 (decode_attention_avx2.cpp): the common shapes' loop (head sizes 64 and 128, 1-4, 6 or
# 8 query heads per key head) and the generic one (head size 32, values narrower than keys,
# 7 query heads per key head)
FP32_SHAPES = [*SHAPES, (16, 2, 64, 64), (14, 2, 64, 64), (12, 2, 128, 128)]


@fp32_kernel
@pytest.mark.parametrize("lengths", LENGTHS)
@pytest.mark.parametrize("shape", FP32_SHAPES)
def test_fp32_rows_are_as_exact_as_the_eager_sums(
    shape: tuple[int, ...], lengths: list[int]
) -> None:
    """Scores, softmax and sums in fp32 (exp to about an ulp): no farther from fp64 than the
    eager fp32 sums inductor's kernel compiles, within a few fp32 roundings; NaNs in slots
    nobody attends to never reach a result."""
    inputs, scale, expected, error = _native_error(shape, lengths, torch.float32)
    clean = [inputs[0], inputs[1].nan_to_num(0), inputs[2].nan_to_num(0), *inputs[3:]]
    eager = (decode_attention.attend(*clean, scale).double() - expected).abs().max()
    rounding = expected.abs().max() * 2.0**-20
    assert error <= max(2 * eager, rounding), (error, eager, rounding)


@fp32_kernel
def test_fp32_rows_never_read_the_keys_behind_a_window() -> None:
    """Slots masked at a row's start, holding NaNs: the row given only the slots it attends
    to, within fp32's rounding."""
    q, k_pool, v_pool, slots, mask = _layout((9, 3, 64, 64), [6, 70, 2, 33], 5, torch.float32)
    kept = native_decode.attend(q[1:2], k_pool, v_pool, slots[1:2, 25:], mask[1:2, 25:], 0.125)
    windowed = mask.clone()
    windowed[1, :25] = False
    k_pool[slots[1, :25]], v_pool[slots[1, :25]] = float("nan"), float("nan")
    out = native_decode.attend(q, k_pool, v_pool, slots, windowed, 0.125)
    assert torch.isfinite(out).all()  # the NaNs behind the mask are never read
    # (the sums pair keys by position, so the window's start moves their rounding)
    torch.testing.assert_close(out[1], kept[0], rtol=1e-5, atol=1e-6)
