"""KV events over ZMQ, in vLLM's wire format (``HiCacheConfig(kv_events={"publisher": "zmq"})``).

Needs the ``events`` extra (``pip install -e ".[events]"``: pyzmq, msgspec).

Wire format (what vLLM's ``ZmqEventPublisher`` sends, and NVIDIA Dynamo's KV router and
SGLang-style subscribers read): each batch is one multipart message
``(topic, seq, payload)`` on a PUB socket the cache binds at ``endpoint``:

* ``topic``: the configured topic, UTF-8;
* ``seq``: the batch's sequence number, 8 bytes big-endian (0, 1, 2, ...; a gap means batches
  were dropped);
* ``payload``: msgpack of a ``KVEventBatch`` as vLLM's msgspec structs encode it
  (``array_like=True``, ``tag=True``): ``[ts, [event, ...], data_parallel_rank]`` with events

  - ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
    medium, lora_name]``: the stored pages of one tree node (``token_ids`` all their tokens,
    ``block_size`` the page size);
  - ``["BlockRemoved", block_hashes, medium]``;
  - ``["AllBlocksCleared"]``.

  ``medium`` is ``"GPU"`` for L1 and ``"CPU"`` for L2 (:data:`~hicache_jax.events.WIRE_MEDIUM`).
  The namespace (``extra_key``) is in the hashes already; an int ``extra_key`` is also sent as
  ``lora_id``, a str one as ``lora_name``.

A batch is the events of one public call of the cache, published when the call returns.

Replay (optional ``replay_endpoint``): a ROUTER socket. A client (DEALER or REQ) sends
``(b"", start_seq)`` with ``start_seq`` 8 bytes big-endian and receives ``(b"", seq, payload)``
for every buffered batch with ``seq >= start_seq`` (the last ``buffer_steps``), then
``(b"", -1 as 8 signed big-endian bytes, b"")``.

Threading: the owning thread of the cache encodes each batch (msgspec, from the compact
records) and appends the frames to a bounded deque; a sender thread ("hicache-kv-events") owns
both sockets from then on, sends, keeps the replay buffer and answers replay requests. It never
touches the cache. A full deque (the sender fell ``buffer_steps`` behind) drops its oldest batch
and counts it.
"""

from __future__ import annotations

import collections
import os
import threading
from typing import Any

from hicache_jax.errors import HiCacheError
from hicache_jax.events import WIRE_MEDIUM, KVEventsConfig, Recorder, _Record, _Removed, _Stored

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _import_deps() -> tuple[Any, Any]:
    try:
        import msgspec
        import zmq
    except ImportError as e:
        raise HiCacheError(f"kv_events publisher='zmq' needs pyzmq and msgspec ({e}): install "
                           "the events extra, pip install -e \".[events]\" (or "
                           "pip install 'hicache-jax[events]')") from None
    return zmq, msgspec


def _wire(record: _Record) -> list:
    """One compact record as vLLM's array-like tagged event."""
    if isinstance(record, _Stored):
        n = record.hashes.shape[0]
        key = record.extra_key
        lora_id = key if isinstance(key, int) and not isinstance(key, bool) else None
        return ["BlockStored", record.hashes.tolist(), record.parent, record.tokens.tolist(),
                record.tokens.shape[0] // n, lora_id, WIRE_MEDIUM[record.medium],
                key if isinstance(key, str) else None]
    if isinstance(record, _Removed):
        return ["BlockRemoved", record.hashes.tolist(), WIRE_MEDIUM[record.medium]]
    return ["AllBlocksCleared"]


class ZmqRecorder(Recorder):
    """``publisher="zmq"``: binds the sockets at construction (nothing stays bound if any bind
    fails) and starts the sender thread; :meth:`close` stops it and closes the sockets."""

    def __init__(self, cfg: KVEventsConfig) -> None:
        super().__init__()
        zmq, msgspec = _import_deps()
        self._encode = msgspec.msgpack.Encoder().encode
        self._rank = cfg.data_parallel_rank
        self._sender = _Sender(zmq, cfg)
        self._closed = False

    def _publish(self, seq: int, ts: float, records: list[_Record]) -> None:
        payload = self._encode([ts, [_wire(r) for r in records], self._rank])
        self._dropped += self._sender.put(seq, payload)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.end_call()
            self._sender.close()


class _Sender:
    """The sender thread and the two sockets it owns (see the module doc)."""

    def __init__(self, zmq: Any, cfg: KVEventsConfig) -> None:
        self._zmq = zmq
        ctx = zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._replay = None
        self._bound: list[Any] = []  # sockets with a tcp/ipc listener, to wait for at close
        try:
            self._bind(self._pub, "endpoint", cfg.endpoint)
            if cfg.replay_endpoint is not None:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._bind(self._replay, "replay_endpoint", cfg.replay_endpoint)
        except BaseException:
            self._close_sockets()
            raise
        self._topic = cfg.topic.encode()
        self._queue: collections.deque = collections.deque()
        self._max = cfg.buffer_steps
        self._lock = threading.Lock()
        self._history: collections.deque = collections.deque(maxlen=cfg.buffer_steps)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="hicache-kv-events", daemon=True)
        self._thread.start()

    def _bind(self, sock: Any, field: str, endpoint: str) -> None:
        try:
            sock.bind(endpoint)
        except self._zmq.ZMQError as e:
            raise HiCacheError(f"kv_events {field}={endpoint!r}: cannot bind ({e}); is the port "
                               "in use by another process or cache?") from None
        if not endpoint.startswith("inproc://"):
            self._bound.append(sock)

    def _close_sockets(self) -> None:
        """Close both sockets and wait (bounded) until their listeners are gone: zmq closes
        them in its I/O thread, and the endpoint is free only then (a new cache may bind it)."""
        zmq = self._zmq
        monitors = [s.get_monitor_socket(zmq.EVENT_CLOSED) for s in self._bound]
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        for mon in monitors:
            if mon.poll(2000):  # the EVENT_CLOSED message (two frames)
                mon.recv_multipart()
            mon.close(linger=0)

    def put(self, seq: int, payload: bytes) -> int:
        """Queue one encoded batch for the thread (owner thread). Returns batches dropped."""
        with self._lock:
            dropped = len(self._queue) >= self._max
            if dropped:
                self._queue.popleft()
            self._queue.append((seq.to_bytes(8, "big"), payload))
        self._wake()
        return int(dropped)

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:  # the pipe is full: the thread has a wake-up waiting already
            pass

    def close(self) -> None:
        """Send what is queued, stop the thread, close the sockets (owner thread)."""
        self._stop = True
        self._wake()
        self._thread.join(timeout=10)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _run(self) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if self._wake_r in ready:
                    try:
                        os.read(self._wake_r, 1 << 16)
                    except BlockingIOError:
                        pass
                with self._lock:
                    batch, self._queue = self._queue, collections.deque()
                for seq, payload in batch:
                    self._pub.send_multipart((self._topic, seq, payload), copy=False)
                    self._history.append((seq, payload))
                if self._replay is not None and self._replay in ready:
                    self._serve_replay()
                if self._stop and not self._queue:
                    return
        finally:
            self._close_sockets()

    def _serve_replay(self) -> None:
        zmq = self._zmq
        while True:
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[2]) != 8:
                continue  # not a replay request (identity, b"", 8-byte seq): ignored
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in self._history:
                if int.from_bytes(seq, "big") >= first:
                    self._replay.send_multipart((client, b"", seq, payload))
            self._replay.send_multipart((client, b"", END_SEQ, b""))
