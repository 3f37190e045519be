"""Sibling linears as one matmul, a lone key's LoRA delta in extra columns: decode steps' weights.

A decode step whose rows all use one key (one adapter snapshot, or the base model) need not
run each adapted linear as the base matmul plus two LoRA products. Two changes make it one
matmul per group of siblings, with the delta kept exact:

- Siblings fed the same input (an attention's q/k/v projections, an MLP's gate/up) are one
  weight, their rows stacked, as vLLM's QKVParallelLinear and MergedColumnParallelLinear do:
  one call where there were three, and the small k/v products no longer run alone.
- The adapter's up-projection rides in extra input columns instead of being merged into the
  weights: with `low = x @ A.T`, `x @ W.T + scale * low @ B.T = [x | low] @ [W | scale*B].T`.
  Merging `W + scale * B @ A` into a bf16 weight rounds most of a young adapter's delta away
  with the weight's last bits, and adding the delta to a rounded bf16 output (the products)
  loses about half of it (bench/fused_linears.py, docs/benchmarks.md); here the delta's
  products are made in the same matmul, summed in fp32 with the base's, and rounded once, as
  a training pass's one-adapter node does (ops.py).

The stacked weight is packed once: for oneDNN (packed.py), or in the native linear kernel's
layout, its bias with it (native_linear.py: bf16 on a CPU with AVX512-BF16, fp32 on one with
AVX2 and FMA). The first sibling
called with an input computes every sibling's output; the others take theirs while the input
is the same tensor (any other input computes the group again, so a wrong guess of siblings
costs time, never values).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from tuneloop.server.engine import native_linear, packed
from tuneloop.server.engine.lora import native_columns
from tuneloop.server.engine.lora.native_columns import DownPairs
from tuneloop.server.engine.lora.segments import Segment, add, stacked_up
from tuneloop.server.engine.native_linear import NativeWeight

__all__ = [
    "SIBLINGS",
    "FusedLinear",
    "fusable",
    "plain_frozen",
    "sibling_groups",
    "take",
    "taken",
]

# Layer names under one parent module that take the same input in the model families served.
SIBLINGS: tuple[frozenset[str], ...] = (
    frozenset({"q_proj", "k_proj", "v_proj"}),
    frozenset({"gate_proj", "up_proj"}),
    frozenset({"q_a_proj", "kv_a_proj_with_mqa"}),  # DeepSeek's compressed attention
    frozenset({"w1", "w3"}),
)


def plain_frozen(base: nn.Module) -> bool:
    """Whether a layer is a plain, unhooked `nn.Linear` with a frozen weight and bias (sharded
    or hooked layers run their own forward): one the engine may compute itself."""
    if type(base) is not nn.Linear or base._forward_hooks or base._forward_pre_hooks:
        return False
    return not base.weight.requires_grad and (base.bias is None or not base.bias.requires_grad)


def fusable(base: nn.Module) -> bool:
    """Whether a layer's weights can be copied into a group: `plain_frozen`, its parameters
    plain tensors (not a sharded tensor type)."""
    if not plain_frozen(base):
        return False
    return all(type(p) in (nn.Parameter, torch.Tensor) for p in base.parameters(recurse=False))


def sibling_groups(names: Sequence[str], bases: Mapping[str, nn.Linear]) -> list[list[str]]:
    """`names` grouped: siblings of one parent (SIBLINGS) with one input size, dtype and device
    together, in `names`' order; every other layer alone."""
    groups: dict[tuple[str, int, str], list[str]] = {}
    out: list[list[str]] = []
    for name in names:
        parent, _, last = name.rpartition(".")
        family = next((i for i, s in enumerate(SIBLINGS) if last in s), None)
        if family is None:
            out.append([name])
            continue
        weight = bases[name].weight
        signature = f"{family}:{weight.shape[-1]}:{weight.dtype}:{weight.device}"
        group = groups.get((parent, family, signature))
        if group is None:
            group = groups[(parent, family, signature)] = []
            out.append(group)
        group.append(name)
    return out


def take(
    held: dict[int, tuple[torch.Tensor, list[torch.Tensor | None]]],
    group: int,
    index: int,
    x: torch.Tensor,
    compute: Callable[[], Sequence[torch.Tensor]],
) -> torch.Tensor:
    """Sibling `index`'s output of group `group` for input x: from the group's outputs made
    for this very x and not yet taken, else from `compute()` (all of them, kept in `held` for
    the other siblings until each took its own)."""
    out = taken(held, group, index, x)
    if out is None:
        held[group] = (x, list(compute()))
        out = taken(held, group, index, x)
    assert out is not None
    return out


def taken(
    held: dict[int, tuple[torch.Tensor, list[torch.Tensor | None]]],
    group: int,
    index: int,
    x: torch.Tensor,
) -> torch.Tensor | None:
    """Sibling `index`'s output of group `group` made for this very x and not yet taken (no
    longer held once taken), or None."""
    entry = held.get(group)
    if entry is None or entry[0] is not x or entry[1][index] is None:
        return None
    out = entry[1][index]
    entry[1][index] = None
    if all(o is None for o in entry[1]):
        del held[group]  # every sibling served: hold nothing
    return out


