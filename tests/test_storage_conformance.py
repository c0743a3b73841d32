"""The conformance kit passes the file backend and fails broken ones, naming the behaviour."""

import threading

import numpy as np
import pytest

from hicache_jax.l3.storage.conformance import ConformanceError, check
from hicache_jax.l3.storage.file import FileStorage


class Stale(FileStorage):
    """Reports every stored page landed without copying it (the host page keeps old bytes)."""

    def _get(self, keys, ids):
        return np.asarray(self._exists(keys), dtype=bool)


class Blocks(FileStorage):
    """Every put blocks (until close releases it, so the test leaves no thread behind)."""

    def __init__(self, *args, **kwargs):
        self._release = threading.Event()
        super().__init__(*args, **kwargs)

    def _put(self, keys, ids):
        self._release.wait(30)
        return np.zeros(len(keys), bool)

    def close(self):
        self._release.set()
        super().close()


class Raises(FileStorage):
    """exists raises a non-storage error."""

    def _exists(self, keys):
        raise RuntimeError("backend bug")


def factory(cls, root):
    return lambda spec, buf, layout: cls(spec, buf, layout, root, batch_pages=2)


def test_file_backend_passes(tmp_path):
    assert check(factory(FileStorage, tmp_path)) == [
        "missing keys", "round trip", "partial batch", "write once", "close during work"]


@pytest.mark.parametrize("cls, words", [
    (Stale, "stale data"),
    (Blocks, "no blocking: put did not finish within 0.5 s"),
    (Raises, "errors: exists raised RuntimeError"),
])
def test_broken_backends_fail_naming_the_behaviour(tmp_path, cls, words):
    with pytest.raises(ConformanceError) as exc:
        check(factory(cls, tmp_path), timeout_s=0.5)
    assert words in str(exc.value)


def test_example_memory_backend_passes_and_loads_by_url():
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    from memory_storage import MemoryStorage
    assert len(check(lambda spec, buf, layout: MemoryStorage(spec, buf, layout, batch_pages=2))) == 5
    from hicache_jax.l3.storage import open_storage
    from hicache_jax.l3.storage.conformance import SPEC, _buffer
    with open_storage("python://memory_storage:MemoryStorage?capacity_pages=2", SPEC, _buffer(),
                      "page_first") as store:
        assert store.capacity_pages == 2


def test_mooncake_backend_passes():
    from storage_servers import running_mooncake
    from hicache_jax.l3.storage import open_storage
    with running_mooncake() as servers:
        assert len(check(lambda spec, buf, layout: open_storage(servers.url, spec, buf, layout),
                         timeout_s=10.0)) == 5
