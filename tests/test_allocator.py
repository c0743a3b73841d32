"""PageAllocator and as_page_ids: batched O(k) alloc/free, double/foreign/duplicate frees,
all-or-nothing validation, and a state machine against a set model."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hicache_jax.errors import HiCacheError, OutOfPagesError
from hicache_jax.memory.allocator import PageAllocator
from hicache_jax.validation import as_page_ids


def snapshot(a: PageAllocator):
    return a.num_free, a.is_allocated(np.arange(a.num_pages)).copy()


def test_alloc_hands_out_distinct_low_ids_first():
    a = PageAllocator(10, "device")
    first = a.alloc(3)
    assert first.dtype == np.int32 and first.tolist() == [0, 1, 2]
    assert a.alloc(2).tolist() == [3, 4]
    assert (a.num_free, a.num_used) == (5, 5)
    a.free([1, 3])
    again = a.alloc(2)
    assert sorted(again.tolist()) == [1, 3]  # freed ids are reused
    assert a.alloc(0).shape == (0,) and a.alloc(0).dtype == np.int32
    a.alloc(np.uint64(2))  # a numpy count: the counts stay Python ints
    assert type(a.num_free) is int and (a.num_free, a.num_used) == (3, 7)


def test_alloc_returns_a_copy():
    a = PageAllocator(4)
    ids = a.alloc(2)
    ids[:] = 3  # scribbling on the result must not touch the free list
    assert sorted(a.alloc(2).tolist()) == [2, 3]


def test_out_of_pages_changes_nothing():
    a = PageAllocator(5, "host")
    a.alloc(3)
    before = snapshot(a)
    with pytest.raises(OutOfPagesError, match="host pool: 3 pages needed, 2 free") as exc:
        a.alloc(3)
    assert (exc.value.needed, exc.value.free) == (3, 2)
    assert isinstance(exc.value, HiCacheError)
    after = snapshot(a)
    assert after[0] == before[0] and (after[1] == before[1]).all()


@pytest.mark.parametrize("n", [-1, True, 1.0, "2", None])
def test_alloc_bad_count(n):
    with pytest.raises(ValueError, match=r"^n="):
        PageAllocator(4).alloc(n)


@pytest.mark.parametrize(
    "ids, err, match",
    [
        ([0, 0], HiCacheError, "duplicate"),  # repeated within one call
        ([0, 4], HiCacheError, r"outside the device pool \[0, 4\)"),  # foreign (beyond the pool)
        ([1], HiCacheError, r"\[1\] are not allocated"),  # never allocated
        ([-1], ValueError, "negative"),
        ([[0]], ValueError, "1-D"),
        ([0.0], TypeError, "integers"),
    ],
)
def test_bad_free_is_all_or_nothing(ids, err, match):
    a = PageAllocator(4, "device")
    a.alloc(1)  # id 0 allocated, 1..3 free
    before = snapshot(a)
    with pytest.raises(err, match=match):
        a.free(ids)
    after = snapshot(a)
    assert after[0] == before[0] and (after[1] == before[1]).all()


def test_double_free_and_mixed_batch():
    a = PageAllocator(8)
    ids = a.alloc(5)
    a.free(ids[:2])
    before = snapshot(a)
    with pytest.raises(HiCacheError, match="double free"):
        a.free(ids[1:4])  # ids[1] already free: the valid ids[2:4] must stay allocated
    after = snapshot(a)
    assert after[0] == before[0] and (after[1] == before[1]).all()
    a.free(ids[2:])
    assert a.num_free == 8


def test_check_allocated_and_is_allocated():
    a = PageAllocator(6)
    ids = a.alloc(3)
    got = a.check_allocated(np.array([2, 0], np.int64), "pages")
    assert got.dtype == np.int32 and got.tolist() == [2, 0]
    with pytest.raises(HiCacheError, match=r"^pages: pool pages \[4\] are not allocated"):
        a.check_allocated([4], "pages")
    assert a.is_allocated([0, 3, 2]).tolist() == [True, False, True]
    a.free(ids)
    assert not a.is_allocated(np.arange(6)).any()


def test_reset_and_empty():
    a = PageAllocator(3)
    a.alloc(3)
    a.reset()
    assert a.num_free == 3 and sorted(a.alloc(3).tolist()) == [0, 1, 2]
    empty = PageAllocator(0)
    assert empty.num_free == 0 and empty.alloc(0).size == 0
    with pytest.raises(OutOfPagesError):
        empty.alloc(1)
    empty.free([])
    with pytest.raises(ValueError, match="num_pages=-1"):
        PageAllocator(-1)


def test_as_page_ids():
    src = np.array([3, 1], np.int64)
    out = as_page_ids(src)
    assert out.dtype == np.int32 and out.tolist() == [3, 1]
    out[0] = 9
    assert src[0] == 3  # a copy
    assert as_page_ids([]).dtype == np.int32 and as_page_ids(range(3)).tolist() == [0, 1, 2]
    assert as_page_ids(np.array([5], np.uint64)).tolist() == [5]
    with pytest.raises(ValueError, match=r"^ids must be 1-D"):
        as_page_ids(3, "ids")
    with pytest.raises(TypeError, match=r"^ids must hold integers, got dtype bool"):
        as_page_ids([True], "ids")
    with pytest.raises(ValueError, match="beyond int32"):
        as_page_ids([2**31])


def _alloc_free_seconds(num_pages: int, k: int, rounds: int = 50) -> float:
    a = PageAllocator(num_pages)
    a.alloc(num_pages // 2)  # a half-full pool: free list and bitmap both large
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(rounds):
            a.free(a.alloc(k))
        best = min(best, time.perf_counter() - t0)
    return best


def test_batched_alloc_free_cost_does_not_grow_with_the_pool():
    """O(k): alloc+free of 32 pages costs the same in a pool of 2**10 and of 2**22 pages
    (an O(pool) step, e.g. scanning the bitmap, would be ~4000x slower in the large one)."""
    small, large = _alloc_free_seconds(2**10, 32), _alloc_free_seconds(2**22, 32)
    assert large < 10 * small, (small, large)


class AllocatorMachine(RuleBasedStateMachine):
    """Random alloc/free (valid and invalid) against a set model."""

    def __init__(self) -> None:
        super().__init__()
        self.a = PageAllocator(24, "device")
        self.owned: set[int] = set()

    @rule(n=st.integers(0, 30))
    def alloc(self, n):
        free = 24 - len(self.owned)
        if n > free:
            with pytest.raises(OutOfPagesError):
                self.a.alloc(n)
            return
        ids = self.a.alloc(n)
        assert len(set(ids.tolist())) == n and not (set(ids.tolist()) & self.owned)
        self.owned |= set(ids.tolist())

    @precondition(lambda self: self.owned)
    @rule(data=st.data())
    def free_some(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.owned)), unique=True, min_size=1))
        self.a.free(np.array(ids))
        self.owned -= set(ids)

    @rule(data=st.data())
    def bad_free(self, data):
        """A batch with at least one id that is free or foreign: nothing changes."""
        bad = data.draw(st.integers(0, 40).filter(lambda i: i not in self.owned))
        good = data.draw(st.lists(st.sampled_from(sorted(self.owned) or [bad]), unique=True))
        ids = [i for i in good if i != bad] + [bad]
        with pytest.raises(HiCacheError):
            self.a.free(ids)

    @invariant()
    def counts_match_model(self):
        assert self.a.num_used == len(self.owned)
        assert set(np.flatnonzero(self.a.is_allocated(np.arange(24))).tolist()) == self.owned


TestAllocatorMachine = AllocatorMachine.TestCase
# A small pool saturates quickly: a few dozen runs cover it in the CI profile; the "long"
# profile (HICACHE_HYPOTHESIS_PROFILE=long) keeps its own, larger budget.
if settings.default.max_examples <= 100:
    TestAllocatorMachine.settings = settings(
        settings.default, max_examples=12, stateful_step_count=25
    )


def test_a_validated_free_still_refuses_a_double_free_and_changes_nothing():
    a = PageAllocator(6, "device")
    ids = a.alloc(4)
    a.free(ids[:2], validated=True)  # a node's own pages: int32, distinct
    assert a.num_free == 4 and not a.is_allocated(ids[:2]).any()
    before = snapshot(a)
    with pytest.raises(HiCacheError, match=r"pages \[0\] are not allocated"):
        a.free(np.array([2, 0], np.int32), validated=True)
    assert snapshot(a)[0] == before[0] and (snapshot(a)[1] == before[1]).all()
    a.free(ids[2:], validated=True)
    assert a.num_free == 6


def test_deferred_frees_leave_the_free_list_as_the_frees_one_by_one_would():
    """Frees inside ``deferring()`` reach ``on_free`` once, at its end, with every id; the free
    list then hands out the same ids in the same order as after the frees one by one; nothing
    freed is handed out before the end; a double free inside it still raises."""
    calls: list[list[int]] = []
    one, batched = PageAllocator(12, "device"), PageAllocator(12, "device")
    batched.on_free = lambda ids: calls.append(ids.tolist())
    for a in (one, batched):
        a.alloc(10)
    parts = [np.array([3, 1], np.int32), np.array([7], np.int32), np.array([0, 9, 4], np.int32)]
    one_early = one.alloc(2)  # (batched takes these two inside its context, below)
    for ids in parts:
        one.free(ids, validated=True)
    with batched.deferring():
        for ids in parts:
            batched.free(ids, validated=True)
        with batched.deferring():  # nested: ends with the outer one
            pass
        assert calls == [] and batched.num_free == 2  # back at the end only
        assert not batched.is_allocated(np.array([3, 7, 0])).any()
        assert batched.alloc(2).tolist() == one_early.tolist() == [10, 11]  # none freed here
        with pytest.raises(HiCacheError, match="not allocated"):
            batched.free(np.array([7], np.int32), validated=True)
    assert sorted(calls[0]) == [0, 1, 3, 4, 7, 9] and len(calls) == 1
    assert batched.alloc(6).tolist() == one.alloc(6).tolist()
    assert batched.num_free == one.num_free == 0
