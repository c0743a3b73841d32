"""Process groups (memory/group.py, memory/group_socket.py): the single-process group and the
distributed group over both transports (direct sockets, the key-value store) with an
in-process store (threads as processes); real jax.distributed processes run it in
test_agreement.py."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from hicache_jax.errors import (
    GroupConnectError,
    GroupDivergedError,
    GroupTimeoutError,
    HiCacheError,
)
from hicache_jax.memory.group import AgreedClock, DistributedGroup, LocalGroup, default_group
from hicache_jax.memory.group_socket import route_host


class FakeStore:
    """jax.distributed's key-value client, in one process (blocking get with a timeout)."""

    def __init__(self) -> None:
        self.kv: dict[str, str] = {}
        self.cv = threading.Condition()

    def key_value_set(self, key: str, value: str) -> None:
        with self.cv:
            assert key not in self.kv, key
            self.kv[key] = value
            self.cv.notify_all()

    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str:
        with self.cv:
            if not self.cv.wait_for(lambda: key in self.kv, timeout_in_ms / 1000):
                raise RuntimeError("DEADLINE_EXCEEDED")
            return self.kv[key]

    def key_value_delete(self, key: str) -> None:
        """The key and every key under it (a directory), as jax's store does."""
        with self.cv:
            gone = [k for k in self.kv if k == key or k.startswith(key + "/")]
            assert gone, key
            for k in gone:
                del self.kv[k]


def run_all(n: int, fn, timeout_s: float = 5.0, store: FakeStore | None = None, **kw) -> list:
    """``fn(group)`` on n threads, each a process of one group over a FakeStore."""
    store, out = store or FakeStore(), [None] * n

    def body(i: int) -> None:
        g = DistributedGroup(timeout_s, name="t", client=store, process_id=i, num_processes=n, **kw)
        try:
            out[i] = fn(g)
        except Exception as e:
            out[i] = e
        finally:
            g.close()

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_local_group_is_the_value_itself():
    g = LocalGroup()
    assert g.allgather("x", "v") == ["v"]
    assert g.agree_min("m", [3, 1]).tolist() == [3, 1]
    assert g.leader("l", "me") == "me"
    g.close()  # nothing to release
    g.check_equal("cfg", [("a", "1")])
    assert isinstance(default_group(), LocalGroup)  # this process is no jax.distributed one


class _Closing(LocalGroup):
    closes = 0

    def close(self) -> None:
        self.closes += 1


def test_a_cache_closes_the_group_it_built_not_the_callers(monkeypatch):
    from hicache_jax import HiCache, HiCacheConfig, KVSpec
    from hicache_jax.cache import agreement

    spec = KVSpec(1, 1, 2, "float32", page_size=2)
    own = _Closing()
    monkeypatch.setattr(agreement, "default_group", lambda timeout_s: own)
    HiCache(spec, HiCacheConfig(device_pages=4)).close()
    mine = _Closing()
    HiCache(spec, HiCacheConfig(device_pages=4, group=mine)).close()
    assert (own.closes, mine.closes) == (1, 0)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("transport", ["socket", "kv"])
def test_min_leader_and_gather_over_processes(n, transport):
    out = run_all(
        n,
        transport=transport,
        fn=lambda g: (
            g.allgather("a", str(g.process_id)),
            g.agree_min("m", [10 + g.process_id, 7 - g.process_id]).tolist(),
            g.leader("l", f"p{g.process_id}"),
        ),
    )
    assert out == [([str(i) for i in range(n)], [10, 8 - n], "p0")] * n


def test_agreement_keys_are_deleted_once_every_peer_read_them():
    store = FakeStore()
    out = run_all(
        3,
        lambda g: [g.allgather("s", "x") for _ in range(7)],
        store=store,
        delete_every=3,
        transport="kv",
    )
    assert all(o == [["x"] * 3] * 7 for o in out)
    # steps 0-2 and 3-5 deleted a block at a time (at steps 3 and 6), step 6's keys kept
    assert sorted(store.kv) == ["t/2/0/6", "t/2/1/6", "t/2/2/6"]


