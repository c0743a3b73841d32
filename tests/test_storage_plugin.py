"""A deployment's own L3 backend loaded from ``python://module:Class?key=value``."""

import numpy as np
import pytest

from hicache_jax.l3.storage import open_storage
from storage_helpers import SPEC, host_buffer, page_keys, pages


class NoGet:
    """A class lacking protocol methods (get_into, put_from)."""

    def exists(self, keys):
        return np.zeros(len(keys), bool)

    def stats(self):
        return {}

    def close(self):
        pass


def test_python_url_loads_a_class_that_stores_and_loads(tmp_path):
    buf = host_buffer(SPEC, "page_first")
    url = f"python://hicache_jax.l3.storage.file:FileStorage?root={tmp_path}"
    with open_storage(url, SPEC, buf, "page_first") as store:
        keys = page_keys(SPEC, list(range(8)))
        assert store.put_from(keys, [0, 1]).wait(10).all()
        assert store.exists(keys).all()
        before = pages(buf, "page_first", [0, 1])
        assert store.get_into(keys, [2, 3]).wait(10).all()
        np.testing.assert_array_equal(pages(buf, "page_first", [2, 3]), before)


@pytest.mark.parametrize(
    "url, error, words",
    [
        (
            "python://no_such_module_xyz:Backend",
            ValueError,
            "cannot import module 'no_such_module_xyz'",
        ),
        ("python://hicache_jax.l3.storage.file:Nope", ValueError, "has no class 'Nope'"),
        ("python://hicache_jax.l3.storage.file", ValueError, "python://package.module:ClassName"),
        ("python://hicache_jax.l3.storage.format:HEADER_BYTES", TypeError, "is not a class"),
        (
            "python://test_storage_plugin:NoGet",
            TypeError,
            "lacks protocol method(s) get_into, put_from",
        ),
    ],
)
def test_python_url_errors_name_what_is_missing(url, error, words):
    buf = host_buffer(SPEC, "page_first")
    snapshot = buf.copy()
    with pytest.raises(error) as exc:
        open_storage(url, SPEC, buf, "page_first")
    assert words in str(exc.value)
    np.testing.assert_array_equal(buf, snapshot)


def test_cache_over_a_python_backend_stores_pages_and_rejects_a_bad_url():
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    from l3_helpers import compute, l3, make, tokens_kv

    cache = make("python://memory_storage:MemoryStorage?capacity_pages=64")
    toks, kv = tokens_kv(0, 4)
    compute(cache, toks, kv)
    cache.flush()
    assert l3(cache)["l3_store_puts_stored"] == 4  # counted by the plugin backend itself
    with pytest.raises(TypeError, match="lacks protocol method"):
        make("python://test_storage_plugin:NoGet")
