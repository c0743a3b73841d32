"""File backend of the L3 tier (and the shared protocol pieces: keys, header, handles)."""

import os
import shutil
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import numpy as np
import pytest

from hicache_jax.errors import HiCacheError
from hicache_jax.l3.storage import (
    ENTRY_ROWS,
    HEADER_BYTES,
    HostPages,
    StorageBackend,
    StorageError,
    StorageUnavailableError,
    entry_pages,
    entry_rows,
    open_storage,
    page_keys,
)
from hicache_jax.l3.storage.file import FileStorage
from hicache_jax.spec import KVSpec
from storage_helpers import NUM_PAGES, SPEC, host_buffer, keys_for, open_file, page_bytes, pages


@pytest.fixture
def root(tmp_path):
    return str(tmp_path / "l3")


# ---- keys and header ---------------------------------------------------------------------------
def test_page_keys_are_namespaced_by_spec_and_extra_key():
    tokens = np.arange(3 * SPEC.page_size)
    base = page_keys(SPEC, tokens)
    assert base == page_keys(SPEC, tokens.tolist())  # stable, input-type independent
    assert len(base) == 3 and len(set(base)) == 3
    assert base[0].startswith("hcj2_" + SPEC.fingerprint())
    assert all(len(k.rsplit("_", 1)[1]) == 32 for k in base)  # a 128-bit page digest
    other_spec = KVSpec(num_layers=3, num_kv_heads=2, head_dim=8, dtype="bfloat16", page_size=4)
    for other in (
        page_keys(SPEC, tokens, "lora-1"),
        page_keys(SPEC, tokens, 1),
        page_keys(SPEC, tokens, b"lora-1"),
        page_keys(other_spec, tokens),
        page_keys(SPEC, tokens + 1),
    ):
        assert not set(other) & set(base)
    assert page_keys(SPEC, tokens, "x") == page_keys(SPEC, tokens, "x")
    from hicache_jax.l3.storage.format import check_keys

    assert check_keys(base) == tuple(base)
    with pytest.raises(TypeError, match="extra_key"):
        page_keys(SPEC, tokens, extra_key=("a", 1))
    with pytest.raises(ValueError, match="1-D"):
        page_keys(SPEC, np.zeros((2, 4), np.int64))
    with pytest.raises(ValueError, match=r">= 0|2\*\*63"):
        page_keys(SPEC, np.array([-1, 0, 0, 0]))


@pytest.mark.parametrize("layout", ["page_first", "layer_first", ENTRY_ROWS])
@pytest.mark.parametrize(
    "dtype,page_size,mla",
    [
        ("bfloat16", 4, False),
        ("float32", 1, False),
        ("float8_e4m3fn", 16, False),
        ("float16", 4, True),
    ],
)
def test_round_trip_bit_exact(root, layout, dtype, page_size, mla):
    spec = KVSpec(
        num_layers=3,
        num_kv_heads=1 if mla else 2,
        head_dim=8,
        dtype=dtype,
        page_size=page_size,
        mla=mla,
    )
    src, buf = open_file(root, layout, spec=spec)
    assert isinstance(src, StorageBackend)
    keys = keys_for(6, spec=spec)
    assert src.put_from(keys, [3, 0, 7, 1, 15, 9]).wait(10).all()
    dst, dbuf = open_file(root, layout, seed=1, spec=spec)
    before = dbuf.copy()
    h = dst.get_into(keys, [10, 11, 12, 13, 14, 2])
    assert h.wait(10).all() and h.done() and h.ok.all() and h.seconds > 0
    np.testing.assert_array_equal(
        pages(dbuf, layout, [10, 11, 12, 13, 14, 2]), pages(buf, layout, [3, 0, 7, 1, 15, 9])
    )
    untouched = [i for i in range(NUM_PAGES) if i not in (10, 11, 12, 13, 14, 2)]
    np.testing.assert_array_equal(pages(dbuf, layout, untouched), pages(before, layout, untouched))
    assert os.path.getsize(src.path(keys[0])) == HEADER_BYTES + spec.page_bytes
    assert src.stats()["put_pages"] == 6 and dst.stats()["get_pages"] == 6
    src.close(), dst.close()