@pytest.mark.parametrize("transport", ["socket", "kv"])
def test_a_differing_field_is_named_on_every_process(transport):
    out = run_all(
        2,
        transport=transport,
        fn=lambda g: g.check_equal(
            "config",
            [
                ("page_size", "4"),
                ("device_pages", str(16 + g.process_id)),
                ("eviction", str(g.process_id)),
            ],
        ),
    )
    for e in out:
        assert isinstance(e, GroupDivergedError) and e.field == "device_pages"
        assert "process 0 has 16, process 1 has 17" in str(e)


@pytest.mark.parametrize("transport", ["socket", "kv"])
def test_different_calls_at_one_step_are_found(transport):
    out = run_all(
        2, transport=transport, fn=lambda g: g.allgather("insert" if g.process_id else "evict", "x")
    )
    assert all(isinstance(e, GroupDivergedError) and e.field == "call" for e in out)
    assert "process 0 is at 'evict', process 1 at 'insert'" in str(out[0])


@pytest.mark.parametrize("transport", ["socket", "kv"])
def test_a_missing_process_is_named_within_the_timeout(transport):
    def fn(g):
        if g.process_id == 2:  # alive but silent (its connections open) past the others' timeout
            time.sleep(1.5)
            return "stopped calling"
        t0 = time.monotonic()
        try:
            g.allgather("step", "x")
        except GroupTimeoutError as e:
            return e, time.monotonic() - t0

    out = run_all(3, fn, timeout_s=0.5, transport=transport)
    for e, seconds in out[:2]:
        assert e.process == 2 and "process 2 of 3 did not reach agreement step 0" in str(e)
        assert isinstance(e, HiCacheError) and 0.4 < seconds < 3.0


def test_bad_arguments():
    with pytest.raises(ValueError, match="timeout_s"):
        DistributedGroup(0, client=FakeStore(), process_id=0, num_processes=2)
    with pytest.raises(ValueError, match="delete_every"):
        DistributedGroup(1.0, client=FakeStore(), process_id=0, num_processes=2, delete_every=0)
    with pytest.raises(HiCacheError, match=r"jax\.distributed\.initialize"):
        DistributedGroup(1.0)
    out = run_all(2, lambda g: g.agree_min("m", np.arange(1 + g.process_id)))
    assert all(isinstance(e, GroupDivergedError) for e in out)


@pytest.mark.parametrize("transport", ["socket", "kv"])
def test_riders_go_with_the_next_agreement_whatever_it_is_for(transport):
    def fn(g):
        got = []
        g.ride("clock", lambda: f"t{g.process_id}", got.append)
        g.ride("other", lambda: "o", got.append)
        out = g.agree_min("m", [5 - g.process_id])  # carries both riders: one step
        g.flush()  # nothing waits: no step
        g.ride("clock", lambda: "late", got.append)
        g.flush()  # alone: a step of its own
        return out.tolist(), got, g.calls, g.calls_by_tag

    for min_, got, calls, by_tag in run_all(3, fn, transport=transport):
        assert min_ == [3] and got == [["t0", "t1", "t2"], ["o"] * 3, ["late"] * 3]
        assert calls == 2 and dict(by_tag) == {"m": 1, "riders": 1}
    local = []
    LocalGroup().ride("clock", lambda: "now", local.append)
    assert local == [["now"]]  # one process: taken at once


@pytest.mark.parametrize("transport", ["socket", "kv"])
def test_a_peer_without_the_same_riders_made_other_calls(transport):
    def fn(g):
        if g.process_id:
            g.ride("clock", lambda: "1", lambda v: None)
        return g.allgather("transfers", "x")

    out = run_all(2, fn, transport=transport)
    assert all(isinstance(e, GroupDivergedError) and e.field == "call" for e in out)
    assert "'transfers+clock'" in str(out[1]) and "'transfers'" in str(out[1])


