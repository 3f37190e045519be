"""Large forward_backward bodies decoded, validated and hashed in a separate process.

A worker thread decoding a 64 MB body shares the server's GIL with the event loop: whenever the
operating system takes the core from that thread while it holds the GIL (8-10 ms slices on a
loaded machine), every other tenant's request waits. In a child process the decode holds its
own interpreter's lock. The body goes to the child through shared memory, the child parses it,
checks it against the model (`forward_backward_work`, so every 400 names the same field as
in-process) and hashes it, and writes the work's arrays back into one shared-memory block; the
parent copies that block (NumPy copies, which release the GIL) and slices its arrays out.

The pool is started on the first large body (a server that never gets one starts no process)
and shut down with the server. A child that dies mid-decode fails its request with a 503 the
client retries, never a hang; the next body starts a fresh pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import multiprocessing
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import numpy as np
from starlette.concurrency import run_in_threadpool

from tuneloop.server.api.errors import ApiError
from tuneloop.server.api.validation import decode_limits, forward_backward_work
from tuneloop.server.engine.types import Example, ForwardBackwardWork, ModelSpec
from tuneloop.types import proto
from tuneloop.types.codec import (
    WireFormatError,
    forward_backward_request_from_proto,
    parse_forward_backward_request,
)
from tuneloop.types.datum import Datum
from tuneloop.types.model_input import ModelInput
from tuneloop.types.proto_pieces import last_string_fields
from tuneloop.types.provenance import ProvenanceSpan

# Bodies from this size on are decoded in the child. Below it a worker thread holds the GIL
# for a few ms at most, less than the two shared-memory hand-overs cost.
PROCESS_BYTES = 4 << 20
# One child: the decode is one core's work, and a 2-core server has the loop to run too.
PROCESSES = 1
# NumPy copies this large release the GIL; between pieces the loop may take it.
_COPY_PIECE = 8 << 20

# (datum, input key or "" for the tokens, dtype, shape, byte offset) of each array.
_Layout = list[tuple[int, str, str, tuple[int, ...], int]]
Spans = tuple[tuple[ProvenanceSpan, ...] | None, tuple[ProvenanceSpan, ...] | None]


@dataclass(frozen=True)
class DecodedBody:
    """What the handler needs of a body decoded in the child."""

    work: ForwardBackwardWork
    seq_id: int
    digest: str  # fingerprint(raw): a retry of the same body is recognised
    spans: list[Spans] | None  # per datum, for stable_reinforce only


@dataclass(frozen=True)
class _Answer:
    """The child's answer: small fields by pickle, the arrays in shared memory `block`."""

    adapter_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, float]
    forward_only: bool
    digest: str
    spans: list[Spans] | None
    layout: _Layout
    block: str | None
    block_bytes: int


@dataclass(frozen=True)
class _Refusal:
    status: int
    detail: str
    field: str | None


CUSTOM = "custom"  # a custom loss: its work needs the server's loss store, decoded in-process


_FIELDS = proto.ForwardBackwardRequestProto.DESCRIPTOR.fields_by_name
_MODEL_ID, _LOSS_FN = _FIELDS["model_id"].number, _FIELDS["loss_fn"].number


def routing_fields(raw: bytes) -> tuple[str, str] | None:
    """The body's model_id and loss_fn, read from its framing without parsing it (None: only a
    parse can tell): the handler looks the model up before the child decodes for that model,
    and decodes a custom loss's body on its thread."""
    found = last_string_fields(raw, (_MODEL_ID, _LOSS_FN))
    if found is None or _MODEL_ID not in found:
        return None
    return found[_MODEL_ID], found.get(_LOSS_FN, "")


def _buf(shared: SharedMemory) -> memoryview:
    buf = shared.buf
    assert buf is not None  # None only after close()
    return buf


def _copy(dst: memoryview, src: memoryview) -> None:
    out, inp = np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8)
    for start in range(0, inp.size, _COPY_PIECE):
        np.copyto(out[start : start + _COPY_PIECE], inp[start : start + _COPY_PIECE])
    del out, inp  # no view of a shared block may outlive its close()