@pytest.mark.parametrize(
    "writer,reader",
    [("layer_first", "page_first"), (ENTRY_ROWS, "layer_first"), ("page_first", ENTRY_ROWS)],
)
def test_entries_are_layout_independent(root, writer, reader):
    src, buf = open_file(root, writer)
    keys = keys_for(4)
    assert src.put_from(keys, [0, 1, 2, 3]).wait(10).all()
    dst, dbuf = open_file(root, reader, seed=1)
    assert dst.get_into(keys, [4, 5, 6, 7]).wait(10).all()
    np.testing.assert_array_equal(
        page_bytes(dbuf, reader, [4, 5, 6, 7]), page_bytes(buf, writer, [0, 1, 2, 3])
    )


def test_entry_rows_buffer():
    rows = entry_rows(SPEC, 3)
    assert rows.shape == (3, HEADER_BYTES + SPEC.page_bytes) and rows.dtype == np.uint8
    view = entry_pages(SPEC, rows)
    assert (
        view.shape
        == (3, SPEC.num_layers, SPEC.kv_factor, SPEC.page_size, SPEC.num_kv_heads, SPEC.head_dim)
        and view.dtype == SPEC.bits_dtype
    )
    view[1] = 0xABCD  # a view, not a copy: the page bytes of row 1, and only those
    assert (rows[1, HEADER_BYTES:] == 0xAB).sum() == SPEC.page_bytes // 2
    assert not rows[1, :HEADER_BYTES].any() and not rows[[0, 2]].any()
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="num_pages"):
            entry_rows(SPEC, bad)
    with pytest.raises(ValueError, match="does not match"):
        entry_pages(SPEC, np.zeros((3, SPEC.page_bytes), np.uint8))  # no header slot
    with pytest.raises(ValueError, match="dtype"):
        entry_pages(SPEC, rows.view(np.uint16))
    with pytest.raises(ValueError, match="entry_rows"):
        open_storage("file:///tmp/x", SPEC, rows, "rows")  # the error lists the layouts
    pool_layout = HostPages(SPEC, host_buffer(SPEC, "page_first"), "page_first")
    with pytest.raises(StorageError, match="no header slots"):
        pool_layout.header(0)
    with pytest.raises(StorageError, match="no entry rows"):
        pool_layout.entry_address(0)


def test_entry_rows_get_fills_the_header_slot_in_place(root):
    src, _ = open_file(root)
    keys = keys_for(2)
    assert src.put_from(keys, [0, 1]).wait(10).all()
    dst, rows = open_file(root, ENTRY_ROWS, seed=1)
    assert dst.get_into(keys, [5, 2]).wait(10).all()
    with open(src.path(keys[0]), "rb") as f:
        assert rows[5].tobytes() == f.read()  # the row is the entry, header included


def test_exists_and_misses(root):
    store, buf = open_file(root)
    keys = keys_for(4)
    store.put_from(keys[:2], [0, 1]).wait(10)
    np.testing.assert_array_equal(store.exists(keys), [True, True, False, False])
    before = buf.copy()
    ok = store.get_into([keys[2], keys[0], keys[3]], [5, 6, 7]).wait(10)
    np.testing.assert_array_equal(ok, [False, True, False])
    np.testing.assert_array_equal(buf[6], buf[0])
    assert store.stats()["get_misses"] == 2
    np.testing.assert_array_equal(buf[5], before[5])  # a miss leaves an absent file's page alone
    assert store.exists([]).shape == (0,) and store.get_into([], []).wait(1).shape == (0,)


def test_write_once_keeps_first_value(root):
    store, _buf = open_file(root)
    key = keys_for(1)
    store.put_from(key, [0]).wait(10)
    first = Path(store.path(key[0])).read_bytes()
    assert store.put_from(key, [1]).wait(10).all()  # present: counts as stored
    assert Path(store.path(key[0])).read_bytes() == first
    assert store.stats()["put_existing"] == 1