@pytest.mark.parametrize("transport", ["socket", "kv"])
def test_agreed_clock_stamps_wait_for_no_one_and_deadlines_take_this_requests_reading(transport):
    def fn(g):
        local = iter([100.0 + g.process_id, 200.0 + g.process_id, 300.0 + g.process_id])
        clock = AgreedClock(g, lambda: next(local))  # agrees process 0's 100.0
        c0 = g.calls
        clock.sync()  # reads 200 only when an agreement carries it
        stamp = clock()
        stamped_calls = g.calls - c0
        fresh = clock.fresh()  # the request's reading now: process 0's 200.0
        clock.sync()
        g.agree_min("transfers", [1])  # carries process 0's 300.0
        return stamp, stamped_calls, fresh, clock(), g.calls - c0

    for stamp, stamped_calls, fresh, after, calls in run_all(2, fn, transport=transport):
        assert 100.0 <= stamp < 100.0 + 1e-6 and stamped_calls == 0
        assert 200.0 <= fresh < 200.0 + 1e-6
        assert 300.0 <= after < 300.0 + 1e-6 and calls == 2


# -- the socket transport (memory/group_socket.py) ----------------------------------------------


def test_socket_transport_carries_any_value_in_process_order():
    big = "x" * 3_000_000  # far beyond a socket's buffer: sent while the peers' frames are read
    values = ["", "a\x1eb\x1dc", "ünï\ncode", big, "1,2,3"]

    def fn(g):
        assert g.transport == "socket"
        return [g.allgather(f"s{k}", f"{v}|{g.process_id}") for k, v in enumerate(values * 4)]

    for got in run_all(3, fn, transport="socket"):
        assert got == [[f"{v}|{p}" for p in range(3)] for v in values * 4]


def test_a_closed_peer_is_named_at_once():
    def fn(g):
        if g.process_id == 1:
            g.close()  # as a killed process: its connections close
            return None
        t0 = time.monotonic()
        try:
            g.allgather("step", "x")
        except GroupTimeoutError as e:
            return e, time.monotonic() - t0

    e, seconds = run_all(2, fn, timeout_s=20.0, transport="socket")[0]
    assert e.process == 1 and "process 1 of 2 did not reach agreement step 0 ('step')" in str(e)
    assert "connection" in str(e) and seconds < 5.0  # not the 20 s timeout


def test_a_peer_that_never_joins_is_named_within_the_timeout():
    t0 = time.monotonic()
    with pytest.raises(GroupTimeoutError, match="process 1 of 2 did not connect") as e:
        DistributedGroup(0.5, name="t", client=FakeStore(), process_id=0, num_processes=2)
    assert e.value.process == 1 and time.monotonic() - t0 < 3.0
    with pytest.raises(GroupTimeoutError, match="process 0 of 2 did not publish its address"):
        DistributedGroup(0.5, name="t", client=FakeStore(), process_id=1, num_processes=2)


def test_an_unreachable_address_is_a_clear_error():
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    store = FakeStore()
    store.key_value_set("t/link/0", f"127.0.0.1:{closed}")  # process 0's address, gone
    with pytest.raises(
        GroupConnectError, match=f"cannot connect to process 0 at 127.0.0.1:{closed}"
    ) as e:
        DistributedGroup(2.0, name="t", client=store, process_id=1, num_processes=2)
    assert e.value.process == 0 and isinstance(e.value, GroupTimeoutError)
    with pytest.raises(GroupConnectError, match=r"cannot listen on 192\.0\.2\.1") as e:
        DistributedGroup(2.0, client=FakeStore(), process_id=0, num_processes=2, host="192.0.2.1")
    assert e.value.process == 0
    with pytest.raises(ValueError, match="transport"):
        DistributedGroup(1.0, client=FakeStore(), process_id=0, num_processes=2, transport="udp")
    with pytest.raises(ValueError, match="port"):
        DistributedGroup(1.0, client=FakeStore(), process_id=0, num_processes=2, port=-1)


def test_route_host_is_the_interface_toward_the_coordinator():
    assert route_host("127.0.0.1:8476") == "127.0.0.1"
    assert route_host(None) == "127.0.0.1"
