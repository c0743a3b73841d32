"""Agreement across processes (cache/agreement.py): mismatched configs fail at construction on
every process naming the field, calls made in a different order are found by the check, and
the digests name the first differing field. The multi-process cases run real jax.distributed
processes (tests/multiproc.py); the rest run in this process."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import bookkeeping_spec, make_cache, serve
from hicache_jax import HiCache, HiCacheConfig
from hicache_jax.cache.agreement import config_fields, state_fields
from multiproc import launch


def test_mismatched_configs_a_different_call_order_and_a_killed_process():
    """One launch of two processes: caches built with a different setting on process 1 fail
    on both, naming it; the same requests with the last two swapped on process 1 are found
    before the first of them returns (its unlock), naming the tree; then process 1 is killed
    mid-run and process 0 raises within the agreement timeout, naming it."""
    timeout_s = 3.0
    out = launch(
        "config",
        2,
        "device_pages=17",
        "eviction=lfu",
        "page_size=8",
        str(timeout_s),
        timeout=60,
        kill={1: "READY"},
    )
    for o in out:
        assert o.result is not None and "trace" not in o.result, o
        for field, shown in (("device_pages", "17"), ("eviction", "lfu"), ("spec.page_size", "8")):
            r = o.result[field.removeprefix("spec.")]
            assert r.get("error") == "GroupDivergedError" and r["field"] == field, o
            assert f"process 1 has {shown}" in r["message"], o
        order = o.result["order"]
        assert order.get("error") == "GroupDivergedError" and order["done"] == 0, o
        assert order["field"] == "tree.nodes" and "before unlock" in order["message"], o
    for o in out[:1]:
        kill = o.result["kill"]
        assert kill.get("error") == "GroupTimeoutError" and kill["process"] == 1, o
        assert "process 1 of 2 did not reach agreement" in kill["message"]
        assert kill["waited"] < 3 * timeout_s, kill  # its last step: one agreement timed out
    assert out[1].rc is None and "READY" in out[1].out and "kill" not in out[1].result


def test_one_process_checks_nothing_and_keeps_its_clock(clock):
    cache = make_cache(bookkeeping_spec(), agreement_check_every=1)
    serve(cache, np.arange(8))
    cache.check_agreement()  # a no-op alone
    c2 = HiCache(bookkeeping_spec(), HiCacheConfig(device_pages=8, host_pages=8), clock=clock)
    clock.tick(5.0)
    serve(c2, np.arange(8))
    assert {n.last_access for n in c2.tree.nodes() if n.parent is not None} == {5.0}


def test_config_fields_name_every_setting():
    spec = bookkeeping_spec()
    a = dict(config_fields(spec, HiCacheConfig(device_pages=8)))
    b = dict(config_fields(spec, HiCacheConfig(device_pages=8, prefetch_policy="timeout")))
    assert a["spec.page_size"] == "4" and a["mesh"] == "None"
    assert [k for k in a if a[k] != b[k]] == ["prefetch_policy"]


def test_state_fields_name_what_differs():
    a, b = make_cache(bookkeeping_spec()), make_cache(bookkeeping_spec())

    def fields(c):
        return dict(state_fields(c.tree, c._owner, c.host_pool.allocator, c._flight, c._n))

    serve(a, np.arange(8))
    serve(b, np.arange(8))
    assert fields(a) == fields(b) | {"tree.eviction_keys": fields(a)["tree.eviction_keys"]}
    serve(b, np.arange(8, 16))
    differ = [k for k, v in fields(a).items() if fields(b)[k] != v]
    assert differ[0] == "tree.nodes" and "counters" in differ


def test_bad_agreement_settings():
    with pytest.raises(ValueError, match="agreement_check_every"):
        HiCacheConfig(device_pages=8, agreement_check_every=-1)
    with pytest.raises(ValueError, match="agreement_timeout_s"):
        HiCacheConfig(device_pages=8, agreement_timeout_s=0)


def _one_process_run(n: int, seed: int, steps: int, lag: int | None = None) -> tuple[list, dict]:
    """The same workload in this process alone (the spec of an n-process run, no mesh;
    ``lag``: its ``completion_lag``)."""
    import multiproc_workers as w
    from hicache_jax import KVSpec

    spec = KVSpec(num_layers=2, num_kv_heads=2 * n, head_dim=4, dtype="float16", page_size=4)
    cache = HiCache(
        spec,
        HiCacheConfig(
            device_pages=12,
            host_pages=16,
            load_back_threshold=4,
            write_policy="write_through",
            agreement_check_every=1,
            completion_lag=lag,
        ),
    )
    log = w._workload(cache, seed, steps)
    cache.flush()
    stats = w._decided(cache.stats())
    cache.close()
    return [list(x) for x in log], stats


@pytest.mark.parametrize("n,steps", [(2, 50)])
def test_a_random_workload_decides_alike_on_every_process(n, steps):
    """Requests over shared prefixes, evictions on both tiers, load-backs; the pools sharded
    over the processes' devices; check_agreement and check_invariants after every call (and
    agreement_check_every=1): every process ends with the same log and figures, those of one
    process running the same calls alone."""
    out = launch("workload", n, "7", str(steps), timeout=90)
    assert all(o.result is not None and "trace" not in o.result for o in out), out
    log, stats = _one_process_run(n, 7, steps)
    assert stats["load_backs"] and stats["evictions"] and stats["host_evictions"]
    for o in out:
        assert o.result["log"] == log
        assert {k: v for k, v in o.result["stats"].items() if "gbps" not in k} == {
            k: v for k, v in stats.items() if "gbps" not in k
        }


def test_with_a_completion_lag_processes_decide_alike_with_no_agreement_for_copies():
    """``completion_lag=1``: copies complete at the next request start on every process,
    agreed by nothing (no "transfers" agreement); the log and counters those of one process
    running the same calls with the same lag."""
    out = launch("workload_lag", 2, "11", "50", "1", timeout=90)
    assert all(o.result is not None and "trace" not in o.result for o in out), out
    log, stats = _one_process_run(2, 11, 50, lag=1)
    assert stats["load_backs"] and stats["evictions"] and stats["host_evictions"], stats
    for o in out:
        assert o.result["transfer_agreements"] == 0
        assert o.result["log"] == log
        assert {k: v for k, v in o.result["stats"].items() if "gbps" not in k} == {
            k: v for k, v in stats.items() if "gbps" not in k
        }


def test_l3_results_are_agreed_over_a_shared_store(tmp_path):
    """Two processes over one file:// store: the random workload with prefetches decides alike;
    then, over a store of each process's own,
    pages removed from process 1's only are a miss on both (lookup, prefetch, the request)."""
    out = launch("l3", 2, "3", "40", str(tmp_path / "shared"), str(tmp_path / "own"), timeout=90)
    assert all(o.result is not None and "trace" not in o.result for o in out), out
    stats = out[0].result["stats"]
    assert stats["l3_prefetch_hit_pages"] and stats["l3_put_pages_stored"], stats

    def decided(d):
        return {k: v for k, v in d.items() if "gbps" not in k and not k.startswith("l3_store_")}

    for o in out:  # (puts land when they land: one process alone may see other hits)
        assert o.result["log"] == out[0].result["log"]
        assert decided(o.result["stats"]) == decided(stats)
        miss = o.result["miss"]
        assert miss["l3_before"] == 32 and miss["l3_after"] == 0, miss
        assert miss["prefetch"] is None and miss["served_cached"] == 0, miss
    assert [o.result["miss"]["files"] for o in out] == [8, 0]  # process 0 still holds them