def test_any_valid_key_round_trips_not_only_hex_ending_ones(root):
    store, buf = open_file(root)
    reader, rbuf = open_file(root, seed=5)
    keys = ["page_1", "req-xyz", "A.B", "ab", "x"]  # the cache's own keys end in hex digits
    assert store.put_from(keys, range(5)).wait(10).all()
    assert store.exists(keys).all()
    assert reader.get_into(keys, range(5)).wait(10).all()
    np.testing.assert_array_equal(
        pages(rbuf, "page_first", range(5)), pages(buf, "page_first", range(5))
    )
    assert store.path(keys_for(1)[0]).split(os.sep)[-2] == keys_for(1)[0][-2:]


def test_entries_another_user_owns_are_hits_and_stay_write_once(root, monkeypatch):
    """Refreshing the LRU age (utime) fails on an entry another user owns or on a read-only
    directory: the entry is still valid (a hit) and present (a put of it counts as stored)."""
    store, buf = open_file(root)
    keys = keys_for(2)
    assert store.put_from(keys, [0, 1]).wait(10).all()

    def denied(*args, **kw):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "utime", denied)
    reader, rbuf = open_file(root, seed=7)
    assert reader.get_into(keys, [2, 3]).wait(10).all()
    np.testing.assert_array_equal(
        pages(rbuf, "page_first", [2, 3]), pages(buf, "page_first", [0, 1])
    )
    assert reader.put_from(keys, [4, 5]).wait(10).all()
    st = reader.stats()
    assert st["put_existing"] == 2 and st.get("puts_dropped", 0) == 0
    assert st.get("get_errors", 0) == 0 and st["lru_touch_failed"] == 4


# ---- atomicity, corruption ---------------------------------------------------------------------
def test_failed_write_leaves_no_entry_and_no_temp(root, monkeypatch):
    store, _ = open_file(root)
    keys = keys_for(2)

    def failing_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", failing_replace)
    ok = store.put_from(keys, [0, 1]).wait(10)
    monkeypatch.undo()
    assert not ok.any() and store.stats()["puts_dropped"] == 2
    assert not store.exists(keys).any()
    assert os.listdir(os.path.join(root, ".tmp")) == []


def test_readers_never_see_partial_entries(root):
    writer, wbuf = open_file(root, seed=3)
    reader, rbuf = open_file(root, seed=4)
    keys = keys_for(NUM_PAGES)
    stop = threading.Event()
    seen = []

    def read_loop():
        while not stop.is_set():
            ok = reader.get_into(keys, np.arange(NUM_PAGES)).wait(10)
            seen.append(int(ok.sum()))
            np.testing.assert_array_equal(rbuf[ok], wbuf[ok])

    t = threading.Thread(target=read_loop)
    t.start()
    for i in range(NUM_PAGES):
        writer.put_from([keys[i]], [i]).wait(10)
    stop.set()
    t.join()
    assert reader.stats().get("corrupt", 0) == 0 and seen
    assert reader.get_into(keys, np.arange(NUM_PAGES)).wait(10).all()


@pytest.mark.parametrize("layout", ["page_first", ENTRY_ROWS])
@pytest.mark.parametrize("where", ["payload", "header", "truncate", "extend", "renamed"])
def test_corrupt_or_truncated_entry_is_a_miss_and_is_removed(root, where, layout):
    store, buf = open_file(root, layout)
    keys = keys_for(3)
    store.put_from(keys, [0, 1, 2]).wait(10)
    path = store.path(keys[1])
    data = bytearray(Path(path).read_bytes())
    if where == "payload":
        data[HEADER_BYTES + 17] ^= 0x40
    elif where == "header":
        data[9] ^= 0x01  # inside the spec fingerprint
    elif where == "truncate":
        data = data[:-5]
    elif where == "extend":
        data += b"\0"
    if where == "renamed":  # a valid entry of another key under this name
        shutil.copyfile(store.path(keys[2]), path)
    else:
        Path(path).write_bytes(bytes(data))
    ok = store.get_into(keys, [5, 6, 7]).wait(10)
    np.testing.assert_array_equal(ok, [True, False, True])
    assert store.stats()["corrupt"] == 1 and not os.path.exists(path)
    assert store.put_from([keys[1]], [1]).wait(10).all()  # repaired by the next put
    assert store.get_into([keys[1]], [6]).wait(10).all()
    np.testing.assert_array_equal(pages(buf, layout, [6]), pages(buf, layout, [1]))


