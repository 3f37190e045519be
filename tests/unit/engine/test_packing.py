"""The packed row's attention: per sequence, as the sequence would get alone. In fp32 it is
SDPA's own kernel (the same bits); in bf16 on a CPU it runs causal_cpu.py's kernels, whose
errors against fp64 are bounded here next to SDPA's own bf16 kernels."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tuneloop.server.engine import causal_cpu, packing  # noqa: E402

F = torch.nn.functional
SHORT = [37, 80, 11]  # the matmul kernel's lengths (at most MATMUL_MAX_TOKENS)
MIXED = [600, 40]  # an RL-length sequence (a prompt and its sampled tokens) and a short one
LONG = [1100]  # torch's flash kernel
MODULE = SimpleNamespace(num_key_value_groups=3, is_causal=True, training=False)


def _inputs(dtype: Any, lengths: list[int], seed: int = 0, magnitude: float = 1.0) -> list[Any]:
    """q, k, v [1, heads, total, 64]; `magnitude` scales q and k (larger attention logits)."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    scales = (magnitude, magnitude, 1.0)  # q, k, v
    return [
        (torch.randn(1, heads, total, 64, generator=g) * scale).to(dtype).requires_grad_()
        for heads, scale in zip((9, 3, 3), scales, strict=True)
    ]


def _alone(q: Any, k: Any, v: Any, lengths: list[int]) -> Any:
    """Each sequence's SDPA on its own, [1, total, heads, d]."""
    pieces = [
        F.scaled_dot_product_attention(a, b, c, is_causal=True, scale=0.125, enable_gqa=True)
        for a, b, c in zip(
            q.split(lengths, 2), k.split(lengths, 2), v.split(lengths, 2), strict=True
        )
    ]
    return torch.cat(pieces, dim=2).transpose(1, 2)


def _packed(q: Any, k: Any, v: Any, lengths: list[int], **kwargs: Any) -> Any:
    with packing.packed_segments(lengths):
        out, _ = packing._packed_sdpa(
            MODULE, q, k, v, None, **{"dropout": 0.0, "scaling": 0.125, **kwargs}
        )
    return out


def _max_error(got: Any, exact: Any) -> float:
    return float((got.detach().double() - exact.detach()).abs().max())


def test_fp32_packed_attention_is_sdpa_per_sequence() -> None:
    q, k, v = _inputs(torch.float32, SHORT)
    assert torch.equal(_packed(q, k, v, SHORT), _alone(q, k, v, SHORT))


def test_bf16_long_sequences_run_sdpas_flash_kernel() -> None:
    q, k, v = (t.detach() for t in _inputs(torch.bfloat16, [1100]))
    assert not causal_cpu.uses_matmul(1100)
    assert torch.equal(_packed(q, k, v, [1100]), _alone(q, k, v, [1100]))


@pytest.mark.parametrize("magnitude", [1.0, 4.0])
@pytest.mark.parametrize("lengths", [SHORT, MIXED, LONG])
def test_bf16_forward_error_is_sdpas(lengths: list[int], magnitude: float) -> None:
    """fp32 scores: within 2x SDPA's bf16 error even where logits are large (rounding the
    scores to bf16 first had 18x at magnitude 4). The matmul kernel rounds the normalized
    probabilities to bf16, where flash rounds the exps before dividing by their sum (the
    largest exp, 1, exact): 1.1-1.7x SDPA's error on these inputs and lengths of 40-600."""
    q, k, v = _inputs(torch.bfloat16, lengths, magnitude=magnitude)
    exact = _alone(*(t.detach().double() for t in (q, k, v)), lengths)
    ours = _max_error(_packed(q, k, v, lengths), exact)
    sdpa = _max_error(_alone(q, k, v, lengths), exact)
    assert ours <= 2.0 * sdpa, (ours, sdpa)


@pytest.mark.parametrize("lengths", [MIXED, [*LONG, 40]])
def test_forward_bits_do_not_depend_on_autograd(lengths: list[int]) -> None:
    """A forward and a forward_backward score a sequence alike, by either kernel."""
    q, k, v = _inputs(torch.bfloat16, lengths)
    with torch.no_grad():
        plain = _packed(q, k, v, lengths)
    assert torch.equal(plain, _packed(q, k, v, lengths))


@pytest.mark.parametrize("magnitude", [1.0, 4.0])
@pytest.mark.parametrize("lengths", [SHORT, MIXED, LONG])
def test_bf16_backward_error_against_fp64(lengths: list[int], magnitude: float) -> None:
    """The key and value gradients (sums over many queries) no farther from fp64 than SDPA's
    bf16 backward's, nearer in sum; the query gradient within 1.5x of its error and 1 % of the
    largest gradient (its score gradients round to bf16 before the matmul with the keys)."""
    q, k, v = _inputs(torch.bfloat16, lengths, magnitude=magnitude)
    grad = torch.randn(1, sum(lengths), 9, 64, generator=torch.Generator().manual_seed(1))
    _packed(q, k, v, lengths).backward(grad.bfloat16())
    ours = [t.grad for t in (q, k, v)]
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    _alone(*exact, lengths).backward(grad.double())
    half = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    _alone(*half, lengths).backward(grad.bfloat16())
    assert [g.dtype for g in ours] == [torch.bfloat16] * 3
    assert [g.shape for g in ours] == [q.shape, k.shape, v.shape]
    errors = [
        (_max_error(got, ref.grad), _max_error(sdpa.grad, ref.grad), ref.grad.abs().max().item())
        for got, sdpa, ref in zip(ours, half, exact, strict=True)
    ]
    (q_ours, q_sdpa, q_top), *keys_values = errors
    assert q_ours <= 1.5 * q_sdpa, errors
    assert q_ours < 0.01 * q_top, errors
    assert all(ours <= sdpa for ours, sdpa, _ in keys_values), errors
    assert sum(e[0] for e in keys_values) < sum(e[1] for e in keys_values), errors


def test_with_dropout_it_is_sdpa() -> None:
    q, k, v = (t.detach() for t in _inputs(torch.bfloat16, SHORT))
    assert torch.equal(_packed(q, k, v, SHORT, dropout=0.0), _packed(q, k, v, SHORT))
    assert not packing._cpu_half(q.float(), {})
    assert not packing._cpu_half(q, {"dropout": 0.1})
    assert packing._cpu_half(q, {"dropout": 0.0})


def test_bucket_lengths_pad_by_at_most_a_thirty_second_and_recur() -> None:
    assert packing.BUCKETS_PER_OCTAVE == 32
    assert [packing.bucketed(n) for n in (0, 1, 16, 17, 300, 530, 1400, 1408)] == [
        0,
        16,
        16,
        32,
        304,
        544,
        1408,
        1408,
    ]
    for n in range(1, 5000):
        b = packing.bucketed(n)
        assert n <= b <= max(n + packing.MIN_GRANULE - 1, n * 33 // 32)
        assert packing.bucketed(b) == b  # a bucket length is its own bucket
    # the lengths of one octave, 1025 to 2048, fall in 32 buckets; below 1024, granules of 16
    assert len({packing.bucketed(n) for n in range(1025, 2049)}) == 32
    assert {packing.bucketed(n) - n for n in range(512, 1024)} == set(range(16))


def test_no_buckets_keeps_the_length(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packing, "BUCKETS_PER_OCTAVE", 0)
    assert [packing.bucketed(n) for n in (1, 17, 1400)] == [1, 17, 1400]
