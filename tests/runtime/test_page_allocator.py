import pytest

from runtime.page_allocator import OutOfPagesError, PageAllocator, page_hash


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


def test_prefix_hash_chains_and_lookup_forgets_reused_pages():
    h1 = page_hash(None, [1, 2, 3])
    assert h1 == page_hash(None, [1, 2, 3])
    assert page_hash(h1, [4]) != page_hash(page_hash(None, [9]), [4]), "hash must chain the parent"
    alloc = PageAllocator(num_pages=1, page_size=3)
    (page,) = alloc.allocate(1)
    alloc.register_full_page(page, h1)
    assert alloc.lookup(h1) == page
    alloc.free([page])
    assert alloc.lookup(h1) is None, "a freed page is not handed out as a cached prefix"
    alloc.allocate(1)
    assert alloc.lookup(h1) is None