class FusedLinear:
    """One group of sibling linears for one key: the stacked (and maybe packed, or a
    `NativeWeight` holding the bias too) weight [sum of outputs, in + LoRA columns], the
    stacked down-projections A [LoRA columns, in] (None: no LoRA columns; `DownPairs`: for
    the native kernel) and the outputs' sizes."""

    def __init__(
        self,
        weight: torch.Tensor | NativeWeight,
        bias: torch.Tensor | None,
        a: torch.Tensor | DownPairs | None,
        sizes: list[int],
        versions: list[tuple[torch.Tensor, int]],
    ) -> None:
        self.weight, self.bias, self.a, self.sizes = weight, bias, a, sizes
        # The base weights copied, with their versions then: an in-place change makes it stale.
        self._versions = versions
        self._held: dict[int, tuple[torch.Tensor, list[torch.Tensor | None]]] = {}  # `take`

    @classmethod
    def build(
        cls,
        bases: Sequence[nn.Linear],
        factors: Sequence[tuple[torch.Tensor, torch.Tensor, float] | None],
        *,
        merge: bool = False,
    ) -> FusedLinear:
        """The group of `bases` ([out_i, in] each, one dtype) with each one's LoRA factors (A
        [r, in], B [out_i, r], scale; None: none): in extra columns, or merged into the rows
        (`merge`: scale * B @ A added in fp32, rounded once to the weight's dtype)."""
        dtype, device = bases[0].weight.dtype, bases[0].weight.device
        rows: list[torch.Tensor] = []
        ups: list[torch.Tensor | None] = [None] * len(bases)  # scale * B in fp32, per member
        downs: list[torch.Tensor] = []
        with torch.no_grad():
            for index, (base, found) in enumerate(zip(bases, factors, strict=True)):
                w = base.weight.detach()
                if found is not None:
                    a, b, scale = found[0].detach(), found[1].detach(), found[2]
                    if merge:
                        w = (b.float() @ a.float()).mul_(scale).add_(w.float()).to(dtype)
                    else:
                        ups[index] = b.float() * scale
                        downs.append(a.to(dtype))
                rows.append(w)
            sizes = [w.shape[0] for w in rows]
            weight = torch.cat(rows) if len(rows) > 1 else rows[0].clone()
            if downs:  # each member's up-projection in its block of the extra columns
                extra = stacked_up(sizes, ups, dtype, device).t()
                weight = torch.cat([weight, extra], dim=1)
            biases = [base.bias for base in bases]
            bias = None
            if any(b is not None for b in biases):
                bias = torch.cat(
                    [
                        b.detach() if b is not None else torch.zeros(n, dtype=dtype, device=device)
                        for b, n in zip(biases, sizes, strict=True)
                    ]
                )
        # The down-projections packed too: oneDNN's kernel on a packed [LoRA columns, in] took
        # 22-28 us against 24-36 us for a plain bf16 matmul at 128 rows (SmolLM2's shapes, an
        # AMX Xeon), 121 of them a decode step. Where the native kernel takes them, it makes
        # [x | x @ A.T] in one call instead (native_columns.py).
        a_all: torch.Tensor | DownPairs | None = None
        if downs and native_columns.available(dtype, device):
            a_all = native_columns.pack(torch.cat(downs))
        elif downs:
            a_all = packed.pack(torch.cat(downs))
        versions = [(base.weight, base.weight._version) for base in bases]
        if native_linear.available(weight):  # (the bias goes into the kernel's sums)
            # (the spans of zero pairs looked for in the LoRA columns alone)
            native = native_linear.pack(weight, bias, extra_from=bases[0].weight.shape[1])
            return cls(native, None, a_all, sizes, versions)
        return cls(packed.pack(weight), bias, a_all, sizes, versions)

    @property
    def versions(self) -> list[tuple[torch.Tensor, int]]:
        """The base weights copied, each with its version (`_version`) when it was copied."""
        return list(self._versions)

    @property
    def nbytes(self) -> int:
        down = self.a.pairs if isinstance(self.a, DownPairs) else self.a
        weight = self.weight
        tensors = [self.bias, down] + ([] if isinstance(weight, NativeWeight) else [weight])
        size = sum(t.numel() * t.element_size() for t in tensors if t is not None)
        return size + (weight.nbytes if isinstance(weight, NativeWeight) else 0)

    def output(
        self, index: int, x: torch.Tensor, segments: Sequence[Segment] | None = None
    ) -> torch.Tensor:
        """Member `index`'s output for input x [..., in], with each segment's key's delta
        added to its rows (a step of several keys on the shared base weights, segments.py)."""
        if len(self.sizes) == 1:
            return self._compute(x, segments)[0]
        return take(self._held, 0, index, x, lambda: self._compute(x, segments))

    def _compute(
        self, x: torch.Tensor, segments: Sequence[Segment] | None
    ) -> tuple[torch.Tensor, ...]:
        flat = x.reshape(-1, x.shape[-1])
        plain = flat
        if isinstance(self.a, DownPairs):
            flat = native_columns.extend(flat, self.a)
        elif self.a is not None:
            flat = torch.cat([flat, packed.linear(flat, self.a, None)], dim=1)
        if isinstance(self.weight, NativeWeight):
            y = native_linear.linear(flat, self.weight)
        else:
            y = packed.linear(flat, self.weight, self.bias)
        if segments:
            y = add(y, plain, segments)
        lead = x.shape[:-1]
        if len(self.sizes) == 1:
            return (y.view(*lead, y.shape[-1]),)
        return tuple(part.view(*lead, part.shape[-1]) for part in y.split(self.sizes, dim=-1))
