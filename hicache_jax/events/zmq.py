"""KV events over ZMQ, in vLLM's wire format (``HiCacheConfig(kv_events={"publisher": "zmq"})``).

Needs the ``events`` extra (``pip install -e ".[events]"``: pyzmq, msgspec).

Wire format (what vLLM's ``ZmqEventPublisher`` sends, and NVIDIA Dynamo's KV router and
SGLang-style subscribers read): each batch is one multipart message
``(topic, seq, payload)`` on a PUB socket the cache binds at ``endpoint``:

* ``topic``: the configured topic, UTF-8;
* ``seq``: the batch's sequence number, 8 bytes big-endian (0, 1, 2, ...; a gap means batches
  were dropped);
* ``payload``: msgpack of a ``KVEventBatch`` as vLLM's msgspec structs encode it:
  ``[ts, [event, ...], data_parallel_rank]``, each event (``encoding``)

  - ``"map"`` (the default; vLLM since PR #42892, e.g. v0.26): a map tagged by ``"type"``,
    ``{"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size",
    "lora_id", "medium", "lora_name"}``, ``{"type": "BlockRemoved", "block_hashes",
    "medium"}``, ``{"type": "AllBlocksCleared"}`` (vLLM's later ``extra_keys`` is left out,
    as msgspec's ``omit_defaults`` leaves out a None field: a consumer reads by name);
  - ``"array"`` (vLLM before it, ``array_like=True, tag=True``):
    ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
    medium, lora_name]``, ``["BlockRemoved", block_hashes, medium]``, ``["AllBlocksCleared"]``
    (vLLM's trailing fields, which have defaults, left out).

  Layer groups (a spec with window groups; ``kv_events`` ``groups``): every event names its
  group with vLLM's hybrid-model fields. A map BlockStored adds ``"group_idx"``,
  ``"kv_cache_spec_kind"`` and, for a sliding-window group, ``"kv_cache_spec_sliding_window"``;
  a map BlockRemoved adds ``"group_idx"``. A positional BlockStored continues after
  ``lora_name`` with ``extra_keys`` (None), ``group_idx``, ``kv_cache_spec_kind``,
  ``kv_cache_spec_sliding_window`` (None but for a sliding-window group); a positional
  BlockRemoved with ``group_idx``. Without window groups neither form changes.

  A BlockStored holds the stored pages of one tree node (``token_ids`` all their tokens,
  ``block_size`` the page size). ``medium`` is ``"GPU"`` for L1 and ``"CPU"`` for L2
  (:data:`~hicache_jax.events.records.WIRE_MEDIUM`), L3's configured name when announced.
  The namespace (``extra_key``) is in the hashes already; an int ``extra_key`` is also sent as
  ``lora_id``, a str one as ``lora_name``.

A batch is the events of one public call of the cache, sealed when the call returns and
published by the publisher thread a few milliseconds later (below).

Replay (optional ``replay_endpoint``): a ROUTER socket. A client (DEALER or REQ) sends
``(b"", start_seq)`` with ``start_seq`` 8 bytes big-endian and receives ``(b"", seq, payload)``
for every buffered batch with ``seq >= start_seq`` (the last ``buffer_steps`` sent, within
``buffer_bytes`` of payloads), then ``(b"", -1 as 8 signed big-endian bytes, b"")``.

Encoding: ``block_hashes`` and ``token_ids`` are packed by numpy straight from the compact
records (:func:`_ints`: one msgpack int width per array) and spliced into msgspec's payload as
``msgspec.Raw``; no Python int is made per token.

Threading (as vLLM's ``ZmqEventPublisher``): the owning thread of the cache only seals a batch
and appends it to a bounded hand-off queue (``buffer_steps`` batches, ``buffer_bytes`` of
records; beyond either the oldest waiting batches are dropped and counted in
``kv_event_batches_dropped``: a gap in ``seq``). A thread per cache ("hicache-kv-events") owns
both sockets: woken by the first batch, it waits ``_GATHER_S`` (2 ms) for more, then encodes
and sends every waiting batch, in order, and answers replay requests from the batches it sent
(polling the ROUTER socket every 20 ms while idle). It never touches the cache. An encode or
send error is counted (``kv_event_publish_errors`` and dropped: a gap in ``seq``), kept in
``last_publish_error``, and never raised. The wait matters on few cores: woken for each batch,
the thread took the GIL from the cache once per call (on 2 cores slower than encoding and
sending on the owning thread); gathered, it takes it every few milliseconds.

``close()`` (``HiCache.close``) waits until the thread has sent every batch sealed before it
(at most ``CLOSE_TIMEOUT_S``), then the PUB socket lingers up to 1 s to deliver them to the
connected subscribers; a batch sealed after it is a publish error.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from hicache_jax.errors import HiCacheError
from hicache_jax.events.block_ids import VllmIds
from hicache_jax.events.recorder import BoundedBatches, Recorder
from hicache_jax.events.records import Record, RemovedRecord, StoredRecord, wire_media
from hicache_jax.spec import KVEventsConfig

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_Raw: Any = None  # msgspec.Raw, bound by _import_deps (msgspec is an optional extra)


def _import_deps() -> tuple[Any, Any]:
    try:
        import msgspec
        import zmq
    except ImportError as e:
        raise HiCacheError(
            f"kv_events publisher='zmq' needs pyzmq and msgspec ({e}): install "
            'the events extra, pip install -e ".[events]" (or '
            "pip install 'hicache-jax[events]')"
        ) from None
    global _Raw
    _Raw = msgspec.Raw
    return zmq, msgspec


# msgpack ints of a fixed width, narrowest first: (largest value, first byte, the packed record
# of that byte and the big-endian value). Any width is a valid msgpack encoding of any int it
# holds, so numpy can write a whole array at one width.
def _width(top: int, marker: int, fmt: str) -> tuple[int, int, np.dtype]:
    return top, marker, np.dtype([("m", "u1"), ("v", fmt)])


_UINT_WIDTHS = (
    _width(0xFF, 0xCC, "u1"),
    _width(0xFFFF, 0xCD, ">u2"),
    _width(0xFFFF_FFFF, 0xCE, ">u4"),
    _width(0xFFFF_FFFF_FFFF_FFFF, 0xCF, ">u8"),
)
_INT64 = _width(0, 0xD3, ">i8")


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
    buf[: len(header)] = np.frombuffer(header, np.uint8)
    body = buf[len(header) :].view(dt)
    body["m"] = marker
    body["v"] = values
    # An ndarray is a buffer; numpy's stubs declare __buffer__ only for Python >= 3.12.
    return _Raw(memoryview(buf))  # type: ignore[arg-type]


def _wire_key(key: Any) -> tuple[int | None, str | None]:
    """``(lora_id, lora_name)`` of an ``extra_key``: ints (bool, numpy ints: the one namespace the
    tree makes of them) that msgpack can hold as ``lora_id``, strings (numpy's and subclasses
    too) as ``lora_name``; any other key goes as neither (a router cannot tell it from None)."""
    if isinstance(key, (bool, np.bool_, int, np.integer)) and -(2**63) <= int(key) < 2**64:
        return int(key), None
    if isinstance(key, str):
        return None, str(key)
    return None, None


def _wire_array(record: Record, media: dict) -> list:
    """One compact record as vLLM's positional tagged event (hashes and tokens as Raw msgpack)."""
    if isinstance(record, StoredRecord):
        n = record.hashes.shape[0]
        lora_id, lora_name = _wire_key(record.extra_key)
        out = [
            "BlockStored",
            _ints(record.hashes),
            record.parent,
            _ints(record.tokens),
            record.tokens.shape[0] // n,
            lora_id,
            media[record.medium],
            lora_name,
        ]
        tag = record.group
        if tag is not None:  # extra_keys (None), then the group's fields
            out += [None, tag.idx, tag.kind, tag.sliding_window]
        return out
    if isinstance(record, RemovedRecord):
        out = ["BlockRemoved", _ints(record.hashes), media[record.medium]]
        if record.group is not None:
            out.append(record.group.idx)
        return out
    return ["AllBlocksCleared"]


