"""The service streams behind one HTTP request, merged, and closed when the client leaves.

One ``/v1/completions`` request may carry several prompts; each is its own engine
request and stream. :class:`PromptStreams` interleaves their deltas as they arrive,
keeps each prompt's totals, and stops the moment the client disconnects, whether the
response is streamed or not: uvicorn does not cancel a plain (non-streamed) handler when
its client goes, so a disconnect watcher runs beside the streams in both cases.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator

import anyio

from shiftjax.serving.engine.errors import RequestFailed
from shiftjax.serving.server.protocol import FINISH_ERROR, Delta, TokenLogprob, Usage

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Totals:
    """What one prompt's stream has produced so far."""

    prompt_tokens: int
    text_parts: list[str] = dataclasses.field(default_factory=list)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    usage: Usage | None = None

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    @property
    def output_tokens(self) -> int:
        return self.usage.output_tokens if self.usage is not None else len(self.token_ids)

    def add(self, delta: Delta) -> None:
        self.text_parts.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
        if delta.usage is not None:
            self.usage = delta.usage
            self.prompt_tokens = delta.usage.prompt_tokens


class PromptStreams:
    """The streams of one HTTP request's prompts, ``request_ids[i]`` for prompt ``i``."""

    def __init__(self, service, request_ids: list[str]):
        self.service = service
        self.request_ids = request_ids
        self.streams: list[AsyncIterator[Delta]] = []
        self.totals: list[Totals] = []
        self.client_gone = False

    def add(self, stream: AsyncIterator[Delta], prompt_tokens: int) -> None:
        self.streams.append(stream)
        self.totals.append(Totals(prompt_tokens))

    def _unfinished(self) -> list[int]:
        return [i for i, t in enumerate(self.totals) if t.finish_reason is None]

    def cancel_all(self) -> None:
        """Cancels every unfinished request now (synchronous, so it happens even inside a
        task that is being cancelled); the service frees their pages."""
        for i in self._unfinished():
            try:
                self.service.cancel(self.request_ids[i])
            except Exception:  # freeing the others matters more than this one's error
                log.exception("cancelling %s failed", self.request_ids[i])

    async def deltas(self, request) -> AsyncIterator[tuple[int, Delta]]:
        """``(prompt index, delta)`` in arrival order until every stream ends or the client
        disconnects (then it just stops, ``client_gone`` set). A delta finishing with
        ``"error"`` raises :class:`RequestFailed`; every unfinished request is cancelled
        and every stream closed on the way out, however it is left."""
        disconnect = asyncio.ensure_future(_disconnected(request))
        pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(self.streams)}
        try:
            while pending:
                done, _ = await asyncio.wait([*pending, disconnect], return_when=asyncio.FIRST_COMPLETED)
                if disconnect in done:
                    self.client_gone = True
                    return
                for future in sorted(done, key=pending.get):
                    index = pending.pop(future)
                    try:
                        delta = future.result()
                    except StopAsyncIteration:
                        continue
                    self.totals[index].add(delta)
                    if delta.finish_reason == FINISH_ERROR:
                        raise RequestFailed(f"request {self.request_ids[index]} failed inside the engine "
                                            "(the server logged why); the server goes on")
                    if delta.finish_reason is None:
                        pending[asyncio.ensure_future(anext(self.streams[index]))] = index
                    yield index, delta
        finally:
            disconnect.cancel()
            self.cancel_all()
            for future in pending:
                future.cancel()
            # shielded: when the client left, the surrounding scope is cancelled, and the
            # streams must still be closed (the pages were freed by cancel_all already)
            with anyio.CancelScope(shield=True):
                await asyncio.gather(*pending, return_exceptions=True)
                for stream in self.streams:
                    aclose = getattr(stream, "aclose", None)
                    if aclose is not None:
                        try:
                            await aclose()
                        except Exception:
                            log.exception("closing a service stream failed")

    async def collect(self, request) -> list[Totals]:
        """Runs every stream to its end (or until the client leaves); the totals."""
        async for _ in self.deltas(request):
            pass
        return self.totals


async def _disconnected(request) -> None:
    """Returns when the client disconnects. The body has been read, so the server's
    ``receive`` now waits for nothing but the disconnect (uvicorn, httpx's ASGI transport)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