# ---- capacity / LRU ----------------------------------------------------------------------------
def test_capacity_evicts_least_recently_used(root):
    entry = HEADER_BYTES + SPEC.page_bytes
    store, _buf = open_file(root, capacity_bytes=10 * entry)
    keys = keys_for(14)
    store.put_from(keys[:8], np.arange(8)).wait(10)
    for i, k in enumerate(keys[:8]):  # make the age order explicit: key 0 oldest
        os.utime(store.path(k), ns=(10**9 * (i + 1), 10**9 * (i + 1)))
    assert store.get_into(keys[:2], [8, 9]).wait(10).all()  # hits: 0 and 1 become youngest
    store.put_from(keys[8:14], np.arange(8, 14)).wait(10)  # 14 entries > 10: evict to 9
    present = store.exists(keys)
    assert present[:2].all(), "recently read entries must survive"
    assert not present[2:7].any() and present[7:].all()
    assert store.usage_bytes() <= 10 * entry and store.stats()["evictions"] == 5


def test_capacity_is_shared_by_instances(root):
    entry = HEADER_BYTES + SPEC.page_bytes
    a, _ = open_file(root, capacity_bytes=8 * entry)
    b, _ = open_file(root, seed=1, capacity_bytes=8 * entry)
    a.put_from(keys_for(6), np.arange(6)).wait(10)
    b.put_from(keys_for(6, start=100), np.arange(6)).wait(10)  # b scans a's files too
    assert b.usage_bytes() <= 8 * entry


