"""Sends a workload to a server on its schedule and records every request.

Each request waits for its send time (from the arrival process or the trace), then, with
``max_concurrency``, for a free slot, and then streams through the backend. The time a
slot took is kept apart (``sent_at - scheduled_at``), so a capped run can be read
honestly: its TTFT starts at send, as vLLM's does, not at the scheduled arrival.

A request that follows another (a conversation's next turn) waits for it instead of a send
time: its prompt is the earlier prompt as sent, the answer's token ids the server returned,
then its own message; it is scheduled when the earlier one finishes, and fails unsent if
that one failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import sys
import time
from typing import Protocol

from tqdm import tqdm

from shiftjax.serving.bench.metrics import RequestRecord
from shiftjax.serving.bench.workloads import WorkloadRequest


class Backend(Protocol):
    name: str

    async def generate(self, record: RequestRecord, prompt_ids: list[int], clock=time.perf_counter, *,
                       keep_output_ids: bool = False) -> None:
        """Streams one request, filling ``record`` (success, error, TTFT, ITL, E2EL, tokens,
        modes, cached tokens; the answer's ids with ``keep_output_ids``). Never raises for a
        failed request; the record says what failed."""
        ...

    async def server_info(self) -> dict: ...


@dataclasses.dataclass
class LoadRun:
    records: list[RequestRecord]  # in request order
    duration_s: float  # from the start to the last completion
    prompts: list[list[int]]  # as sent: a later turn's whole prompt, not only its message
    sent_order: list[int]  # the indices of the requests sent, in the order they went out


async def run_load(
    backend: Backend,
    requests: list[WorkloadRequest],
    prompts: list[list[int]],
    send_offsets: list[float],
    *,
    max_concurrency: int | None = None,
    progress: bool = True,
    clock=time.perf_counter,
) -> LoadRun:
    """Runs every request. ``prompts[i]`` of a request that follows another is only what
    it adds after the earlier prompt and answer; its send offset is not used."""
    if not len(requests) == len(prompts) == len(send_offsets):
        raise ValueError("requests, prompts and send offsets must have one entry per request")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {max_concurrency}")
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    followed = {r.previous for r in requests if r.previous is not None}
    finished = {index: asyncio.Event() for index in followed}
    records = [RequestRecord(index=i, prompt_len=r.prompt_len, output_len=r.output_len,
                             scheduled_at=float(send_offsets[i]), conversation=r.conversation, turn=r.turn)
               for i, r in enumerate(requests)]
    sent, sent_order = list(prompts), []
    bar = tqdm(total=len(requests), file=sys.stderr, disable=not progress, unit="req", dynamic_ncols=True)
    start = clock()

    async def send(index: int) -> None:
        request, record = requests[index], records[index]
        if request.previous is None:
            delay = start + record.scheduled_at - clock()
            if delay > 0:
                await asyncio.sleep(delay)
        else:
            await finished[request.previous].wait()
            before = records[request.previous]
            record.scheduled_at = clock() - start
            if not before.success:
                record.error = f"not sent: the request it follows ({before.index}) failed"
                return
            sent[index] = sent[request.previous] + before.output_ids + list(prompts[index])
            record.prompt_len = len(sent[index])
        async with slots:
            record.sent_at = clock() - start
            sent_order.append(index)
            try:
                await backend.generate(record, sent[index], clock, keep_output_ids=index in followed)
            except Exception as error:  # a backend bug fails this request, not the run
                record.success = False
                record.error = f"{type(error).__name__}: {error}"

    async def send_and_count(index: int) -> None:
        try:
            await send(index)
        finally:  # a later turn waits on this one whatever happened to it
            if index in finished:
                finished[index].set()
            bar.update(1)

    try:
        await asyncio.gather(*(send_and_count(i) for i in range(len(requests))))
    finally:
        bar.close()
    return LoadRun(records, clock() - start, sent, sent_order)