def test_state_slots_split_over_processes_read_back_exact_through_l2_and_l3(tmp_path):
    """A hybrid's state slots split over heads, the heads over 2 processes, one file:// store:
    each process holds its heads' part of every slot, and the checkpoint it wrote reads back
    bit-exact after a load-back from L2 and after a prefetch from L3."""
    out = launch("state_shards", 2, str(tmp_path), timeout=90)
    assert all(o.result is not None and "trace" not in o.result for o in out), out
    for o in out:
        r = o.result
        assert r["sharded"] and r["first"] == {"cached": 0, "state_ok": None}, r
        assert r["from_host"] == {"cached": 32, "state_ok": True}, r
        assert r["prefetched"] == 8 and r["from_l3"] == {"cached": 32, "state_ok": True}, r


@pytest.mark.parametrize("n", [4])
def test_pools_sharded_over_processes_keep_their_own_heads_through_l2_and_l3(n, tmp_path):
    """KV heads sharded over the processes' devices, one file:// store shared by them: each
    process reads back exactly its heads of the written KV (per shard, as numpy) after a
    load-back from L2 and after a prefetch from L3; the entries are keyed by the shard, so a
    cache of another process count (this one, alone) finds none of them. Then the random
    workload with prefetches over the same store decides alike on every process."""
    from hicache_jax import KVSpec

    out = launch("shards", n, str(tmp_path), "5", "25", timeout=90)
    assert all(o.result is not None and "trace" not in o.result for o in out), out
    assert [o.result["heads"] for o in out] == [[2 * i, 2 * i + 2] for i in range(n)]
    for o in out:
        r = o.result
        assert r["first"]["cached"] == 0
        assert r["from_host"] == {"cached": 32, "bytes_ok": True}, r
        assert r["l3_held"] == 32 and r["prefetched"] == 8, r
        assert r["from_l3"] == {"cached": 32, "bytes_ok": True}, r
        assert r["workload"]["log"] == out[0].result["workload"]["log"]
        assert {k: v for k, v in r["workload"]["stats"].items() if "gbps" not in k} == {
            k: v for k, v in out[0].result["workload"]["stats"].items() if "gbps" not in k
        }
    assert out[0].result["workload"]["stats"]["load_backs"]
    spec = KVSpec(num_layers=2, num_kv_heads=2 * n, head_dim=4, dtype="float16", page_size=4)
    alone = HiCache(spec, HiCacheConfig(device_pages=8, host_pages=8, storage=f"file://{tmp_path}"))
    assert alone.lookup(np.arange(32), l3=True)["l3"] == 0
    assert alone.read_kv_local(np.zeros(0, np.int32)).shape == spec.kv_shape(0)
    assert alone.local_heads == slice(0, 2 * n)
    alone.close()
