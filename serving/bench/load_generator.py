"""Sends a workload to a server on its schedule and records every request.

Each request waits for its send time (from the arrival process or the trace), then, with
``max_concurrency``, for a free slot, and then streams through the backend. The time a
slot took is kept apart (``sent_at - scheduled_at``), so a capped run can be read
honestly: its TTFT starts at send, as vLLM's does, not at the scheduled arrival.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from typing import Protocol

from tqdm import tqdm

from shiftjax.serving.bench.metrics import RequestRecord
from shiftjax.serving.bench.workloads import WorkloadRequest


class Backend(Protocol):
    name: str

    async def generate(self, record: RequestRecord, prompt_ids: list[int], clock=time.perf_counter) -> None:
        """Streams one request, filling ``record`` (success, error, TTFT, ITL, E2EL, tokens,
        modes). Never raises for a failed request; the record says what failed."""
        ...

    async def server_info(self) -> dict: ...


async def run_load(
    backend: Backend,
    requests: list[WorkloadRequest],
    prompts: list[list[int]],
    send_offsets: list[float],
    *,
    max_concurrency: int | None = None,
    progress: bool = True,
    clock=time.perf_counter,
) -> tuple[list[RequestRecord], float]:
    """Runs every request and returns their records (in request order) and the run's
    duration in seconds: from the start to the last completion."""
    if not len(requests) == len(prompts) == len(send_offsets):
        raise ValueError("requests, prompts and send offsets must have one entry per request")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {max_concurrency}")
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    bar = tqdm(total=len(requests), file=sys.stderr, disable=not progress, unit="req", dynamic_ncols=True)
    start = clock()

    async def send(index: int) -> RequestRecord:
        request = requests[index]
        record = RequestRecord(index=index, prompt_len=request.prompt_len, output_len=request.output_len,
                               scheduled_at=float(send_offsets[index]))
        delay = start + record.scheduled_at - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        async with slots:
            record.sent_at = clock() - start
            try:
                await backend.generate(record, prompts[index], clock)
            except Exception as error:  # a backend bug fails this request, not the run
                record.success = False
                record.error = f"{type(error).__name__}: {error}"
        bar.update(1)
        return record

    try:
        records = await asyncio.gather(*(send(i) for i in range(len(requests))))
    finally:
        bar.close()
    return list(records), clock() - start
