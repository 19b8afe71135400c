"""The paged block allocator: cache pages with reference counts, and the prefix cache.

Page 0 is the scratch page and is never handed out. A page is in exactly one of three
states: referenced (by one request, or by several that share a cached prompt prefix),
free (no content anyone can name), or cached (no reference, but its full and committed
K/V are named by a block hash and can be taken again). Allocation takes free pages first
and then evicts cached ones, least recently used first (vLLM V1's prefix cache), so a
cached page is only lost when no free page is left.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence

import numpy as np


class OutOfPages(Exception):
    """Raised when a request needs more pages than are free; the caller preempts."""


def page_hashes(tokens: Sequence[int], page_size: int, key: bytes = b"",
                parent: bytes | None = None, first_page: int = 0) -> list[bytes]:
    """The block hashes of the full pages of ``tokens`` from page ``first_page`` on: each
    chains the hash before it (``parent``, the hash of page ``first_page - 1``), the page's
    token ids and ``key`` (everything else that changes K/V or must not share it: the
    request's cache salt). SHA-256, so that every process of a mesh computes the same
    hashes and no one can make two prompts collide."""
    hashes, previous = [], parent or b""
    for start in range(first_page * page_size, len(tokens) - page_size + 1, page_size):
        block = np.asarray(tokens[start:start + page_size], np.int64).tobytes()
        previous = hashlib.sha256(previous + block + key).digest()
        hashes.append(previous)
    return hashes


class PageAllocator:
    def __init__(self, num_pages: int, caching: bool = False):
        if num_pages < 2:
            raise ValueError(f"num_pages must be at least 2 (page 0 is scratch), got {num_pages}")
        self.num_pages = num_pages
        self.caching = caching
        # Pages are handed out lowest first, which keeps tests readable; page 0 never.
        self._free = list(range(num_pages - 1, 0, -1))
        self._refs = [0] * num_pages
        self._page_of_hash: dict[bytes, int] = {}
        self._hash_of_page: dict[int, bytes] = {}
        self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self.num_evicted = 0

    @property
    def num_free(self) -> int:
        """Pages an allocation can take: free ones and cached ones without a reference."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Pages whose K/V a block hash names (referenced or not)."""
        return len(self._hash_of_page)

    def allocate(self, count: int) -> list[int]:
        """``count`` pages, each with one reference, none of them named by a hash."""
        if count > self.num_free:
            raise OutOfPages(f"{count} pages wanted, {self.num_free} free")
        pages = []
        for _ in range(count):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._cached.popitem(last=False)
                del self._page_of_hash[self._hash_of_page.pop(page)]
                self.num_evicted += 1
            self._refs[page] = 1
            pages.append(page)
        return pages

    def free(self, pages: list[int]) -> None:
        """Drops one reference to each page. A page left without one becomes free, or cached
        if a hash names it; a request's last pages are queued for eviction first (they are
        the least likely to be another prompt's prefix)."""
        for page in reversed(pages):
            refs = self._refs[page] - 1
            if refs < 0:
                raise RuntimeError(f"page {page} freed more often than it was taken")
            self._refs[page] = refs
            if refs == 0:
                if page in self._hash_of_page:
                    self._cached[page] = None
                else:
                    self._free.append(page)

    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """The cached pages of the longest prefix of ``hashes``, each with a reference taken."""
        pages = []
        for block_hash in hashes:
            page = self._page_of_hash.get(block_hash)
            if page is None:
                break
            pages.append(page)
        for page in pages:
            if self._refs[page] == 0:
                del self._cached[page]
            self._refs[page] += 1
        return pages

    def cached_prefix_pages(self, hashes: Sequence[bytes]) -> int:
        """How many leading ``hashes`` are cached (a read-only probe, for routing)."""
        count = 0
        for block_hash in hashes:
            if block_hash not in self._page_of_hash:
                break
            count += 1
        return count

    def register(self, page: int, block_hash: bytes) -> bool:
        """Names a full, committed, referenced page by its hash, so that later prompts can
        share it; False (nothing named) when another page already holds that block (two
        requests computed it at once) or caching is off."""
        if not self.caching or block_hash in self._page_of_hash:
            return False
        if self._refs[page] < 1 or page in self._hash_of_page:
            raise RuntimeError(f"page {page} cannot be named: {self._refs[page]} references")
        self._page_of_hash[block_hash] = page
        self._hash_of_page[page] = block_hash
        return True

    def forget_cached(self) -> None:
        """Unnames every page (the cache's contents were lost, or are being dropped)."""
        self._free.extend(sorted(self._cached, reverse=True))
        self._cached.clear()
        self._page_of_hash.clear()
        self._hash_of_page.clear()

    def check(self) -> None:
        """Raises if the books disagree (tests): every page but 0 exactly once referenced,
        free or cached; names one-to-one; no reference negative."""
        free, cached = set(self._free), set(self._cached)
        referenced = {p for p in range(1, self.num_pages) if self._refs[p] > 0}
        if len(free) != len(self._free) or free & cached or (free | cached) & referenced:
            raise AssertionError("a page is in two states")
        if free | cached | referenced != set(range(1, self.num_pages)) or self._refs[0] != 0:
            raise AssertionError("a page is lost or page 0 was handed out")
        if any(r < 0 for r in self._refs) or not cached <= set(self._hash_of_page):
            raise AssertionError("a negative reference count, or a cached page without a name")
        if {p: h for h, p in self._page_of_hash.items()} != self._hash_of_page:
            raise AssertionError("hash names are not one-to-one")
