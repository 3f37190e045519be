"""The decode step replayed as a CUDA graph, one per bucket of rows, context width and adapters.

On a GPU an eager decode step is bound by the host issuing its kernels, not by the device: an
8B Qwen3 at 128 rows issues ~3,000 small kernels a step and kept the device busy 15 % of it
(docs/benchmarks.md). A CUDA graph records the step's kernels once and replays them with one
launch, as vLLM and nano-vllm do for batch-size buckets. Here a graph is one whole step of
decode rows: the transformer body under the paged attention and the rows' LoRA routing, then
the LM head; its inputs are static tensors (token ids, positions, the slot each new key and
value goes to, each row's slots and mask) that a step fills before the replay.

Shapes are fixed per graph, so a step is padded to its bucket: rows to the next of
`ROW_BUCKETS` (pad rows read token 0 at position 0, write their keys to the pool's scratch
slot, attend to its zero pad slot alone, and their logits are dropped: whatever a pad row
computes, a broken adapter's NaN included, no other row reads), the context width to a bucket
at most a quarter above it (`width_bucket`; masked pad slots, as the eager step pads to its
longest row). Pad rows use the last row's adapter, so the adapter layout of a bucket is the
step's with its last segment longer. A graph is made the first time its (rows, width,
layout) is seen: one eager run outside the graph (caches of cast and stacked factors are built
there, not captured), then the capture. At most `MAX_GRAPHS` are kept, sharing one memory pool.

Only steps whose rows all decode run as graphs (a step with prompt chunks runs eagerly), and
only where the step needs no host-side decision inside the forward: dense models (mixture-of-
experts layers route tokens with host-read counts), no lone-key weight copies (those are the
CPU's), no flash-attn block tables; sharded ranks (their forward gathers the shards with
collectives) never ask for graphs. A graph reads its adapters' factors as cast when it was
made, so it is kept across sampling calls only while each of its keys' factors are the same
(`AdapterBank.version`: a sampler made again under its id, or loaded, makes a new graph), and
rows of a trainable adapter (its factors change in place at every optimizer step) run eagerly.

`capture=False` runs the same padded static step eagerly (a CPU has no graphs): the tests check
with it that padding rows and widths leaves the real rows' tokens and logprobs as they were.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tuneloop.server.engine import compiled
from tuneloop.server.engine.lora import Routing

if TYPE_CHECKING:
    from collections.abc import Sequence

    from tuneloop.server.engine.model_runner import ModelRunner, Scheduled

__all__ = ["MAX_GRAPHS", "ROW_BUCKETS", "DecodeGraphs", "StaticStep", "width_bucket"]

log = logging.getLogger(__name__)

# Rows of a graph: a step of D rows runs in the smallest bucket >= D (vLLM's spacing: every
# size up to 4, then multiples of 8, then of 16 and 32); more rows run eagerly.
ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256)
# The widest context a graph gathers; a longer one runs eagerly (the reference decode gathers
# every row's slots to the longest context, which no graph makes cheaper).
MAX_WIDTH = 8192
# Graphs kept at once (each holds its static inputs and its logits; the pool is shared).
MAX_GRAPHS = 16
# Config fields of mixture-of-experts models, whose routing reads counts on the host.
_EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")


def width_bucket(width: int) -> int:
    """The padded context width: 64 and below to 64, else up to a multiple of an eighth of
    the next power of two (at most 25 % over, four buckets per doubling)."""
    if width <= 64:
        return 64
    step = (1 << (width - 1).bit_length()) // 8
    return -(-width // step) * step


def row_bucket(rows: int) -> int | None:
    """The smallest row bucket that holds `rows`, or None when none does."""
    at = bisect.bisect_left(ROW_BUCKETS, rows)
    return ROW_BUCKETS[at] if at < len(ROW_BUCKETS) else None


@dataclass
class StaticStep:
    """One graph's static inputs, routings and (once captured) graph and logits."""

    rows: int
    width: int
    ids: torch.Tensor  # [1, rows] long
    positions: torch.Tensor  # [1, rows] long
    slot_mapping: torch.Tensor  # [rows] long
    decode_slots: torch.Tensor  # [rows, width] long
    decode_mask: torch.Tensor  # [rows, 1, 1, width] bool
    body: Routing
    head: Routing
    versions: tuple[int | None, ...]  # its keys' AdapterBank.version when it was made
    graph: Any = None  # torch.cuda.CUDAGraph once captured
    logits: torch.Tensor | None = None  # the graph's output, [rows, V] fp32