def _wire_map(record: Record, media: dict) -> dict:
    """One compact record as vLLM's map event: field names, the tag under ``"type"``."""
    if isinstance(record, StoredRecord):
        n = record.hashes.shape[0]
        lora_id, lora_name = _wire_key(record.extra_key)
        out = {
            "type": "BlockStored",
            "block_hashes": _ints(record.hashes),
            "parent_block_hash": record.parent,
            "token_ids": _ints(record.tokens),
            "block_size": record.tokens.shape[0] // n,
            "lora_id": lora_id,
            "medium": media[record.medium],
            "lora_name": lora_name,
        }
        tag = record.group
        if tag is not None:  # as vLLM's omit_defaults: a None field is left out
            out["group_idx"] = tag.idx
            out["kv_cache_spec_kind"] = tag.kind
            if tag.sliding_window is not None:
                out["kv_cache_spec_sliding_window"] = tag.sliding_window
        return out
    if isinstance(record, RemovedRecord):
        out = {
            "type": "BlockRemoved",
            "block_hashes": _ints(record.hashes),
            "medium": media[record.medium],
        }
        if record.group is not None:
            out["group_idx"] = record.group.idx
        return out
    return {"type": "AllBlocksCleared"}


_WIRE = {"array": _wire_array, "map": _wire_map}


