"""KV events over ZMQ: vLLM's wire format, decoded here by a subscriber written only against the
published format (msgspec structs with vLLM's field names), the replay socket, and the errors of
a bad configuration (bind failures leave nothing bound)."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

msgspec = pytest.importorskip("msgspec")
zmq = pytest.importorskip("zmq")

from helpers import bookkeeping_spec, make_cache, tree_pages  # noqa: E402
from helpers import serve as put  # noqa: E402
from hicache_jax import HiCache, HiCacheConfig, HiCacheError, KVSpec, Medium  # noqa: E402
from storage_servers import free_port  # noqa: E402

# -- the published format: vLLM's structs (vllm/distributed/kv_events.py), nothing of ours ----


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


DECODE = msgspec.msgpack.Decoder(KVEventBatch).decode
MEDIUM = {"GPU": Medium.DEVICE, "CPU": Medium.HOST}
PS = 4
SPEC = bookkeeping_spec(PS)
TIMEOUT_MS = 10_000


def zmq_events(endpoint, replay=None, buffer_steps=10_000, topic="kv-events", encoding="array"):
    """The positional form (the structs above) unless ``encoding`` says otherwise."""
    return {
        "publisher": "zmq",
        "endpoint": endpoint,
        "replay_endpoint": replay,
        "buffer_steps": buffer_steps,
        "topic": topic,
        "encoding": encoding,
    }


def make(kv_events, policy="write_back", device=16, host=32):
    return make_cache(SPEC, device, host, write_policy=policy, kv_events=kv_events)


class Subscriber:
    """A SUB socket (and a DEALER for replay): ``(seq, KVEventBatch)`` in order."""

    def __init__(self, endpoint, replay=None, topic=b"kv-events"):
        self.ctx = zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.dealer = None
        if replay is not None:
            self.dealer = self.ctx.socket(zmq.DEALER)
            self.dealer.setsockopt(zmq.LINGER, 0)
            self.dealer.connect(replay)
        self.topic = topic

    def recv(self):
        assert self.sub.poll(TIMEOUT_MS), "no batch published within the timeout"
        topic, seq, payload = self.sub.recv_multipart()
        assert topic == self.topic and len(seq) == 8
        return int.from_bytes(seq, "big"), DECODE(payload)

    def replay(self, start):
        self.dealer.send_multipart((b"", start.to_bytes(8, "big")))
        out = []
        while True:
            assert self.dealer.poll(TIMEOUT_MS), "no replay answer within the timeout"
            empty, seq, payload = self.dealer.recv_multipart()
            seq = int.from_bytes(seq, "big", signed=True)
            if seq == -1:
                assert (empty, payload) == (b"", b"")
                return out
            out.append((seq, DECODE(payload)))

    def until_connected(self, cache):
        """PUB drops what it sends before the subscription arrives: reset the (empty) cache
        until one AllBlocksCleared comes through; from then on nothing is missed."""
        for _ in range(200):
            cache.reset()
            if self.sub.poll(50):
                seq = self.recv_cleared()
                # the publisher thread may still hold later resets of this loop: take them all,
                # so that the test's next recv() is the batch of its own next call
                assert cache._events.wait_published(10)
                while self.sub.poll(200):
                    seq = self.recv_cleared()
                return seq
        raise AssertionError("the subscription never got through")

    def recv_cleared(self):
        """The seq of a batch whose last event is AllBlocksCleared, in either encoding."""
        import msgpack

        _, seq, payload = self.sub.recv_multipart()
        last = msgpack.unpackb(payload)[1][-1]
        assert last in (["AllBlocksCleared"], {"type": "AllBlocksCleared"}), last
        return int.from_bytes(seq, "big")

    def close(self):
        self.sub.close(linger=0)
        if self.dealer is not None:
            self.dealer.close(linger=0)


def apply(state: set, batch: KVEventBatch) -> set:
    """A per-instance index: ``(block_hash, medium)`` pairs, from the wire events only;
    ``(block_hash, medium, group_idx)`` for events that name their layer group."""

    def key(h, ev):
        m = MEDIUM[ev.medium]
        return (h, m) if ev.group_idx is None else (h, m, ev.group_idx)

    for ev in batch.events:
        if isinstance(ev, AllBlocksCleared):
            state.clear()
        elif isinstance(ev, BlockStored):
            assert len(ev.token_ids) == len(ev.block_hashes) * ev.block_size
            for h in ev.block_hashes:
                assert key(h, ev) not in state, "stored twice"
                state.add(key(h, ev))
        else:
            for h in ev.block_hashes:
                state.remove(key(h, ev))
    return state


@pytest.fixture
def tcp():
    return f"tcp://127.0.0.1:{free_port()}"


def test_wire_format_is_vllms_one_block_stored_per_node(tcp):
    cache = make(zmq_events(tcp))
    sub = Subscriber(tcp)
    try:
        seq0 = sub.until_connected(cache)
        put(cache, np.arange(12))
        seq, batch = sub.recv()
        assert seq == seq0 + 1 and batch.data_parallel_rank == 0 and batch.ts > 0
        (ev,) = batch.events  # three pages of one node: one BlockStored
        assert ev.block_size == PS and ev.token_ids == list(range(12)) and ev.medium == "GPU"
        assert ev.parent_block_hash is None and (ev.lora_id, ev.lora_name) == (None, None)
        node = cache.tree.match(np.arange(12)).node
        assert ev.block_hashes == node.page_hashes.tolist()
        cache.evict(12)  # write_back: to host, then off device
        _, batch = sub.recv()
        assert [(type(e).__name__, e.medium) for e in batch.events] == [
            ("BlockStored", "CPU"),
            ("BlockRemoved", "GPU"),
        ]
        put(cache, np.arange(4), extra_key="tenant")
        _, batch = sub.recv()
        assert batch.events[0].lora_name == "tenant"
    finally:
        sub.close()
        cache.close()


# vLLM's field lists (vllm/distributed/kv_events.py), as published: the map form tags each event
# under "type" (vLLM PR #42892); the positional form lists the same fields in this order.
STORED_FIELDS = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
]
REMOVED_FIELDS = ["block_hashes", "medium"]


def raw_batches(sub, cache, n):
    """``n`` payloads after the subscription got through, decoded by plain msgpack."""
    import msgpack

    sub.until_connected(cache)
    out = []
    for _ in range(n):
        assert sub.sub.poll(TIMEOUT_MS)
        _, _, payload = sub.sub.recv_multipart()
        out.append(msgpack.unpackb(payload))
    return out


def workload(cache):
    put(cache, np.arange(8), extra_key="tenant")
    cache.evict(8)  # write_back: to host, then off device


@pytest.mark.parametrize("encoding", ["map", "array", None])
def test_both_encodings_decode_with_msgpack_from_vllms_field_lists(tcp, encoding):
    kv = zmq_events(tcp, encoding=encoding)
    if encoding is None:
        del kv["encoding"]  # the default: vLLM's current (map) form
    cache = make(kv)
    sub = Subscriber(tcp)
    try:
        cache.reset()
        batches = raw_batches(sub, cache, 0)
        workload(cache)
        import msgpack

        for _ in range(2):
            assert sub.sub.poll(TIMEOUT_MS)
            batches.append(msgpack.unpackb(sub.sub.recv_multipart()[2]))
    finally:
        sub.close()
        cache.close()
    events = []
    for ts, evs, rank in batches:  # the batch stays [ts, events, dp_rank]
        assert ts > 0 and rank == 0
        for ev in evs:
            if (encoding or "map") == "map":
                assert isinstance(ev, dict)
                tag = ev.pop("type")
                want = STORED_FIELDS if tag == "BlockStored" else REMOVED_FIELDS
                assert sorted(ev) == sorted(want)
                events.append((tag, ev))
            else:
                assert isinstance(ev, list)
                tag, *values = ev
                want = STORED_FIELDS if tag == "BlockStored" else REMOVED_FIELDS
                assert len(values) == len(want)
                events.append((tag, dict(zip(want, values))))
    assert [(t, e["medium"]) for t, e in events] == [
        ("BlockStored", "GPU"),
        ("BlockStored", "CPU"),
        ("BlockRemoved", "GPU"),
    ]
    stored = events[0][1]
    assert stored["token_ids"] == list(range(8)) and stored["block_size"] == PS
    assert stored["lora_name"] == "tenant" and stored["parent_block_hash"] is None
    assert events[2][1]["block_hashes"] == stored["block_hashes"] == events[1][1]["block_hashes"]


GROUP_STORED = ["extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"]
W = 8


def window_spec():
    """Layers 0-2 sliding-window (``groups[0]``), layer 3 full (``groups[1]``)."""
    return KVSpec.from_pattern(
        "3:1", num_layers=4, num_kv_heads=2, head_dim=4, page_size=PS, window=W
    )


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_window_groups_on_the_wire_name_their_group_in_vllms_fields(tcp, encoding):
    cache = make_cache(
        window_spec(),
        16,
        32,
        write_policy="write_back",
        window_spare=False,  # pages no node end reads freed at insert: two kept
        kv_events=zmq_events(tcp, encoding=encoding),
    )
    sub = Subscriber(tcp)
    try:
        batches = raw_batches(sub, cache, 0)
        put(cache, np.arange(24))  # six pages; the window group keeps pages 4 and 5
        cache.evict(24)  # write_back: to host, then off device
        import msgpack

        for _ in range(2):
            assert sub.sub.poll(TIMEOUT_MS)
            batches.append(msgpack.unpackb(sub.sub.recv_multipart()[2]))
    finally:
        sub.close()
        cache.close()
    events = []
    for _, evs, _ in batches:
        for ev in evs:
            if encoding == "map":
                tag = ev.pop("type")
                if tag == "BlockStored":  # vLLM's omit_defaults: None fields left out
                    window = "kv_cache_spec_sliding_window" in ev
                    want = (
                        STORED_FIELDS + GROUP_STORED[1:]
                        if window
                        else STORED_FIELDS + GROUP_STORED[1:3]
                    )
                else:
                    want = REMOVED_FIELDS + ["group_idx"]
                assert sorted(ev) == sorted(want)
                events.append((tag, ev))
            else:
                tag, *values = ev
                want = (
                    STORED_FIELDS + GROUP_STORED
                    if tag == "BlockStored"
                    else REMOVED_FIELDS + ["group_idx"]
                )
                assert len(values) == len(want)
                events.append((tag, dict(zip(want, values))))
    summary = [
        (
            t,
            e["medium"],
            e["group_idx"],
            e.get("kv_cache_spec_kind"),
            e.get("kv_cache_spec_sliding_window"),
            len(e["block_hashes"]),
        )
        for t, e in events
    ]
    assert summary == [
        ("BlockStored", "GPU", 1, "full_attention", None, 6),
        ("BlockStored", "GPU", 0, "sliding_window", W, 2),
        ("BlockStored", "CPU", 1, "full_attention", None, 6),
        ("BlockStored", "CPU", 0, "sliding_window", W, 2),
        ("BlockRemoved", "GPU", 1, None, None, 6),
        ("BlockRemoved", "GPU", 0, None, None, 2),
    ]
    full, window = events[0][1], events[1][1]
    assert window["block_hashes"] == full["block_hashes"][4:]  # the same hashes per position
    assert window["parent_block_hash"] == full["block_hashes"][3]
    assert window["token_ids"] == list(range(16, 24)) and window["block_size"] == PS


def test_window_groups_replayed_from_the_socket_equal_the_cache_per_group(tcp):
    rng = np.random.default_rng(5)
    cache = make_cache(window_spec(), 12, 16, write_policy="write_back", kv_events=zmq_events(tcp))
    sub = Subscriber(tcp)
    state: set = set()
    try:
        sub.until_connected(cache)
        for _ in range(80):
            op = rng.integers(8)
            if op < 5:
                prefix = rng.integers(3, size=rng.integers(1, 5)).repeat(PS)
                put(cache, np.concatenate([prefix, rng.integers(50, size=PS * rng.integers(4))]))
            elif op == 5:
                cache.evict(int(rng.integers(1, 6)) * PS)
            elif op == 6:
                cache.evict_host(int(rng.integers(1, 6)) * PS)
            else:
                cache.flush()
        cache.flush()
        want = cache.stats()["kv_event_batches"]
        seq = -1
        while seq < want - 1:
            seq, batch = sub.recv()
            apply(state, batch)
        assert state == tree_pages(cache) and any(k[2] == 0 for k in state)
    finally:
        sub.close()
        cache.close()


def test_a_bad_encoding_is_refused():
    with pytest.raises(ValueError, match="encoding='json' is not one of"):
        HiCacheConfig(device_pages=4, kv_events={"publisher": "zmq", "encoding": "json"})


def test_random_workload_replayed_from_the_socket_equals_the_cache(tcp):
    rng = np.random.default_rng(7)
    cache = make(zmq_events(tcp), policy="clean_ahead", device=12, host=12)
    sub = Subscriber(tcp)
    state: set = set()
    try:
        sub.until_connected(cache)
        for step in range(120):
            op = rng.integers(10)
            if op < 6:
                prefix = rng.integers(3, size=rng.integers(1, 5)).repeat(PS)  # shared prefixes
                put(
                    cache,
                    np.concatenate([prefix, rng.integers(50, size=PS * rng.integers(3))]),
                    extra_key=[None, 1][int(rng.integers(2))],
                )
            elif op == 6:
                cache.evict(int(rng.integers(1, 6)) * PS)
            elif op == 7:
                cache.evict_host(int(rng.integers(1, 6)) * PS)
            elif op == 8:
                cache.flush()
            elif step % 40 == 9:
                cache.reset()
        cache.flush()
        want = cache.stats()["kv_event_batches"]
        seq = -1
        while seq < want - 1:
            seq, batch = sub.recv()
            apply(state, batch)
        assert state == tree_pages(cache) and state
        assert cache.stats()["kv_event_batches_dropped"] == 0
    finally:
        sub.close()
        cache.close()


def test_replay_socket_gives_a_late_subscriber_every_batch_from_a_seq(tmp_path):
    ep, rep = f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/replay"
    cache = make(zmq_events(ep, rep))
    try:
        for i in range(6):
            put(cache, np.arange(8) + 100 * i)  # six batches, nobody listening
        cache.evict(8)
        n = cache.stats()["kv_event_batches"]
        assert n == 7
        # replay serves the batches the publisher thread has sent: let it send the last one
        assert cache._events.wait_published(10)
        sub = Subscriber(ep, rep)
        try:
            got = sub.replay(2)
            assert [s for s, _ in got] == list(range(2, n))
            assert got[0][1].events[0].token_ids == list(range(200, 208))
            state = set()
            for _, batch in sub.replay(0):
                apply(state, batch)
            assert state == tree_pages(cache)
            assert sub.replay(n) == []  # nothing after the last: just the end marker
        finally:
            sub.close()
    finally:
        cache.close()


def test_replay_buffer_keeps_the_last_buffer_steps_batches(tmp_path):
    ep, rep = f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/replay"
    cache = make(zmq_events(ep, rep, buffer_steps=3), device=64)
    sub = Subscriber(ep, rep)
    try:
        for i in range(5):
            put(cache, np.arange(4) + 100 * i)
        cache.flush()
        for _ in range(100):  # the sender thread may still be sending: poll, bounded
            got = [s for s, _ in sub.replay(0)]
            if got and got[-1] == 4:
                break
        assert got == [2, 3, 4]
    finally:
        sub.close()
        cache.close()


def test_port_in_use_is_a_clear_error_naming_the_field_and_binds_nothing(tcp, tmp_path):
    a = make(zmq_events(tcp))
    try:
        with pytest.raises(
            HiCacheError,
            match=r"kv_events endpoint='tcp://127.0.0.1:\d+': "
            "cannot bind",
        ):
            make(zmq_events(tcp))
        rep = f"ipc://{tmp_path}/replay"
        b_ep = f"tcp://127.0.0.1:{free_port()}"
        with pytest.raises(HiCacheError, match="kv_events replay_endpoint="):
            make(zmq_events(b_ep, replay=tcp))  # the replay bind fails: the PUB is unbound
        make(zmq_events(b_ep, replay=rep)).close()  # so the same endpoint binds now
    finally:
        a.close()
    make(zmq_events(tcp)).close()  # close() unbound it


def test_a_port_in_use_also_releases_the_l3_backend_opened_before(tcp, tmp_path, monkeypatch):
    from hicache_jax.l3 import tier as l3

    closed, real_close = [], l3.L3Tier.close
    monkeypatch.setattr(l3.L3Tier, "close", lambda self: closed.append(1) or real_close(self))
    a = make(zmq_events(tcp))
    try:
        with pytest.raises(HiCacheError, match="cannot bind"):
            HiCache(
                SPEC,
                HiCacheConfig(
                    device_pages=16,
                    host_pages=32,
                    kv_events=zmq_events(tcp),
                    storage=f"file://{tmp_path}/l3",
                ),
            )
        assert closed == [1]
    finally:
        a.close()


def test_missing_extra_names_it(monkeypatch, tcp):
    import builtins

    real = builtins.__import__

    def no_zmq(name, *args, **kwargs):
        if name == "zmq":
            raise ImportError("No module named 'zmq'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_zmq)
    with pytest.raises(HiCacheError, match=r'pip install -e "\.\[events\]"'):
        make(zmq_events(tcp))


def test_take_events_with_zmq_says_where_events_go(tcp):
    cache = make(zmq_events(tcp))
    try:
        with pytest.raises(HiCacheError, match="ZMQ endpoint"):
            cache.take_events()
    finally:
        cache.close()


@pytest.mark.parametrize("n", [0, 1, 15, 16, 65535, 65536])
def test_int_arrays_packed_by_numpy_decode_as_the_ints(n):
    from hicache_jax.events import zmq as events_zmq

    events_zmq._import_deps()
    rng = np.random.default_rng(n)
    for hi in [1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**62]:
        a = rng.integers(0, hi, size=n, endpoint=True)
        a[:1] = hi
        for values in (a, a - hi // 2, a.astype(np.uint64) * np.uint64(3)):
            raw = events_zmq._ints(values)
            assert msgspec.msgpack.decode(msgspec.msgpack.encode([raw])) == [values.tolist()]


@pytest.mark.parametrize(
    "key,lora_id,lora_name",
    [
        (2**64, None, None),
        (-(2**63) - 1, None, None),
        (True, 1, None),
        (np.int64(7), 7, None),
        (np.str_("ns"), None, "ns"),
        (b"tenant", None, None),
        (("a", 1), None, None),
    ],
)
def test_every_extra_key_publishes_and_a_failed_publish_never_raises(key, lora_id, lora_name):
    """msgspec refused some extra_keys (ints beyond 64 bits, numpy strings): the error came out
    of the call after it had changed the cache, and the batch was lost without a seq gap."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    cache = make(zmq_events(endpoint))
    sub = Subscriber(endpoint)
    try:
        first = sub.until_connected(cache)
        put(cache, np.arange(2 * PS), key)
        seq, batch = sub.recv()
        stored = [e for e in batch.events if isinstance(e, BlockStored)]
        assert seq > first and stored
        assert (stored[0].lora_id, stored[0].lora_name) == (lora_id, lora_name)
        assert cache.stats()["kv_event_publish_errors"] == 0
        cache._events._publish = lambda *a: 1 / 0  # a publisher that fails: counted, no raise
        put(cache, np.arange(4 * PS), key)
        st = cache.stats()
        assert st["kv_event_publish_errors"] >= 1 and st["kv_event_batches_dropped"] >= 1
        assert "ZeroDivisionError" in cache._events.last_publish_error
        assert cache.match_prefix(np.arange(4 * PS), key).device_len == 4 * PS
    finally:
        sub.close()
        cache.close()


