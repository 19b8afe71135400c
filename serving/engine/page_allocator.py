"""The paged block allocator: a free list of cache pages; page 0 is the scratch page."""

from __future__ import annotations


class OutOfPages(Exception):
    """Raised when a request needs more pages than are free; the caller preempts."""


class PageAllocator:
    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be at least 2 (page 0 is scratch), got {num_pages}")
        self.num_pages = num_pages
        # Pages are handed out lowest first, which keeps tests readable; page 0 never.
        self._free = list(range(num_pages - 1, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def utilisation(self) -> float:
        return 1.0 - self.num_free / (self.num_pages - 1)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise OutOfPages(f"{count} pages wanted, {len(self._free)} free")
        return [self._free.pop() for _ in range(count)]

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))
