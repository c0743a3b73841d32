"""TransferEngine: asynchronous page copies between the device pool (L1) and the host pool (L2).

``backup(device_ids, host_ids)`` (device -> host) and ``load(host_ids, device_ids)`` (host ->
device) validate their ids in numpy, dispatch ONE jitted page copy (``page_copy.copy_pages``, a
per-page ``dynamic_slice`` / ``dynamic_update_slice`` loop: each byte moved once, no staging
buffer) and return a :class:`TransferHandle` at once. The destination pool is donated and
rebound (the device pool through ``DevicePagePool.run``, the host pool through
``HostPagePool.run``); the source is passed read-only, so no Python reference outlives the call.

Ordering and safety come from XLA, not from locks: every access to a pool is a computation on
its single array, so a copy in flight is ordered before any later update of the same array (a
donating update waits for earlier readers). Completion is detected by polling a small per-call
token (``is_ready()``); no worker thread ever touches a pool (ARCHITECTURE.md: one dispatching
thread). Each transfer depends on all earlier ones (it donates one pool and reads the other), so
transfers complete in dispatch order, and a handle seen complete completes every earlier handle too.

On XLA:CPU the copy runs on XLA's own execution thread, not in the caller: see
``page_copy.MIN_INDEX_LEN`` for what makes it asynchronous there. A copy of at most
``page_copy.INLINE_COPY_BYTES`` between pools on XLA:CPU is dispatched in its inline form
(``page_copy.inline_copy``): it runs in the caller once its inputs are ready, which costs less
CPU than the hand-off to XLA's thread; behind a computation it reads it still returns at once.

Host pages in flight: ``busy_host_pages(ids)`` says which pages a transfer not yet observed
complete reads or writes. The data itself is protected by XLA ordering; the cache consults this
when a node gives up host pages (``inflight.InFlight.free_host``: pages under a pending copy are
freed once it lands), so that the *ownership* of a page never changes under a pending copy.

Layer-wise load (``layerwise=True``): one copy per layer, each with its own token, dispatched in
layer order; ``wait_layer(l)`` returns once layer ``l``'s pages are in the device pool. What
overlaps: everything the host does after dispatch (scheduling, tokenising, dispatching other
work) overlaps the whole load, and the caller learns layer 0 is complete long before the last
layer. What does not: the device pool is one ``jax.Array``, so a forward step that takes the pool
depends on every update dispatched before it, including later layers' copies; and XLA:CPU (one
stream per device) and a GPU compute stream run dispatched executions in order. Real compute /
copy overlap needs the host->device fetch inside the forward's own jit (XLA then uses its copy
streams) -- not something a separate transfer call can give.

Threading: one thread (the cache's) calls everything here.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from hicache_jax.errors import HiCacheError
from hicache_jax.memory.histogram import HistogramSnapshot, TransferHistogram
from hicache_jax.memory.page_copy import (
    INLINE_COPY_BYTES,
    PLAN_META,
    bound_copy,
    copy_fn,
    copy_plan,
    fused_copy,
    inline_copy,
    layer_plans,
)
from hicache_jax.memory.window import spare_rank
from hicache_jax.spec import HostLayout
from hicache_jax.validation import check_bool, check_int, is_int

if TYPE_CHECKING:  # the pools are only passed in: the engine needs their public attributes
    from hicache_jax.memory.device_pool import DevicePagePool
    from hicache_jax.memory.host_pool import HostPagePool
    from hicache_jax.memory.window import WindowPages


def transfer_fns(
    num_layers: int,
    host_layout: HostLayout,
    host_put: jax.sharding.Sharding | None,
    dev_put: jax.sharding.Sharding | None,
) -> tuple[Any, Any, Any]:
    """``(backup, load, load_layer)``: the page copies of a transfer engine with their static
    arguments bound (``page_copy.copy_fn``), destination donated. ``host_put`` / ``dev_put``:
    the host pool's sharding / the device pool's, when the host pool is in another memory space
    (pinned_host), else None. Also what ``lowering/checks.py`` lowers for other platforms."""
    backup = copy_fn(
        dst_layout=host_layout,
        src_layout=HostLayout.LAYER_FIRST,
        num_layers=num_layers,
        dst_put=host_put,
    )
    load: dict[str, Any] = dict(
        dst_layout=HostLayout.LAYER_FIRST, src_layout=host_layout, src_put=dev_put
    )
    return backup, copy_fn(**load, num_layers=num_layers), copy_fn(**load, num_layers=1)


class TransferKind(str, enum.Enum):
    BACKUP = "backup"  # device -> host
    LOAD = "load"  # host -> device


class TransferHandle:
    """One dispatched transfer. Created by :class:`TransferEngine` only.

    Attributes:
        kind: "backup" (device -> host) or "load" (host -> device).
        device_ids, host_ids: int32[n] numpy copies of the ids, pairwise (page i <-> page i).
        nbytes: bytes moved (``n * spec.page_bytes``).
        tag: the caller's record of what the transfer is for (the cache's operations in flight:
            see ``inflight.py``); None unless given.
        layerwise: one token per layer (only loads can be layer-wise).
        seconds: dispatch -> completion as observed by ``done``/``wait``/``poll`` (None before).
    """

    __slots__ = (
        "kind",
        "device_ids",
        "host_ids",
        "nbytes",
        "tag",
        "layerwise",
        "seconds",
        "_engine",
        "_tokens",
        "_window_tokens",
        "_t0",
        "_complete",
        "_start",
    )

    def __init__(
        self,
        engine: TransferEngine,
        kind: TransferKind,
        device_ids: np.ndarray,
        host_ids: np.ndarray,
        tag: Any,
        layerwise: bool,
    ) -> None:
        self.kind = kind
        self.device_ids = device_ids
        self.host_ids = host_ids
        self.nbytes = int(device_ids.size) * engine.spec.page_bytes
        self.tag = tag
        self.layerwise = layerwise
        self.seconds: float | None = None
        self._engine = engine
        self._tokens: list[jax.Array] = []
        self._window_tokens: list[jax.Array] = []  # the window groups' copies (one per group)
        self._t0 = engine._clock()
        self._complete = False
        self._start = engine._starts  # the request starts before its dispatch (complete_after)

    def __repr__(self) -> str:
        state = "done" if self._complete else "in flight"
        return f"TransferHandle({self.kind.value}, pages={self.device_ids.size}, {state})"

    def done(self) -> bool:
        """Non-blocking: has every page landed? (Applies the completion when it has; with a
        group or :meth:`TransferEngine.complete_after`, reports only what the last poll
        applied.)"""
        # several processes, or completions at set request starts: applied in poll() only
        # (is_ready() is on jax's concrete arrays, ArrayImpl, not in the jax.Array interface)
        if (
            not self._complete
            and not self._engine._decided
            and all(t.is_ready() for t in self._tokens)  # type: ignore[attr-defined]
            and all(t.is_ready() for t in self._window_tokens)  # type: ignore[attr-defined]
        ):
            self._engine._finish(self)
        return self._complete

    def wait(self) -> TransferHandle:
        """Block until every page has landed; returns self."""
        if not self._complete:
            for token in (*self._tokens, *self._window_tokens):
                token.block_until_ready()
            self._engine._finish(self)
        return self

    def wait_layer(self, layer: int) -> None:
        """Block until layer ``layer``'s pages have landed (whole transfer unless layer-wise).

        Raises:
            ValueError: ``layer`` not in ``[0, num_layers)``.
        """
        num_layers = self._engine.spec.num_layers
        if not is_int(layer) or not 0 <= layer < num_layers:
            raise ValueError(f"layer={layer!r} must be an int in [0, {num_layers})")
        if not self.layerwise or self._complete or layer == num_layers - 1:
            # The layers are copied in dispatch order, so the last one landing means all have:
            # wait() makes that observed (XLA:CPU may mark an earlier layer's token ready a
            # little after a later one's, and done() would then still say False).
            self.wait()
        elif self._tokens:
            for token in self._window_tokens:  # (few pages: the window groups' in one copy)
                token.block_until_ready()
            self._tokens[layer].block_until_ready()
            self.done()


class TransferEngine:
    """Queued, polled page copies between a device pool and a host pool.

    Args:
        device_pool: the L1 pool (its array is donated by loads, read by backups).
        host_pool: the L2 pool, same ``spec``, placed like the device pool (same mesh and head
            axis, or both unsharded on the same device).
        clock: the time source of the handles' ``seconds``.

    Raises:
        ValueError: the pools' specs or placements differ.
    """

    def __init__(
        self,
        device_pool: DevicePagePool,
        host_pool: HostPagePool,
        *,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if device_pool.spec != host_pool.spec:
            raise ValueError(
                f"device pool spec {device_pool.spec} != host pool spec {host_pool.spec}"
            )
        dev = device_pool.array.sharding
        if not dev.is_equivalent_to(host_pool.device_sharding, len(device_pool.shape)):
            raise ValueError(
                f"host pool placement {host_pool.sharding} does not match the device "
                f"pool's {dev}: build the host pool with the same mesh and axis"
            )
        self.device_pool = device_pool
        self.host_pool = host_pool
        self._clock = clock  # handles' seconds (a simulator injects its own)
        #: the handles' seconds are wall time (the default clock), so a dispatch that compiled
        #: a copy program counts its compile; False under an injected clock
        self.wall_clock = clock is time.perf_counter
        self.spec = device_pool.spec
        host_put = None if host_pool.on_device_memory else host_pool.sharding
        dev_put = None if host_pool.on_device_memory else host_pool.device_sharding
        # dispatched as jits with their static arguments bound (page_copy.bound_copy)
        fns = transfer_fns(self.spec.num_layers, host_pool.layout, host_put, dev_put)
        self._backup_fn, self._load_fn, self._load_layer_fn = map(bound_copy, fns)
        # XLA:CPU: copies of up to this many pages run inline (page_copy.INLINE_COPY_BYTES)
        devices: set[jax.Device] = dev.device_set  # (set[Device] in jax: unresolved)
        cpu = host_pool.on_device_memory and all(d.platform == "cpu" for d in devices)
        self._inline_pages = INLINE_COPY_BYTES // self.spec.page_bytes if cpu else 0
        self._backup_inline, self._load_inline = inline_copy(fns[0]), inline_copy(fns[1])
        self._busy = np.zeros(host_pool.num_pages, np.int32)  # transfers using each host page
        self._in_flight: list[TransferHandle] = []  # dispatch order
        self._finished: list[TransferHandle] = []  # completion order, not yet polled
        self._group: Any = None  # several processes: see agree_with
        self._lag: int | None = None  # see complete_after
        self._starts = 0  # request starts seen (polls with agree=True)
        self._decided = False  # completion seen only by poll: a group or a lag
        #: complete_after: request starts that waited for a copy not yet landed, and how long
        self.lag_waits, self.lag_wait_seconds = 0, 0.0
        # every completed transfer of pages, per direction (memory/histogram.py)
        self._hist = {kind: TransferHistogram() for kind in TransferKind}
        # window groups (attach_windows): each tier's pages, each group's (backup, load) copy
        self._windows: tuple[WindowPages, WindowPages] | None = None
        self._window_loads: list[Any] = []  # each group's own load (layer-wise loads)
        self._fused: dict[bool, tuple[Any, Any]] = {}
        #: window group pages a backup or load could not copy (no free page of the group on
        #: the destination tier): those pages hold no window KV there (not servable from it)
        self.window_pages_dropped = 0

    def attach_windows(self, device: WindowPages, host: WindowPages) -> None:
        """Copy the window groups' pages with the full-attention pages they are attached to
        (memory/window.py): every backup and load then also copies, per group, the group
        pages of the pages it moves that hold one, into fresh group pages of the destination
        tier (attached there to the destination pages), in the same handle -- in the same
        program as the full pages (``page_copy.fused_copy``: one dispatch), but for a
        layer-wise load, whose window groups are copied once, beside its first layer."""
        self._windows = (device, host)
        self._window_loads = []
        full = transfer_fns(
            self.spec.num_layers, self.host_pool.layout, *self._puts(self.host_pool)
        )
        groups = []
        for dp, hp in zip(device.pools, host.pools):
            fns = transfer_fns(dp.spec.num_layers, hp.layout, *self._puts(hp))
            groups.append(fns)
            self._window_loads.append(bound_copy(fns[1]))
        # (backup, load) over every group, async and inline (XLA:CPU: INLINE_COPY_BYTES)
        self._fused = {
            inline: (
                fused_copy([full[0], *(f[0] for f in groups)], inline),
                fused_copy([full[1], *(f[1] for f in groups)], inline),
            )
            for inline in (False, True)
        }

    @staticmethod
    def _puts(host_pool: HostPagePool) -> tuple[Any, Any]:
        if host_pool.on_device_memory:
            return None, None
        return host_pool.sharding, host_pool.device_sharding

    def _window_plans(
        self, handle: TransferHandle, src: np.ndarray, dst: np.ndarray, to_host: bool, plan: Any
    ) -> np.ndarray:
        """The window groups' part of a transfer of full-attention pages ``src -> dst`` (of
        copy plan ``plan``): for each group, fresh destination pages for the source pages that
        hold one (those a node end reads first, then spare ones, where there is room),
        attached there, and the plan of their copy, as long as ``plan`` (an empty plan where
        none); ``int32 [1 + groups, 3, L]``: ``plan`` first, then each group's (what the
        fused copy takes)."""
        assert self._windows is not None
        dev, host = self._windows
        src_side, dst_side = (dev, host) if to_host else (host, dev)
        dst_side.detach(dst)  # (fresh pages hold none; a caller's, or a node's host copy, might)
        length = plan.shape[1]
        plans = np.zeros((1 + len(self._window_loads), 3, length), np.int32)
        plans[0] = plan
        for g in range(len(self._window_loads)):
            w = src_side.attach[g, src]
            on = w >= 0
            n_on = int(np.count_nonzero(on))
            if not n_on:
                continue
            stamps = src_side.spare[g, src]
            worths = None  # a valued group's spare pages carry their worth (value_groups)
            if src_side.valued[g]:
                assert src_side.worth is not None
                worths = src_side.worth[g, src]
            spare = stamps > 0  # (spare pages are attached ones)
            n_spare = int(np.count_nonzero(spare))
            kept = n_on - n_spare
            sel: np.ndarray | None
            if n_spare:  # the pages a node end reads first, then spare ones
                if n_on == w.size:  # (every page holds one: one stable sort puts them so)
                    sel = np.argsort(spare, kind="stable")
                else:
                    sel = np.concatenate([np.flatnonzero(on & ~spare), np.flatnonzero(spare)])
                if dst_side.pools[g].allocator.num_free < n_on:
                    # short there: the spare pages of the highest rank first, each freeing
                    # only a spare page of no higher rank (WindowPages.take_for_copy; a
                    # valued group's: of no higher worth)
                    sp = sel[kept:]
                    ranks = spare_rank(stamps[sp])
                    key = ranks if worths is None else worths[sp]
                    order = np.argsort(-key, kind="stable")
                    sel[kept:] = sp[order]
                    taken = dst_side.take_for_copy(
                        g, kept, ranks[order], None if worths is None else key[order]
                    )
                else:
                    taken = dst_side.take(g, n_on)
            else:
                sel = np.flatnonzero(on) if n_on < w.size else None  # (None: all, no index)
                taken = dst_side.take(g, n_on)
            if taken.size < n_on:
                # (counted: pages a node end reads; spare ones are not copied, silently)
                self.window_pages_dropped += max(0, kept - int(taken.size))
                sel = (np.arange(n_on) if sel is None else sel)[: taken.size]
            if not taken.size:
                continue
            d, s = (dst, w) if sel is None else (dst[sel], w[sel])
            dst_side.attach[g, d] = taken
            if taken.size > kept:  # spare there too, of the same rank
                assert sel is not None
                rest = sel[kept:]
                dst_side.mark_spare(
                    g,
                    d[kept:],
                    spare_rank(stamps[rest]),
                    fresh=True,
                    worth=None if worths is None else worths[rest],
                )
            handle.nbytes += int(taken.size) * dev.pools[g].spec.page_bytes
            copy_plan(taken, s, length=length, out=plans[1 + g])
        return plans

    def agree_with(self, group: Any) -> None:
        """Several processes (``memory/group.py``): from now on a transfer counts as complete
        only once every process of ``group`` has seen it complete -- each poll applies the
        MIN over processes of the transfers seen complete, so every process's cache acts on
        the same ones (a process's copy may land later than its peer's)."""
        self._group, self._decided = group, True

    def complete_after(self, lag: int) -> None:
        """From now on a transfer counts as complete at the ``lag``-th request start after its
        dispatch (a request start: ``poll(agree=True)``), where it is waited for if it has
        not landed, and at a wait; never at any other poll. Which copies a decision sees done
        then depends on the calls alone, not on when copies land: every process (and every
        run of the same calls) applies the same ones with no agreement
        (ARCHITECTURE.md, "Several processes"). The price: a start that finds a copy of
        ``lag`` starts ago still moving waits for it (``lag_waits``, ``lag_wait_seconds``).

        Raises:
            TypeError / ValueError: ``lag`` not an int >= 1.
        """
        self._lag, self._decided = check_int("lag", lag, 1), True

    # ----------------------------------------------------------------------------- dispatch
    def backup(
        self, device_ids: Any, host_ids: Any, *, tag: Any = None, validated: bool = False
    ) -> TransferHandle:
        """Copy device pages to host pages (device_ids[i] -> host_ids[i]); returns at once.

        Args:
            validated: the caller vouches for the ids: int32 numpy arrays of the same length,
                distinct, allocated in their pools (the cache's own, from its tree and its
                allocators); the checks below are skipped.

        Raises:
            TypeError / ValueError: ids not 1-D ints, out of range, repeated, lengths differ.
            HiCacheError: ids not allocated in their pool.
            All before dispatch: both pools unchanged.
        """
        d, h = (device_ids, host_ids) if validated else self._validate(device_ids, host_ids)
        handle = TransferHandle(self, TransferKind.BACKUP, d, h, tag, layerwise=False)
        if d.size:
            small = d.size <= self._inline_pages
            plan = copy_plan(h, d)
            if self._windows is None:
                fn = self._backup_inline if small else self._backup_fn
                handle._tokens.append(self.host_pool.run(fn, self.device_pool.array, plan))
            else:  # every group in one program
                dev, host = self._windows
                plans = self._window_plans(handle, d, h, True, plan)
                handle._tokens.append(
                    self.host_pool.run_with(
                        host.pools,
                        self._fused[small][0],
                        self.device_pool.array,
                        tuple(p.array for p in dev.pools),
                        plans,
                    )
                )
        return self._track(handle)

    def load(
        self,
        host_ids: Any,
        device_ids: Any,
        *,
        layerwise: bool = False,
        tag: Any = None,
        validated: bool = False,
    ) -> TransferHandle:
        """Copy host pages to device pages (host_ids[i] -> device_ids[i]); returns at once.

        Args:
            layerwise: dispatch one copy per layer so ``wait_layer(l)`` can return early.
            validated: as in :meth:`backup`.

        Raises:
            Like :meth:`backup`; also TypeError for a non-bool ``layerwise``.
        """
        check_bool("layerwise", layerwise)
        d, h = (device_ids, host_ids) if validated else self._validate(device_ids, host_ids)
        handle = TransferHandle(self, TransferKind.LOAD, d, h, tag, layerwise=layerwise)
        if d.size:
            plan = copy_plan(d, h)
            if layerwise:
                # One execution per layer: each has its own completion token. The host pool
                # buffer is read, never donated, so all layers read the same array.
                for layer_plan in layer_plans(plan, self.spec.num_layers):
                    handle._tokens.append(
                        self.device_pool.run(self._load_layer_fn, self.host_pool.buffer, layer_plan)
                    )
                if self._windows is not None:  # the window groups once, beside layer 0
                    self._load_windows_apart(handle, h, d, plan)
            elif self._windows is None:
                fn = self._load_inline if d.size <= self._inline_pages else self._load_fn
                handle._tokens.append(self.device_pool.run(fn, self.host_pool.buffer, plan))
            else:  # every group in one program
                dev, host = self._windows
                plans = self._window_plans(handle, h, d, False, plan)
                handle._tokens.append(
                    self.device_pool.run_with(
                        dev.pools,
                        self._fused[d.size <= self._inline_pages][1],
                        self.host_pool.buffer,
                        tuple(p.buffer for p in host.pools),
                        plans,
                    )
                )
        return self._track(handle)

    def _load_windows_apart(
        self, handle: TransferHandle, h: np.ndarray, d: np.ndarray, plan: Any
    ) -> None:
        """A layer-wise load's window groups: one copy per group (``wait_layer`` of any layer
        waits them too)."""
        assert self._windows is not None
        dev, host = self._windows
        for g, group_plan in enumerate(self._window_plans(handle, h, d, False, plan)[1:]):
            if group_plan[PLAN_META, 0]:
                handle._window_tokens.append(
                    dev.pools[g].run(self._window_loads[g], host.pools[g].buffer, group_plan)
                )

    def _validate(self, device_ids: Any, host_ids: Any) -> tuple[np.ndarray, np.ndarray]:
        d = self.device_pool.validate_ids(device_ids, "device_ids")
        h = self.host_pool.validate_ids(host_ids, "host_ids")
        if d.size != h.size:
            raise ValueError(
                f"device_ids ({d.size} pages) and host_ids ({h.size} pages) must "
                "have the same length"
            )
        if not self.device_pool.allocator.is_allocated(d).all():
            bad = d[~self.device_pool.allocator.is_allocated(d)][:8]
            raise HiCacheError(f"device_ids {bad.tolist()} are not allocated")
        if not self.host_pool.allocator.is_allocated(h).all():
            bad = h[~self.host_pool.allocator.is_allocated(h)][:8]
            raise HiCacheError(f"host_ids {bad.tolist()} are not allocated")
        return d, h

    def _track(self, handle: TransferHandle) -> TransferHandle:
        if not handle._tokens:  # zero pages: nothing dispatched, complete now -- on its own
            # (through _finish it would also complete every transfer dispatched before it)
            handle.seconds, handle._complete = 0.0, True
            self._finished.append(handle)
            return handle
        self._busy[handle.host_ids] += 1  # ids are distinct within one transfer
        self._in_flight.append(handle)
        return handle

    # --------------------------------------------------------------------------- completion
    def _finish(self, handle: TransferHandle) -> None:
        """Apply the completion of ``handle`` and of every transfer dispatched before it.

        Every transfer depends on all earlier ones: it donates one pool and reads the other,
        both the outputs of the previous transfers (and a donating update waits for earlier
        readers). So once a handle's token is ready, the earlier transfers have landed too --
        even if their own tokens are not yet marked ready (XLA:CPU was seen to mark a later
        execution's outputs ready before an earlier one's token). Completion order is therefore
        dispatch order.
        """
        now = self._clock()
        upto = self._in_flight.index(handle) + 1
        done, self._in_flight = self._in_flight[:upto], self._in_flight[upto:]
        for item in done:
            item.seconds = now - item._t0
            item._complete = True
            item._tokens = []
            self._busy[item.host_ids] -= 1
            self._hist[item.kind].record(item.nbytes, item.seconds)
        self._finished.extend(done)

    def poll(self, agree: bool = True) -> list[TransferHandle]:
        """Handles finished since the last ``poll`` / ``wait_all``, in completion order.

        Completion order is dispatch order (see ``_finish``); a zero-page transfer completes at
        dispatch. ``seconds`` is an upper bound: dispatch to observation. With a group
        (:meth:`agree_with`), the transfers every process has seen complete, when ``agree``
        (every process must pass the same); ``agree=False`` takes no agreement and applies
        none of the copies in flight: they stay in flight until an agreed poll or a wait,
        which is always safe (a decision that needs them waits for them). Without a group
        ``agree`` changes nothing.
        """
        if self._lag is not None:  # complete_after: the copies due at this start, waited for
            if agree:
                self._starts += 1
                self._apply_due(self._starts - self._lag)
            out, self._finished = self._finished, []
            return out
        if self._group is not None and not (agree and self._in_flight):
            out, self._finished = self._finished, []
            return out
        ready = 0  # the latest finished one finishes the rest: count up to it
        for i in range(len(self._in_flight), 0, -1):
            # is_ready(): on jax's concrete arrays (ArrayImpl), not in the jax.Array interface
            if all(t.is_ready() for t in self._in_flight[i - 1]._tokens):  # type: ignore[attr-defined]
                ready = i
                break
        if self._group is not None:  # the same queue on every process
            ready = int(self._group.agree_min("transfers", [ready])[0])
        if ready:
            self._finish(self._in_flight[ready - 1])
        out, self._finished = self._finished, []
        return out

    def _apply_due(self, start: int) -> None:
        """Complete every transfer dispatched before request start ``start + 1`` (a prefix of
        the queue), waiting for the last of them if it has not landed."""
        due = 0
        while due < len(self._in_flight) and self._in_flight[due]._start <= start:
            due += 1
        if not due:
            return
        last = self._in_flight[due - 1]
        # is_ready(): on jax's concrete arrays (ArrayImpl), not in the jax.Array interface
        if not all(t.is_ready() for t in last._tokens):  # type: ignore[attr-defined]
            t0 = time.perf_counter()
            for token in last._tokens:
                token.block_until_ready()
            self.lag_waits += 1
            self.lag_wait_seconds += time.perf_counter() - t0
        self._finish(last)

    def wait_all(self) -> list[TransferHandle]:
        """Block until nothing is in flight; returns what ``poll`` would (no request start)."""
        for handle in list(self._in_flight):
            handle.wait()
        return self.poll(agree=False)

    def stats(self) -> dict[str, Any]:
        """The transfers of pages completed per direction (each one observation of
        :meth:`histograms`; a zero-page transfer moves nothing and is not counted) and the
        waits of :meth:`complete_after` (measured, not decided: they differ between
        processes)."""
        return {
            "transfers_to_host": self._hist[TransferKind.BACKUP].seconds.snapshot().count,
            "transfers_to_device": self._hist[TransferKind.LOAD].seconds.snapshot().count,
            "completion_lag_waits": self.lag_waits,
            "completion_lag_wait_seconds": self.lag_wait_seconds,
            "window_pages_dropped": self.window_pages_dropped,
        }

    def histograms(self) -> dict[str, dict[str, HistogramSnapshot]]:
        """Duration, bytes and bandwidth of every completed transfer of pages, per direction:
        ``{"to_host": ..., "to_device": ...}``, each ``{"seconds", "bytes", "gbps"}``
        (:class:`~hicache_jax.memory.histogram.TransferHistogram`). Any thread may call it."""
        return {
            "to_host": self._hist[TransferKind.BACKUP].snapshot(),
            "to_device": self._hist[TransferKind.LOAD].snapshot(),
        }

    def reset_histograms(self) -> None:
        """Forget the transfers counted so far (``HiCache.reset``)."""
        self._hist = {kind: TransferHistogram() for kind in TransferKind}

    @property
    def in_flight(self) -> int:
        """Transfers dispatched and not yet observed complete."""
        return len(self._in_flight)

    # ------------------------------------------------------------------------ host page guard
    def busy_host_pages(self, host_ids: Any, *, validated: bool = False) -> np.ndarray:
        """Bool mask: which of ``host_ids`` a transfer not yet observed complete reads or writes.
        ``validated``: ``host_ids`` already is an int32 numpy array of in-range ids."""
        h = host_ids if validated else self.host_pool.validate_ids(host_ids)
        return self._busy[h] > 0
