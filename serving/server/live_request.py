"""What the engine service knows about one submitted request while it is live."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

from shiftjax.serving.engine.output_processor import OutputDelta, OutputProcessor
from shiftjax.serving.engine.scheduler import Request
from shiftjax.serving.server.protocol import Delta, GenerationRequest, TokenLogprob, Usage

log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class LiveRequest:
    """One submitted request as the service tracks it (the engine thread owns the fields
    after ``queue``; the caller's loop only reads the queue)."""

    request: GenerationRequest
    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = dataclasses.field(default_factory=asyncio.Queue)
    submitted: float = dataclasses.field(default_factory=time.monotonic)
    engine_request: Request | None = None
    output: OutputProcessor | None = None  # from admission: its text, stop strings and end
    first_scheduled: float | None = None  # when a step first took it
    first_token: float | None = None
    last_token: float | None = None
    done: bool = False

    @property
    def sent(self) -> int:
        """Output tokens already streamed."""
        return 0 if self.output is None else self.output.sent

    async def stream(self, closed: Callable[[LiveRequest], None]):
        """The request's deltas as the engine thread queues them, ending after the one with a
        finish reason or with the error queued instead; ``closed(self)`` when the stream is
        closed before that (``aclose()``, or the consuming task cancelled)."""
        ended = False
        try:
            while True:
                item = await self.queue.get()
                if isinstance(item, BaseException):
                    ended = True
                    raise item
                if item.finish_reason is not None:
                    ended = True
                yield item
                if ended:
                    return
        finally:
            if not ended:
                closed(self)

    def next_delta(self, request: Request) -> tuple[Delta, OutputDelta]:
        """The delta of the tokens ``request`` (its engine request) gained since the last:
        their text and, when asked, logprobs; and the output's state (its finish and stop
        reasons when these tokens end it)."""
        first = self.sent
        output = self.output.update(request)
        params, new_ids = self.request.params, output.token_ids
        logprobs = ()
        if params.logprobs:
            tops = request.output_top_logprobs[first:] if params.top_logprobs else [()] * len(new_ids)
            logprobs = tuple(TokenLogprob(t, lp, top) for t, lp, top in
                             zip(new_ids, request.output_logprobs[first:], tops))
        return Delta(self.request_id, new_ids, output.text, logprobs), output

    def token_arrivals(self, count: int, now: float) -> list[tuple[bool, float]]:
        """Records ``count`` tokens streamed at ``now``; for each, whether it is the first and
        the seconds since the one before it (since submit, for the first: TTFT)."""
        arrivals = []
        for i in range(count):
            first = self.first_token is None and i == 0
            arrivals.append((first, now - (self.submitted if first else (self.last_token or now))))
        self.first_token = self.first_token or now
        self.last_token = now
        return arrivals

    def past_deadline(self, now: float) -> bool:
        deadline = self.request.deadline
        return deadline is not None and deadline <= now

    def usage(self) -> Usage:
        """Times from submit; ``ttft_seconds`` is 0.0 when no token came (and
        ``queue_seconds`` the whole wait when the request never ran)."""
        now, request = time.monotonic(), self.engine_request
        return Usage(
            prompt_tokens=len(self.request.prompt_ids), output_tokens=self.sent,
            queue_seconds=(self.first_scheduled or now) - self.submitted,
            ttft_seconds=0.0 if self.first_token is None else self.first_token - self.submitted,
            e2e_seconds=now - self.submitted, modes=tuple(request.modes) if request else (),
            preemptions=request.preemptions if request else 0,
            cached_prompt_tokens=request.num_cached_tokens if request else 0)


class Outbox:
    """What one pass of the engine thread sends to the callers' event loops (deltas, or the
    error a stream raises): one ``call_soon_threadsafe`` per loop per pass."""

    def __init__(self):
        self._items: dict[asyncio.AbstractEventLoop, list] = {}

    def put(self, live: LiveRequest, item: Delta | BaseException) -> None:
        self._items.setdefault(live.loop, []).append((live.queue, item))

    def send(self) -> None:
        for loop, items in self._items.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the caller's loop is closed: nobody is listening
                log.warning("an event loop closed with %d deltas undelivered", len(items))


def _deliver(items) -> None:
    for queue, item in items:
        queue.put_nowait(item)
