"""Mooncake backend against real servers (mooncake_master + mooncake_client holder on 127.0.0.1).

Skipped, with the reason, only when the Mooncake package cannot be imported here; CI installs it
(``pip install mooncake-transfer-engine-non-cuda``, ``apt-get install -y libibverbs1``).
"""

import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from hicache_jax.l3.storage import ENTRY_ROWS, HEADER_BYTES, StorageUnavailableError, open_storage
from hicache_jax.spec import KVSpec
from storage_helpers import NUM_PAGES, SPEC, host_buffer, keys_for, open_mc, page_bytes, pages
from storage_servers import (
    MooncakeServers,
    mooncake_fixture,
    mooncake_skip_reason,
    running_mooncake,
)

pytestmark = pytest.mark.skipif(
    mooncake_skip_reason() is not None, reason=str(mooncake_skip_reason())
)

servers = mooncake_fixture("module")
BIG = KVSpec(num_layers=2, num_kv_heads=4, head_dim=64, dtype="bfloat16", page_size=16)  # 32 KiB


def unique_keys(n, spec=SPEC):
    return keys_for(n, start=int(time.monotonic_ns() % 10**12), spec=spec)


@pytest.mark.parametrize(
    "layout,zero_copy",
    [("page_first", True), ("page_first", False), ("layer_first", False), (ENTRY_ROWS, False)],
)
def test_round_trip_bit_exact_across_clients(servers, layout, zero_copy):
    src, buf = open_mc(servers, layout, zero_copy=zero_copy, spec=BIG)
    dst, dbuf = open_mc(servers, layout, seed=1, zero_copy=zero_copy, spec=BIG, batch_pages=4)
    assert src.zero_copy is zero_copy
    keys = unique_keys(10, spec=BIG)
    src_ids, dst_ids = [3, 0, 7, 1, 15, 9, 2, 4, 5, 6], [10, 11, 12, 13, 14, 8, 0, 1, 3, 7]
    assert src.put_from(keys, src_ids).wait(20).all()
    np.testing.assert_array_equal(dst.exists(keys + ["absent"]), [True] * 10 + [False])
    before = dbuf.copy()
    h = dst.get_into(keys, dst_ids)
    assert h.wait(20).all()
    np.testing.assert_array_equal(pages(dbuf, layout, dst_ids), pages(buf, layout, src_ids))
    rest = sorted(set(range(NUM_PAGES)) - set(dst_ids))
    np.testing.assert_array_equal(pages(dbuf, layout, rest), pages(before, layout, rest))
    assert dst.stats()["get_pages"] == 10 and src.stats()["put_pages"] == 10
    src.close(), dst.close()


@pytest.mark.parametrize("writer,reader", [(ENTRY_ROWS, "layer_first"), ("page_first", ENTRY_ROWS)])
def test_entry_rows_interoperate_with_pool_layouts(servers, writer, reader):
    src, buf = open_mc(servers, writer, spec=BIG)
    dst, dbuf = open_mc(servers, reader, seed=1, spec=BIG)
    keys = unique_keys(5, spec=BIG)
    assert src.put_from(keys, [4, 0, 9, 2, 1]).wait(20).all()
    assert dst.get_into(keys, [1, 2, 3, 12, 15]).wait(20).all()
    np.testing.assert_array_equal(
        page_bytes(dbuf, reader, [1, 2, 3, 12, 15]), page_bytes(buf, writer, [4, 0, 9, 2, 1])
    )
    if reader == ENTRY_ROWS:  # moved in place: the header landed in the row's own slot
        assert bytes(dbuf[1, :4]) == b"HCKV"
    src.close(), dst.close()


