"""Agreement across processes (cache/agreement.py): mismatched configs fail at construction on
every process naming the field, calls made in a different order are found by the check, and
the digests name the first differing field. The multi-process cases run real jax.distributed
processes (tests/multiproc.py); the rest run in this process."""

from __future__ import annotations

import numpy as np
import pytest

from hicache_jax import HiCache, HiCacheConfig
from hicache_jax.cache.agreement import config_fields, state_fields
from helpers import bookkeeping_spec, make_cache, serve
from multiproc import launch


@pytest.mark.parametrize("field,value,shown", [("device_pages", "17", "'17'"),
                                               ("eviction", "lfu", "'lfu'")])
def test_a_mismatched_config_fails_on_every_process_naming_the_field(field, value, shown):
    out = launch("config", 2, "1", field, value, timeout=60)
    for o in out:
        assert o.result is not None and o.result.get("error") == "GroupDivergedError", o
        assert o.result["field"] == field and f"process 1 has {shown}" in o.result["message"]


def test_calls_in_a_different_order_are_found():
    out = launch("order", 2, timeout=60)
    for o in out:
        assert o.result is not None and o.result.get("error") == "GroupDivergedError", o
        assert o.result["done"] == 0 and o.result["field"] == "tree.nodes", o


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
    fields = lambda c: dict(state_fields(c.tree, c._owner, c.host_pool.allocator,  # noqa: E731
                                         c._flight, c._n))
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
