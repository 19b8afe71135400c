"""The page allocator's books with the prefix cache: references, free and cached pages,
LRU eviction and block hashes."""

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from shiftjax.serving.engine.page_allocator import OutOfPages, PageAllocator, page_hashes


def test_hashes_chain_the_prefix_and_the_key():
    a = page_hashes([1, 2, 3, 4, 5, 6, 7], page_size=2)
    assert len(a) == 3  # the partial last page has no hash
    b = page_hashes([1, 2, 3, 4, 9, 9], page_size=2)
    assert a[:2] == b[:2] and a[2] != b[2]
    assert page_hashes([3, 4], page_size=2) != a[1:2]  # the same block after another prefix
    assert page_hashes([1, 2], page_size=2, key=b"tenant") != a[:1]
    assert page_hashes([1, 2, 3, 4, 5, 6], 2, parent=a[0], first_page=1) == a[1:3]


def test_cached_pages_are_shared_then_evicted_least_recently_used_first():
    allocator = PageAllocator(6, caching=True)
    first = allocator.allocate(2)
    hashes = page_hashes([1, 2, 3, 4], page_size=2)
    assert all(allocator.register(page, h) for page, h in zip(first, hashes))
    assert not allocator.register(allocator.allocate(1)[0], hashes[0])  # that block is named already
    allocator.free(first)  # the last page queued for eviction first
    assert allocator.num_free == 4 and allocator.num_cached == 2
    assert allocator.match(hashes) == first  # shared again, taken off the eviction queue
    allocator.free(first)
    allocator.check()
    # free pages go first; then the cached ones, the request's tail first
    taken = allocator.allocate(3)
    assert first[1] in taken and first[0] not in taken and allocator.num_evicted == 1
    assert allocator.match(hashes) == [first[0]]  # the chain stops at the evicted page
    allocator.check()


def test_a_page_freed_twice_is_an_error_and_out_of_pages_says_so():
    allocator = PageAllocator(3, caching=True)
    pages = allocator.allocate(2)
    with pytest.raises(OutOfPages):
        allocator.allocate(1)
    allocator.free(pages)
    with pytest.raises(RuntimeError, match="freed more often"):
        allocator.free(pages[:1])


def test_without_caching_nothing_is_named():
    allocator = PageAllocator(4)
    [page] = allocator.allocate(1)
    assert not allocator.register(page, b"x") and allocator.match([b"x"]) == []


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["take", "share", "free", "forget"]), st.integers(0, 7),
                          st.integers(1, 3)), max_size=60))
def test_books_balance_under_any_sequence(operations):
    """References never negative, no page both free and referenced, every page back when
    every holder has let go (the property the engine relies on)."""
    allocator = PageAllocator(9, caching=True)
    holders: list[list[int]] = []
    for op, prefix, count in operations:
        hashes = page_hashes(list(range(prefix, prefix + 2 * count)), page_size=2)
        if op == "take" and count <= allocator.num_free:
            pages = allocator.allocate(count)
            for page, h in zip(pages, hashes):
                allocator.register(page, h)
            holders.append(pages)
        elif op == "share":
            holders.append(allocator.match(hashes))
        elif op == "free" and holders:
            allocator.free(holders.pop(prefix % len(holders)))
        elif op == "forget":
            allocator.forget_cached()
        allocator.check()
    for pages in holders:
        allocator.free(pages)
    allocator.check()
    assert allocator.num_free == 8
