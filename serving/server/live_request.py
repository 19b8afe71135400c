"""What the engine service knows about one submitted request while it is live."""

from __future__ import annotations

import asyncio
import dataclasses
import time

from shiftjax.serving.engine.detokenizer import IncrementalDetokenizer
from shiftjax.serving.server.protocol import GenerationRequest, Usage
from shiftjax.serving.engine.scheduler import Request


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
    detokenizer: IncrementalDetokenizer | None = None
    first_scheduled: float | None = None  # when a step first took it
    first_token: float | None = None
    last_token: float | None = None
    sent: int = 0  # output tokens already streamed
    done: bool = False

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
            preemptions=request.preemptions if request else 0)