def test_another_process_reads_what_this_one_stored(servers):
    """Cross-instance reuse at the backend level: a second process (a second client) gets the
    pages this process put, bit-exact."""
    store, _buf = open_mc(servers, "layer_first", seed=7)
    keys = unique_keys(8)
    assert store.put_from(keys, np.arange(8)).wait(20).all()
    code = (
        f"import sys, numpy as np; sys.path.insert(0, {os.path.dirname(__file__)!r});"
        "from storage_helpers import SPEC, host_buffer, open_mc, pages;"
        "from storage_servers import MooncakeServers;"
        f"s, b = open_mc(MooncakeServers({servers.rpc_port}, 0, ''), 'page_first', seed=1);"
        f"assert s.get_into({keys!r}, np.arange(8) + 8).wait(20).all();"
        "ref = pages(host_buffer(SPEC, 'layer_first', seed=7), 'layer_first', np.arange(8));"
        "np.testing.assert_array_equal(b[8:16], ref); s.close(); print('bit-exact')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0 and "bit-exact" in proc.stdout, proc.stderr[-3000:]
    store.close()


def test_misses_and_write_once(servers):
    store, buf = open_mc(servers)
    keys = unique_keys(3)
    assert store.put_from(keys[:1], [0]).wait(20).all()
    assert store.put_from(keys[:1], [1]).wait(20).all()  # write-once: no-op, reported stored
    ok = store.get_into(keys, [4, 5, 6]).wait(20)
    np.testing.assert_array_equal(ok, [True, False, False])
    np.testing.assert_array_equal(buf[4], buf[0])  # the first value stays
    assert store.stats()["get_misses"] == 2 and "get_errors" not in store.stats()
    store.close()


def test_default_batch_is_one_store_call_of_16_mib_of_pages(servers):
    from hicache_jax.l3.storage.mooncake import STAGING_BYTES

    store, _ = open_mc(servers)
    assert store.batch_pages == STAGING_BYTES // SPEC.page_bytes >= 1
    calls = []

    class CountingClient:  # the client's methods are read-only: wrap it
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def batch_put_from(self, keys, ptrs, sizes):
            calls.append(len(keys))
            return self.inner.batch_put_from(keys, ptrs, sizes)

    store._store = CountingClient(store._store)
    n = min(NUM_PAGES, store.batch_pages)
    assert store.put_from(unique_keys(n), np.arange(n)).wait(20).all()
    assert calls == [n]  # one call, not a pipeline of smaller ones
    store.close()


def test_pipelined_sub_batches_with_gaps(servers):
    store, buf = open_mc(servers, batch_pages=2)  # 16 pages: 8 store calls per handle
    keys = unique_keys(NUM_PAGES)
    present = np.arange(NUM_PAGES) % 3 != 1
    assert (
        store.put_from([k for k, p in zip(keys, present) if p], np.flatnonzero(present))
        .wait(20)
        .all()
    )
    before = buf.copy()
    buf[np.flatnonzero(present)] = 0
    ok = store.get_into(keys, np.arange(NUM_PAGES)).wait(20)
    np.testing.assert_array_equal(ok, present)
    np.testing.assert_array_equal(buf[present], before[present])
    store.close()


@pytest.mark.parametrize("layout", ["page_first", ENTRY_ROWS])
@pytest.mark.parametrize("damage", ["payload", "fingerprint", "short", "long"])
def test_corrupt_or_truncated_entry_is_a_miss_and_is_removed(servers, damage, layout):
    store, buf = open_mc(servers, layout)
    keys = unique_keys(2)
    entry = np.zeros(HEADER_BYTES + SPEC.page_bytes + 8, np.uint8)
    page1 = page_bytes(buf, layout, [1])[0]
    store.codec.pack_into(entry[:HEADER_BYTES], keys[1], [page1])
    entry[HEADER_BYTES : HEADER_BYTES + SPEC.page_bytes] = page1
    size = HEADER_BYTES + SPEC.page_bytes
    if damage == "payload":
        entry[HEADER_BYTES + 3] ^= 1
    elif damage == "fingerprint":
        entry[9] ^= 1
    else:
        size += -7 if damage == "short" else 8
    raw = store._store  # the client's own API: write a damaged entry under a valid key
    assert raw.register_buffer(entry.ctypes.data, entry.nbytes) == 0
    assert raw.batch_put_from([keys[1]], [entry.ctypes.data], [size]) == [0]
    raw.unregister_buffer(entry.ctypes.data)
    store.put_from(keys[:1], [0]).wait(20)
    ok = store.get_into(keys, [8, 9]).wait(20)
    np.testing.assert_array_equal(ok, [True, False])
    assert store.stats()["corrupt"] == 1 and not store.exists(keys[1:]).any()  # removed
    assert store.put_from(keys[1:], [1]).wait(20).all()  # repairable
    assert store.get_into(keys[1:], [9]).wait(20).all()
    np.testing.assert_array_equal(pages(buf, layout, [9]), pages(buf, layout, [1]))
    store.close()


def test_unreachable_master_fails_fast_naming_the_address():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    buf = host_buffer(SPEC, "page_first")
    t0 = time.monotonic()
    with pytest.raises(StorageUnavailableError, match=f"127.0.0.1:{port}.*unreachable"):
        open_storage(f"mooncake://127.0.0.1:{port}", SPEC, buf, setup_timeout_s=2.0)
    assert time.monotonic() - t0 < 3.0


def test_silent_master_setup_is_bounded():
    """A port that accepts but never answers made setup() retry for ~10 minutes."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        addr = f"127.0.0.1:{listener.getsockname()[1]}"
        t0 = time.monotonic()
        with pytest.raises(StorageUnavailableError, match=f"{addr}.*did not answer"):
            open_storage(
                f"mooncake://{addr}", SPEC, host_buffer(SPEC, "page_first"), setup_timeout_s=1.0
            )
        assert time.monotonic() - t0 < 8.0


def test_bad_mooncake_arguments():
    buf = host_buffer(SPEC, "layer_first")
    with pytest.raises(ValueError, match="host:port"):
        open_storage("mooncake://nohost", SPEC, buf, "layer_first")
    with pytest.raises(ValueError, match="zero_copy"):
        open_storage("mooncake://127.0.0.1:1", SPEC, buf, "layer_first", zero_copy=True)
    with pytest.raises(ValueError, match="zero_copy"):
        open_storage(
            "mooncake://127.0.0.1:1",
            SPEC,
            host_buffer(SPEC, ENTRY_ROWS),
            ENTRY_ROWS,
            zero_copy=True,
        )
    with pytest.raises(ValueError, match="setup_timeout_s"):
        open_storage("mooncake://127.0.0.1:1?setup_timeout_s=0", SPEC, buf, "layer_first")
    with pytest.raises(ValueError, match="exists_timeout_s"):
        open_storage("mooncake://127.0.0.1:1", SPEC, buf, "layer_first", exists_timeout_s=-1)
    with pytest.raises(ValueError, match="checksum"):
        open_storage("mooncake://127.0.0.1:1", SPEC, buf, "layer_first", checksum="sha1")


def test_holder_dying_mid_run_gives_misses_dropped_puts_and_recovers():
    with running_mooncake(client_ttl_s=2) as own:
        store, buf = open_mc(own)
        keys = unique_keys(8)
        assert store.put_from(keys[:4], [0, 1, 2, 3]).wait(20).all()
        kept = buf.copy()
        own.kill_holder()
        t0 = time.monotonic()
        got = store.get_into(keys[:4], [8, 9, 10, 11])
        put = store.put_from(keys[4:], [4, 5, 6, 7])
        assert not got.wait(20).any() and not put.wait(20).any()
        # the breaker is open now: further calls return at once
        t1 = time.monotonic()
        assert not store.put_from(keys[4:], [4, 5, 6, 7]).wait(5).any()
        assert not store.get_into(keys[:2], [8, 9]).wait(5).any()
        assert time.monotonic() - t1 < 1.5 and time.monotonic() - t0 < 15
        stats = store.stats()
        assert stats["puts_dropped"] >= 8 and stats["get_skipped"] >= 2
        untouched = [i for i in range(NUM_PAGES) if i not in (8, 9, 10, 11)]
        np.testing.assert_array_equal(buf[untouched], kept[untouched])  # L2 not corrupted
        own.start_holder()  # memory back (the old entries are gone with it)
        deadline = time.monotonic() + 20
        while not store.put_from(keys[4:], [4, 5, 6, 7]).wait(20).all():
            assert time.monotonic() < deadline, store.stats()
            time.sleep(0.5)
        assert store.get_into(keys[4:], [12, 13, 14, 15]).wait(20).all()
        np.testing.assert_array_equal(buf[12:16], buf[4:8])
        store.close()


def test_master_dying_mid_run_does_not_block_the_caller():
    with running_mooncake() as own:
        store, _buf = open_mc(own)
        keys = unique_keys(4)
        assert store.put_from(keys[:2], [0, 1]).wait(20).all()
        own.kill_master()
        t0 = time.monotonic()
        got = store.get_into(keys[:2], [8, 9])
        put = store.put_from(keys[2:], [2, 3])
        assert time.monotonic() - t0 < 1.0  # dispatch never waits on the store (seconds)
        t1 = time.monotonic()
        assert not store.exists(keys).any()  # synchronous but bounded (exists_timeout_s=2)
        assert time.monotonic() - t1 < 3.5
        assert not got.wait(30).any() and not put.wait(30).any()
        t2 = time.monotonic()
        assert not store.exists(keys).any()
        assert not store.get_into(keys, [8, 9, 10, 11]).wait(5).any()
        assert time.monotonic() - t2 < 1.5  # the breaker answers: no 2 s exists timeout
        closer = threading.Thread(target=store.close)
        closer.start()
        closer.join(30)
        assert not closer.is_alive()


def test_servers_helper_lists_the_holder_segment(servers):
    assert isinstance(servers, MooncakeServers) and servers.segments()
    assert servers.master.poll() is None and servers.holder.poll() is None
