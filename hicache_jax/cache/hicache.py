"""HiCache: the public facade over the radix tree, the two page pools and the transfer engine.

Semantics follow SGLang's HiCache (``hiradix_cache.py``). Each piece of state has one owner,
a part built in dependency order in :meth:`HiCache._init_state` (ARCHITECTURE.md, "The cache's
parts"); this class validates, polls, and calls them. It owns the primitives, a request's
admission (:meth:`HiCache.begin`, :meth:`HiCache.begin_many`: match, prepare, load back, lock,
in that order, then the :class:`~hicache_jax.cache.request.Request` handle that owns the rest of
the request's life) and the public face of the control calls (their part:
:mod:`hicache_jax.cache.control`); the primitives stay public for schedulers that need them.
Matches go stale (:mod:`hicache_jax.cache.match`): :meth:`insert` gets only pages, and a stale
page re-allocated to a caller cannot be told from a fresh one, which is why the request flow
locks the match first.

Threading: one thread owns the cache and makes every call but :meth:`stats` (any thread, reads
only; :mod:`hicache_jax.cache.thread_owner`). Transfer completion is polled at the start of the
public methods, never signalled by callbacks. After :meth:`close`, only ``stats()`` works.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np

from hicache_jax.cache.agreement import Agreement, bind_completions, join_group
from hicache_jax.cache.completion import Completion
from hicache_jax.cache.control.calls import Control
from hicache_jax.cache.control.invalidate import Invalidation
from hicache_jax.cache.control.pins import Pins
from hicache_jax.cache.control.storage_attach import L3Slot
from hicache_jax.cache.evictor import Evictor
from hicache_jax.cache.inflight import InFlight
from hicache_jax.cache.insertion import Insertion
from hicache_jax.cache.introspection import cache_stats, check_cache
from hicache_jax.cache.l3_port import CacheL3Port
from hicache_jax.cache.loading.cost_model import CostModel
from hicache_jax.cache.loading.load_many import check_matches, load_chains
from hicache_jax.cache.loading.load_policy import CostRule, make_rule
from hicache_jax.cache.loading.overlap import Overlap, OverlapCopy
from hicache_jax.cache.match import (
    Match,
    NodeRef,
    check_node,
    current,
    cut_to,
    held_pages,
    is_stale,
    node_ref,
    revalidate,
    unprotected_device_pages,
)
from hicache_jax.cache.ownership import ALLOCATED, CALLERS, DevicePageOwners
from hicache_jax.cache.removal import Removal
from hicache_jax.cache.request import (
    Request,
    Served,
    admit_matched,
    declined_len,
    loaded_len,
    served_of,
)
from hicache_jax.cache.thread_owner import ThreadOwner, publishes
from hicache_jax.cache.windows import Windows, group_load_bytes, storage_spare
from hicache_jax.cache.write_policy import WriteContext, make_write_policy
from hicache_jax.errors import HiCacheError
from hicache_jax.events.factory import make_recorder
from hicache_jax.events.recorder import NullRecorder, Recorder
from hicache_jax.events.records import EventBatch, KVEvent
from hicache_jax.l3.prefetch import PrefetchHandle
from hicache_jax.l3.tier import L3Tier, NullL3Tier, open_l3
from hicache_jax.memory.device_pool import DevicePagePool
from hicache_jax.memory.group import AgreedClock
from hicache_jax.memory.histogram import HistogramSnapshot
from hicache_jax.memory.host_pool import HostPagePool
from hicache_jax.memory.state import check_state, pack_state, unpack_state
from hicache_jax.memory.transfer import TransferEngine
from hicache_jax.memory.window import WindowPages
from hicache_jax.spec import (
    EvictionPolicy,
    GroupKind,
    HiCacheConfig,
    KVSpec,
    LayerGroup,
    resolve_eviction,
)
from hicache_jax.tree.eviction import WORTH_POWER
from hicache_jax.tree.node import TreeNode
from hicache_jax.tree.radix import RadixTree
from hicache_jax.validation import check_bool, check_int, page_tokens

__all__ = ["HiCache"]


class HiCache:
    """Hierarchical KV page cache: device pool (L1), host pool (L2), radix tree of prefixes.

    Args:
        spec: what one page holds.
        cfg: sizes and policies.
        clock: time source of access stamps and L3 deadlines (tests inject a manual clock).
        transfer_engine: builds the transfer engine from ``(device_pool, host_pool)`` (default
            :class:`~hicache_jax.memory.transfer.TransferEngine`; tests inject one that holds
            copies in flight).
    """

    def __init__(
        self,
        spec: KVSpec,
        cfg: HiCacheConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        transfer_engine: Callable[[DevicePagePool, HostPagePool], TransferEngine] = TransferEngine,
    ) -> None:
        if not isinstance(spec, KVSpec):
            raise TypeError(f"spec must be a KVSpec, got {type(spec).__name__}")
        if not isinstance(cfg, HiCacheConfig):
            raise TypeError(f"cfg must be a HiCacheConfig, got {type(cfg).__name__}")
        if cfg.eviction is None:  # the default: by the spec (HiCacheConfig.eviction)
            cfg = dataclasses.replace(cfg, eviction=resolve_eviction(None, spec))
        self.spec, self.cfg = spec, cfg
        # several processes: one group decides alike (ARCHITECTURE.md, "Several processes")
        # (its own group closed by close(); stamps and deadlines: the leader's clock)
        self._group, self._owns_group, clock = join_group(spec, cfg, clock)
        self._sync = clock.sync if isinstance(clock, AgreedClock) else None
        self._ps, self._page_bytes = spec.page_size, spec.page_bytes  # (a computed property)
        self._tree = RadixTree(spec.page_size, clock)
        if cfg.eviction is EvictionPolicy.VALUE:
            self._tree.worth_power = WORTH_POWER
        self._device = DevicePagePool(
            spec,
            cfg.device_pages,
            mesh=cfg.mesh,
            axis=cfg.shard_axis,
            copy_backend=cfg.copy_backend,
            huge_pages=cfg.huge_pages,
        )
        assert cfg.host_pages is not None  # HiCacheConfig.__post_init__ resolves it
        self._host = HostPagePool(
            spec,
            cfg.host_pages,
            layout=cfg.host_layout,
            mesh=cfg.mesh,
            axis=cfg.shard_axis,
            huge_pages=cfg.huge_pages,
        )
        self._engine = transfer_engine(self._device, self._host)
        self._windows = self._build_windows(spec, cfg)
        bind_completions(self._engine, self._group, cfg.completion_lag)
        self._events: NullRecorder | Recorder = NullRecorder()  # the configured one: below
        self._threads = ThreadOwner()
        # deadlines and ttls (L3, pins): the request's own clock reading; stamps: the order
        self._port = CacheL3Port(
            spec,
            clock.fresh if isinstance(clock, AgreedClock) else clock,
            self._tree,
            self._host,
            self._group,
            None if self._windows is None else self._windows.host,  # L3 puts and fetches them
            storage_spare(spec, cfg.storage_window_spare, cfg.checkpoint_every_pages),
        )
        # NullL3Tier without storage; attach_storage / detach_storage swap the slot's tier
        # L3 holds this process's heads (all of them in one process), keyed by the shard
        self._l3 = L3Slot(open_l3(self._port, self._host.local_spec, cfg), collections.Counter())
        # Last, so that nothing stays bound when anything above raises. Off: NullRecorder.
        try:
            assert not isinstance(cfg.kv_events, (dict, str))  # parsed by HiCacheConfig
            self._events = make_recorder(cfg.kv_events, cfg.storage)
            if self._windows is not None:  # events name their layer group (events/groups.py)
                self._events.watch_groups(spec, self._windows.device, self._windows.host)
        except BaseException:  # e.g. a port in use: release the L3 backend opened above
            self._l3.close()
            raise
        self._init_state()  # its parts take the recorder and the L3 tier

    def _build_windows(self, spec: KVSpec, cfg: HiCacheConfig) -> Windows | None:
        """The window groups' pools on both tiers, attached to the full-attention pages and
        copied with them (ARCHITECTURE.md, "Layer groups"); None without window groups."""
        groups = spec.window_groups
        if not groups:
            return None
        if cfg.load_overlap:
            raise ValueError("load_overlap=True with window groups is not supported yet")
        if cfg.mesh is not None:  # slots split over heads shard as pages: the mesh must divide
            axis = cfg.shard_axis  # (HiCacheConfig resolves it with a mesh)
            size = cfg.mesh.shape[axis]
            for i, g in enumerate(spec.groups):
                if g.kind is GroupKind.STATE and g.state_heads > 1 and g.state_heads % size:
                    raise ValueError(
                        f"groups[{i}].state_heads={g.state_heads} (its arrays' head axes) is "
                        f"not divisible by the size {size} of mesh axis {axis!r}: split the "
                        "state as the model's devices do, or name no head_axis (whole slots "
                        "on every device)"
                    )
        assert cfg.host_pages is not None  # HiCacheConfig.__post_init__ resolves it
        dev_n = [
            _slots(cfg.state_device_slots, cfg.device_pages, spec.page_bytes, g.slot_bytes)
            if g.kind is GroupKind.STATE
            else cfg.window_device_pages or cfg.device_pages
            for g in groups
        ]
        host_n = [
            _slots(cfg.state_host_slots, cfg.host_pages, spec.page_bytes, g.slot_bytes)
            if g.kind is GroupKind.STATE
            else cfg.host_pages
            if cfg.window_host_pages is None
            else cfg.window_host_pages
            for g in groups
        ]
        dev = WindowPages(
            groups,
            [
                DevicePagePool(
                    g.spec(spec.page_size, spec.shard),
                    n,
                    mesh=cfg.mesh,
                    axis=cfg.shard_axis,
                    copy_backend=cfg.copy_backend,
                    huge_pages=cfg.huge_pages,
                )
                for g, n in zip(groups, dev_n, strict=True)
            ],
            self._device.allocator,
            "device",
        )
        host = WindowPages(
            groups,
            [
                HostPagePool(
                    g.spec(spec.page_size, spec.shard),
                    n,
                    layout=cfg.host_layout,
                    mesh=cfg.mesh,
                    axis=cfg.shard_axis,
                    huge_pages=cfg.huge_pages,
                )
                for g, n in zip(groups, host_n, strict=True)
            ],
            self._host.allocator,
            "host",
        )
        self._engine.attach_windows(dev, host)
        power = WORTH_POWER if cfg.eviction is EvictionPolicy.VALUE else None
        return Windows(spec, dev, host, cfg.window_spare, worth_power=power)

    def _init_state(self) -> None:
        """Build the parts in dependency order, each given what it needs (ARCHITECTURE.md,
        "The cache's parts"); ``reset()`` builds them again."""
        cfg, tree, events = self.cfg, self._tree, self._events
        dev, host = self._device.allocator, self._host.allocator
        self._owner = DevicePageOwners(cfg.device_pages)
        self._caller_locks: dict[TreeNode, int] = {}
        self._n: collections.Counter[str] = collections.Counter()
        self._l3.rebind(self._n)
        self._cost = CostModel(
            cfg.cost_page_bytes or self.spec.page_bytes,
            self._ps,
            cfg.prefill_cost,
            observed_page_bytes=self.spec.page_bytes,
            group_bytes=group_load_bytes(self.spec),
        )
        self._rule = make_rule(cfg, self._cost, dev, tree)
        if isinstance(self._rule, CostRule) and self._windows is not None:
            self._rule.servable = self._windows.load_ends
        # load_overlap: begin() lets the cost rule pick two-ended splits (cache/loading/overlap.py)
        self._split_rule = (
            self._rule if cfg.load_overlap and isinstance(self._rule, CostRule) else None
        )
        self._flight = InFlight(
            self.spec,
            tree,
            self._engine,
            dev,
            host,
            self._owner,
            events,
            self._n,
            self._l3.on_backup,
            self._cost,
            self._port.fetched,
        )
        assert cfg.host_pages is not None  # HiCacheConfig.__post_init__ resolves it
        self._pins = Pins(
            tree, self._port.clock, cfg.pin_max_share, cfg.device_pages, cfg.host_pages
        )
        self._complete = Completion(
            self._engine, self._flight, self._l3, self._pins.expire, self._sync
        )
        self._overlap = Overlap(self._ps, self._engine, self._cost, self._n, self._complete)
        cut_ok = None if self._windows is None else self._windows.cut_keeps_servable
        self._removal = Removal(
            cfg, tree, dev, self._owner, events, self._n, self._flight, self._l3, cut_ok
        )
        self._write = make_write_policy(
            WriteContext(
                cfg,
                tree,
                self._flight,
                self._n,
                dev,
                events,
                host,
                self._removal,
                self._complete,
                l3=self._l3,
            )
        )
        if self._windows is not None:  # a backup first makes host room for its window pages
            self._flight.window_room = functools.partial(
                self._windows.make_host_room, evict_host=self._write.evict_host
            )
        self._evict = Evictor(
            cfg,
            tree,
            dev,
            self._n,
            self._flight,
            self._write,
            self._removal,
            self._complete,
            cut_ok,
        )
        self._inserter = Insertion(
            self._ps,
            tree,
            dev,
            self._owner,
            events,
            self._n,
            self._device.validate_ids,
            self._write.after_insert,
            self._caller_locks,
            self._windows,
            functools.partial(self._engine.backup, validated=True),
        )
        self._agreement = Agreement(
            self._group,
            cfg.agreement_check_every,
            tree,
            self._owner,
            host,
            self._flight,
            self._n,
            self._l3,
        )
        self._control = Control(
            self._ps,
            tree,
            self._l3,
            self._pins,
            Invalidation(tree, self._removal, self._pins, self._l3),
            self._complete,
            self._port,
            events,
            self._host,
            self._agreement,
            self._cost,
            self._windows,
        )
        self._port.bind(events, self._write, self._rule, self._cost)

    def _guard(self) -> None:
        """Every public call but ``stats()``: the owner passes for one ``get_ident()``."""
        if threading.get_ident() != self._threads.ident:
            self._threads.take()

    def _check_pages(self, pages: Any, allowed: np.ndarray, what: str) -> np.ndarray:
        return self._owner.check(self._device.validate_ids(pages, "pages"), allowed, what)

    # -- public API --------------------------------------------------------------------------

    @publishes
    def match_prefix(self, tokens: Any, extra_key: Hashable = None) -> Match:
        """Longest cached whole-page prefix of ``tokens`` on device, then on host.

        Args:
            tokens: 1-D non-negative int sequence; a trailing partial page is ignored.
            extra_key: hashable namespace (LoRA id, tenant salt).

        Returns:
            A :class:`Match`; its ``device_pages`` stay valid while ``node`` is locked.
        """
        arr = page_tokens(tokens, extra_key, self._ps)  # validate before polling
        self._complete(attach=True, sync=True)  # a request starts
        self._l3.before_match(arr, extra_key)
        tm = self._tree.match(arr, extra_key, validated=True)
        self._n["match_tokens"] += arr.shape[0]
        if self._windows is None:
            self._n["device_hit_tokens"] += tm.device_len
            self._n["host_hit_tokens"] += tm.host_len
            return Match(
                tm.device_pages,
                tm.device_len,
                tm.host_len,
                node_ref(tm.node, tm.last_device_node),
            )
        # The longest servable prefix, and of it the part the device pages serve alone: the
        # device part of the Match; device pages past it count in the host part (resident).
        alone, whole = self._windows.split_match(tm)
        inside = 0 < alone < tm.device_len  # the device part's servable end inside a node
        if whole < tm.device_len + tm.host_len or inside:
            self._n["window_unservable_tokens"] += tm.device_len + tm.host_len - whole
            if inside:  # split there: the hold below protects a node end, not an inner page
                self._tree.match(arr[:alone], extra_key, validated=True)
            tm = self._tree.match(arr[:whole], extra_key, validated=True)
        self._windows.hold(tm.device_pages, tm.host_nodes, alone // self._ps)
        self._n["device_hit_tokens"] += tm.device_len
        self._n["host_hit_tokens"] += tm.host_len
        return Match(
            tm.device_pages[: alone // self._ps],
            alone,
            whole - alone,
            node_ref(tm.node, tm.last_device_node),
            resident_len=tm.device_len - alone,
            resident_pages=tm.device_pages[alone // self._ps :],
        )

    # -- admission (ARCHITECTURE.md, "A request's data flow") ---------------------------------

    def begin(self, tokens: Any, extra_key: Hashable = None, *, layerwise: bool = False) -> Request:
        """Admit one request: match, prepare (clean_ahead's backups), load the host part back
        (or not, as :meth:`load_back` decides; under ``load_overlap`` maybe a two-ended split),
        lock; then its :class:`Request` handle, which owns the lock. Always admitted: its pages
        come at :meth:`Request.extend`, which raises ``OutOfPagesError`` when they cannot be
        had."""
        m = self.match_prefix(tokens, extra_key)
        self.prepare([m], -(-len(tokens) // self._ps) - held_pages(m))
        split = self._split_rule
        t0 = time.perf_counter()
        if split is None:
            lm = self.load_back(m, layerwise=layerwise)
        else:
            split.overlap = True  # the cost rule may pick a two-ended split
            try:
                lm = self.load_back(m, layerwise=layerwise)
            finally:
                split.overlap = False
        wait = time.perf_counter() - t0
        self.lock(lm.node)
        copy = None if split is None else self._start_split(split, lm)
        back = 0 if copy is None else copy.span[1] - copy.span[0]
        served = served_of(len(tokens), m, lm, self._page_bytes, self._ps, wait, back)
        self._count_served(served)
        return Request(
            self,
            extra_key,
            lm,
            loaded_len(m, lm),
            overlap=copy,
            served=served,
            declined=declined_len(m, lm),
        )

    def _start_split(self, rule: CostRule, lm: Match) -> OverlapCopy | None:
        """The copy of the two-ended split ``rule`` decided for ``lm``'s chain (locked), if it
        decided one and it can start; the lock released if starting it raises."""
        node = check_node(self._tree, lm.node)
        front = rule.take_split(node)
        if front is None:
            return None
        try:
            return self._overlap.start(
                node, front, lm.device_len, lm.host_len, self.alloc_pages, self.free_pages
            )
        except BaseException:
            if not self.closed:
                self.unlock(lm.node)
            raise

    def begin_many(
        self,
        prompts: Sequence[Any],
        *,
        extra_keys: Sequence[Hashable] | None = None,
        budget: int | None = None,
        layerwise: bool = False,
    ) -> list[Request | None]:
        """Admit a scheduler step's requests, oldest (first in ``prompts``) first, with ONE
        load-back transfer (:meth:`load_back_many`); None for those not admitted.

        Each admitted request takes ``ceil(len(prompt) / page_size)`` device pages in the end
        (its matched prefix, its host part loaded or recomputed, its uncached rest), and its
        lock takes its unprotected matched pages out of the evictable ones. Requests are
        admitted in order while what they take fits ``budget`` pages (default, and at most: the
        free + evictable device pages now), up to the first that does not: it and every later
        one are not admitted (None), and nothing is loaded, locked or allocated for them. The
        pages themselves come at :meth:`Request.extend`.

        Raises:
            TypeError / ValueError: malformed prompts, keys or budget, before any change.
        """
        prompts = list(prompts)
        keys = [None] * len(prompts) if extra_keys is None else list(extra_keys)
        if len(keys) != len(prompts):
            raise ValueError(f"extra_keys has {len(keys)} keys for {len(prompts)} prompts")
        if budget is not None:
            budget = check_int("budget", budget)
        check_bool("layerwise", layerwise)
        for t, k in zip(prompts, keys):
            page_tokens(t, k, self._ps)  # every prompt checked before anything is matched
        st = self.stats()
        avail = st["device_free_pages"] + st["device_evictable_pages"]
        budget = avail if budget is None else min(budget, avail)
        seen: set = set()
        used, new, before = 0, 0, []
        for t, k in zip(prompts, keys):  # one by one: no hit counted beyond the first refused
            m = self.match_prefix(t, k)
            own = -(-len(t) // self._ps) - held_pages(m)
            used += own + unprotected_device_pages(m.node, seen)
            if used > budget:
                break
            before.append(m)
            new += own
        if before:
            self.prepare(before, new)  # clean_ahead: what their pages will evict, backed up now
        out: list[Request | None] = [None] * len(prompts)
        # load back in one transfer, lock each, wrap each
        out[: len(before)] = admit_matched(
            self,
            before,
            extra_keys=keys[: len(before)],
            layerwise=layerwise,
            prompt_lens=[len(t) for t in prompts[: len(before)]],
        )
        return out

    def record_served(self, served: Sequence[Served]) -> None:
        """Add admitted requests' :class:`~hicache_jax.cache.request.Served` figures to
        ``stats()`` (``admitted_requests``, ``served_device_tokens``, ``served_host_tokens``,
        ``served_l3_tokens``, ``recomputed_tokens``, ...). Admission calls it
        (:meth:`begin`, :meth:`begin_many`, ``admit_matched``); a scheduler that builds its
        handles itself calls it with theirs."""
        self._guard()
        for s in served:
            self._count_served(s)

    def _count_served(self, s: Served) -> None:
        n = self._n
        n["admitted_requests"] += 1
        n["admitted_prompt_tokens"] += s.prompt_tokens
        n["served_device_tokens"] += s.device_tokens
        if s.host_tokens or s.l3_tokens or s.load_wait_s:  # nothing loaded: nothing more
            n["served_host_tokens"] += s.host_tokens
            n["served_l3_tokens"] += s.l3_tokens
            n["served_load_bytes"] += s.load_bytes
            # seconds are floats in the same Counter, as the parts' seconds_to_* are
            n["served_load_wait_seconds"] += s.load_wait_s  # type: ignore[assignment]
        n["recomputed_tokens"] += s.recomputed_tokens

    @publishes
    def prefetch(self, tokens: Any, extra_key: Hashable = None) -> PrefetchHandle | None:
        """Start fetching from L3 into host pages the pages of ``tokens`` beyond L1 + L2: a
        :class:`~hicache_jax.l3.prefetch.PrefetchHandle`, or None (no storage, nothing beyond
        L1 + L2, none in L3). They appear to :meth:`match_prefix` per ``cfg.prefetch_policy``."""
        arr = page_tokens(tokens, extra_key, self._ps)
        self._complete(attach=True, sync=True)  # a request starts
        return self._l3.prefetch(arr, extra_key)

    @publishes
    def load_back(self, match: Match, *, layerwise: bool = False) -> Match:
        """Copy the host-only part of ``match`` back to device pages.

        Args:
            match: from :meth:`match_prefix` or :meth:`load_back`; it may be stale (pages
                evicted or moved since, its node deleted: the prefix is matched again).
            layerwise: return before the copy completes, with ``Match.load_handle`` set so the
                forward can ``wait_layer(l)`` per layer.

        Returns:
            What holds the prefix of ``match.node`` now, on every path: loaded (``device_len``
            grown, ``host_len == 0``), or nothing on host, or declined (a ``host_len`` shorter
            than ``cfg.load_back_threshold``, more host tokens to copy than
            ``cfg.load_back_quota``, no device pages): ``match`` itself if still current, else
            a Match of the current state (with ``resident_pages``: cut back to its device
            part, which serves alone). No lock.
        """
        if not isinstance(match, Match) or not isinstance(match.node, NodeRef):
            raise TypeError(f"match must be a Match from match_prefix, got {type(match).__name__}")
        check_bool("layerwise", layerwise)
        self._complete(attach=True)
        match, node = revalidate(self._tree, match)
        if node.value is not None or node.parent is None:  # nothing host-only: nothing to load
            return self._servable(current(match, node, self._ps))
        return self._load_back([(match, node)], bool(layerwise))[0]

    @publishes
    def load_back_many(self, matches: Any, *, layerwise: bool = False) -> list[Match]:
        """:meth:`load_back` of several matches (a batching scheduler's step) in ONE copy
        dispatch, each decided as ``load_back`` decides it, in list order (overlaps load once;
        see :mod:`~hicache_jax.cache.loading.load_many`): one Match per input, what holds its prefix
        now; with ``layerwise`` each carries the one ``load_handle``. TypeError / HiCacheError
        (not Matches of this cache, ``layerwise`` not a bool) before any change."""
        check_matches(self._tree, matches)
        check_bool("layerwise", layerwise)
        self._complete(attach=True)
        return self._load_back([revalidate(self._tree, m) for m in matches], bool(layerwise))

    def _load_back(self, resolved: list[tuple[Match, TreeNode]], layerwise: bool) -> list[Match]:
        sizes = self._write.largest_alloc, self._write.announced  # a load that raised: as before
        try:
            loaded = load_chains(
                self._tree,
                resolved,
                rule=self._rule,
                page_size=self._ps,
                take=self._load_take(len(resolved)),
                load=self._flight.load,
                counters=self._n,
                layerwise=layerwise,
                fetched=self._port.fetched,
            )
        except BaseException:
            self._write.largest_alloc, self._write.announced = sizes
            raise
        return [self._servable(m) for m in loaded]

    def _load_take(self, chains: int) -> Callable[[int], np.ndarray]:
        """The device pages of a load-back (``load_chains`` takes them once its chains are
        locked); with STATE groups, also room for a slot per chain in each group's device
        pool (leaves evicted where no slot is free or spare), so the checkpoint at a loaded
        chain's end comes with it instead of being dropped (which would cut the hit)."""
        take = self._evict.take
        states = () if self._windows is None else self._windows.states
        if not states:
            return take

        def take_with_slots(n: int) -> np.ndarray:
            ids = take(n)
            self._window_room(chains, states)
            return ids

        return take_with_slots

    def _servable(self, m: Match) -> Match:
        """``m`` cut back to the longest prefix its device pages can serve (window groups:
        a load declined or split by the load rule may end where window pages were freed);
        ``m`` itself without window groups or when it is servable."""
        w = self._windows
        if w is None:
            return m
        ntok = w.servable_device(m.device_pages)
        if ntok >= m.device_len:
            return m
        self._n["window_unservable_tokens"] += m.device_len - ntok
        cut = cut_to(self._tree, m, ntok)
        w.hold(cut.device_pages)
        return cut

    def lock(self, node: NodeRef) -> None:
        """Protect a match's prefix (``Match.node``: the node and its ancestors) from eviction
        on both tiers (counted).

        Raises:
            HiCacheError: the match is stale: its device pages were evicted, or evicted and
                loaded back into other pages, since it was made (lock before calls that may
                evict, or pass it through :meth:`load_back`); or its node left the cache.
        """
        self._guard()
        tnode = check_node(self._tree, node)
        if is_stale(node):
            raise HiCacheError(
                f"stale Match: the device pages of {node!r} were evicted or moved since the "
                "match (by alloc_pages, load_back, insert or evict of other requests): call "
                "match_prefix (or load_back) again and lock the new Match's node"
            )
        self._tree.lock(tnode)
        self._caller_locks[tnode] = self._caller_locks.get(tnode, 0) + 1

    @publishes  # clean_ahead's admission pass may give up host copies (BlockRemoved)
    def prepare(self, matches: Sequence[Match], num_pages: int) -> None:
        """Under clean_ahead, back up now what admitting ``matches`` (not yet locked, taking
        ``num_pages`` device pages in all) will evict (``begin``, ``begin_many`` call it)."""
        check_matches(self._tree, matches)
        num_pages = check_int("num_pages", num_pages)
        if not self._write.admission_pass:  # other policies: the announced pages, no pass
            return self._write.before_admit(num_pages, [])
        self._complete(attach=True)
        nodes = [revalidate(self._tree, m)[1] for m in matches]
        self._write.before_admit(num_pages, nodes)

    @publishes  # clean_ahead's pass at unlock may give up host copies (BlockRemoved)
    def unlock(self, node: NodeRef) -> None:
        """Undo one :meth:`lock` of ``node``. ``HiCacheError`` if the caller holds none."""
        tnode = check_node(self._tree, node)
        held = self._caller_locks.get(tnode, 0)
        if held == 0:
            raise HiCacheError(f"unlock of {tnode!r} without a matching lock")
        self._tree.unlock(tnode)
        if held == 1:
            del self._caller_locks[tnode]
        else:
            self._caller_locks[tnode] = held - 1
        self._write.after_unlock()  # a request's end: its nodes are evictable again

    @publishes
    def alloc_pages(self, n: int) -> np.ndarray:
        """Take ``n`` device pages for the caller, evicting as needed.

        Returns:
            int32 ``[n]`` page ids, owned by the caller until :meth:`insert` or
            :meth:`free_pages`.

        Raises:
            OutOfPagesError: not enough free + evictable pages; ``needed``, ``free``,
                ``evictable``, ``locked`` say why. Raised before evicting anything; copies in
                flight (whose locks may be what holds the pages) are waited for first.
        """
        n = check_int("n", n)
        self._complete(attach=True)
        ids = self._evict.take(n)
        if self._windows is not None and self._windows.local:  # its forward writes them all
            try:
                self._window_room(ids.size, self._windows.local)
                self._windows.attach_new(ids)
            except BaseException:
                self._device.allocator.free(ids)
                raise
        self._owner.to_caller(ids)
        return ids

    def _window_room(self, n: int, groups: Sequence[int]) -> None:
        """Evict device nodes (their window pages and slots go with them) until each of
        ``groups``' device pools has ``n`` free pages or nothing more can be evicted (then
        ``attach_new`` raises ``OutOfPagesError``); only with a group pool smaller than the
        full-attention pool."""
        assert self._windows is not None
        while True:
            dev = self._windows.device
            short = n - min(dev.room(g) for g in groups)
            if short <= 0 or self._evict.evict_device(short * self._ps) == 0:
                return

    def free_pages(self, pages: Any) -> None:
        """Give back caller-owned pages that were never inserted."""
        self._guard()
        ids = self._check_pages(pages, CALLERS, "caller-owned (from alloc_pages, not inserted)")
        self._device.allocator.free(ids)
        self._owner.release(ids)

    def write_kv(self, pages: Any, kv: Any) -> None:
        """Write KV into caller-owned pages.

        Args:
            pages: n caller-owned device page ids.
            kv: ``spec.kv_shape(n)`` = [num_layers, kv, n, page_size, heads, head_dim] in
                ``spec.dtype`` or its raw-bits dtype; jax or numpy. Not consumed.
        """
        self._guard()
        ids = self._check_pages(pages, CALLERS, "caller-owned (cached pages are read-only)")
        self._device.write(ids, kv)

    @publishes
    def wait_loaded(self, pages: Any) -> None:
        """Wait for the load-backs still writing allocated device ``pages`` and acknowledge
        them now: the cost model's L2 -> L1 link then gets the copy's own time, not the time to
        a later call (ARCHITECTURE.md, "Load or recompute")."""
        load = self._flight.load_writing(self._check_pages(pages, ALLOCATED, "allocated"))
        if load is not None:
            self._complete(upto=load)

    @property
    def window_pools(self) -> tuple[DevicePagePool, ...]:
        """The device pools of the spec's window groups (``spec.window_groups`` order; empty
        without them): each holds its group's layers; a forward writes them with
        ``device_pool.run_with(cache.window_pools, step, ...)``."""
        return () if self._windows is None else self._windows.device.pools

    def window_pages(self, pages: Any) -> np.ndarray:
        """int32 ``[len(spec.window_groups), n]``: each window group's device page holding the
        same tokens as allocated device ``pages`` (a request's page table, per group), -1
        where the group keeps none (pages no continuation after them reads; a forward masks
        them out, so it may read any page there, e.g. ``pool.scratch_page``).

        Raises:
            HiCacheError: the spec has no window groups, or a page is not allocated.
        """
        self._guard()
        ids = self._check_pages(pages, ALLOCATED, "allocated")
        if self._windows is None:
            raise HiCacheError("window_pages: the spec has no window groups")
        return self._windows.device.attach[:, ids]

    def write_window_kv(self, group: int, pages: Any, kv: Any) -> None:
        """Write window group ``group``'s KV of caller-owned ``pages``: ``kv`` of
        ``spec.window_groups[group].spec(page_size).kv_shape(n)`` (like :meth:`write_kv`).

        Raises:
            HiCacheError: no window groups, or pages not caller-owned.
            TypeError / ValueError: a bad group, shape or dtype; the pools unchanged.
        """
        self._guard()
        ids = self._check_pages(pages, CALLERS, "caller-owned (cached pages are read-only)")
        if group in self.spec.state_groups:
            raise ValueError(
                f"group={group!r} is a state group: checkpoints go through write_state"
            )
        pool, w = self._group_pages(group, ids)
        pool.write(w, kv)

    @publishes
    def read_window_kv(self, group: int, pages: Any) -> Any:
        """Window group ``group``'s KV of allocated device ``pages`` (each must hold the
        group's page): like :meth:`read_kv`, in the group's shape.

        Raises:
            HiCacheError: no window groups, a page not allocated or holding no group page.
        """
        ids = self._check_pages(pages, ALLOCATED, "allocated")
        load = self._flight.load_writing(ids)
        if load is not None:
            self._complete(upto=load)
        pool, w = self._group_pages(group, ids)
        return pool.read(w)

    def _group_pages(self, group: int, ids: np.ndarray) -> tuple[DevicePagePool, np.ndarray]:
        """Window group ``group``'s device pool and its pages of device pages ``ids`` (each
        must hold one); the group checked first."""
        pools = self.window_pools
        if not pools:
            raise HiCacheError("the spec has no window groups")
        if not isinstance(group, int) or isinstance(group, bool) or not 0 <= group < len(pools):
            raise ValueError(f"group={group!r} must be an int in [0, {len(pools)})")
        assert self._windows is not None
        w = self._windows.device.attach[group, ids]
        if (w < 0).any():
            bad = ids[w < 0][:8].tolist()
            if group in self.spec.state_groups:
                raise HiCacheError(f"pages {bad} hold no checkpoint of state group {group}")
            raise HiCacheError(f"pages {bad} hold no page of window group {group}")
        return pools[group], w

    # -- recurrent state (ARCHITECTURE.md, "Recurrent state") ---------------------------------

    def write_state(self, group: int, pages: Any, state: Any) -> None:
        """Checkpoint: write STATE group ``group``'s state after exactly the tokens ending
        with each of caller-owned ``pages`` into that page's slot (a fresh slot where it holds
        none, evicting to make room). The slot goes into the tree with its page
        (:meth:`insert`, ``Request.commit`` / ``finish``) and is never written again there: a
        hit reads it (:meth:`read_state`) into the caller's own state.

        Args:
            group: index in ``spec.window_groups`` of a ``STATE`` group.
            pages: ``n`` caller-owned device pages, each ending at a checkpoint.
            state: the group's arrays (a sequence in ``group.state`` order or a mapping by
                name), each ``[n, len(layers), *shape]`` in its dtype; jax or numpy.

        Raises:
            HiCacheError: pages not caller-owned; the spec has no STATE group.
            ValueError / TypeError: a bad group, a missing, misshapen or mistyped array
                (naming it); nothing taken or written.
            OutOfPagesError: no slot can be had; nothing taken or written.
        """
        self._guard()
        ids = self._check_pages(pages, CALLERS, "caller-owned (cached checkpoints are read-only)")
        g, grp = self._state_group(group)
        bits = pack_state(grp, check_state(grp, state, ids.size))
        assert self._windows is not None
        dev = self._windows.device
        fresh = ids[dev.attach[g, ids] < 0]
        if fresh.size:
            self._window_room(fresh.size, (g,))
        slots = self._windows.checkpoint(g, ids)
        try:
            dev.pools[g].write(slots, bits)
        except BaseException:
            dev.detach_group(g, fresh)
            raise

    @publishes
    def read_state(self, group: int, pages: Any) -> tuple[Any, ...]:
        """STATE group ``group``'s checkpoints at the ends of allocated device ``pages`` (each
        must hold one: e.g. a request's last cached page, ``Request.cached_len``): new arrays
        in the layout :meth:`write_state` takes, bit-identical to what was written.

        Raises:
            HiCacheError: a page not allocated or holding no checkpoint of the group.
            ValueError: a bad group.
        """
        ids = self._check_pages(pages, ALLOCATED, "allocated")
        g, grp = self._state_group(group)
        load = self._flight.load_writing(ids)
        if load is not None:
            self._complete(upto=load)
        pool, slots = self._group_pages(g, ids)
        return unpack_state(grp, pool.read_bits(slots))

    def checkpoint_positions(
        self, tokens: Any, cached_len: int, extra_key: Hashable = None
    ) -> list[int]:
        """Where a request with prompt ``tokens``, served from the cache up to ``cached_len``
        tokens, should write checkpoints (:meth:`write_state`) as it prefills: prefix lengths
        in ``(cached_len, len]`` (page multiples): where the tree's pages of ``tokens`` go on
        past ``cached_len`` (no checkpoint there yet: this request's becomes the tree's),
        ``cfg.checkpoint_tail_pages`` before the prompt's last whole page, every
        ``cfg.checkpoint_every_pages`` pages, and the prompt's last whole page. Changes
        nothing; [] without STATE groups."""
        self._guard()
        arr = page_tokens(tokens, extra_key, self._ps)
        cached_len = check_int("cached_len", cached_len)
        if self._windows is None or not self._windows.states:
            return []
        dev, host = self._tree.peek(arr, extra_key)
        return self._windows.positions(
            cached_len,
            dev + host,
            arr.shape[0],
            self.cfg.checkpoint_every_pages,
            self.cfg.checkpoint_tail_pages,
        )

    def _state_group(self, group: Any) -> tuple[int, LayerGroup]:
        """``group`` checked: the index of a STATE group in ``spec.window_groups``."""
        states = self.spec.state_groups
        if not states:
            raise HiCacheError("the spec has no state (recurrent) group")
        if not isinstance(group, int) or isinstance(group, bool) or group not in states:
            raise ValueError(f"group={group!r} must be a state group's index: one of {states}")
        return group, self.spec.window_groups[group]

    @publishes
    def read_kv(self, pages: Any) -> Any:
        """KV of allocated device pages: ``spec.kv_shape(n)`` in ``spec.dtype`` (a new array)."""
        ids = self._check_pages(pages, ALLOCATED, "allocated")
        load = self._flight.load_writing(ids)
        if load is not None:  # a layer-wise load may still be writing these pages
            self._complete(upto=load)
        return self._device.read(ids)

    @publishes
    def insert(
        self,
        tokens: Any,
        pages: Any,
        extra_key: Hashable = None,
        *,
        chunked: bool = False,
        priority: int = 0,
    ) -> int:
        """Cache the whole pages of ``tokens`` with ``pages`` (ARCHITECTURE.md, data flow).

        Args:
            tokens: 1-D non-negative int sequence; a trailing partial page is ignored.
            pages: int ``[len(tokens) // page_size]``: the tree's own page for a position it
                holds on device, or a caller-owned page. Caller pages at positions the tree
                already holds are freed; the others become the tree's.
            extra_key: namespace.
            chunked: one chunk of a chunked prefill: no hit is counted on existing nodes.
            priority: request priority (``eviction="priority"``).

        Returns:
            Tokens already cached (either tier) before the call.
        """
        return self._inserter(tokens, pages, extra_key, chunked, priority)[0].prefix_len

    @publishes
    def insert_locked(
        self, tokens: Any, pages: Any, node: NodeRef, extra_key: Hashable = None
    ) -> Match:
        """:meth:`insert` for a request that goes on (SGLang's ``cache_unfinished_req``): the
        caller's lock on ``node`` moves to the inserted prefix, which other requests then hit.
        Counts no hit (``chunked``). What :meth:`Request.commit` calls.

        Returns:
            The Match of ``tokens`` now, locked for the caller: its ``device_pages`` are the
            tree's (where another request inserted a page first, the caller's was freed).

        Raises:
            HiCacheError: the caller holds no lock on ``node``; ValueError / TypeError as
                :meth:`insert`; before any change.
        """
        if not self._caller_locks.get(check_node(self._tree, node)):
            raise HiCacheError(f"insert_locked: the caller holds no lock on {node!r}")
        arr = self._inserter(tokens, pages, extra_key, True, 0)[1]
        tm = self._tree.match(arr, extra_key, validated=True)
        m = Match(
            tm.device_pages, tm.device_len, tm.host_len, node_ref(tm.node, tm.last_device_node)
        )
        if m.device_len != arr.shape[0]:
            raise HiCacheError(
                f"inserted {arr.shape[0]} tokens but {m.device_len} are "
                "on device: the cache lost pages its caller holds"
            )
        self.lock(m.node)
        self.unlock(node)
        return m

    @publishes
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` device tokens if possible; returns tokens freed."""
        num_tokens = check_int("num_tokens", num_tokens)
        self._complete(attach=True)
        return self._evict.evict_device(num_tokens)

    @publishes
    def evict_host(self, num_tokens: int) -> int:
        """Delete host-only leaves worth ``num_tokens``; returns tokens freed on host."""
        num_tokens = check_int("num_tokens", num_tokens)
        self._complete(attach=True)
        return self._removal.evict_host_leaves(num_tokens)

    # -- control calls (ARCHITECTURE.md, "Control API"; the work: cache/control/) ---------------

    @property
    def local_heads(self) -> slice:
        """The kv heads this process holds: all of them, unless the pools span several
        processes (a mesh over their devices; ARCHITECTURE.md, "Several processes")."""
        return self._control.local_heads

    def read_kv_local(self, pages: Any) -> np.ndarray:
        """:meth:`read_kv` of this process's heads (:attr:`local_heads`) as numpy:
        ``[num_layers, kv, n, page_size, local heads, head_dim]`` in ``spec.dtype``, read
        from its own shards (a pool over several processes is an array none can read whole)."""
        return self._control.local_shard(self.read_kv(pages))

    def check_agreement(self) -> None:
        """Compare this cache with its copies on the other processes of its group (tree,
        page ownership, transfers in flight, counters; cache/agreement.py): ``HiCacheError``
        (``GroupDivergedError``) on every process naming the first field that differs, or
        ``GroupTimeoutError`` naming a process that did not take part. One process: a no-op."""
        self._guard()
        self._control.check_agreement()

    def lookup(
        self, tokens: Any, extra_key: Hashable = None, *, l3: bool = False
    ) -> dict[str, int]:
        """Tokens of ``tokens``' cached prefix per tier ("device", "host", with ``l3`` also
        "l3": the store's beyond them), with no side effect (cache/control/lookup.py)."""
        self._guard()
        return self._control.lookup(tokens, extra_key, l3)

    @publishes
    def invalidate(self, tokens: Any = None, extra_key: Hashable = None) -> dict[str, int]:
        """Drop the namespace ``extra_key`` (``tokens=None``), or ``tokens``' last page and all
        below it, from every tier, L3 too, after waiting for transfers
        (cache/control/invalidate.py): ``{"device", "host"}`` tokens freed, ``"l3"`` store
        pages deleted, ``"l3_unreached"`` 1 where the store kept entries it could not delete
        (never read by this cache again). ``InvalidateLockedError`` (nothing dropped) where
        running requests hold them."""
        return self._control.invalidate(tokens, extra_key)

    @publishes
    def pin(
        self,
        tokens: Any,
        extra_key: Hashable = None,
        *,
        ttl_s: float | None = None,
        tier: str = "device",
    ) -> int:
        """Keep the part of ``tokens``' cached prefix held on ``tier`` ("device" | "host") from
        eviction there, until :meth:`unpin` or ``ttl_s`` seconds on the cache's clock; returns
        the tokens pinned. ``PinLimitError`` (with the figures) beyond ``cfg.pin_max_share``
        of the pool; HiCacheError if nothing is held there (cache/control/pins.py)."""
        return self._control.pin(tokens, extra_key, ttl_s, tier)

    @publishes
    def unpin(self, tokens: Any, extra_key: Hashable = None, *, tier: str = "device") -> int:
        """Undo :meth:`pin` of the same tokens; HiCacheError if they are not pinned there."""
        return self._control.unpin(tokens, extra_key, tier)

    @publishes
    def attach_storage(self, url: str) -> None:
        """Open the L3 store ``url`` (as ``HiCacheConfig.storage``) on a live cache, requests in
        flight included; L1 and L2 untouched (cache/control/storage_attach.py); ``cfg.storage``
        becomes ``url``. With ``kv_events`` ``l3_medium`` set, its pages are announced as this
        cache's puts land (nothing at the attach). HiCacheError if storage is attached;
        ValueError / StorageUnavailableError (nothing changed) as at construction."""
        self.cfg = self._control.attach_storage(self.cfg, url)

    @publishes
    def detach_storage(self) -> int:
        """Finish the L3 work in flight (puts stored, prefetches landed), close the store, and
        go on without L3 (``cfg.storage`` None); returns the operations finished
        (``stats()["storage_detach_*"]``). Every page announced on L3 is announced removed.
        HiCacheError without storage."""
        finished = self._control.detach_storage()
        self.cfg = dataclasses.replace(self.cfg, storage=None)
        return finished

    def take_events(self) -> list[KVEvent]:
        """KV events (one per page) since the last take, oldest first; ``HiCacheError`` unless
        built with ``kv_events={"publisher": "queue"}``."""
        self._guard()
        return self._control.take_events()

    def take_event_batches(self) -> list[EventBatch]:
        """The event batches (one per public call) since the last take; a gap in ``seq``: the
        oldest were dropped (``stats()["kv_event_batches_dropped"]``). Raises as take_events."""
        self._guard()
        return self._control.take_event_batches()

    def observe_prefill(self, n_new: int, n_cached: int, seconds: float) -> None:
        """A prefill sample for ``load_policy="cost"`` (cache/loading/cost_model.py): ``n_new``
        tokens computed after ``n_cached`` in ``seconds``. ValueError for a negative /
        non-finite one."""
        self._guard()
        self._control.observe_prefill(n_new, n_cached, seconds)

    # -- introspection -----------------------------------------------------------------------

    @property
    def device_pool(self) -> DevicePagePool:
        """The device pool (L1). A serving stack's jitted forward writes K/V of pages it
        allocated straight into it with ``device_pool.run(step, ...)`` (pool donated); the pool
        object holds the only reference to the array, so do not keep ``device_pool.array``."""
        self._guard()
        return self._device

    @property
    def host_pool(self) -> HostPagePool:
        self._guard()
        return self._host

    @property
    def tree(self) -> RadixTree:
        self._guard()
        return self._tree

    @property
    def l3(self) -> L3Tier | NullL3Tier:
        self._guard()
        return self._l3.tier

    @property
    def transfer_engine(self) -> TransferEngine:
        self._guard()
        return self._engine

    def page_owners(self) -> np.ndarray:
        """int8 ``[device_pages]`` copy: each device page's ``PageOwner`` (free, caller, tree)."""
        self._guard()
        return self._owner.owners()

    @publishes
    def flush(self) -> None:
        """Wait for every transfer in flight (L3 puts and prefetches too) and apply it."""
        self._complete(upto=None, wait=True)
        self._l3.flush()

    def close(self) -> None:
        """Flush, then release the L3 backend (its threads, connections) and the group the
        cache built (``cfg.group`` stays the caller's). Idempotent. Every later call but
        ``stats()`` raises :class:`HiCacheError`."""
        if self._threads.closed:
            return
        self.flush()
        try:
            self._l3.close()
        finally:
            self._events.close()  # the ZMQ publisher sends what is queued and unbinds
            self._threads.close()
            if self._owns_group:
                self._group.close()  # peers then see this process gone

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (any thread may read it)."""
        return self._threads.closed

    def release_thread(self) -> None:
        """Hand the cache over: the owning thread gives it up and the next call from any thread
        takes it (e.g. built and warmed up on one thread, served from a scheduler thread).
        A no-op when no thread owns it yet."""
        if self._threads.ident is None and not self._threads.closed:
            return
        self._guard()
        self._threads.release()

    @publishes
    def reset(self) -> None:
        """Wait for transfers, then forget everything: tree, caller pages and locks, counters
        (the L3 store keeps its entries, and its client's ``l3_store_*`` counters)."""
        self.flush()
        self._tree.reset()
        self._device.allocator.reset()
        self._host.allocator.reset()
        if self._windows is not None:
            self._windows.device.reset()
            self._windows.host.reset()
        self._engine.reset_histograms()
        self._init_state()
        self._port.reset()
        self._l3.reset_counters()
        self._events.cleared()

    def stats(self) -> dict[str, Any]:
        """Counters and occupancy of both tiers. Pure (no polling); any thread may call it, also
        after :meth:`close` (figures read while the owner is inside a call may disagree)."""
        return (
            cache_stats(
                self._n,
                self._device.allocator,
                self._host.allocator,
                self._tree,
                self._owner,
                len(self._flight),
                self._write.reserve_pages(),
            )
            | self._events.stats()
            | self._l3.stats()
            | self._cost.stats()
            | self._pins.stats()
            | self._engine.stats()
            | {"agreements": self._group.calls, "agreement_seconds": self._group.seconds}
            | self._window_stats()
        )

    def _window_stats(self) -> dict[str, int]:
        w = self._windows
        out = {}
        for prefix, unit in (("window", "pages"), ("state", "slots")):
            which = () if w is None else (w.local if prefix == "window" else w.states)
            for tier in ("device", "host"):
                side = None if w is None else getattr(w, tier)
                used = [] if side is None else side.used_pages()
                spare = [] if side is None else side.spare_pages()
                out[f"{prefix}_{tier}_used_{unit}"] = sum(used[g] for g in which)
                out[f"{prefix}_{tier}_spare_{unit}"] = sum(spare[g] for g in which)
        out["window_spare_reclaimed"] = (
            0 if w is None else w.device.spare_reclaimed + w.host.spare_reclaimed
        )
        return out

    def transfer_histograms(self) -> dict[str, dict[str, HistogramSnapshot]]:
        """Duration, bytes and bandwidth of every completed device <-> host transfer of pages,
        per direction (``"to_host"``: backups, ``"to_device"``: load-backs and two-ended
        splits' copies), as fixed-bucket histograms (memory/histogram.py); each direction's
        ``count`` equals ``stats()["transfers_to_host"]`` / ``["transfers_to_device"]``.
        Pure, like :meth:`stats`: any thread, also after :meth:`close`."""
        return self._engine.histograms()

    def check_invariants(self) -> None:
        """Check every invariant (ARCHITECTURE.md) on the whole cache, O(cache), for tests;
        ``HiCacheError`` names the first broken one."""
        self._guard()
        check_cache(
            self._tree,
            self._owner,
            self._device.allocator,
            self._host.allocator,
            self._flight,
            self._caller_locks,
            self._port,
            self._write.continuous_prefix,
            self._pins,
        )
        if self._windows is not None:
            self._windows.check(self._tree.root)


def _slots(given: int | None, pages: int, page_bytes: int, slot_bytes: int) -> int:
    """A state group's slots on a tier: ``given``, else as many as take a quarter of the
    tier's full-attention pool bytes (at least 8, at most ``pages``)."""
    if given is not None:
        return given
    return max(1, min(pages, max(8, pages * page_bytes // (4 * slot_bytes))))
