"""The conformance kit passes the real backends (file, Mooncake, the example in examples/) and
fails broken ones, naming the behaviour each breaks."""

import functools
import os
import sys
import threading
import time

import numpy as np
import pytest

from hicache_jax.l3.storage.base import BackendBase
from hicache_jax.l3.storage.conformance import ConformanceError, check
from hicache_jax.l3.storage.file import FileStorage
from hicache_jax.l3.storage.format import Verdict

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from memory_storage import MemoryStorage

ALL = [
    "missing keys",
    "round trip",
    "partial batch",
    "write once",
    "delete",
    "delete by prefix",
    "put racing a get",
    "torn or foreign entry",
    "two processes",
    "close during work",
]


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


class PrefixMissesAGeneration(FileStorage):
    """delete_prefix removes only the keys of generation 0 (it matches ``prefix + "_"``)."""

    def delete_prefix(self, prefix):
        return super().delete_prefix(prefix + "_")


class Raises(FileStorage):
    """exists raises a non-storage error."""

    def _exists(self, keys):
        raise RuntimeError("backend bug")


class RaisesInside(FileStorage):
    """A put's worker raises an I/O error instead of counting it and reporting a miss."""

    def _put(self, keys, ids):
        raise OSError("disk full")


class KeepsDeleted(FileStorage):
    """delete reports the entries there removed but leaves them."""

    def delete(self, keys):
        return self.exists(keys)


class Unverified(FileStorage):
    """Serves whatever bytes are in an entry's file (no header or checksum check)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.codec.verify = lambda *args: Verdict.VALID


class Abandons(FileStorage):
    """Work still queued when close starts is dropped: its handle never finishes."""

    def _run(self, handle):
        time.sleep(0.05)
        if not self._closed:
            super()._run(handle)


class TornPuts(BackendBase):
    """In memory; a put makes the entry visible before it has written all of it, and a get
    copies whatever is there: a get racing a put lands a torn page."""

    url = "python://test:TornPuts"

    def __init__(self, spec, buf, layout):
        super().__init__(spec, buf, layout, batch_pages=8)
        self._entries = {}

    def _exists(self, keys):
        return np.array([k in self._entries for k in keys], dtype=bool)

    def _get(self, keys, ids):
        for key, page in zip(keys, ids):
            if key in self._entries:
                self.host.write_page(int(page), self._entries[key])
        return self._exists(keys)

    def _put(self, keys, ids):
        for key, page in zip(keys, ids):
            if key not in self._entries:
                row = np.zeros(self.spec.page_bytes, np.uint8)
                self._entries[key] = row
                full = np.empty_like(row)
                self.host.read_page(int(page), full)
                row[: row.size // 2] = full[: row.size // 2]
                time.sleep(0.002)
                row[row.size // 2 :] = full[row.size // 2 :]
        return np.ones(len(keys), dtype=bool)

    def _close(self):
        self._entries.clear()


def factory(cls, root):
    return lambda spec, buf, layout: cls(spec, buf, layout, root, batch_pages=2)


def test_file_backend_passes_in_one_and_in_two_processes(tmp_path):
    assert check(factory(FileStorage, tmp_path)) == [n for n in ALL if n != "two processes"]
    shared = functools.partial(FileStorage, root=str(tmp_path), batch_pages=2)  # picklable
    assert check(shared, shared=True) == ALL


@pytest.mark.parametrize(
    "cls, words",
    [
        (Stale, "stale data"),
        (Blocks, "no blocking: put did not finish within 0.5 s"),
        (Raises, "errors: exists raised RuntimeError"),
        (RaisesInside, "errors: put raised OSError: disk full inside the backend"),
        (KeepsDeleted, "delete: exists after delete: a deleted key is still there"),
        (
            PrefixMissesAGeneration,
            ("delete by prefix: an entry of the prefix is still there after delete_prefix"),
        ),
        (Unverified, "torn or foreign entry: a get of a truncated entry reported the page landed"),
        (Abandons, "close during work: a put in flight at close did not finish within 0.5 s"),
    ],
)
def test_broken_backends_fail_naming_the_behaviour(tmp_path, cls, words):
    with pytest.raises(ConformanceError) as exc:
        check(factory(cls, tmp_path), timeout_s=0.5)
    assert words in str(exc.value)


def test_a_torn_page_under_a_racing_get_fails():
    with pytest.raises(
        ConformanceError,
        match=r"put racing a get: a get racing a put: a get "
        r"reported page . landed whose bytes differ",
    ):
        check(TornPuts)


def test_example_memory_backend_passes_and_loads_by_url():
    got = check(lambda spec, buf, layout: MemoryStorage(spec, buf, layout, batch_pages=2))
    assert got == [n for n in ALL if n not in ("two processes", "torn or foreign entry")]
    from hicache_jax.l3.storage import open_storage
    from hicache_jax.l3.storage.conformance import SPEC, _buffer

    with open_storage(
        "python://memory_storage:MemoryStorage?capacity_pages=2", SPEC, _buffer(), "page_first"
    ) as store:
        assert store.capacity_pages == 2


def test_a_store_of_one_process_fails_the_two_process_check():
    with pytest.raises(
        ConformanceError,
        match="two processes: pages put in another process never all reached this one",
    ):
        check(MemoryStorage, timeout_s=0.5, shared=True)


def test_mooncake_backend_passes():
    from hicache_jax.l3.storage import open_storage
    from storage_servers import running_mooncake

    with running_mooncake() as servers:
        got = check(functools.partial(open_storage, servers.url), timeout_s=10.0, shared=True)
    assert got == [n for n in ALL if n != "torn or foreign entry"]
