"""A KV-aware router: which instance holds the longest prefix of a request, on which tier.

It subscribes to the KV events of several caches (``HiCacheConfig(kv_events={"publisher": "zmq",
...})``, vLLM's wire format, so the same code reads vLLM's or SGLang's publishers) and keeps one
index per instance. It knows nothing of the caches' hash function: like NVIDIA Dynamo's router,
it learns each page from its ``BlockStored`` (parent hash + the page's tokens), so a query walks
the request's pages by tokens. Missed batches (a sequence gap, or a late start) are fetched
from the instance's replay socket.

Run it as a demo (two caches in this process, on two ipc endpoints)::

    python examples/kv_router.py

Needs the events extra: ``pip install -e ".[events]"``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Hashable, Sequence
from typing import Any

import msgspec
import numpy as np
import xxhash
import zmq

END_SEQ = -1


# -- the wire format (vLLM's msgspec structs, tagged; each event positional or, as vLLM now
# sends it, a map of field names tagged by "type": both decode) ------------------------------


class _Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(_Event):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None
    group_idx: int | None = None  # a model with several layer groups: which one
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(_Event):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(_Event):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_EVENTS = {cls.__name__: cls for cls in (BlockStored, BlockRemoved, AllBlocksCleared)}


def _event(ev: Any) -> _Event:
    """One event, positional ``[tag, *fields]`` or a map ``{"type": tag, field: ...}``."""
    if isinstance(ev, dict):
        cls = _EVENTS[ev["type"]]
        return cls(*(ev.get(f) for f in cls.__struct_fields__))
    cls = _EVENTS[ev[0]]
    return cls(*ev[1 : 1 + len(cls.__struct_fields__)])


def _decode(payload: bytes) -> KVEventBatch:
    ts, events, *rank = msgspec.msgpack.decode(payload)
    return KVEventBatch(ts, [_event(e) for e in events], *rank)


# -- Dynamo's block keys --------------------------------------------------------------------

DYNAMO_SEED = 1337


def dynamo_block_key(tokens: Sequence[int]) -> int:
    """A block's key as NVIDIA Dynamo's router computes it from the tokens alone: xxh3-64
    of the tokens as little-endian u32, seed 1337."""
    return xxhash.xxh3_64_intdigest(np.asarray(tokens, dtype="<u4").tobytes(), seed=DYNAMO_SEED)


# -- one instance's index -------------------------------------------------------------------

#: ``kv_cache_spec_kind`` of the groups an index keeps: a model with sliding-window or chunked
#: layers announces each group's pages apart (``group_idx``); this router scores by the
#: full-attention pages and skips the others' events.
FULL_KINDS = ("full_attention", "mla_attention")


class InstanceIndex:
    """Pages an instance holds: ``block_hash -> mediums``, and how to reach each page by
    tokens: ``(parent key, page tokens) -> block_hash`` (the parent key of a first page is its
    namespace, from ``lora_id`` / ``lora_name``)."""

    def __init__(self, keying: str = "tokens", block_size: int | None = None) -> None:
        """``keying="dynamo"`` keys a page by :func:`dynamo_block_key` of its tokens, and
        (like Dynamo) ignores a ``BlockStored`` whose ``block_size`` is not ``block_size``."""
        if keying not in ("tokens", "dynamo"):
            raise ValueError(f"keying={keying!r}: expected 'tokens' or 'dynamo'")
        if keying == "dynamo" and block_size is None:
            raise ValueError("keying='dynamo' needs the router's block_size")
        self.keying, self.block_size = keying, block_size
        self.dropped = 0
        self.mediums: dict[int, set[str]] = {}
        # A set: first pages of namespaces the wire cannot tell apart (extra_keys other than
        # None, int and str all arrive as lora_id = lora_name = None) share one key.
        self._by_tokens: dict[tuple, set[int]] = {}
        self._key_of: dict[int, tuple] = {}
        self._kinds: dict[int, str | None] = {}  # group_idx -> kind, learned from BlockStored

    def apply(self, batch: KVEventBatch) -> None:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                if ev.group_idx is not None:
                    self._kinds[ev.group_idx] = ev.kv_cache_spec_kind
                    if ev.kv_cache_spec_kind not in FULL_KINDS:
                        continue
                if self.block_size is not None and ev.block_size != self.block_size:
                    self.dropped += 1
                    continue
                parent: Any = ev.parent_block_hash
                if parent is None:
                    parent = ("namespace", ev.lora_id, ev.lora_name)
                ps = ev.block_size
                for i, h in enumerate(ev.block_hashes):
                    key = (parent, self._page_key(ev.token_ids[i * ps : (i + 1) * ps]))
                    self._by_tokens.setdefault(key, set()).add(h)
                    self._key_of[h] = key
                    self.mediums.setdefault(h, set()).add(ev.medium)
                    parent = h
            elif isinstance(ev, BlockRemoved):
                if ev.group_idx is not None and self._kinds.get(ev.group_idx) not in FULL_KINDS:
                    continue  # another group's pages (or one never stored here)
                for h in ev.block_hashes:
                    held = self.mediums.get(h)
                    if held is None:  # stored before this index started (see catch_up)
                        continue
                    held.discard(ev.medium)
                    if not held:
                        del self.mediums[h]
                        key = self._key_of.pop(h)
                        shared = self._by_tokens[key]
                        shared.discard(h)
                        if not shared:
                            del self._by_tokens[key]
            else:
                self.mediums.clear()
                self._by_tokens.clear()
                self._key_of.clear()

    def _page_key(self, tokens: Sequence[int]) -> Any:
        return dynamo_block_key(tokens) if self.keying == "dynamo" else tuple(tokens)

    def longest_prefix(
        self, tokens: Sequence[int], page_size: int, extra_key: Hashable = None
    ) -> tuple[int, int]:
        """``(tokens on device, further tokens on host only)`` of the longest cached prefix,
        as the cache's ``match_prefix`` counts them (L1 pages come first: a device page's
        ancestors are on device)."""
        if extra_key is not None and not isinstance(extra_key, (int, np.integer, str)):
            raise TypeError(
                f"extra_key={extra_key!r}: only None, int and str namespaces are "
                "on the wire (lora_id / lora_name)"
            )
        lora_id = int(extra_key) if isinstance(extra_key, (int, np.integer)) else None
        parent: Any = ("namespace", lora_id, extra_key if isinstance(extra_key, str) else None)
        device = host = 0
        toks = list(tokens)
        for start in range(0, len(toks) // page_size * page_size, page_size):
            found = self._by_tokens.get((parent, self._page_key(toks[start : start + page_size])))
            if not found:
                break
            h = min(found)  # one hash but for namespaces the wire cannot tell apart
            held = self.mediums[h]
            if "GPU" in held and host == 0:
                device += page_size
            elif "CPU" in held or "GPU" in held:
                host += page_size
            else:  # an L3 page (when announced): not on this instance's L1 / L2
                break
            parent = h
        return device, host


@dataclasses.dataclass(frozen=True)
class Answer:
    instance: str
    device_tokens: int  # of the prefix, on the instance's L1 ("GPU")
    host_tokens: int  # further tokens on its L2 ("CPU"): loaded back, not recomputed


# -- the router ------------------------------------------------------------------------------


class KVRouter:
    """Subscribes to instances' KV events (``{name: (endpoint, replay_endpoint or None)}``);
    call :meth:`poll` (or :meth:`sync`) to apply what arrived, :meth:`route` to ask."""

    def __init__(
        self,
        instances: dict[str, tuple[str, str | None]],
        *,
        topic: str = "kv-events",
        page_size: int,
        ctx: zmq.Context | None = None,
    ) -> None:
        self._ctx = ctx or zmq.Context.instance()
        self.page_size = page_size
        self.index = {name: InstanceIndex() for name in instances}
        self.next_seq = dict.fromkeys(instances, 0)
        self.restarts: dict[str, int] = {}  # indexes started over after an unrecoverable gap
        self._sub, self._replay = {}, {}
        for name, (endpoint, replay) in instances.items():
            sub = self._ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
            sub.connect(endpoint)
            self._sub[name] = sub
            if replay is not None:
                dealer = self._ctx.socket(zmq.DEALER)
                dealer.setsockopt(zmq.LINGER, 0)
                dealer.connect(replay)
                self._replay[name] = dealer

    def _apply(self, name: str, seq: int, payload: bytes) -> bool:
        """Apply batch ``seq`` if it is the next one; False on a gap (replay needed)."""
        if seq < self.next_seq[name]:
            return True  # already applied (replayed before the live copy arrived)
        if seq > self.next_seq[name]:
            return False
        self.index[name].apply(_decode(payload))
        self.next_seq[name] = seq + 1
        return True

    def catch_up(self, name: str, timeout_s: float = 10.0) -> None:
        """Ask ``name``'s replay socket for every batch from the next one expected."""
        dealer = self._replay.get(name)
        if dealer is None:
            raise RuntimeError(f"instance {name!r} missed batches and has no replay endpoint")
        dealer.send_multipart((b"", self.next_seq[name].to_bytes(8, "big")))
        while True:
            if not dealer.poll(int(timeout_s * 1000)):
                raise TimeoutError(f"no replay answer from {name!r} in {timeout_s} s")
            _, seq, payload = dealer.recv_multipart()
            seq = int.from_bytes(seq, "big", signed=True)
            if seq == END_SEQ:
                return
            if seq > self.next_seq[name]:
                # The replay buffer no longer holds the batches missed: start this instance's
                # index over from what it does hold (pages stored before are not announced
                # again, so the index can only answer too little, never too much).
                self.index[name] = InstanceIndex()
                self.next_seq[name] = seq
                self.restarts[name] = self.restarts.get(name, 0) + 1
            self._apply(name, seq, payload)

    def poll(self, timeout_ms: int = 0) -> int:
        """Apply every batch that has arrived (waiting up to ``timeout_ms`` for the first);
        returns how many messages were read."""
        poller = zmq.Poller()
        for sub in self._sub.values():
            poller.register(sub, zmq.POLLIN)
        read = 0
        ready = dict(poller.poll(timeout_ms))
        for name, sub in self._sub.items():
            while sub in ready:
                try:
                    _, seq, payload = sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                read += 1
                if not self._apply(name, int.from_bytes(seq, "big"), payload):
                    self.catch_up(name)
        return read

    def sync(self, name: str, batches: int, timeout_s: float = 10.0) -> None:
        """Wait until ``batches`` batches of ``name`` are applied (e.g. the cache's
        ``stats()["kv_event_batches"]``), replaying when the live stream stays silent."""
        deadline = time.monotonic() + timeout_s
        while self.next_seq[name] < batches:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name!r}: {self.next_seq[name]} of {batches} batches")
            if not self.poll(50) and self.next_seq[name] < batches and name in self._replay:
                self.catch_up(name)  # e.g. published before our subscription was in place

    def lookup(self, name: str, tokens: Sequence[int], extra_key: Hashable = None) -> Answer:
        dev, host = self.index[name].longest_prefix(tokens, self.page_size, extra_key)
        return Answer(name, dev, host)

    def route(self, tokens: Sequence[int], extra_key: Hashable = None) -> Answer:
        """The instance with the longest cached prefix (device tokens break ties)."""
        answers = [self.lookup(name, tokens, extra_key) for name in self.index]
        return max(answers, key=lambda a: (a.device_tokens + a.host_tokens, a.device_tokens))

    def close(self) -> None:
        for sock in [*self._sub.values(), *self._replay.values()]:
            sock.close(linger=0)