class ZmqRecorder(Recorder):
    """``publisher="zmq"``: binds the sockets at construction (nothing stays bound if any bind
    fails) and starts the publisher thread; :meth:`close` sends what is queued, stops it and
    closes the sockets."""

    def __init__(
        self,
        cfg: KVEventsConfig,
        ids: VllmIds | None = None,
        l3_medium: str | None = None,
        l3: bool | None = None,
    ) -> None:
        super().__init__(ids, l3_medium is not None if l3 is None else l3)
        zmq, msgspec = _import_deps()
        self._publisher = _Publisher(
            zmq, msgspec.msgpack.Encoder().encode, cfg, self, wire_media(l3_medium)
        )
        self._closed = False

    def _publish(self, seq: int, ts: float, records: list[Record], nbytes: int) -> None:
        self._dropped += self._publisher.put(seq, ts, records, nbytes)

    def stats(self) -> dict[str, int]:
        out = super().stats()
        out["kv_event_batches_dropped"] += self._publisher.dropped
        out["kv_event_publish_errors"] += self._publisher.errors
        return out

    def l3_attached(self, medium: str | None) -> None:
        """The wire name of L3 from now on: once every batch sealed so far is sent (they name
        the previous store's medium), the publisher thread takes the new names."""
        media = wire_media(medium)
        if media != self._publisher.media:
            self.wait_published(CLOSE_TIMEOUT_S)
            self._publisher.media = media

    def wait_published(self, timeout: float | None = None) -> bool:
        """Wait until every sealed batch is sent (or counted dropped); False on timeout."""
        return self._publisher.wait_idle(timeout)

    def close(self) -> None:
        """Seal the pending batch, wait (at most ``CLOSE_TIMEOUT_S``) until the publisher thread
        has sent every queued batch, then stop it and close the sockets. Idempotent."""
        if not self._closed:
            self._closed = True
            self.end_call()
            self._publisher.close()


#: How long :meth:`ZmqRecorder.close` waits for the queued batches to be sent, and then how long
#: the PUB socket lingers to deliver them to connected subscribers.
CLOSE_TIMEOUT_S = 10.0
_LINGER_MS = 1000
_IDLE_POLL_MS = 20  # how often an idle publisher thread looks at the replay socket
_GATHER_S = 0.002  # once woken, how long the publisher thread waits for more batches


