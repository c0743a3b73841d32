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

Encoding: ``block_hashes`` and ``token_ids`` are packed by numpy straight from the compact
records (:func:`_ints`: one msgpack int width per array) and spliced into msgspec's payload as
``msgspec.Raw``; no Python int is made per token.

Threading: the owning thread of the cache encodes each batch (msgspec, from the compact
records) and sends it on the PUB socket itself (zmq queues it; a socket may change threads
with the cache, whose ownership hand-over is a lock); a thread per cache ("hicache-kv-replay",
only with a replay endpoint) owns the ROUTER socket and answers replay requests from the last
``buffer_steps`` encoded batches (a deque under a lock). It never touches the cache. Waking a
sender thread per batch cost ~0.5 ms of GIL hand-over per call on 2 cores: measured, dropped.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import numpy as np

from hicache_jax.errors import HiCacheError
from hicache_jax.events import WIRE_MEDIUM, KVEventsConfig, Recorder, _Record, _Removed, _Stored

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_Raw: Any = None  # msgspec.Raw, bound by _import_deps (msgspec is an optional extra)


def _import_deps() -> tuple[Any, Any]:
    try:
        import msgspec
        import zmq
    except ImportError as e:
        raise HiCacheError(f"kv_events publisher='zmq' needs pyzmq and msgspec ({e}): install "
                           "the events extra, pip install -e \".[events]\" (or "
                           "pip install 'hicache-jax[events]')") from None
    global _Raw
    _Raw = msgspec.Raw
    return zmq, msgspec


# msgpack ints of a fixed width, narrowest first: (largest value, first byte, the packed record
# of that byte and the big-endian value). Any width is a valid msgpack encoding of any int it
# holds, so numpy can write a whole array at one width.
def _width(top: int, marker: int, fmt: str) -> tuple[int, int, np.dtype]:
    return top, marker, np.dtype([("m", "u1"), ("v", fmt)])


_UINT_WIDTHS = (_width(0xff, 0xcc, "u1"), _width(0xffff, 0xcd, ">u2"),
                _width(0xffff_ffff, 0xce, ">u4"), _width(0xffff_ffff_ffff_ffff, 0xcf, ">u8"))
_INT64 = _width(0, 0xd3, ">i8")


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes((0x90 | n,))
    return b"\xdc" + n.to_bytes(2, "big") if n < 0x10000 else b"\xdd" + n.to_bytes(4, "big")


def _ints(values: np.ndarray) -> Any:
    """A 1-D int array as a msgpack array of ints, without Python ints (what ``tolist()`` then
    msgspec would give, up to the width of each int: ~10 us, not ~150 us, for 14K tokens).

    Every element gets the narrowest width that holds the array's largest value (positive
    fixint below 128, then uint 8/16/32/64; int 64 if any is negative): one reduction (the
    max of the values read as unsigned, so a negative one shows as a top bit), then numpy
    writes the marker byte and the big-endian value of all elements in two assignments.

    Returns:
        ``msgspec.Raw``: msgspec splices it into the payload as it is.
    """
    n = values.shape[0]
    header = _array_header(n)
    if n == 0:
        return _Raw(header)
    size = values.dtype.itemsize
    if values.dtype == np.uint64:  # page hashes: nearly all need 8 bytes, so no reduction
        hi, negative = 1 << 63, 0
    elif values.dtype.kind == "i":
        hi = int(values.view(f"u{size}").max())
        negative = hi >> (8 * size - 1)
    else:
        hi, negative = int(values.max()), 0
    if negative:
        _, marker, dt = _INT64
    elif hi < 0x80:  # positive fixint: the value is the byte
        return _Raw(header + values.astype(np.uint8).tobytes())
    else:
        _, marker, dt = next(w for w in _UINT_WIDTHS if hi <= w[0])
    buf = np.empty(len(header) + n * dt.itemsize, np.uint8)
    buf[:len(header)] = np.frombuffer(header, np.uint8)
    body = buf[len(header):].view(dt)
    body["m"] = marker
    body["v"] = values
    return _Raw(memoryview(buf))


