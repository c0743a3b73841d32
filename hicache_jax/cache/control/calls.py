"""The control calls' part (ARCHITECTURE.md, "Control API"): where a prefix lives, pins,
invalidation, storage attached and detached at run time, the event queue, prefill samples and
the processes' agreement.

:class:`Control` is owned by :class:`~hicache_jax.cache.hicache.HiCache`, built in its
``_init_state`` from the parts it calls, each given at construction; the facade's public
control methods check the owning thread, seal their event batch and delegate here, one call
each. The work itself is the parts': :mod:`~hicache_jax.cache.control.lookup`,
:class:`~hicache_jax.cache.control.pins.Pins`,
:class:`~hicache_jax.cache.control.invalidate.Invalidation`,
:class:`~hicache_jax.cache.control.storage_attach.L3Slot`.

Threading: the cache's thread only (the facade checks it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import Any

import numpy as np

from hicache_jax.cache.agreement import Agreement
from hicache_jax.cache.completion import Completion
from hicache_jax.cache.control.invalidate import Invalidation
from hicache_jax.cache.control.lookup import lookup
from hicache_jax.cache.control.pins import Pins
from hicache_jax.cache.control.storage_attach import L3Slot
from hicache_jax.cache.l3_port import CacheL3Port
from hicache_jax.cache.loading.cost_model import CostModel
from hicache_jax.cache.windows import Windows
from hicache_jax.events.factory import l3_wire_medium
from hicache_jax.events.recorder import NullRecorder, Recorder
from hicache_jax.events.records import EventBatch, KVEvent
from hicache_jax.memory.host_pool import HostPagePool
from hicache_jax.memory.placement import local_numpy
from hicache_jax.spec import HiCacheConfig
from hicache_jax.tree.radix import RadixTree
from hicache_jax.validation import check_bool, check_extra_key, page_tokens

__all__ = ["Control"]


class Control:
    """The control calls of one cache (see the module docstring).

    Args:
        page_size: tokens per page.
        tree: the cache's radix tree.
        l3: the slot holding the cache's L3 tier.
        pins: the cache's pins.
        invalidation: drops namespaces and prefixes.
        complete: applies finished transfers (polls and waits).
        port: the cache's side of the L3 port (a tier opened at attach is given it).
        events: the cache's event recorder.
        host: the host pool (its local spec and heads).
        agreement: the comparison with the other processes' copies.
        cost: the cost model (prefill samples).
        windows: the layer-group rules (window or state groups): lookup's figures are the
            servable prefix's.
    """

    def __init__(
        self,
        page_size: int,
        tree: RadixTree,
        l3: L3Slot,
        pins: Pins,
        invalidation: Invalidation,
        complete: Completion,
        port: CacheL3Port,
        events: NullRecorder | Recorder,
        host: HostPagePool,
        agreement: Agreement,
        cost: CostModel,
        windows: Windows | None = None,
    ) -> None:
        self._ps, self._tree, self._l3, self._pins = page_size, tree, l3, pins
        self._windows = windows
        self._invalidate, self._complete, self._port = invalidation, complete, port
        self._events, self._host, self._agreement, self._cost = events, host, agreement, cost

    @property
    def local_heads(self) -> slice:
        return self._host.local_heads

    def local_shard(self, kv: Any) -> np.ndarray:
        """This process's heads of ``kv`` (``[num_layers, kv, n, page_size, heads, head_dim]``,
        a pool read) as numpy, read from its own shards."""
        out, heads = local_numpy(kv), self._host.local_heads
        if out.shape[4] != heads.stop - heads.start:  # no page: an array of this process's
            out = out[:, :, :, :, heads]
        return out

    def check_agreement(self) -> None:
        self._agreement.check()

    def lookup(self, tokens: Any, extra_key: Hashable, l3: bool) -> dict[str, int]:
        return lookup(
            self._tree,
            tokens,
            extra_key,
            self._ps,
            self._l3 if check_bool("l3", l3) else None,
            self._windows,
        )

    def invalidate(self, tokens: Any, extra_key: Hashable) -> dict[str, int]:
        arr = None if tokens is None else page_tokens(tokens, extra_key, self._ps)
        check_extra_key(extra_key)
        if arr is not None and arr.size == 0:
            raise ValueError(f"tokens has no whole page of {self._ps} tokens: nothing to name")
        self._complete(upto=None, wait=True)
        self._l3.flush()
        return self._invalidate(extra_key, arr)

    def pin(self, tokens: Any, extra_key: Hashable, ttl_s: float | None, tier: str) -> int:
        arr = page_tokens(tokens, extra_key, self._ps)
        parsed, ttl_s = Pins.parse(tier, ttl_s)
        self._complete(attach=True)
        return self._pins.pin(arr, extra_key, parsed, ttl_s)

    def unpin(self, tokens: Any, extra_key: Hashable, tier: str) -> int:
        arr = page_tokens(tokens, extra_key, self._ps)
        parsed = Pins.parse(tier, None)[0]
        self._complete(attach=True)
        return self._pins.unpin(arr, extra_key, parsed)

    def attach_storage(self, cfg: HiCacheConfig, url: str) -> HiCacheConfig:
        """Open ``url`` as the L3 tier (see ``HiCache.attach_storage``); returns the cache's new
        config (``cfg`` with ``storage=url``), which the facade takes."""
        if not isinstance(url, str):
            raise TypeError(f"url must be a storage URL string, got {type(url).__name__}")
        cfg = dataclasses.replace(cfg, storage=url)
        self._complete(attach=True)
        held = [n for n in self._tree.nodes() if n.host_value is not None]
        self._l3.attach(self._port, self._host.local_spec, cfg, held)
        assert not isinstance(cfg.kv_events, (dict, str))  # parsed by HiCacheConfig
        self._events.l3_attached(l3_wire_medium(cfg.kv_events, url))
        return cfg

    def detach_storage(self) -> int:
        """Finish the L3 work in flight, close the store (see ``HiCache.detach_storage``);
        the operations finished. The facade drops ``storage`` from its config."""
        self._complete(attach=True)
        finished = self._l3.detach()
        self._events.l3_detached()  # this cache reaches nothing of the store now
        return finished

    def take_events(self) -> list[KVEvent]:
        return self._events.take()

    def take_event_batches(self) -> list[EventBatch]:
        return self._events.take_batches()

    def observe_prefill(self, n_new: int, n_cached: int, seconds: float) -> None:
        self._cost.observe_prefill(n_new, n_cached, seconds)