class _Publisher:
    """The publisher thread ("hicache-kv-events") and the sockets it owns (see the module doc).

    The owning thread of the cache only calls :meth:`put` (a lock, an append, a notify when the
    thread sleeps); everything else of a batch happens on the thread.
    """

    def __init__(
        self, zmq: Any, encode: Any, cfg: KVEventsConfig, recorder: Recorder, media: dict
    ) -> None:
        self._zmq, self._encode, self._recorder = zmq, encode, recorder
        self._rank = cfg.data_parallel_rank
        self._wire, self.media = _WIRE[cfg.encoding], media
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
            self._close_sockets([self._pub, self._replay], linger_ms=0)
            raise
        self._topic = cfg.topic.encode()
        # Shared with the owning thread, under _cv: the hand-off queue and the flags.
        self._cv = threading.Condition(threading.Lock())
        self._queue = BoundedBatches(cfg.buffer_steps, cfg.buffer_bytes)
        self._sleeping = self._busy = self._stop = False
        # The thread's own (the owning thread only reads the counters):
        self._history = BoundedBatches(cfg.buffer_steps, cfg.buffer_bytes)
        self.dropped = self.errors = 0
        self._thread = threading.Thread(target=self._run, name="hicache-kv-events", daemon=True)
        self._thread.start()

    def _bind(self, sock: Any, field: str, endpoint: str) -> None:
        try:
            sock.bind(endpoint)
        except self._zmq.ZMQError as e:
            raise HiCacheError(
                f"kv_events {field}={endpoint!r}: cannot bind ({e}); is the port "
                "in use by another process or cache?"
            ) from None
        if not endpoint.startswith("inproc://"):
            self._bound.append(sock)

    def _close_sockets(self, socks: list[Any], linger_ms: int) -> None:
        """Close sockets and wait (bounded) until their listeners are gone: zmq closes them in
        its I/O thread, and the endpoint is free only then (a new cache may bind it)."""
        zmq = self._zmq
        socks = [s for s in socks if s is not None]
        monitors = [s.get_monitor_socket(zmq.EVENT_CLOSED) for s in socks if s in self._bound]
        for sock in socks:
            sock.close(linger=linger_ms)
        for mon in monitors:
            if mon.poll(2000):  # the EVENT_CLOSED message (two frames)
                mon.recv_multipart()
            mon.close(linger=0)

    # -- the owning thread ---------------------------------------------------------------------

    def put(self, seq: int, ts: float, records: list[Record], nbytes: int) -> int:
        """Queue a sealed batch for the thread; returns how many queued batches were dropped to
        stay within ``buffer_steps`` / ``buffer_bytes`` (the thread fell that far behind)."""
        with self._cv:
            if self._stop:
                raise HiCacheError("the KV event publisher is closed")
            dropped = self._queue.append((seq, ts, records), nbytes)
            if self._sleeping:
                self._sleeping = False
                self._cv.notify()
        return dropped

    def wait_idle(self, timeout: float | None) -> bool:
        with self._cv:
            return self._cv.wait_for(
                lambda: not (self._queue or self._busy) or not self._thread.is_alive(), timeout
            )

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=CLOSE_TIMEOUT_S + 2 * _LINGER_MS / 1000)

    # -- the publisher thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    batches = self._queue.take()
                    stop = self._stop
                    if not batches and not stop:
                        self._busy = False
                        self._cv.notify_all()  # wait_idle
                        self._sleeping = True
                        self._cv.wait(_IDLE_POLL_MS / 1000 if self._replay is not None else None)
                        self._sleeping = False
                        if _GATHER_S and self._queue and not self._stop:
                            self._cv.release()
                            time.sleep(_GATHER_S)
                            self._cv.acquire()
                        batches = self._queue.take()
                        stop = self._stop
                    self._busy = bool(batches)
                for seq, ts, records in batches:
                    self._send(seq, ts, records)
                if self._replay is not None:
                    self._serve_replay(self._replay)
                if stop and not batches:
                    with self._cv:
                        if not self._queue:
                            return
        finally:
            with self._cv:
                self._busy = False
                self._cv.notify_all()
            self._close_sockets([self._pub, self._replay], linger_ms=_LINGER_MS)

    def _send(self, seq: int, ts: float, records: list[Record]) -> None:
        seq_bytes = seq.to_bytes(8, "big")
        try:
            wire, media = self._wire, self.media
            payload = self._encode([ts, [wire(r, media) for r in records], self._rank])
            # Copied: a zero-copy send (copy=False, payloads from 64 KiB) has pyzmq's gc thread
            # wake and take the GIL to release each payload, ~30 us per request more.
            self._pub.send_multipart((self._topic, seq_bytes, payload))
        except Exception as e:  # counted as the owner thread counts its own (a gap in seq)
            self.dropped += 1
            self.errors += 1
            self._recorder.last_publish_error = f"batch {seq}: {e!r}"
            return
        if self._replay is not None:
            self._history.append((seq, seq_bytes, payload), len(payload))

    def _serve_replay(self, replay: Any) -> None:
        zmq = self._zmq
        while True:
            try:
                frames = replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[2]) != 8:
                continue  # not a replay request (identity, b"", 8-byte seq): ignored
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, seq_bytes, payload in self._history:
                if seq >= first:
                    replay.send_multipart((client, b"", seq_bytes, payload))
            replay.send_multipart((client, b"", END_SEQ, b""))
