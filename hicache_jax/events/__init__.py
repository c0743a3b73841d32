"""KV cache events: where each page of each cached prefix lives (pure Python; no jax).

A router that sends requests to the replica holding their prefix needs to know which pages each
replica caches and on which tier. With ``HiCacheConfig(kv_events=...)`` set,
:class:`~hicache_jax.HiCache` records an event whenever pages appear on or leave a tier, in the
spirit of vLLM's / SGLang's KV events:

* :class:`BlockStored` — the page with hash ``block_hash`` is now held on ``medium``;
  ``parent_block_hash`` is the hash of the page before it in the same prefix (``None`` for the
  first page of a namespace), and ``token_ids`` are the page's tokens.
* :class:`BlockRemoved` — the page is no longer held on ``medium``.
* :class:`AllBlocksCleared` — everything is gone (``HiCache.reset``).

Page hashes come from the radix tree (``TreeNode.page_hashes``, defined in
:mod:`hicache_jax.tree.hashing`): ``h_i = xxh3_64(tokens of page i, seed=h_{i-1})``, the chain of a
namespace seeded from its ``extra_key``, so two processes that cache the same prefix report the
same hashes. A node split changes no page hash, so events
never depend on how the tree is split.

Off by default (``kv_events=None``): the cache then holds a :class:`NullRecorder` whose methods
do nothing, chosen once at construction. When on, the events of one public call form one batch
(sealed when the call returns) with a sequence number; a recorder holds them compactly (one
record per run of a node's pages: views of its page hashes and of its tokens, which the tree
never writes in place) and turns them into Python ints only when a consumer reads them or
they are serialized. A view keeps its whole array alive (a node key, after the node is gone),
so a record counts the bytes of the arrays it keeps alive, not of the view
(:func:`record_bytes`): an upper bound of what the buffer holds. Copying the tokens instead
(int32) cost ~9 us a record against ~0.3 us, for at most twice the records in a buffer.

* ``publisher="queue"`` (:class:`QueueRecorder`): in-process; ``HiCache.take_events()`` /
  ``take_event_batches()``. At most ``buffer_steps`` batches and ``buffer_bytes`` bytes of
  their hashes and tokens (:func:`record_bytes`) wait: beyond either, the oldest batches are
  dropped and counted (``kv_event_batches_dropped``), and the batches taken show the gap in
  their ``seq``. A batch larger than ``buffer_bytes`` by itself is dropped too.
* ``publisher="zmq"`` (:class:`~hicache_jax.events.zmq.ZmqRecorder`): published on a ZMQ PUB
  socket in vLLM's wire format by a publisher thread (:mod:`hicache_jax.events.zmq`).

Replaying the events in order over an empty set of ``(block_hash, medium)`` pairs gives exactly
the pages the cache holds on each tier (the state-machine test checks this after every step).

Layer groups: with a spec that has window groups (``KVSpec.window_groups``) every event names
its group (``group_idx``, ``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``, as vLLM's
hybrid-model events), and each window group's pages the tree holds are announced per tier
(:mod:`hicache_jax.events.groups`; ``kv_events={"groups": "full"}``: the full-attention pages
only). :func:`replay` then keeps ``(block_hash, medium, group_idx)``.

Threading: a recorder is used by the cache's owning thread only; ``stats()`` reads its counters.
The ZMQ recorder hands sealed batches to its publisher thread, which only reads their records
(views of arrays the tree never writes in place; see :mod:`hicache_jax.events.zmq`).
"""

from hicache_jax.events.records import (
    WIRE_MEDIUM,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    Medium,
    replay,
)
from hicache_jax.spec import KVEventsConfig

__all__ = [
    "WIRE_MEDIUM",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KVEvent",
    "KVEventsConfig",
    "Medium",
    "replay",
]
