"""The state machine of tests/test_hicache_state_machine.py over a hybrid model: one recurrent
layer (a ``STATE`` group: checkpoints in state slots) beside one full layer, slot pools half
the page pools (slots reclaimed, nodes evicted for slots). A file of its own so that pytest-xdist
(``--dist loadfile``) runs it beside the long state-machine file."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from test_hicache_state_machine import COVERAGE, LONG, POLICIES, STATE_RUN, HiCacheMachine

#: (write policy, page size, checkpoint_every_pages) of the hybrid (recurrent + full) runs.
STATE_RUNS = (
    [(p, ps, e) for p in POLICIES for ps in (1, 4) for e in (0, 2)]
    if LONG
    else [("write_through", 4, 0), ("clean_ahead", 4, 2)]
)


@pytest.mark.parametrize("write_policy,page_size,every", STATE_RUNS)
def test_hicache_state_machine_state_slots(write_policy, page_size, every):
    """The same machine over a hybrid model (a recurrent layer's STATE group and a full
    layer), slot pools half the page pools: every served prefix ends at the checkpoint taken
    at its end (read_state bit-exact); every slot on either tier is the checkpoint taken at
    its page's end, its digest unchanged since taken (none mutated by copies, load-backs,
    splits, a caller rewriting its own slots); no slot leaked (invariants, used counts); the
    KV events replay to the slots held per tier; bad state calls change nothing."""
    machine = type(
        f"HiCacheState_{write_policy}_{page_size}_{every}",
        (HiCacheMachine,),
        dict(
            write_policy=write_policy,
            eviction="lru",
            page_size=page_size,
            state=True,
            checkpoint_every=every,
        ),
    )
    cfg = settings(max_examples=60 if LONG else 6, stateful_step_count=40)
    COVERAGE.clear()
    STATE_RUN.clear()
    run_state_machine_as_test(machine, settings=cfg)
    assert COVERAGE["steps"] >= 60, COVERAGE
    for key in ("backups", "load_backs", "window_pages_trimmed", "evictions"):
        assert COVERAGE[key] > 0, f"the machine never exercised {key}: {dict(COVERAGE)}"
    assert STATE_RUN["checkpoints"] > 0, STATE_RUN