def decode_job(
    body_name: str, size: int, spec: ModelSpec, max_request_bytes: int, adapter_id: str
) -> _Answer | _Refusal | str:
    """In the child: the body in shared block `body_name`, decoded into work for `spec`."""
    shared = SharedMemory(body_name)
    try:
        body = bytes(_buf(shared)[:size])
    finally:
        shared.close()
    try:
        msg = parse_forward_backward_request(body)
        limits = decode_limits(spec, max_request_bytes)
        request = forward_backward_request_from_proto(msg, limits, token_arrays=True)
        if request.loss_fn == CUSTOM:
            return CUSTOM
        work = forward_backward_work(request, spec, adapter_id)
    except WireFormatError as exc:
        return _Refusal(400, str(exc), exc.field)
    except ApiError as exc:
        return _Refusal(exc.status, exc.detail, exc.field)
    spans: list[Spans] | None = None
    if request.loss_fn == "stable_reinforce":
        spans = [(d.model_input_spans, d.loss_fn_input_spans) for d in request.data]
    layout: _Layout = []
    arrays: list[np.ndarray] = []
    offset = 0
    for i, example in enumerate(work.examples):
        for key, array in (("", example.tokens), *example.inputs.items()):
            array = np.ascontiguousarray(array)
            layout.append((i, key, array.dtype.str, array.shape, offset))
            arrays.append(array)
            offset += -(-array.nbytes // 8) * 8  # 8-byte aligned
    block: SharedMemory | None = None
    if offset:
        block = SharedMemory(create=True, size=offset)
        for (_, _, _, _, at), array in zip(layout, arrays, strict=True):
            flat = array.reshape(-1).view(np.uint8)
            _buf(block)[at : at + flat.size] = flat.data
        block.close()
    return _Answer(
        adapter_id,
        request.seq_id,
        request.loss_fn,
        dict(work.loss_config),
        work.forward_only,
        hashlib.sha256(body).hexdigest(),
        spans,
        layout,
        block.name if block is not None else None,
        offset,
    )


def _unpack(answer: _Answer) -> DecodedBody:
    """In the parent (a worker thread): the work, its arrays copied out of the child's block."""
    data = bytearray(answer.block_bytes)
    if answer.block is not None:
        block = SharedMemory(answer.block)
        try:
            _copy(memoryview(data), _buf(block)[: answer.block_bytes])
        finally:
            block.close()
            block.unlink()
    tokens: list[np.ndarray] = []
    inputs: list[dict[str, np.ndarray]] = []
    for i, key, dtype_str, shape, at in answer.layout:
        dtype = np.dtype(dtype_str)
        count = int(np.prod(shape, dtype=np.int64))
        array = (
            np.frombuffer(data, dtype, count, at).reshape(shape)
            if count
            else np.empty(shape, dtype)
        )
        if key == "":
            tokens.append(array)
            inputs.append({})
        else:
            inputs[i][key] = array
    examples = tuple(Example(t, x) for t, x in zip(tokens, inputs, strict=True))
    work = ForwardBackwardWork(
        answer.adapter_id, examples, answer.loss_fn, answer.config, answer.forward_only
    )
    return DecodedBody(work, answer.seq_id, answer.digest, answer.spans)


def _free_answer(job: Future[Any]) -> None:
    if job.cancelled() or job.exception() is not None:
        return
    answer = job.result()
    if isinstance(answer, _Answer) and answer.block is not None:
        block = SharedMemory(answer.block)
        block.close()
        block.unlink()


class DecodePool:
    """The server's decoding processes: started lazily, restarted after a death, closed with it."""

    def __init__(self, processes: int = PROCESSES, job: Any = decode_job) -> None:
        self._processes = processes
        self._job = job
        self._lock = threading.Lock()
        self._executor: ProcessPoolExecutor | None = None

    def _pool(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._executor is None:
                # spawn, not fork: the server has threads (database, engine) a fork would copy
                # mid-state, and a fresh interpreter imports only the decoding modules.
                context = multiprocessing.get_context("spawn")
                self._executor = ProcessPoolExecutor(self._processes, mp_context=context)
            return self._executor

    @property
    def started(self) -> bool:
        return self._executor is not None

    def pids(self) -> list[int]:
        """The live decoding processes' ids (none before the first large body)."""
        executor = self._executor
        processes = getattr(executor, "_processes", None) or {}
        return [p.pid for p in processes.values() if p.pid is not None]

    def _discard(self, executor: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._executor is executor:
                self._executor = None
        executor.shutdown(wait=False, cancel_futures=True)

    async def decode(
        self, raw: bytes, spec: ModelSpec, max_request_bytes: int, adapter_id: str
    ) -> DecodedBody | None:
        """The body's work (None for a custom loss's); an ApiError naming the field, or a 503
        to retry."""
        shared = SharedMemory(create=True, size=max(len(raw), 1))
        try:
            await run_in_threadpool(_copy, _buf(shared), memoryview(raw))
            executor = self._pool()
            try:
                job = executor.submit(
                    self._job, shared.name, len(raw), spec, max_request_bytes, adapter_id
                )
                answer = await asyncio.wrap_future(job)
            except asyncio.CancelledError:
                # The client went away mid-decode: the child still answers; free its block.
                job.add_done_callback(_free_answer)
                raise
            except BrokenProcessPool:
                self._discard(executor)
                raise ApiError(
                    503,
                    "body: the process decoding it stopped; send the request again",
                    "body",
                    headers={"retry-after": "1"},
                ) from None
        finally:
            # A request cancelled mid-copy leaves the copying thread a view: the mapping then
            # goes with that view; the name goes now.
            with contextlib.suppress(BufferError):
                shared.close()
            shared.unlink()
        if isinstance(answer, _Refusal):
            raise ApiError(answer.status, answer.detail, answer.field)
        if isinstance(answer, str):
            return None
        return await run_in_threadpool(_unpack, answer)

    def close(self) -> None:
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)


def spans_as_data(spans: Sequence[Spans]) -> list[Datum]:
    """Per datum, a Datum holding only the two span fields `attach_stability` reads."""
    empty = ModelInput.empty()
    return [Datum(empty, {}, model, targets) for model, targets in spans]


__all__ = [
    "CUSTOM",
    "PROCESS_BYTES",
    "DecodePool",
    "DecodedBody",
    "decode_job",
    "routing_fields",
    "spans_as_data",
]
