"""The throttled file store (l3/storage/throttle.py): the file backend's behaviour, at least its
latency and bandwidth per handle, its URL options checked, usable as a cache's L3."""

import time

import numpy as np
import pytest

from hicache_jax import KVSpec
from hicache_jax.l3.storage import open_storage
from hicache_jax.l3.storage.conformance import check
from hicache_jax.l3.storage.throttle import ThrottledFileStorage
from l3_helpers import write_then_prefetch
from storage_helpers import SPEC, host_buffer, keys_for, page_bytes


def test_it_passes_the_conformance_kit(tmp_path):
    assert check(
        lambda spec, buf, layout: ThrottledFileStorage(
            spec, buf, layout, tmp_path, gbps=1.0, latency_ms=1, batch_pages=2
        )
    ) == [
        "missing keys",
        "round trip",
        "partial batch",
        "write once",
        "delete",
        "delete by prefix",
        "put racing a get",
        "torn or foreign entry",
        "close during work",
    ]


def test_a_get_takes_its_latency_plus_its_bytes_over_the_bandwidth(tmp_path):
    buf = host_buffer(SPEC, "page_first")
    n = 8
    gbps = n * SPEC.page_bytes / 0.05 / 1e9  # 8 pages in 50 ms
    url = f"throttle+file://{tmp_path}?gbps={gbps!r}&latency_ms=20&batch_pages=2"
    store = open_storage(url, SPEC, buf, "page_first")
    assert store.url.startswith("throttle+file://") and "latency_ms=20" in store.url
    keys = keys_for(n)
    store.put_from(keys, np.arange(n)).wait()
    out = host_buffer(SPEC, "page_first", seed=1)
    reader = open_storage(f"file://{tmp_path}", SPEC, out, "page_first")  # same entries
    assert reader.get_into(keys, np.arange(n)).wait().all()
    t0 = time.perf_counter()
    ok = store.get_into(keys, np.arange(n, 2 * n)).wait()
    took = time.perf_counter() - t0
    assert ok.all() and took >= 0.02 + 0.05 * 0.95
    np.testing.assert_array_equal(
        page_bytes(buf, "page_first", np.arange(n, 2 * n)),
        page_bytes(out, "page_first", np.arange(n)),
    )
    assert store.exists(keys).all()
    store.close(), reader.close()


@pytest.mark.parametrize(
    "query, words",
    [
        ("", "has no gbps"),
        ("?gbps=0", "gbps=0.0 must be a finite number > 0"),
        ("?gbps=nan", "gbps=nan"),
        ("?gbps=1&latency_ms=-1", "latency_ms=-1.0"),
        ("?gbps=fast", "bad value 'fast' for gbps"),
        ("?gbps=1&speed=2", "unknown option 'speed'"),
    ],
)
def test_bad_options_are_clear_errors_and_open_nothing(tmp_path, query, words):
    root = tmp_path / "l3"
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace("?", r"\?")):
        open_storage(
            f"throttle+file://{root}{query}", SPEC, host_buffer(SPEC, "page_first"), "page_first"
        )
    assert not root.exists()  # checked before the directory is made


def test_a_cache_prefetches_from_it(tmp_path):
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", page_size=4)
    url = f"throttle+file://{tmp_path}?gbps=1&latency_ms=1"
    cfg = dict(
        device_pages=32,
        host_pages=64,
        storage=url,
        write_through_threshold=1,
        load_back_threshold=4,
    )
    a, b, h, toks, kv = write_then_prefetch(spec, cfg, 4, seed=3)
    assert h.pages_found == 4
    h.wait()
    m = b.load_back(b.match_prefix(toks))
    np.testing.assert_array_equal(
        np.asarray(b.read_kv(m.device_pages)).view(np.uint32), kv.view(np.uint32)
    )
    a.close(), b.close()