class DecodeGraphs:
    """The runner's decode-step graphs (see the module docstring)."""

    def __init__(self, runner: ModelRunner, *, capture: bool = True) -> None:
        self.runner = runner
        self.capture = capture
        self._steps: dict[tuple[Any, ...], StaticStep] = {}
        self._pool: Any = None  # torch.cuda graph memory pool, made with the first graph
        self.disabled = False  # a capture failed: every step runs eagerly from then on
        self.captured = 0  # graphs captured (tests and benches read it)
        self.replayed = 0  # steps run through a static step

    def __len__(self) -> int:
        return len(self._steps)

    def _supported(self) -> bool:
        runner = self.runner
        config = getattr(runner.model, "config", None)
        experts = any(getattr(config, name, None) for name in _EXPERT_FIELDS)
        return not (
            self.disabled
            or experts
            or runner.kernel
            or runner.decode_kernel is not None
            or runner.lone_weights is not None
        )

    def run(self, work: Sequence[Scheduled]) -> torch.Tensor | None:
        """The step's logits [len(work), V] through its bucket's graph, or None where the step
        must run eagerly (prompt chunks in it, too many rows or too wide, unsupported)."""
        if not work or not all(i.length == 1 and i.wants_logits for i in work):
            return None
        if not self._supported():
            return None
        rows = row_bucket(len(work))
        contexts = np.array([i.seq.computed + 1 for i in work], dtype=np.int64)
        width = width_bucket(int(contexts.max()))
        if rows is None or width > MAX_WIDTH:
            return None
        keys = [i.seq.key for i in work]
        keys += [keys[-1]] * (rows - len(work))
        layout = tuple(Routing.from_lengths(keys, [1] * rows).runs)
        versions = tuple(self.runner.bank.version(key) for key in dict.fromkeys(keys))
        if None in versions:
            return None  # a trainable adapter's rows
        cache_key = (rows, width, layout)
        static = self._steps.pop(cache_key, None)
        if static is None or static.versions != versions:
            static = self._new(rows, width, keys, versions)
        self._steps[cache_key] = static  # most recently used last
        while len(self._steps) > MAX_GRAPHS:
            del self._steps[next(iter(self._steps))]
        self._fill(static, work, contexts)
        if self.capture and static.graph is None and not self._record(static):
            self._steps.pop(cache_key, None)
            return None  # the step runs eagerly; its keys were written by the same inputs
        if self.capture:
            static.graph.replay()
            assert static.logits is not None
            logits = static.logits
        else:
            logits = self.runner.forward_static(static)
        runner = self.runner
        for item in work:
            item.seq.computed += 1
        runner.forwards += 1
        runner.tokens += len(work)
        self.replayed += 1
        # A copy: the next replay writes the graph's output again while this step's rows may
        # still be read.
        return logits[: len(work)].clone()

    def _new(
        self, rows: int, width: int, keys: list[str | None], versions: tuple[int | None, ...]
    ) -> StaticStep:
        device = self.runner.device

        def zeros(*shape: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        def routing() -> Routing:
            made = Routing.from_lengths(keys, [1] * rows)
            made.steps = True
            return made

        return StaticStep(
            rows,
            width,
            zeros(1, rows),
            zeros(1, rows),
            zeros(rows),
            zeros(rows, width),
            zeros(rows, 1, 1, width, dtype=torch.bool),
            routing(),
            routing(),
            versions,
        )

    def _fill(self, static: StaticStep, work: Sequence[Scheduled], contexts: np.ndarray) -> None:
        """Copy the step's rows into the static inputs; pad rows after them."""
        pool = self.runner.pool
        count, rows, width = len(work), static.rows, static.width
        ids = np.zeros(rows, dtype=np.int64)
        positions = np.zeros(rows, dtype=np.int64)
        for row, item in enumerate(work):
            ids[row], positions[row] = item.seq.tokens[item.seq.computed], item.seq.computed
        # Pad rows read the zero pad slot alone (no empty softmax) and write the scratch slot.
        slots = np.full((rows, width), pool.pad_slot, dtype=np.int64)
        mask = np.zeros((rows, width), dtype=bool)
        mask[count:, 0] = True
        slots[:count], mask[:count] = self.runner.decode_layout(
            [i.seq for i in work], contexts, width
        )
        new_slots = np.full(rows, pool.scratch_slot, dtype=np.int64)
        new_slots[:count] = slots[np.arange(count), contexts - 1]  # each row's new position
        static.ids.copy_(torch.from_numpy(ids)[None])
        static.positions.copy_(torch.from_numpy(positions)[None])
        static.slot_mapping.copy_(torch.from_numpy(new_slots))
        static.decode_slots.copy_(torch.from_numpy(slots))
        static.decode_mask.copy_(torch.from_numpy(mask)[:, None, None, :])

    def _record(self, static: StaticStep) -> bool:
        """Warm up and capture `static`'s graph; False (graphs off from now on) if it fails."""
        runner = self.runner
        try:
            current = torch.cuda.current_stream(runner.device)
            side = torch.cuda.Stream(runner.device)
            side.wait_stream(current)
            # Compiled norms (compiled.py) run their kernels here, and compile any graph they
            # lack in the warm-up, before the capture.
            with compiled.graph_capture():
                with torch.cuda.stream(side):  # caches built here, outside the graph
                    runner.forward_static(static)
                current.wait_stream(side)
                if self._pool is None:
                    self._pool = torch.cuda.graph_pool_handle()
                graph = torch.cuda.CUDAGraph()
                # thread_local: CUDA calls of other threads (none in a step) do not spoil it
                with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                    static.logits = runner.forward_static(static)
        except Exception as exc:  # any capture failure: eager from now on
            self.disabled = True
            log.warning(
                "decode step not captured as a CUDA graph (%s: %s); decoding eagerly",
                type(exc).__name__,
                exc,
            )
            return False
        static.graph = graph
        self.captured += 1
        log.info(
            "captured the decode step of %d rows, width %d (%d graphs)",
            static.rows,
            static.width,
            len(self._steps),
        )
        return True
