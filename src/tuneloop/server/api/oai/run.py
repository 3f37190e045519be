"""One OpenAI request's sampling: an engine request per prompt, queued with the server's other
sampling work, with tokens handed over as they are drawn when streaming.

Each prompt is an Operation with a future of the caller's tenant, exactly as asample submits
it: the engine loop batches it with other work, the future table counts it against the in-flight
quota, and the metering hook counts its tokens. A backend that decodes step by step calls the
work's token hook on its engine thread; the hook only schedules the token onto the event loop
(call_soon_threadsafe), where it is detokenized. Its tokens are scheduled before the backend
hands over the finished result, so a result never overtakes its own tokens. Backends that do not
stream (the fake backend, a worker group) deliver the result whole, and it is sent in one piece.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tuneloop.server.api.errors import ApiError
from tuneloop.server.api.oai.params import Plan
from tuneloop.server.api.oai.text import ChoiceText, ModelText
from tuneloop.server.api.revocation import REVOKED
from tuneloop.server.api.state import ServerState
from tuneloop.server.engine.types import SampleResult, SampleWork, TopkRow
from tuneloop.server.scheduler.futures import Outcome
from tuneloop.server.scheduler.queue import Operation

# A future is awaited in holds of this length; the engine answers every request it takes.
HOLD_S = 3600.0


@dataclass
class Finished:
    """A prompt whose request ended: its result, or the error the caller gets."""

    prompt: int
    result: SampleResult | None
    error: ApiError | None = None


def _error(outcome: Outcome) -> ApiError:
    try:
        body = json.loads(outcome.body)
    except ValueError:
        body = {}
    message = str(body.get("error", "sampling failed"))
    category = body.get("category")
    if category == REVOKED:
        return ApiError(401, message, "Authorization")
    return ApiError(400 if category == "user" else 500, message, None)


class Generation:
    def __init__(
        self,
        state: ServerState,
        tenant: str,
        sampler_id: str,
        model: ModelText,
        prompts: Sequence[list[int]],
        plan: Plan,
        max_tokens: Sequence[int],
        stop_ids: tuple[int, ...],
    ) -> None:
        self.state, self.tenant, self.plan = state, tenant, plan
        self.prompts = prompts
        n = plan.n
        self.choices = [
            ChoiceText(model, plan.stop, stop_ids) for _ in range(len(prompts) * plan.n)
        ]
        self.results: list[SampleResult | None] = [None] * len(prompts)
        self.request_ids: list[str] = []
        # One key cancels every prompt's request when the caller goes away (see `cancel`).
        self.cancel_key = f"oai-{secrets.token_hex(12)}"
        self.changed: set[int] = set()  # choices that got tokens since last looked at
        self._wake = asyncio.Event()
        loop = asyncio.get_running_loop()
        self.works = []
        for p, prompt in enumerate(prompts):

            def hook(sample: int, token: int, logprob: float, topk: TopkRow, p: int = p) -> None:
                loop.call_soon_threadsafe(self._on_token, p * n + sample, token, logprob, topk)

            self.works.append(
                SampleWork(
                    sampler_id=sampler_id,
                    prompt=np.asarray(prompt, dtype=np.int64),
                    num_samples=n,
                    max_tokens=max_tokens[p],
                    temperature=plan.temperature,
                    top_k=plan.top_k,
                    top_p=plan.top_p,
                    seed=plan.seed,
                    stop_token_ids=stop_ids,
                    stop_strings=plan.stop,
                    topk_sample_logprobs=plan.logprobs or 0,
                    on_token=hook if plan.stream else None,
                    cancel_key=self.cancel_key,
                )
            )

    def submit(self) -> None:
        """Queue every prompt's request (the caller checked the in-flight quota)."""
        state = self.state
        for p, work in enumerate(self.works):
            request_id = state.futures.create(self.tenant, "Sample")
            state.revocations.track(request_id, self.cancel_key)
            self.request_ids.append(request_id)
            state.queue.submit_sample(
                Operation(request_id, "sample", work, self._finisher(p), tenant=self.tenant)
            )
        state.engine.notify("sample")

    @property
    def finished(self) -> bool:
        return all(result is not None for result in self.results)

    def cancel(self) -> None:
        """The caller went away: its requests still queued or decoding stop at the next step
        instead of running to max_tokens (nobody would read them)."""
        if self.request_ids and not self.finished:
            self.state.engine.cancel_samplers([self.cancel_key])

    def _finisher(self, p: int) -> Any:
        def finish(result: SampleResult) -> Outcome:
            self.results[p] = result
            return Outcome(b"{}", "application/json")

        return finish

    def _on_token(self, choice: int, token: int, logprob: float, topk: TopkRow) -> None:
        self.choices[choice].push(token, logprob, topk)
        self.changed.add(choice)
        self._wake.set()

    async def _wait(self, p: int) -> Finished:
        while True:
            outcome = await self.state.futures.wait(self.request_ids[p], self.tenant, HOLD_S)
            if outcome is not None:
                break
        if outcome.failed:
            return Finished(p, None, _error(outcome))
        result = self.results[p]
        assert result is not None
        for j, sequence in enumerate(result.sequences):  # what was not streamed, if anything
            choice = self.choices[p * self.plan.n + j]
            for i in range(choice.seen, len(sequence.tokens)):
                topk = sequence.topk[i] if sequence.topk is not None else None
                choice.push(sequence.tokens[i], sequence.logprobs[i], topk)
            choice.finish()
        return Finished(p, result)

    async def results_all(self) -> list[Finished]:
        return list(await asyncio.gather(*(self._wait(p) for p in range(len(self.works)))))

    async def events(self) -> AsyncIterator[tuple[set[int], list[Finished]]]:
        """(choices with new tokens, prompts just finished), until every prompt finished."""
        waiting = {asyncio.ensure_future(self._wait(p)) for p in range(len(self.works))}
        try:
            while waiting:
                woken = asyncio.ensure_future(self._wake.wait())
                await asyncio.wait({*waiting, woken}, return_when=asyncio.FIRST_COMPLETED)
                woken.cancel()
                self._wake.clear()
                done = {task for task in waiting if task.done()}
                waiting -= done
                changed, self.changed = self.changed, set()
                yield changed, [task.result() for task in done]
        finally:
            for task in waiting:
                task.cancel()

    def finish_reason(self, choice: int) -> str:
        result = self.results[choice // self.plan.n]
        assert result is not None
        sequence = result.sequences[choice % self.plan.n]
        stopped = sequence.stop_reason == "stop" or self.choices[choice].stopped_at is not None
        return "stop" if stopped else "length"

    def usage_counts(self) -> tuple[int, int]:
        """(prompt tokens, generated tokens): what metering counts for these requests."""
        generated = sum(len(s.tokens) for r in self.results if r is not None for s in r.sequences)
        return sum(len(p) for p in self.prompts), generated
