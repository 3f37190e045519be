"""A training pass's adapted-layer products by frozen weights on the native linear kernel.

At half precision an adapted layer's forward (ops.py's one-adapter node, siblings.py's group)
sums the LoRA delta with the base in fp32 and rounds once: one matmul of [x | x @ A.T] by
[W | scale * B]. By torch that joins the inputs and the weights anew every pass (a copy of W
and of x a layer), then runs oneDNN; the backward's input gradient, dy_1 @ W_1 + ... +
d_low @ A, is a chain of matmuls each rounded to bf16 and read back by the next. Where the CPU
has AVX512-BF16, the native linear kernel's entry of several operands
(`linear_bf16_operands` in linear_avx512.cpp) makes both without joining anything, each
output summed in fp32 and rounded once: the frozen W (forward) and each member's W^T (input
gradient) in the kernel's blocks once, kept while their tensors are unchanged (`frozen`,
`transposed`); B and A^T packed per call (the rank's columns: small); the activations and
gradients read where they lie. A sibling group's B holds zeros outside each member's own rank
columns; the kernel leaves those pairs out (`spans`), as a decode step's fused groups do.
Where the CPU has AMX the entry runs on the tile unit, and takes a product only where every
operand is whole tile steps wide (32 inputs: SmolLM2's widths and rank 32 are); the AVX-512
loops ran there at a tenth of oneDNN's rate. On an AMX Xeon whole steps of bench/engine.py's
batches read 0.985-0.999x (oneDNN's kernel on the tiles is as fast at their ~700 rows a
part, ahead of the joins it saves), steps of 32-64-token sequences 1.046x (docs/benchmarks.md).

Another kernel than oneDNN's, so the outputs round differently (a bf16 step in a few of them;
the input gradient rounds once where the chain rounded at each matmul). The packed copies are
the adapted layers' weights twice more; each is made only where it takes at most
COPY_SHARE of the free memory, else the pass keeps torch's products.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from tuneloop.server.engine import native, native_linear
from tuneloop.server.engine.memory import COPY_SHARE, free_bytes
from tuneloop.server.engine.native_linear import NativeWeight

__all__ = [
    "available",
    "b_blocks",
    "frozen",
    "input_grad",
    "kernel_blocks",
    "operands_kernel",
    "product",
    "spans_of",
    "summed",
    "transposed",
]

_P, _I = ctypes.c_void_p, ctypes.c_int64
# count, xs, lds, ks, ws, strides, rows, bias, n, y, ldy, threads, spans
_SIGNATURE = (ctypes.c_int, _P, _P, _P, _P, _P, _I, _P, _I, _P, _I, ctypes.c_int, _P)
_NATIVE = True  # (bench/train_variants.py switches it off to compare: --variant native-summed)
OPERANDS = 8  # operands a call at most (linear_avx512.cpp's kOperands)
_BLOCK = 64
_TILE_K = 32  # inputs a tile step of the kernel's AMX form

# Per frozen weight (a sibling group's first member), the weights' pointers and versions when
# packed and the packed copies (None: refused for memory); dropped with the weight. `_FROZEN`:
# the stacked rows (forward), `_TRANSPOSED`: each member's W^T (input gradient).
_FROZEN: WeakIdKeyDictionary = WeakIdKeyDictionary()
_TRANSPOSED: WeakIdKeyDictionary = WeakIdKeyDictionary()
_LOCK = threading.Lock()
_SPANS: dict[tuple[tuple[int, ...], tuple[int, ...], int], torch.Tensor | None] = {}


def operands_kernel() -> Any:
    """linear_avx512.cpp's entry point of several operands (`_SIGNATURE`), or None where it
    cannot be built."""
    return native.function(
        native_linear.SOURCE,
        "linear_bf16_operands",
        _SIGNATURE,
        ctypes.c_int,
        ("avx512f", "avx512_bf16"),
    )


def available(x: torch.Tensor, weights: Sequence[torch.Tensor], widths: Sequence[int]) -> bool:
    """Whether the kernel takes a product of a pass over x with these frozen weights whose
    operands are `widths` wide (forward: x's and the LoRA rank's; input gradient: each
    member's outputs and the ranks): bf16 CPU tensors, every width but the last even, a
    kernel built here (TUNELOOP_NATIVE_LINEAR not 0). On a CPU with AMX only where the tile
    unit takes the call (every width whole tile steps of 32 inputs): the AVX-512 loops ran
    there at a tenth of oneDNN's rate on the tiles."""
    if not _NATIVE or os.environ.get("TUNELOOP_NATIVE_LINEAR", "1") == "0":
        return False
    if x.dtype != torch.bfloat16 or x.device.type != "cpu" or any(w % 2 for w in widths[:-1]):
        return False
    if any(w.dtype != torch.bfloat16 or w.device.type != "cpu" or w.dim() != 2 for w in weights):
        return False
    if operands_kernel() is None:
        return False
    if "amx_bf16" in native.cpu_flags():
        return native_linear.tiles(None) and all(w % _TILE_K == 0 for w in widths)
    return True


def _state(weights: Sequence[torch.Tensor]) -> tuple[Any, ...]:
    return tuple((w.data_ptr(), w._version, tuple(w.shape)) for w in weights)


def kernel_blocks(matrix: torch.Tensor) -> torch.Tensor:
    """matrix [N, K] in the kernel's blocks, [ceil(N / 64), ceil(K / 2), 64, 2], zeros past N
    and K."""
    n, k = matrix.shape
    nb, kp = -(-n // _BLOCK), -(-k // 2)
    padded = matrix.new_zeros((nb * _BLOCK, 2 * kp))
    padded[:n, :k] = matrix.detach()
    return padded.view(nb, _BLOCK, kp, 2).transpose(1, 2).contiguous()


def _kept(held: WeakIdKeyDictionary, weights: Sequence[torch.Tensor], make: Any) -> Any:
    """`make()`'s packed copy of the weights, kept in `held` with the first weight while every
    one of them is the same tensor, unchanged in place; None where the copy would take more
    than COPY_SHARE of the free memory."""
    state = _state(weights)
    found = held.get(weights[0])
    if found is not None and found[0] == state:
        return found[1]
    with _LOCK:  # (both threads' parts may ask first at once: one copy)
        found = held.get(weights[0])
        if found is not None and found[0] == state:
            return found[1]
        need = sum(w.numel() for w in weights) * 2
        free = free_bytes(weights[0].device)
        copy = None
        if free is None or need <= COPY_SHARE * free:
            with torch.no_grad():
                copy = make()
        held[weights[0]] = (state, copy)
        return copy


def frozen(weights: Sequence[torch.Tensor]) -> NativeWeight | None:
    """The weights' rows stacked in the kernel's blocks (a forward's W), kept while they are
    unchanged; None where refused for memory (`_kept`)."""

    def make() -> NativeWeight:
        whole = torch.cat([w.detach() for w in weights]) if len(weights) > 1 else weights[0]
        return NativeWeight(kernel_blocks(whole), None, whole.shape[0], whole.shape[1])

    packed: NativeWeight | None = _kept(_FROZEN, weights, make)
    return packed


def transposed(weights: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
    """Each weight's transpose W_i^T [in, out_i] in the kernel's blocks (an input gradient's
    operands' weights), kept while they are unchanged; None where refused for memory."""
    copies: list[torch.Tensor] | None = _kept(
        _TRANSPOSED, weights, lambda: [kernel_blocks(w.detach().t()) for w in weights]
    )
    return copies


def b_blocks(ups: Sequence[torch.Tensor], scales: Sequence[float]) -> torch.Tensor:
    """The members' scale * B ([out_i, r_i] each) as the kernel's blocks of the joined weights'
    LoRA columns, [ceil(N / 64), ceil(R / 2), 64, 2]: member i's rows, its own rank's columns,
    zeros elsewhere (N = the members' outputs, R = their ranks)."""
    n, r = sum(b.shape[0] for b in ups), sum(b.shape[1] for b in ups)
    joined = ups[0].new_zeros((n, r))
    row = column = 0
    for b, scale in zip(ups, scales, strict=True):
        size, rank = b.shape
        torch.mul(b, scale, out=joined[row : row + size, column : column + rank])
        row, column = row + size, column + rank
    return kernel_blocks(joined)


def spans_of(sizes: Sequence[int], ranks: Sequence[int], split: int) -> torch.Tensor | None:
    """The kernel's `spans` for a group's joined weights ([W | B blocks], W's `split` pairs
    first): every block's W pairs, then the rank columns of the members whose rows the block
    holds; None for one member (no zero columns) or odd ranks (a pair across two members)."""
    key = (tuple(sizes), tuple(ranks), split)
    if key in _SPANS:
        return _SPANS[key]
    spans = None
    if len(sizes) > 1 and all(r % 2 == 0 for r in ranks):
        starts, columns = [0], [0]
        for size, rank in zip(sizes, ranks, strict=True):
            starts.append(starts[-1] + size)
            columns.append(columns[-1] + rank)
        blocks = -(-starts[-1] // _BLOCK)
        table = []
        for b in range(blocks):
            lo, hi = b * _BLOCK, min((b + 1) * _BLOCK, starts[-1])
            members = [i for i in range(len(sizes)) if starts[i] < hi and starts[i + 1] > lo]
            first, last = columns[members[0]] // 2, columns[members[-1] + 1] // 2
            table.append([0, split, split + first, split + last])
        spans = torch.tensor(table, dtype=torch.int32)
    _SPANS[key] = spans
    return spans


def product(
    xs: Sequence[torch.Tensor],
    blocks: Sequence[torch.Tensor],
    n: int,
    bias: torch.Tensor | None = None,
    spans: torch.Tensor | None = None,
) -> torch.Tensor:
    """[x_1 | ... | x_m] @ W.T + bias, [rows, n] bf16, each output summed in fp32 (from the
    bias) and rounded once: operand x_o [rows, K_o] (features contiguous, rows strided; every
    K_o but the last even) read where it lies, its weights in blocks[o] ([ceil(n / 64),
    ceil(K_o / 2), 64, 2], `kernel_blocks`)."""
    kernel = operands_kernel()
    if kernel is None:
        raise RuntimeError("the native linear kernel is not built on this CPU")
    count = len(xs)
    if not 0 < count <= OPERANDS or len(blocks) != count:
        raise ValueError(f"the native linear kernel takes 1-{OPERANDS} operands, each with weights")
    rows = xs[0].shape[0] if xs[0].dim() == 2 else -1
    nb = -(-n // _BLOCK)
    held = []
    for o, (x, w) in enumerate(zip(xs, blocks, strict=True)):
        width = x.shape[-1]
        x = native.bf16_rows(x, width, "native linear kernel", f"[{n}, {width}] weight")
        if x.shape[0] != rows or w.shape[0] != nb or w.shape[1] * 2 < width:
            raise ValueError(f"operand {o} does not match the others' rows or its weights")
        if w.dtype != torch.bfloat16 or w.shape[2:] != (_BLOCK, 2) or _pair_stride(w) != 128:
            raise ValueError(f"operand {o}'s weights are not the kernel's blocks")
        if width % 2 and o + 1 < count:
            raise ValueError(f"operand {o} has an odd width: only the last may")
        held.append((x, w))
    if bias is not None:
        padded = bias.new_zeros(nb * _BLOCK, dtype=torch.float32)
        padded[:n] = bias.detach()
        bias = padded
    y = torch.empty((rows, n), dtype=torch.bfloat16)
    pointers = (ctypes.c_void_p * count)(*[x.data_ptr() for x, _ in held])
    lds = (ctypes.c_int64 * count)(*[x.stride(0) if rows > 1 else x.shape[1] for x, _ in held])
    widths = (ctypes.c_int64 * count)(*[x.shape[1] for x, _ in held])
    weights = (ctypes.c_void_p * count)(*[w.data_ptr() for _, w in held])
    strides = (ctypes.c_int64 * count)(*[_block_stride(w) // 128 for _, w in held])
    code = kernel(
        count,
        pointers,
        lds,
        widths,
        weights,
        strides,
        rows,
        bias.data_ptr() if bias is not None else None,
        n,
        y.data_ptr(),
        n,
        torch.get_num_threads(),
        spans.data_ptr() if spans is not None else None,
    )
    if code:
        raise ValueError("the native linear kernel refused its shapes")
    return y


def _pair_stride(w: torch.Tensor) -> int:
    """Elements from one input pair of a block to the next: 128 in the kernel's blocks (a dim
    of one pair or one block may carry any stride, as torch keeps it contiguous)."""
    if w.stride(2) != 2 or w.stride(3) != 1:
        return -1
    pair = w.stride(1) if w.shape[1] > 1 else 128
    return pair if _block_stride(w) % 128 == 0 else -1


def _block_stride(w: torch.Tensor) -> int:
    return w.stride(0) if w.shape[0] > 1 else w.shape[1] * 128


def summed(
    x: torch.Tensor,
    low: torch.Tensor,
    weight: NativeWeight,
    blocks: torch.Tensor,
    bias: torch.Tensor | None = None,
    spans: torch.Tensor | None = None,
) -> torch.Tensor:
    """A forward's [x | low] @ [W | B].T + bias ([rows, N] bf16, `product`): W in `weight`
    (`frozen`), B in `blocks` (`b_blocks`)."""
    if x.shape[-1] != weight.in_features:
        raise ValueError(f"inputs of {x.shape[-1]} features for a {list(weight.shape)} weight")
    return product([x, low], [weight.blocks, blocks], weight.out_features, bias, spans)


def input_grad(
    dys: Sequence[torch.Tensor],
    d_low: torch.Tensor,
    weights: Sequence[torch.Tensor],
    a: torch.Tensor,
) -> torch.Tensor | None:
    """An adapted layer's (or sibling group's) input gradient, dy_1 @ W_1 + ... + dy_G @ W_G +
    d_low @ A ([rows, in] bf16, summed in fp32 and rounded once, `product`): W_i^T packed once
    (`transposed`), A^T [in, R] packed per call; None where the copy is refused, a member's
    width is odd or the group has more operands than a call takes (torch's products then)."""
    if len(dys) + 1 > OPERANDS or any(dy.shape[-1] % 2 for dy in dys):
        return None  # (an operand before the last starts at a whole pair)
    packed = transposed(weights)
    if packed is None:
        return None
    return product([*dys, d_low], [*packed, kernel_blocks(a.t())], a.shape[1])
