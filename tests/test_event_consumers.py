"""Consumer conformance: subscribers written only from the published formats of the consumers
hicache_jax's KV events feed, each replayed a random workload (evictions, host evictions,
load-backs, L3 prefetches from a file:// store, ``invalidate`` of prefixes and namespaces,
storage detached and attached again, resets) and checked against the cache's own ``lookup``:

* vLLM positional: each event ``[tag, *fields]`` in vLLM's field order;
* vLLM map (vLLM PR #42892): each event a map of field names tagged by ``"type"``;
* NVIDIA Dynamo: keys a block by xxh3-64 of its tokens as little-endian u32 (seed 1337), maps
  ``medium`` strings to tiers (GPU/DEVICE device; CPU/CPU_PINNED/CPU_TIER1 host;
  CPU_TIER2/DISK/NVME/STORAGE disk; EXTERNAL/REMOTE external) and drops a block whose
  ``block_size`` differs from its own;
* llm-d: drops a BlockStored whose parent it does not know; here it must drop nothing.

On L3 (``DISK``) the consumers' view must be sound: every page they hold there is in the store
(invalidated pages are announced removed), and nothing while the storage is detached.

The batches come back from the replay socket (every batch from seq 0, no subscription race).
"""

from __future__ import annotations

import collections
import itertools

import numpy as np
import pytest

msgpack = pytest.importorskip("msgpack")
zmq = pytest.importorskip("zmq")
pytest.importorskip("msgspec")
xxhash = pytest.importorskip("xxhash")

from helpers import bookkeeping_spec, make_cache, replay_all, serve  # noqa: E402  # noqa: E402

PS = 4
STORED = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
]
REMOVED = ["block_hashes", "medium"]
DYNAMO_TIER = {
    "GPU": "device",
    "DEVICE": "device",
    "CPU": "host",
    "CPU_PINNED": "host",
    "CPU_TIER1": "host",
    "CPU_TIER2": "disk",
    "DISK": "disk",
    "NVME": "disk",
    "STORAGE": "disk",
    "EXTERNAL": "external",
    "REMOTE": "external",
}
_ports = itertools.count()


# -- decoding, from vLLM's published field lists ----------------------------------------------


def decode_positional(ev: list) -> tuple[str, dict]:
    tag, *values = ev
    fields = {"BlockStored": STORED, "BlockRemoved": REMOVED}.get(tag, [])
    return tag, dict(zip(fields, values))


def decode_map(ev: dict) -> tuple[str, dict]:
    ev = dict(ev)
    return ev.pop("type"), ev


# -- consumers --------------------------------------------------------------------------------