def _wire_key(key: Any) -> tuple[int | None, str | None]:
    """``(lora_id, lora_name)`` of an ``extra_key``: ints (bool, numpy ints: the one namespace the
    tree makes of them) that msgpack can hold as ``lora_id``, strings (numpy's and subclasses
    too) as ``lora_name``; any other key goes as neither (a router cannot tell it from None)."""
    if isinstance(key, (bool, np.bool_, int, np.integer)) and -2**63 <= int(key) < 2**64:
        return int(key), None
    if isinstance(key, str):
        return None, str(key)
    return None, None


def _wire(record: _Record) -> list:
    """One compact record as vLLM's array-like tagged event (hashes and tokens as Raw msgpack)."""
    if isinstance(record, _Stored):
        n = record.hashes.shape[0]
        lora_id, lora_name = _wire_key(record.extra_key)
        return ["BlockStored", _ints(record.hashes), record.parent, _ints(record.tokens),
                record.tokens.shape[0] // n, lora_id, WIRE_MEDIUM[record.medium], lora_name]
    if isinstance(record, _Removed):
        return ["BlockRemoved", _ints(record.hashes), WIRE_MEDIUM[record.medium]]
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
    """The PUB socket (the cache's owning thread sends on it) and the replay ROUTER socket with
    the thread that answers it (see the module doc)."""

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
            self._close_sockets([self._pub, self._replay])
            raise
        self._topic = cfg.topic.encode()
        self._lock = threading.Lock()
        self._history: collections.deque = collections.deque(maxlen=cfg.buffer_steps)
        self._stop = False
        self._thread = None
        if self._replay is not None:
            self._thread = threading.Thread(target=self._run, name="hicache-kv-replay",
                                            daemon=True)
            self._thread.start()

    def _bind(self, sock: Any, field: str, endpoint: str) -> None:
        try:
            sock.bind(endpoint)
        except self._zmq.ZMQError as e:
            raise HiCacheError(f"kv_events {field}={endpoint!r}: cannot bind ({e}); is the port "
                               "in use by another process or cache?") from None
        if not endpoint.startswith("inproc://"):
            self._bound.append(sock)

    def _close_sockets(self, socks: list[Any]) -> None:
        """Close sockets and wait (bounded) until their listeners are gone: zmq closes them in
        its I/O thread, and the endpoint is free only then (a new cache may bind it)."""
        zmq = self._zmq
        socks = [s for s in socks if s is not None]
        monitors = [s.get_monitor_socket(zmq.EVENT_CLOSED) for s in socks if s in self._bound]
        for sock in socks:
            sock.close(linger=0)
        for mon in monitors:
            if mon.poll(2000):  # the EVENT_CLOSED message (two frames)
                mon.recv_multipart()
            mon.close(linger=0)

    def put(self, seq: int, payload: bytes) -> int:
        """Send one encoded batch (owner thread) and keep it for replay. Returns 0: a PUB socket
        drops for a slow subscriber itself, who sees the gap in ``seq``."""
        seq_bytes = seq.to_bytes(8, "big")
        # Copied: a zero-copy send (copy=False, payloads from 64 KiB) has pyzmq's gc thread
        # wake and take the GIL to release each payload, ~30 us per request more than a memcpy.
        self._pub.send_multipart((self._topic, seq_bytes, payload))
        if self._replay is not None:
            with self._lock:
                self._history.append((seq, seq_bytes, payload))
        return 0

    def close(self) -> None:
        """Stop the replay thread, close the sockets (owner thread)."""
        self._stop = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._close_sockets([self._pub])

    def _run(self) -> None:
        try:
            while not self._stop:
                if self._replay.poll(100):
                    self._serve_replay()
        finally:
            self._close_sockets([self._replay])

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
            with self._lock:
                history = list(self._history)
            for seq, seq_bytes, payload in history:
                if seq >= first:
                    self._replay.send_multipart((client, b"", seq_bytes, payload))
            self._replay.send_multipart((client, b"", END_SEQ, b""))
