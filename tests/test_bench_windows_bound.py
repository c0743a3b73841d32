"""bench_windows_bound's page-level model of a windowed cache (page keys: one int per prefix,
as ``PageKeys`` names them; a window of 2 pages)."""

from __future__ import annotations

import pytest

from benchmarks.bench_windows_bound import FULL, WIN, Sim, lru_hits
from hicache_jax.replay.block_lru import BlockLRU


def _run(keys, budget, cap, policy):
    sim = Sim(budget, cap, policy, k=2)
    served = [sim.serve(ks, t) for t, ks in enumerate(keys)]
    return sim, served


@pytest.mark.parametrize("policy", ["lru", "value", "unified", "value-all"])
def test_a_repeat_is_served_whole_and_the_bytes_stay_within_the_budget(policy):
    keys = [[1, 2, 3, 4], [1, 2, 3, 4], [5, 6], [1, 2, 3, 4]]
    served = _run(keys, 1000, None, policy)[1]
    assert served == [0, 4, 0, 4]
    small, _ = _run(keys, 4 * (FULL + WIN), None, policy)
    assert FULL * len(small.page_prio) + WIN * len(small.win_prio) <= 4 * (FULL + WIN)


def test_a_branch_is_served_only_where_the_window_before_it_is_held():
    """A prompt diverging at page 3 of a stored one reads the window KV of pages 2 and 3: kept
    as spare pages where the window pool has room, reclaimed where it holds the firm ones
    alone (those the stored prompt's end reads), and then nothing is served."""
    keys = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 9]]
    assert _run(keys, 1000, None, "lru")[1] == [0, 3]
    assert _run(keys, 1000, 2, "lru")[1] == [0, 0]


def test_spare_window_pages_go_lowest_rank_first():
    """Of an 8-page prompt's spare window KV, with room for two, the two that ends at
    multiples of 4 read stay (pages 3 and 4): a prompt leaving it at page 4 is served there."""
    keys = [list(range(1, 9)), [1, 2, 3, 4, 99]]
    assert _run(keys, 1000, 4, "lru")[1] == [0, 4]
    sim, _ = _run(keys[:1], 1000, 4, "lru")
    assert set(sim.win_prio) == {3, 4, 7, 8}


def test_lru_hits_is_the_exact_lru():
    keys = [[1, 2], [3, 4], [1, 2, 5], [3]]
    lru = BlockLRU(3)
    assert lru_hits(keys, 3) == sum(lru.serve(k) for k in keys)
