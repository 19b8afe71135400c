"""The threads that tokenize, render chat templates, detokenize and parse request bodies,
so that the event loop both front ends share never does.

On the loop, a 20 MB prompt took 16-18 s to tokenize, and for all that time HTTP
``/health``, gRPC health and every other request's stream stood still (issue 31). In a
worker thread it stalls nothing: the tokenizers library releases the GIL while it encodes
(a 2.2 MB prompt, 1.4 s of encoding, left another thread waking every 10 ms late by at most
40 ms; this 2-core CPU, 2026-12), and the pure-Python work (a chat template, JSON) yields
the GIL to the loop every switch interval (5 ms).

The pool is bounded twice: ``workers`` threads, and at most ``max_pending`` jobs queued or
running, past which a request is refused as :class:`Overloaded` (429 / RESOURCE_EXHAUSTED)
rather than queued behind megabytes of other clients' prompts.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from shiftjax.serving.engine.errors import Overloaded

T = TypeVar("T")

DEFAULT_WORKERS = 2
DEFAULT_MAX_PENDING = 1024  # a burst of 200 concurrent streams must not see 429


class TokenizePool:
    """A bounded :class:`ThreadPoolExecutor` for a front end's CPU work; one may serve both
    front ends (``shiftjax serve`` shares one). Threads start on first use."""

    def __init__(self, workers: int = DEFAULT_WORKERS, max_pending: int = DEFAULT_MAX_PENDING):
        if workers < 1 or max_pending < 1:
            raise ValueError(f"a tokenize pool needs workers >= 1 and max_pending >= 1, got {workers}, {max_pending}")
        self.workers, self.max_pending = workers, max_pending
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="shiftjax-tokenize")
        self._lock = threading.Lock()  # callers may sit on several event loops
        self._pending = 0

    @property
    def pending(self) -> int:
        """Jobs queued or running now."""
        return self._pending

    async def run(self, function: Callable[..., T], *args, **kwargs) -> T:
        """``function(*args, **kwargs)`` on a worker thread, awaited; raises what it raises,
        or :class:`Overloaded` at once when ``max_pending`` jobs are already waiting."""
        with self._lock:
            if self._pending >= self.max_pending:
                raise Overloaded(f"the server is tokenizing {self._pending} requests already; retry later")
            self._pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self._executor, functools.partial(function, *args, **kwargs))
        finally:
            with self._lock:
                self._pending -= 1

    def shutdown(self) -> None:
        """Drops queued jobs and lets the running ones end on their own."""
        self._executor.shutdown(wait=False, cancel_futures=True)
