import pytest

from jax_llm_runtime.runtime.engine.page_allocator import OutOfPagesError, PageAllocator, page_hash


def test_allocate_and_free_round_trip():
    alloc = PageAllocator(num_pages=4, page_size=16)
    pages = alloc.allocate(3)
    assert len(set(pages)) == 3 and alloc.num_free == 1
    assert all(alloc.ref_count(p) == 1 for p in pages)
    alloc.free(pages)
    assert alloc.num_free == 4
    assert sorted(alloc.allocate(4)) == [0, 1, 2, 3]


def test_out_of_pages_is_an_error_and_changes_nothing():
    alloc = PageAllocator(num_pages=2, page_size=16)
    alloc.allocate(1)
    assert not alloc.can_allocate(2)
    with pytest.raises(OutOfPagesError):
        alloc.allocate(2)
    assert alloc.num_free == 1


def test_shared_page_returns_only_after_last_reference():
    alloc = PageAllocator(num_pages=2, page_size=16)
    (page,) = alloc.allocate(1)
    alloc.share(page)
    alloc.free([page])
    assert alloc.num_free == 1 and alloc.ref_count(page) == 1
    alloc.free([page])
    assert alloc.num_free == 2


def test_double_free_and_sharing_a_free_page_are_errors():
    alloc = PageAllocator(num_pages=2, page_size=16)
    (page,) = alloc.allocate(1)
    alloc.free([page])
    with pytest.raises(ValueError):
        alloc.free([page])
    with pytest.raises(ValueError):
        alloc.share(page)


def test_prefix_hash_chains_the_parent():
    h1 = page_hash(None, [1, 2, 3])
    assert h1 == page_hash(None, [1, 2, 3])
    assert h1 != page_hash(None, [1, 2, 4])
    assert page_hash(h1, [4]) != page_hash(page_hash(None, [9]), [4]), "hash must chain the parent"


def test_freed_page_stays_cached_until_handed_out_again():
    alloc = PageAllocator(num_pages=2, page_size=3)
    (page,) = alloc.allocate(1)
    digest = page_hash(None, [1, 2, 3])
    alloc.register_full_page(page, digest)
    alloc.free([page])
    assert alloc.num_free == 2 and alloc.num_cached == 1
    assert alloc.lookup(digest) == page, "a freed page keeps its prefix until it is reused"
    alloc.share(page)  # taken back from the free list by a sequence with the same prefix
    assert alloc.ref_count(page) == 1 and alloc.num_free == 1
    alloc.free([page])
    alloc.allocate(2)  # evicts it: its old contents are about to be overwritten
    assert alloc.lookup(digest) is None and alloc.num_cached == 0


def test_eviction_takes_the_least_recently_freed_page_first():
    alloc = PageAllocator(num_pages=3, page_size=1)
    pages = alloc.allocate(3)
    digests = [page_hash(None, [i]) for i in range(3)]
    for page, digest in zip(pages, digests, strict=True):
        alloc.register_full_page(page, digest)
    alloc.free([pages[2], pages[0], pages[1]])
    assert alloc.allocate(1) == [pages[2]]
    assert alloc.lookup(digests[2]) is None
    assert alloc.lookup(digests[0]) == pages[0] and alloc.lookup(digests[1]) == pages[1]


def test_sharing_an_unregistered_free_page_is_an_error():
    alloc = PageAllocator(num_pages=1, page_size=1)
    (page,) = alloc.allocate(1)
    alloc.free([page])
    with pytest.raises(ValueError):
        alloc.share(page)
