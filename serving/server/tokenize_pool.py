"""The threads that tokenize, render chat templates, detokenize and parse request bodies,
so that the event loop both front ends share never does.

On the loop, a 20 MB prompt took 16-18 s to tokenize, and for all that time HTTP
``/health``, gRPC health and every other request's stream stood still. A worker
thread alone is not enough: the tokenizers library's ``encode`` held the GIL for the whole
of an encode from the second call on (a 2.7 MB prompt, 450,000 tokens: the loop stalled
1.16-1.32 s, as long as the encode), and ``decode`` held it too (300,000 ids: 46 ms), while
``encode_batch`` and ``decode_batch`` of one text released it every time (the loop's worst
gap 22-33 ms and 6 ms; tokenizers 0.23.3, this 2-core CPU, 2026-12). So :func:`encode` and
:func:`decode` go through the batch calls. The pure-Python work (a chat template, JSON)
yields the GIL to the loop every switch interval (5 ms).

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


def encode(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """``tokenizer.encode(text, add_special_tokens)``, the same ids, with the GIL released
    while a tokenizers backend works (the module docstring); any other tokenizer's own."""
    batch = getattr(getattr(tokenizer, "backend", None), "encode_batch", None)
    if batch is None or not isinstance(text, str):
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return batch([text], add_special_tokens=add_special_tokens)[0].ids


def decode(tokenizer, ids, skip_special_tokens: bool = True) -> str:
    """``tokenizer.decode(ids, skip_special_tokens)``, with the GIL released likewise."""
    batch = getattr(getattr(tokenizer, "backend", None), "decode_batch", None)
    if batch is None:
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    return batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]
