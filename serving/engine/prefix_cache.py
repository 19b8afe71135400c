"""Automatic prefix caching, as vLLM V1 does it: a request admitted with a prompt whose
leading full pages some earlier request computed shares those pages and starts its
prefill after them.

A full page's block hash chains the hash of the page before it, the page's token ids and
the request's cache key (its ``cache_salt``, hashed: requests of different salts never
share). A page is named by its hash once it is full and its step is committed, so a shared
page is never written: a request writes only from ``num_computed`` on, which is past every
page it shares. The last token of a request is always computed (it gives the logits to
sample from), so at most ``(num_tokens - 1) // page_size`` pages are shared. Pages hold
K/V that both modes read alike (one cache, one PartitionSpec), so a page computed in a TP
step serves an SP step and the other way round.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from shiftjax.serving.engine.errors import InvalidRequest
from shiftjax.serving.engine.page_allocator import PageAllocator, page_hashes

if TYPE_CHECKING:
    from shiftjax.serving.engine.scheduler import Request


def cache_key(cache_salt: str | None) -> bytes:
    """The hash key of requests with this salt (None or "": the shared cache). Any string
    hashes (``surrogatepass``: JSON can carry a lone surrogate, which UTF-8 cannot)."""
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise InvalidRequest("cache_salt", f"must be a string, got {type(cache_salt).__name__}")
    if not cache_salt:
        return b""
    return hashlib.sha256(b"cache_salt\0" + cache_salt.encode("utf-8", "surrogatepass")).digest()


class PrefixCache:
    """The scheduler's side of the cache: which pages a request takes at admission, which
    it names as it commits; the allocator keeps the books (``page_allocator.py``).
    ``queries`` and ``hits`` count prompt tokens at each request's first admission (the one
    that got it its pages, not an attempt that found none)."""

    def __init__(self, allocator: PageAllocator, page_size: int):
        self.allocator = allocator
        self.page_size = page_size
        self.queries = 0
        self.hits = 0

    @property
    def enabled(self) -> bool:
        return self.allocator.caching

    def take(self, request: Request) -> None:
        """Shares the cached pages of ``request``'s longest cached prefix (it holds no pages:
        new, or preempted) and counts them as computed."""
        if not self.enabled:
            return
        shareable = (request.num_tokens - 1) // self.page_size
        self._hash(request, shareable)
        pages = self.allocator.match(request.block_hashes[:shareable])
        request.pages = pages
        request.num_registered = len(pages)  # shared pages are named already
        request.num_computed = len(pages) * self.page_size

    def give_back(self, request: Request) -> None:
        """Undoes :meth:`take` for a request that could not be admitted after all."""
        self.allocator.free(request.pages)
        request.pages = []
        request._page_array = None
        request.num_computed = request.num_registered = 0

    def admitted(self, request: Request) -> None:
        """Counts ``request``'s lookup, at its first admission (a preempted request's return
        is not a query of its own)."""
        if request.prefix_checked:
            return
        request.prefix_checked = True
        request.num_cached_tokens = request.num_computed if self.enabled else 0
        self.queries += len(request.prompt_ids)
        self.hits += request.num_cached_tokens

    def register(self, request: Request) -> None:
        """Names the pages that ``request``'s committed tokens have filled."""
        if not self.enabled:
            return
        full = request.num_computed // self.page_size
        if full <= request.num_registered:
            return
        self._hash(request, full)
        for i in range(request.num_registered, full):
            self.allocator.register(request.pages[i], request.block_hashes[i])
        request.num_registered = full

    def cached_tokens(self, prompt_ids: list[int], key: bytes) -> int:
        """Prompt tokens a request of ``prompt_ids`` would find cached now (a read-only probe:
        the data-parallel router asks every replica)."""
        if not self.enabled:
            return 0
        shareable = (len(prompt_ids) - 1) // self.page_size
        hashes = page_hashes(prompt_ids[:shareable * self.page_size], self.page_size, key)
        return self.allocator.cached_prefix_pages(hashes) * self.page_size

    def forget(self) -> None:
        """The caches were reallocated: no page holds what its name says any more."""
        self.allocator.forget_cached()

    def _hash(self, request: Request, pages: int) -> None:
        """Extends ``request.block_hashes`` to its first ``pages`` full pages (their tokens
        are known: committed, or the prompt)."""
        have = len(request.block_hashes)
        if have < pages:
            parent = request.block_hashes[-1] if have else None
            tokens = request.token_slice(have * self.page_size, (pages - have) * self.page_size)
            request.block_hashes += page_hashes(tokens, self.page_size, request.cache_key, parent)