# -- the publisher thread ------------------------------------------------------------------


def test_publisher_thread_delivers_every_batch_in_order(tcp):
    cache = make(zmq_events(tcp), device=512)
    sub = Subscriber(tcp)
    try:
        first = sub.until_connected(cache)
        for i in range(300):  # faster than one wake-up of the thread each
            put(cache, np.arange(4) + 10 * i)
        got = [sub.recv() for _ in range(300)]
        assert [s for s, _ in got] == list(range(first + 1, first + 301))
        assert [b.events[0].token_ids[0] for _, b in got] == [10 * i for i in range(300)]
        assert cache.stats()["kv_event_batches_dropped"] == 0
    finally:
        sub.close()
        cache.close()


def test_close_sends_every_queued_batch_first(tcp):
    cache = make(zmq_events(tcp), device=512)
    sub = Subscriber(tcp)
    try:
        first = sub.until_connected(cache)
        gate = threading.Event()
        publisher = cache._events._publisher
        real_send = publisher._send
        publisher._send = lambda *a: gate.wait(10) and real_send(*a)  # the thread falls behind
        for i in range(20):
            put(cache, np.arange(4) + 10 * i)
        gate.set()
        cache.close()  # waits for the 20 queued batches
        assert [sub.recv()[0] for _ in range(20)] == list(range(first + 1, first + 21))
        assert cache.stats()["kv_event_batches_dropped"] == 0
    finally:
        sub.close()
        cache.close()


