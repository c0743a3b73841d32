"""bench_state_bound's LP: the pages served with ``K`` checkpoints held at a time, on prompts
whose answer is known by hand (page keys: one int per prefix, as ``PageKeys`` names them)."""

from __future__ import annotations

import pytest

from benchmarks.bench_state_bound import (
    online_points,
    oracle_hits,
    slots_bound,
    split_design,
    unified_lru,
)


def test_overlapping_reuses_need_a_slot_each():
    """Two prefixes each reused once, the reuses' holding times overlapping: one slot serves
    one of them (2 pages), two serve both (4)."""
    keys = [[1, 2], [3, 4], [1, 2], [3, 4]]
    hits = oracle_hits(keys, 100)
    assert hits == [0, 0, 2, 2]
    assert slots_bound(keys, hits, 1) == pytest.approx(2)
    assert slots_bound(keys, hits, 2) == pytest.approx(4)


def test_one_slot_serves_every_reuse_of_one_checkpoint():
    """A prefix reused by three requests in a row: one slot, held throughout, serves all."""
    keys = [[1, 2], [1, 2], [1, 2], [1, 2]]
    assert slots_bound(keys, oracle_hits(keys, 100), 1) == pytest.approx(6)


def test_an_online_policy_checkpoints_only_where_it_can_know_to():
    """A prompt leaving a stored one at page 2: a clairvoyant policy checkpointed there; one
    that knows no future only at its intervals and ends (every 2 pages: served 2, none: 0)."""
    keys = [[1, 2, 3, 4], [1, 2, 9]]
    hits = oracle_hits(keys, 100)
    assert hits == [0, 2]
    assert online_points(keys, 0)[0] == {4}
    assert online_points(keys, 2)[0] == {2, 4}
    assert online_points(keys, 0)[1] == {2, 3}  # where it leaves the tree, and its end
    assert slots_bound(keys, hits, 1) == pytest.approx(2)
    assert slots_bound(keys, hits, 1, every=2) == pytest.approx(2)
    assert slots_bound(keys, hits, 1, every=0) == pytest.approx(0)


def test_the_unified_lru_serves_from_held_checkpoints_and_spends_bytes_on_them():
    """A prompt, then its reuse: served whole when its end checkpoint fits beside its pages,
    not at all when the checkpoint's bytes push the pages out; an interval checkpoint serves
    a prompt that leaves it after its interval."""
    keys = [[1, 2, 3, 4], [1, 2, 3, 4]]
    assert unified_lru(keys, 10, 2.0, 0) == 4
    assert unified_lru(keys, 5, 2.0, 0) == 0  # 4 pages + 2: its checkpoint went
    branch = [[1, 2, 3, 4], [1, 2, 9]]
    assert unified_lru(branch, 100, 2.0, 0) == 0  # no checkpoint at page 2
    assert unified_lru(branch, 100, 2.0, 2) == 2


def test_greedydual_keeps_the_long_prefix_lru_would_evict():
    """A long prompt, then a short one, then the long one again, with room for one of them:
    LRU evicts the long one (older), GreedyDual keeps it (its checkpoint saves 6 pages)."""
    keys = [[1, 2, 3, 4, 5, 6], [7], [1, 2, 3, 4, 5, 6]]
    assert unified_lru(keys, 8, 1.0, 0) == 0
    assert unified_lru(keys, 8, 1.0, 0, weight=1.0) == 6


def test_a_tail_checkpoint_serves_a_prompt_that_leaves_before_the_end():
    """A prompt left 2 pages before its end: its end checkpoint serves nothing, one 2 pages
    before it serves those pages (unified and split designs alike)."""
    keys = [[1, 2, 3, 4, 5], [1, 2, 3, 9]]
    assert unified_lru(keys, 100, 1.0, 0) == 0
    assert unified_lru(keys, 100, 1.0, 0, tail=2) == 3
    assert split_design(keys, 100, 10, 1.0, 0) == 0
    assert split_design(keys, 100, 10, 1.0, 2) == 3


def test_the_split_keeps_slots_by_worth_under_greedydual():
    """Two slots, a long prompt's end then two short ones: LRU's slots lose the long one's
    checkpoint, GreedyDual's keep it (worth its pages squared)."""
    long = list(range(1, 9))
    keys = [long, [20], [30], long]
    assert split_design(keys, 100, 2, 1.0, 0) == 0
    assert split_design(keys, 100, 2, 1.0, 0, weight=2.0) == 8