# -- demo -----------------------------------------------------------------------------------


def _serve(cache: Any, tokens: np.ndarray) -> None:
    """One request through the cache's handle, without the model (the pages' KV is not
    written): begin (match, load back, lock), the pages it computes, finish (insert, unlock)."""
    whole = tokens[: tokens.size // cache.spec.page_size * cache.spec.page_size]
    with cache.begin(whole) as req:
        req.extend(whole.size - req.cached_len)
        req.finish(whole)


def main() -> None:
    import tempfile

    from hicache_jax import HiCache, HiCacheConfig, KVSpec

    spec = KVSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", page_size=4)
    tmp = tempfile.mkdtemp(prefix="kv-router-")
    instances, caches = {}, {}
    for name in ("a", "b"):
        ep, replay = f"ipc://{tmp}/{name}", f"ipc://{tmp}/{name}-replay"
        instances[name] = (ep, replay)
        caches[name] = HiCache(
            spec,
            HiCacheConfig(
                device_pages=64,
                host_pages=128,
                kv_events={"publisher": "zmq", "endpoint": ep, "replay_endpoint": replay},
            ),
        )
    router = KVRouter(instances, page_size=spec.page_size)
    system_a, system_b = np.arange(32), np.arange(1000, 1024)
    _serve(caches["a"], system_a)
    _serve(caches["b"], system_b)
    caches["a"].evict(16)  # half of a's prefix goes to host (backed up) or is dropped
    for name, cache in caches.items():
        cache.flush()
        router.sync(name, cache.stats()["kv_event_batches"])
    for query in (np.concatenate([system_a, [7, 7, 7, 7]]), np.concatenate([system_b, [1] * 8])):
        print(f"query starting {query[:3].tolist()}...: {router.route(query)}")
    router.close()
    for cache in caches.values():
        cache.close()


if __name__ == "__main__":
    main()