# ---- concurrency -------------------------------------------------------------------------------
def test_concurrent_instances_share_the_directory(root):
    stores = [open_file(root, seed=0) for _ in range(3)]  # same content for the same key
    keys = keys_for(NUM_PAGES)
    handles = [
        s.put_from(
            keys[i::2] + keys[1 - i :: 2],
            np.r_[np.arange(NUM_PAGES)[i::2], np.arange(NUM_PAGES)[1 - i :: 2]],
        )
        for i, (s, _) in enumerate(stores[:2])
    ]
    code = (
        f"import numpy as np, sys; sys.path.insert(0, {os.path.dirname(__file__)!r});"
        f"from storage_helpers import open_file, keys_for, NUM_PAGES;"
        f"s, _ = open_file({root!r}); "
        f"assert s.put_from(keys_for(NUM_PAGES), np.arange(NUM_PAGES)).wait(30).all()"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert all(h.wait(10).all() for h in handles)
    reader, rbuf = stores[2]
    rbuf[:] = 0
    assert reader.get_into(keys, np.arange(NUM_PAGES)).wait(10).all()
    np.testing.assert_array_equal(rbuf, stores[0][1])
    assert os.listdir(os.path.join(root, ".tmp")) == []


# ---- faults, handles, validation ---------------------------------------------------------------
def test_directory_gone_mid_run_gives_misses_and_dropped_puts(root):
    store, _buf = open_file(root)
    keys = keys_for(4)
    store.put_from(keys[:2], [0, 1]).wait(10)
    shutil.rmtree(root)
    assert not store.get_into(keys[:2], [4, 5]).wait(10).any()
    assert not store.put_from(keys[2:], [2, 3]).wait(10).any()
    assert store.stats()["puts_dropped"] == 2


def test_handle_progress_cancel_and_timeout(root):
    store, _buf = open_file(root, batch_pages=1)
    keys = keys_for(4)
    store.put_from(keys, np.arange(4)).wait(10)
    gate, entered = threading.Event(), threading.Event()
    real_get = store._get

    def gated(k, ids):
        entered.set()
        gate.wait(10)
        return real_get(k, ids)

    store._get = gated
    h = store.get_into(keys, [8, 9, 10, 11])
    entered.wait(10)
    with pytest.raises(TimeoutError, match="not done"):
        h.wait(0.01)
    with pytest.raises(StorageError, match="in flight"):
        _ = h.ok
    assert not h.done() and not h.landed().any()
    h.cancel()
    gate.set()
    ok = h.wait(10)
    assert ok[0] and not ok[1:].any()  # the running sub-batch finished, the rest were skipped


def test_wait_without_timeout_runs_a_queued_handle_inline(root):
    store, buf = open_file(root)
    keys = keys_for(2)
    store.put_from(keys, [0, 1]).wait(10)
    gate, runners = threading.Event(), []
    real_get = store._get

    def gated(k, ids):
        runners.append(threading.current_thread())
        if len(runners) == 1:
            gate.wait(10)
        return real_get(k, ids)

    store._get = gated
    first = store.get_into(keys[:1], [8])  # occupies the get lane's worker
    second = store.get_into(keys[1:], [9])  # queued behind it

    def run_inline(handle):  # what wait() runs: claim the queued handle, only then free the lane
        claimed = handle._claim()
        gate.set()
        if claimed:
            with store._lane_locks[handle.kind]:
                store._run(handle)

    second._inline = run_inline
    assert second.wait().all() and first.wait(10).all()  # no deadlock, both exact
    assert runners[0] is not threading.current_thread()
    assert runners[1] is threading.current_thread()  # the waiter ran it, after the lane freed
    np.testing.assert_array_equal(buf[8:10], buf[0:2])


def test_worker_bug_is_raised_by_wait(root):
    store, _ = open_file(root)

    def broken(k, ids):
        raise ZeroDivisionError("bug")

    store._put = broken
    h = store.put_from(keys_for(1), [0])
    with pytest.raises(StorageError, match="worker failed"):
        h.wait(10)


def test_bad_arguments_raise_before_any_state_change(root):
    store, buf = open_file(root)
    keys = keys_for(3)
    snapshot = buf.copy()
    cases = [
        ((keys, [0, 1]), ValueError, "len"),
        ((keys, [0, 1, 16]), ValueError, r"\[0, 16\)"),
        ((keys, [0, 1, -1]), ValueError, r"\[0, 16\)"),
        ((keys, [0, 0, 1]), ValueError, "unique"),
        ((keys, np.zeros((3, 1), int)), ValueError, "1-D"),
        ((keys, [0.0, 1.0, 2.0]), ValueError, "1-D integers"),
        (([keys[0], keys[0]], [0, 1]), ValueError, "unique"),
        ((["a/b"], [0]), ValueError, "key"),
        ((keys[0], [0]), TypeError, "keys"),
        (([1], [0]), ValueError, "key"),
    ]
    for method in (store.put_from, store.get_into):
        for args, err, match in cases:
            with pytest.raises(err, match=match):
                method(*args)
    with pytest.raises(TypeError, match="keys"):
        store.exists("abc")
    np.testing.assert_array_equal(buf, snapshot)
    assert store.stats() == {} and not store.exists(keys).any()


def test_bad_open_arguments(root, tmp_path):
    buf = host_buffer(SPEC, "page_first")
    with pytest.raises(ValueError, match="scheme"):
        open_storage("s3://bucket", SPEC, buf)
    with pytest.raises(ValueError, match="unknown option"):
        open_storage(f"file://{root}?capacity=3", SPEC, buf)
    with pytest.raises(ValueError, match="bad value"):
        open_storage(f"file://{root}?capacity_bytes=lots", SPEC, buf)
    with pytest.raises(ValueError, match="capacity_bytes"):
        open_storage(f"file://{root}?capacity_bytes=10", SPEC, buf)
    with pytest.raises(ValueError, match="local path"):
        open_storage("file://host/dir", SPEC, buf)
    with pytest.raises(ValueError, match="dtype"):
        open_storage(f"file://{root}", SPEC, buf.astype(np.uint32))
    with pytest.raises(ValueError, match="layer_first"):
        open_storage(f"file://{root}", SPEC, buf, "layer_first")
    with pytest.raises(ValueError, match="contiguous"):
        open_storage(f"file://{root}", SPEC, buf[::2])
    with pytest.raises(TypeError, match="numpy"):
        open_storage(f"file://{root}", SPEC, buf.tolist())
    with pytest.raises(ValueError, match="layout"):
        open_storage(f"file://{root}", SPEC, buf, "row_major")
    assert not os.path.exists(root)
    blocker = tmp_path / "a_file"
    blocker.write_bytes(b"x")
    with pytest.raises(StorageUnavailableError, match="a_file"):
        open_storage(f"file://{blocker}", SPEC, buf)
    with pytest.raises(ValueError, match="bad value 'maybe' for fsync"):
        open_storage(f"file://{root}?fsync=maybe", SPEC, buf)  # not silently False
    assert not os.path.exists(root)
    store = open_storage(f"file://{root}?capacity_bytes=100000&fsync=true", SPEC, buf)
    assert isinstance(store, FileStorage) and store.fsync and store.capacity_bytes == 100000
    assert store.put_from(keys_for(1), [0]).wait(10).all()
    store.close()
    store.close()
    with pytest.raises(StorageError, match="closed"):
        store.put_from(keys_for(1), [0])
    assert issubclass(StorageError, HiCacheError)


def temp_name(key):
    """A temp file name as the store writes it: ``<key>.<32 hex>`` (uuid4)."""
    return f"{key}.{uuid.uuid4().hex}"


def test_stale_temp_files_are_removed_at_open(root):
    _store, _ = open_file(root)
    tmp = Path(root, ".tmp")
    stale, fresh = tmp / temp_name(keys_for(1)[0]), tmp / temp_name(keys_for(1)[0])
    foreign = tmp / "leftover"  # aged too, but not a name the store writes: not its file
    for p in (stale, fresh, foreign):
        p.write_bytes(b"partial")
    os.utime(stale, (1, 1))
    os.utime(foreign, (1, 1))
    open_file(root)
    assert not stale.exists() and fresh.exists() and foreign.exists()


# ---- a directory others write to ---------------------------------------------------------------
def run_isolated(code, root, timeout=120):
    """Run ``code`` in a fresh interpreter with the backend helpers: an operation that hangs
    there (a worker blocked for good keeps an interpreter from exiting) fails this test after
    ``timeout`` seconds instead of wedging the test run."""
    prelude = (
        f"import os, stat, sys, numpy as np; "
        f"sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
        f"from storage_helpers import open_file, keys_for\nroot = {root!r}\n"
    )
    try:
        proc = subprocess.run(
            [sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"hung for {timeout} s")
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("kind", ["fifo", "symlink_to_fifo"])
def test_fifo_at_an_entry_path_is_a_miss_never_waited_on(root, kind):
    run_isolated(
        f"""
s, buf = open_file(root)
keys = keys_for(3)
assert s.put_from(keys, [0, 1, 2]).wait(30).all()
path = s.path(keys[1])
os.unlink(path)
if {kind!r} == "fifo":
    os.mkfifo(path)
else:
    os.mkfifo(root + "/pipe")
    os.symlink(root + "/pipe", path)
ok = s.get_into(keys, [5, 6, 7]).wait(30)        # the old code blocked in open() for good
assert ok.tolist() == [True, False, True], ok
assert s.get_into(keys[2:], [8]).wait(30).all()  # the lane is free: later gets land
assert s.exists(keys).tolist() == [True, False, True]
assert not s.put_from(keys[1:2], [1]).wait(30).any()  # not replaced, not followed
assert not stat.S_ISREG(os.lstat(path).st_mode)
st = s.stats()
assert st["not_regular"] == 2 and st["puts_dropped"] == 1 and "corrupt" not in st, st
s.close()
""",
        root,
    )


def test_symlink_at_an_entry_path_is_not_followed(root, tmp_path):
    store, _buf = open_file(root)
    keys = keys_for(3)
    assert store.put_from(keys, [0, 1, 2]).wait(10).all()
    path = store.path(keys[1])
    elsewhere = tmp_path / "elsewhere"  # a valid entry of this key, outside the store
    shutil.copyfile(path, elsewhere)
    outside = elsewhere.read_bytes()
    os.unlink(path)
    os.symlink(elsewhere, path)
    np.testing.assert_array_equal(store.exists(keys), [True, False, True])
    np.testing.assert_array_equal(store.get_into(keys, [5, 6, 7]).wait(10), [True, False, True])
    assert not store.put_from(keys[1:2], [1]).wait(10).any()
    assert os.path.islink(path) and elsewhere.read_bytes() == outside
    st = store.stats()
    assert st["not_regular"] == 2 and st["puts_dropped"] == 1 and "corrupt" not in st


def test_directory_at_an_entry_path_is_a_miss_and_a_dropped_put(root):
    store, _buf = open_file(root)
    keys = keys_for(3)
    assert store.put_from(keys, [0, 1, 2]).wait(10).all()
    path = store.path(keys[1])
    os.unlink(path)
    os.mkdir(path)
    for _ in range(2):
        np.testing.assert_array_equal(store.get_into(keys, [5, 6, 7]).wait(10), [True, False, True])
        assert not store.put_from(keys[1:2], [1]).wait(10).any()
    assert not store.exists(keys[1:2]).any() and os.path.isdir(path)
    st = store.stats()
    assert st["not_regular"] == 4 and st["puts_dropped"] == 2
    assert "corrupt" not in st and st.get("put_existing", 0) == 0


@pytest.mark.parametrize("key", [".", "..", "abc\n"])
def test_dot_keys_are_rejected(root, key):
    store, _ = open_file(root)
    for call in (
        lambda: store.put_from([key], [0]),
        lambda: store.get_into([key], [0]),
        lambda: store.exists([key]),
    ):
        with pytest.raises(ValueError, match="key"):
            call()
    assert store.stats() == {}


@pytest.mark.parametrize("folder", [".tmp", "3f"])
def test_a_store_folder_that_is_a_symlink_is_refused(root, tmp_path, folder):
    user = tmp_path / "user"
    user.mkdir()
    mine = [user / "thesis.tex", user / temp_name(keys_for(1)[0]), user / keys_for(1)[0]]
    for p in mine:
        p.write_bytes(b"the user's data")
        os.utime(p, (1, 1))
    os.makedirs(root)
    os.symlink(user, os.path.join(root, folder))
    with pytest.raises(StorageUnavailableError, match="symlink"):
        open_file(root, capacity_bytes=HEADER_BYTES + SPEC.page_bytes)
    assert all(p.read_bytes() == b"the user's data" for p in mine)


def test_eviction_and_sweeps_touch_only_the_stores_own_files(root, tmp_path):
    entry = HEADER_BYTES + SPEC.page_bytes
    store, _ = open_file(root, capacity_bytes=4 * entry)
    key = keys_for(1, start=500)[0]
    other = next(f"{i:02x}" for i in range(256) if f"{i:02x}" != key[-2:])
    target = tmp_path / "target"
    target.write_bytes(b"x" * entry)
    foreign = [
        Path(root, "00", "notes.txt"),
        Path(root, "3f", "has space"),
        Path(root, other, key),  # a key's name in another key's folder
        Path(root, ".tmp", "draft.tex"),
        Path(root, ".tmp", key + ".not-a-uuid"),
        Path(root, "README"),
    ]
    for p in foreign:
        p.write_bytes(b"y" * entry)
    link = Path(store.path(key))
    os.symlink(target, link)  # a symlink at an entry path
    for p in foreign + [target]:
        os.utime(p, (1, 1))  # oldest of all
    assert store.put_from(keys_for(8), np.arange(8)).wait(10).all()
    open_file(root, capacity_bytes=4 * entry)  # the sweep at open, too
    assert all(p.read_bytes() == b"y" * entry for p in foreign)
    assert link.is_symlink() and target.read_bytes() == b"x" * entry
    assert store.stats()["evictions"] == 5 and store.usage_bytes() == 3 * entry


def test_capacity_enforcement_sweeps_stale_temp_files_and_counts_the_rest(root):
    entry = HEADER_BYTES + SPEC.page_bytes
    store, _ = open_file(root, capacity_bytes=10 * entry)
    tmp = Path(root, ".tmp")
    stale = tmp / temp_name(keys_for(1)[0])  # a crashed writer's leftover
    fresh = tmp / temp_name(keys_for(1)[0])  # another process's write in flight
    stale.write_bytes(b"s" * entry)
    fresh.write_bytes(b"f" * 5 * entry)
    os.utime(stale, (1, 1))
    assert store.put_from(keys_for(6), np.arange(6)).wait(10).all()  # 6 + 5 in flight > 10
    assert not stale.exists() and fresh.exists()
    st = store.stats()
    assert st["temp_swept"] == 1 and st["evictions"] == 2
    assert store.usage_bytes() == 9 * entry  # 4 entries + the temp file in flight


def test_a_long_lived_instance_sweeps_stale_temp_files(root, monkeypatch):
    from hicache_jax.l3.storage import file as file_mod

    store, _ = open_file(root)  # no capacity bound: no enforcement scans
    tmp = Path(root, ".tmp")
    stale, fresh = tmp / temp_name(keys_for(1)[0]), tmp / temp_name(keys_for(1)[0])
    for p in (stale, fresh):
        p.write_bytes(b"partial")
    os.utime(stale, (1, 1))
    assert store.put_from(keys_for(1), [0]).wait(10).all()
    assert stale.exists()  # not due yet: puts do not scan the temp folder
    monkeypatch.setattr(file_mod, "_SWEEP_INTERVAL_S", 0.0)  # due at every put
    assert store.put_from(keys_for(1, start=1), [1]).wait(10).all()
    assert not stale.exists() and fresh.exists() and store.stats()["temp_swept"] == 1


# ---- checksums ---------------------------------------------------------------------------------
@pytest.mark.parametrize("writer_sum,reader_sum", [("crc32", "xxh3"), ("xxh3", "crc32")])
def test_checksums_interoperate_and_detect_damage(root, writer_sum, reader_sum):
    pytest.importorskip("xxhash", reason="xxh3 checksums need the xxhash package")
    writer, buf = open_file(root, checksum=writer_sum)
    reader, rbuf = open_file(root, seed=1, checksum=reader_sum)
    keys = keys_for(3)
    assert writer.put_from(keys, [0, 1, 2]).wait(10).all()
    data = bytearray(Path(writer.path(keys[1])).read_bytes())
    data[-1] ^= 0x80
    Path(writer.path(keys[1])).write_bytes(bytes(data))
    np.testing.assert_array_equal(reader.get_into(keys, [3, 4, 5]).wait(10), [True, False, True])
    np.testing.assert_array_equal(rbuf[[3, 5]], buf[[0, 2]])
    assert reader.stats()["corrupt"] == 1


def test_entry_with_an_uncomputable_checksum_is_a_miss_left_in_place(root, monkeypatch):
    pytest.importorskip("xxhash", reason="xxh3 checksums need the xxhash package")
    from hicache_jax.l3.storage import format as fmt

    writer, _ = open_file(root, checksum="xxh3")
    keys = keys_for(1)
    writer.put_from(keys, [0]).wait(10)
    monkeypatch.setattr(fmt, "xxhash_available", lambda: False)
    reader, _ = open_file(root, seed=1)
    assert not reader.get_into(keys, [3]).wait(10).any()
    assert reader.stats() == {"uncheckable": 1, "get_misses": 1}
    assert os.path.exists(writer.path(keys[0]))
    with pytest.raises(ValueError, match="xxhash"):
        open_file(root, checksum="xxh3")


def test_unknown_checksum_is_rejected(root):
    with pytest.raises(ValueError, match="checksum"):
        open_file(root, checksum="md5")
    assert not os.path.exists(root)


def test_auto_checksum_prefers_xxh3_and_falls_back_to_crc32(root, monkeypatch):
    from hicache_jax.l3.storage import format as fmt

    monkeypatch.setattr(fmt, "xxhash_available", lambda: False)
    assert open_file(root)[0].codec.checksum == "crc32"
    monkeypatch.setattr(fmt, "xxhash_available", lambda: True)
    assert open_file(root)[0].codec.checksum == "xxh3"