def test_a_publisher_thread_behind_by_buffer_steps_drops_the_oldest_and_counts(tcp):
    cache = make(zmq_events(tcp, buffer_steps=4), device=512)
    sub = Subscriber(tcp)
    try:
        first = sub.until_connected(cache)
        gate, entered = threading.Event(), threading.Event()
        publisher = cache._events._publisher
        real_send = publisher._send

        def slow_send(*a):
            entered.set()
            gate.wait(10)
            return real_send(*a)

        publisher._send = slow_send
        put(cache, np.arange(4))  # taken by the thread, which then waits
        assert entered.wait(10) and cache._events.wait_published(0.01) is False
        for i in range(1, 11):
            put(cache, np.arange(4) + 10 * i)  # 10 more: 6 dropped from the hand-off
        gate.set()
        assert cache._events.wait_published(10)
        seqs = [sub.recv()[0] - first for _ in range(5)]
        assert seqs[0] == 1 and seqs[1:] == [8, 9, 10, 11]  # the gap shows the 6 dropped
        assert cache.stats()["kv_event_batches_dropped"] == 6
    finally:
        sub.close()
        cache.close()


def test_a_failing_socket_is_counted_and_the_gap_is_visible(tcp):
    cache = make(zmq_events(tcp), device=512)
    sub = Subscriber(tcp)
    try:
        first = sub.until_connected(cache)
        publisher = cache._events._publisher
        real_pub = publisher._pub

        class Broken:
            def send_multipart(self, frames):
                raise zmq.ZMQError(zmq.EAGAIN, "the socket fails")

        assert cache._events.wait_published(10)
        publisher._pub = Broken()
        put(cache, np.arange(4))
        assert cache._events.wait_published(10)
        s = cache.stats()
        assert (s["kv_event_publish_errors"], s["kv_event_batches_dropped"]) == (1, 1)
        assert cache._events.last_publish_error.startswith(f"batch {first + 1}: ZMQError")
        publisher._pub = real_pub
        put(cache, np.arange(4) + 10)
        assert sub.recv()[0] == first + 2  # the failed batch is a gap in seq
    finally:
        sub.close()
        cache.close()


