"""The control API of a HiCache (ARCHITECTURE.md, "Control API"): where a prefix lives, pins,
invalidation, storage attached and detached at run time, the event queue and prefill samples. A base class of :class:`~hicache_jax.cache.hicache.HiCache` holding only these
thin public methods (the facade module stays small); the work is done by the parts they call --
:mod:`~hicache_jax.cache.lookup`, :mod:`~hicache_jax.cache.pins`,
:mod:`~hicache_jax.cache.invalidate`, :mod:`~hicache_jax.cache.storage_attach` -- which the facade builds in ``_init_state``.

Threading: as the facade (the owning thread only).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Hashable

import numpy as np

from hicache_jax.cache.lookup import lookup
from hicache_jax.memory.placement import local_numpy
from hicache_jax.cache.pins import Pins
from hicache_jax.cache.thread_owner import publishes
from hicache_jax.events.factory import l3_wire_medium
from hicache_jax.events.records import EventBatch, KVEvent
from hicache_jax.validation import check_bool, check_extra_key, page_tokens


class ControlAPI:
    """The control calls of :class:`~hicache_jax.cache.hicache.HiCache` (see the module doc);
    they use the facade's parts (``_tree``, ``_l3``, ``_pins``, ``_invalidate``, ...)."""

    _ps: int
    _tree: Any
    _l3: Any
    _pins: Pins
    _invalidate: Any
    _complete: Any
    _guard: Any
    _port: Any
    _events: Any
    _host: Any
    _agreement: Any
    _cost: Any
    spec: Any
    cfg: Any

    @property
    def local_heads(self) -> slice:
        """The kv heads this process holds: all of them, unless the pools span several
        processes (a mesh over their devices; ARCHITECTURE.md, "Several processes")."""
        return self._host.local_heads

    def read_kv_local(self, pages: Any) -> np.ndarray:
        """:meth:`read_kv` of this process's heads (:attr:`local_heads`) as numpy:
        ``[num_layers, kv, n, page_size, local heads, head_dim]`` in ``spec.dtype``, read
        from its own shards (a pool over several processes is an array none can read whole)."""
        out, heads = local_numpy(self.read_kv(pages)), self._host.local_heads
        if out.shape[4] != heads.stop - heads.start:  # no page: an array of this process's
            out = out[:, :, :, :, heads]
        return out

    def check_agreement(self) -> None:
        """Compare this cache with its copies on the other processes of its group (tree,
        page ownership, transfers in flight, counters; cache/agreement.py): ``HiCacheError``
        (``GroupDivergedError``) on every process naming the first field that differs, or
        ``GroupTimeoutError`` naming a process that did not take part. One process: a no-op."""
        self._guard()
        self._agreement.check()

    def lookup(self, tokens: Any, extra_key: Hashable = None, *,
               l3: bool = False) -> dict[str, int]:
        """Tokens of ``tokens``' cached prefix per tier ("device", "host", with ``l3`` also
        "l3": the store's beyond them), with no side effect (cache/lookup.py)."""
        self._guard()
        return lookup(self._tree, tokens, extra_key, self._ps,
                      self._l3 if check_bool("l3", l3) else None)

    @publishes
    def invalidate(self, tokens: Any = None, extra_key: Hashable = None) -> dict[str, int]:
        """Drop the namespace ``extra_key`` (``tokens=None``), or ``tokens``' last page and all
        below it, from every tier, L3 too, after waiting for transfers (cache/invalidate.py):
        ``{"device", "host"}`` tokens freed, ``"l3"`` store pages deleted, ``"l3_unreached"``
        1 where the store kept entries it could not delete (never read by this cache again).
        ``InvalidateLockedError`` (nothing dropped) where running requests hold them."""
        arr = None if tokens is None else page_tokens(tokens, extra_key, self._ps)
        check_extra_key(extra_key)
        if arr is not None and arr.size == 0:
            raise ValueError(f"tokens has no whole page of {self._ps} tokens: nothing to name")
        self._complete(upto=None, wait=True)
        self._l3.flush()
        return self._invalidate(extra_key, arr)

    @publishes
    def pin(self, tokens: Any, extra_key: Hashable = None, *, ttl_s: float | None = None,
            tier: str = "device") -> int:
        """Keep the part of ``tokens``' cached prefix held on ``tier`` ("device" | "host") from
        eviction there, until :meth:`unpin` or ``ttl_s`` seconds on the cache's clock; returns
        the tokens pinned. ``PinLimitError`` (with the figures) beyond ``cfg.pin_max_share``
        of the pool; HiCacheError if nothing is held there (cache/pins.py)."""
        arr = page_tokens(tokens, extra_key, self._ps)
        tier, ttl_s = Pins.parse(tier, ttl_s)
        self._complete(attach=True)
        return self._pins.pin(arr, extra_key, tier, ttl_s)

    @publishes
    def unpin(self, tokens: Any, extra_key: Hashable = None, *, tier: str = "device") -> int:
        """Undo :meth:`pin` of the same tokens; HiCacheError if they are not pinned there."""
        arr = page_tokens(tokens, extra_key, self._ps)
        tier = Pins.parse(tier, None)[0]
        self._complete(attach=True)
        return self._pins.unpin(arr, extra_key, tier)

    @publishes
    def attach_storage(self, url: str) -> None:
        """Open the L3 store ``url`` (as ``HiCacheConfig.storage``) on a live cache, requests in
        flight included; L1 and L2 untouched (cache/storage_attach.py). With ``kv_events``
        ``l3_medium`` set, its pages are announced as this cache's puts land (nothing at the
        attach). HiCacheError if storage is attached; ValueError / StorageUnavailableError
        (nothing changed) as at construction."""
        if not isinstance(url, str):
            raise TypeError(f"url must be a storage URL string, got {type(url).__name__}")
        cfg = dataclasses.replace(self.cfg, storage=url)
        self._complete(attach=True)
        held = [n for n in self._tree.nodes() if n.host_value is not None]
        self._l3.attach(self._port, self._host.local_spec, cfg, held)
        self.cfg = cfg
        self._events.l3_attached(l3_wire_medium(cfg.kv_events, url))

    @publishes
    def detach_storage(self) -> int:
        """Finish the L3 work in flight (puts stored, prefetches landed), close the store, and
        go on without L3; returns the operations finished (``stats()["storage_detach_*"]``).
        Every page announced on L3 is announced removed. HiCacheError without storage."""
        self._complete(attach=True)
        finished = self._l3.detach()
        self._events.l3_detached()  # this cache reaches nothing of the store now
        self.cfg = dataclasses.replace(self.cfg, storage=None)
        return finished

    def take_events(self) -> list[KVEvent]:
        """KV events (one per page) since the last take, oldest first; ``HiCacheError`` unless
        built with ``kv_events={"publisher": "queue"}``."""
        self._guard()
        return self._events.take()

    def take_event_batches(self) -> list[EventBatch]:
        """The event batches (one per public call) since the last take; a gap in ``seq``: the
        oldest were dropped (``stats()["kv_event_batches_dropped"]``). Raises as take_events."""
        self._guard()
        return self._events.take_batches()

    def observe_prefill(self, n_new: int, n_cached: int, seconds: float) -> None:
        """A prefill sample for ``load_policy="cost"`` (cache/loading/cost_model.py): ``n_new`` tokens
        computed after ``n_cached`` in ``seconds``. ValueError for a negative / non-finite one."""
        self._guard()
        self._cost.observe_prefill(n_new, n_cached, seconds)