class TierIndex:
    """Blocks per tier, reached by ``(parent key, page key)``; ``page_key`` and ``tier`` are
    the consumer's rules. ``block_size``: blocks of another size are dropped (Dynamo)."""

    def __init__(self, page_key, tier, block_size=None, parent_rule=False):
        self.page_key, self.tier, self.block_size = page_key, tier, block_size
        self.parent_rule = parent_rule
        self.tiers: dict[int, set[str]] = {}
        self.by_key: dict[tuple, int] = {}
        self.key_of: dict[int, tuple] = {}
        self.dropped = self.unknown_removed = 0

    def apply(self, tag: str, ev: dict) -> None:
        if tag == "AllBlocksCleared":
            self.tiers.clear(), self.by_key.clear(), self.key_of.clear()
        elif tag == "BlockStored":
            if self.block_size is not None and ev["block_size"] != self.block_size:
                self.dropped += 1
                return
            parent = ev["parent_block_hash"]
            if self.parent_rule and parent is not None and parent not in self.tiers:
                self.dropped += 1  # llm-d: an unknown parent, the event is skipped
                return
            ps, toks = ev["block_size"], ev["token_ids"]
            pkey = parent if parent is not None else ("ns", ev["lora_id"], ev["lora_name"])
            for i, h in enumerate(ev["block_hashes"]):
                key = (pkey, self.page_key(toks[i * ps : (i + 1) * ps]))
                self.by_key[key], self.key_of[h] = h, key
                self.tiers.setdefault(h, set()).add(self.tier(ev["medium"]))
                pkey = h
        elif tag == "BlockRemoved":
            for h in ev["block_hashes"]:
                held = self.tiers.get(h)
                if held is None:  # never stored here (dropped): a consumer ignores it
                    self.unknown_removed += 1
                    continue
                held.discard(self.tier(ev["medium"]))
                if not held:
                    del self.tiers[h]
                    self.by_key.pop(self.key_of.pop(h), None)

    def lookup(self, tokens, device_tier, host_tier, lora_name=None) -> dict[str, int]:
        """Tokens on device from the start, then further tokens on host (the cache's rule)."""
        key, device, host = ("ns", None, lora_name), 0, 0
        for start in range(0, len(tokens) // PS * PS, PS):
            h = self.by_key.get((key, self.page_key(tokens[start : start + PS])))
            if h is None:
                break
            held = self.tiers[h]
            if device_tier in held and host == 0:
                device += PS
            elif host_tier in held or device_tier in held:
                host += PS
            else:
                break
            key = h
        return {"device": device, "host": host}


def dynamo_key(tokens) -> int:
    return xxhash.xxh3_64_intdigest(np.asarray(tokens, "<u4").tobytes(), seed=1337)


def consumers():
    same = lambda m: m  # noqa: E731
    return {
        "vllm": TierIndex(tuple, same),
        "dynamo": TierIndex(dynamo_key, DYNAMO_TIER.__getitem__, block_size=PS),
        "dynamo_other_size": TierIndex(dynamo_key, DYNAMO_TIER.__getitem__, block_size=2 * PS),
        "llm-d": TierIndex(tuple, same, parent_rule=True),
    }


# -- the workload -----------------------------------------------------------------------------


def run(
    encoding: str, tmp_path, seed: int, l3_policy: str = "write_through", block_hash: str = "tree"
):
    rng = np.random.default_rng(seed)
    n = next(_ports)
    ep, rep = f"inproc://consumers-{n}", f"inproc://consumers-replay-{n}"
    cache = make_cache(
        bookkeeping_spec(PS),
        12,
        16,
        write_policy="write_through",
        storage=f"file://{tmp_path}/l3-{n}",
        storage_write_policy=l3_policy,
        kv_events={
            "publisher": "zmq",
            "endpoint": ep,
            "replay_endpoint": rep,
            "encoding": encoding,
            "l3_medium": "auto",
            "block_hash": block_hash,
            "hash_seed": "0",
        },
    )
    prompts = [rng.integers(3, size=k).repeat(PS) for k in range(1, 4)]
    checks, url, invalidated = [], cache.cfg.storage, {"device": 0, "host": 0, "l3": 0}
    totals = collections.Counter({"l3_prefetch_pages": 0, "host_evictions": 0})
    try:
        for step in range(150):
            op = rng.integers(12)
            prefix = prompts[int(rng.integers(len(prompts)))]
            toks = np.concatenate([prefix, rng.integers(40, size=PS * int(rng.integers(4)))])
            key = [None, "tenant"][int(rng.integers(2))]
            if step in (40, 60, 110, 120):  # counters start again after these
                totals.update({k: cache.stats().get(k, 0) for k in totals})
            if step in (60, 110):
                cache.reset()
            elif step in (40, 120):
                cache.detach_storage()  # its L3 pages announced removed
            elif step in (70, 130):
                cache.attach_storage(url)  # the same store: announced as put
            elif step == 145:  # one L3 prefetch for sure (an
                serve(cache, toks, key)  # invalidated namespace leaves none)
                serve(cache, toks, key)
                cache.evict(1 << 20)
                cache.evict_host(1 << 20)  # write_back puts it now
                cache.flush()
                cache.prefetch(toks, key)
            elif op < 5:
                serve(cache, toks, key)  # matches load back host pages
            elif op == 5:
                cache.evict(int(rng.integers(4, 12)) * PS)
            elif op == 6:
                cache.evict_host(int(rng.integers(1, 8)) * PS)
            elif op in (7, 8):
                cache.prefetch(toks, key)  # L3 -> host
            elif op == 9:
                cache.flush()
            elif op == 10 and rng.integers(2):  # a prefix: its last page and below
                got = cache.invalidate(toks[: PS * int(rng.integers(1, toks.size // PS + 1))], key)
                invalidated = {t: invalidated[t] + got[t] for t in invalidated}
            elif op == 11 and rng.integers(4) == 0:  # now and then a whole namespace
                got = cache.invalidate(extra_key=key)
                invalidated = {t: invalidated[t] + got[t] for t in invalidated}
            # the cache's own answer for a few prompts, after the batches sealed so far (a call
            # that publishes seals what calls that do not, e.g. the handle's lock, recorded)
            cache.evict(0)
            checks.append(
                (
                    cache.stats()["kv_event_batches"],
                    cache.cfg.storage is not None,
                    [(p, k, cache.lookup(p, k)) for p in (toks, prefix) for k in (None, "tenant")],
                )
            )
        cache.flush()
        cache.match_prefix(np.arange(PS))  # attach landed prefetches; a call seals
        assert cache._events.wait_published(10)
        batches = replay_all(rep)
        totals.update({k: cache.stats().get(k, 0) for k in totals})
        stats = cache.stats() | {f"invalidated_{t}": v for t, v in invalidated.items()}
        stats |= {f"total_{k}": v for k, v in totals.items()}
        stats["run"] = n
    finally:
        cache.close()
    return batches, checks, stats


def in_store(url: str, index: TierIndex) -> list[bool]:
    """For each page a consumer holds on DISK: is its prefix's last page in the store?"""
    from hicache_jax.l3.storage import ENTRY_ROWS, entry_rows, open_storage, page_keys

    spec = bookkeeping_spec(PS)
    out = []
    with open_storage(url, spec, entry_rows(spec, 1), ENTRY_ROWS) as store:
        for h, tiers in index.tiers.items():
            if "DISK" not in tiers:
                continue
            pages, key = [], h
            while not isinstance(key, tuple) or key[0] != "ns":
                key, toks = index.key_of[key]
                pages.append(toks)
            extra_key = key[2] if key[2] is not None else key[1]
            tokens = np.array([t for page in reversed(pages) for t in page])
            out.append(bool(store.exists(page_keys(spec, tokens, extra_key)[-1:])[0]))
    return out


@pytest.mark.parametrize(
    "seed, l3_policy, block_hash",
    [
        (0, "write_through", "tree"),
        (1, "write_back", "tree"),
        (2, "write_back", "vllm:sha256"),
        (3, "write_through", "vllm:sha256_cbor"),
    ],
)
@pytest.mark.parametrize("encoding", ["array", "map"])
def test_every_consumer_agrees_with_the_caches_lookup(
    encoding, seed, l3_policy, block_hash, tmp_path
):
    """write_back puts a leaf to L3 before its parent (host eviction goes leaf first): its
    announcement waits for the parent's. The consumers key blocks by tokens, so vLLM's ids
    serve them as well as the tree's."""
    batches, checks, stats = run(encoding, tmp_path, seed, l3_policy, block_hash)
    assert [seq for seq, _ in batches] == list(range(stats["kv_event_batches"]))  # none lost
    decode = decode_map if encoding == "map" else decode_positional
    subs = consumers()
    media, applied, seen = set(), 0, {"device": 0, "host": 0}
    l3_removed = 0
    for upto, attached, answers in checks:
        for _, (_ts, events, _rank) in batches[applied:upto]:
            for raw in events:
                assert isinstance(raw, dict if encoding == "map" else list)
                tag, ev = decode(raw)
                if tag == "BlockStored":
                    assert ev["block_size"] == PS
                    assert len(ev["token_ids"]) == PS * len(ev["block_hashes"])
                    media.add(ev["medium"])
                elif tag == "BlockRemoved" and ev["medium"] == "DISK":
                    l3_removed += len(ev["block_hashes"])
                for sub in subs.values():
                    sub.apply(tag, ev)
        applied = upto
        if not attached:  # detached: the consumers hold nothing on L3 for this cache
            assert not any("disk" in t for t in subs["dynamo"].tiers.values())
        for toks, key, want in answers:
            toks = [int(t) for t in toks]
            assert subs["vllm"].lookup(toks, "GPU", "CPU", key) == want
            assert subs["llm-d"].lookup(toks, "GPU", "CPU", key) == want
            assert subs["dynamo"].lookup(toks, "device", "host", key) == want
            seen = {t: seen[t] + (want[t] > 0) for t in seen}
    assert seen["device"] > 20 and seen["host"] > 20  # both tiers were compared, often
    assert media == {"GPU", "CPU", "DISK"}  # L3 announced as its own medium
    assert stats["total_l3_prefetch_pages"] > 0 and stats["total_host_evictions"] > 0
    assert subs["llm-d"].dropped == 0  # a parent always comes first
    for name in ("vllm", "dynamo", "llm-d"):
        assert subs[name].unknown_removed == 0, name
    assert subs["dynamo_other_size"].tiers == {}  # another block size: all dropped
    assert stats["invalidated_device"] + stats["invalidated_host"] > 0
    assert stats["invalidated_l3"] > 0 and l3_removed > 0  # invalidate and detach said so
    assert all(in_store(f"file://{tmp_path}/l3-{stats['run']}", subs["vllm"]))
    # every page on disk has its parent known on disk (L3 is announced parents first)
    dyn = subs["dynamo"]
    for h, tiers in dyn.tiers.items():
        if "disk" in tiers:
            parent = dyn.key_of[h][0]
            assert isinstance(parent, tuple) or "disk" in dyn.tiers[parent]