def test_replay_buffer_is_bounded_by_bytes_too(tmp_path):
    ep, rep = f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/replay"
    cache = make(zmq_events(ep, rep) | {"buffer_bytes": 300}, device=64)
    sub = Subscriber(ep, rep)
    try:
        for i in range(10):  # one-page batches: ~50-byte payloads
            put(cache, np.arange(4) + 100 * i)
            assert cache._events.wait_published(10)
        got = [s for s, _ in sub.replay(0)]
        assert 4 <= len(got) <= 6 and got == list(range(10 - len(got), 10))  # <= 300 bytes
        assert cache.stats()["kv_event_batches_dropped"] == 0  # sent: dropped from replay only
        put(cache, np.arange(8) + 5000)  # 2 pages, 304 bytes held: over the bound
        assert cache.stats()["kv_event_batches_dropped"] == 1  # dropped at the hand-off
        put(cache, np.arange(4) + 6000)
        assert cache._events.wait_published(10)
        assert [s for s, _ in sub.replay(10)] == [11]  # seq 10 is the gap
    finally:
        sub.close()
        cache.close()


def test_bench_events_runs_and_reports_each_thread(tmp_path, monkeypatch, capsys):
    """Smoke test of benchmarks/bench_events.py (the current tree only, 30 requests)."""
    import json
    import sys

    from benchmarks import bench_events

    out = tmp_path / "e.json"
    monkeypatch.setattr(
        sys, "argv", ["bench_events", "--quick", "--limit", "30", "--json", str(out)]
    )
    bench_events.main()
    text = capsys.readouterr().out
    assert "target zmq with a live subscriber within 1.5x of events off:" in text
    runs = json.loads(out.read_text())["results"]["runs"]["current"]
    (zmq_run,) = runs["zmq"]
    assert zmq_run["requests"] == 30 and isinstance(zmq_run["received_batches"], int)
    assert zmq_run["cpu_us_per_request"]["publisher"] > 0
    assert runs["off"][0]["cpu_us_per_request"]["publisher"] is None
