"""InFlight: the cache's transfers in flight, from claim to acknowledgement.

A backup of a node is *claimed* (host pages reserved), *dispatched* with the other claims of the
same call in ONE transfer, and the node holds its host pages **from the dispatch on**: it is
backed up at once, not locked, and may be evicted from device, loaded back or split while the
copy runs. XLA orders every later access of the pools after the copy (it reads the device
pool's array, a later write donates it and waits; it writes the host pool's array, which every
later read or write takes as input), so the bytes a later reader sees are the copied ones; the
eviction path frees a dirty node's device pages without waiting for its copy. Host pages a node
gives up while a copy into them is still in flight are *parked* here (the target of a copy in
flight) and freed when it lands, so a host page never changes owner under a pending copy. The
acknowledgement counts the copy's bytes and seconds (``stats()``). A load-back of host-only
chains is dispatched in one transfer and acknowledged the same way (its node stays locked
until then, the chains' device pages stop being "loading").

Order comes from the transfer engine's own queue: it completes transfers in dispatch order and
``poll()`` returns them in that order, so a parent's backup is acknowledged before its child's.
Each handle's ``tag`` holds the operations it carries (several backups share one handle); this
class keeps them by sequence number only to find one (``read_kv`` of a page being loaded) and
to state what is in flight (:meth:`HiCache.check_invariants`).

Threading: the cache's thread only.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from hicache_jax.cache.l3_port import FetchedPages
from hicache_jax.cache.loading.cost_model import CostModel
from hicache_jax.cache.ownership import DevicePageOwners
from hicache_jax.errors import OutOfPagesError
from hicache_jax.events.recorder import NullRecorder, Recorder
from hicache_jax.events.records import Medium
from hicache_jax.memory.allocator import PageAllocator
from hicache_jax.memory.page_copy import index_len, stage_chunks
from hicache_jax.memory.transfer import TransferEngine, TransferKind
from hicache_jax.spec import KVSpec
from hicache_jax.tree.node import TreeNode
from hicache_jax.tree.radix import RadixTree

Claim = tuple[TreeNode, np.ndarray]  # (node, host pages reserved for its backup)


@dataclass(eq=False)
class Op:
    """One acknowledgement to apply: a backup of ``node`` (which holds its host pages from the
    dispatch on) or a load-back ending at ``node`` (locked until then)."""

    seq: int
    kind: TransferKind
    handle: Any
    node: TreeNode
    device_ids: np.ndarray
    host_ids: np.ndarray


class InFlight:
    """Transfers in flight of one cache.

    Args:
        spec: the cache's KVSpec.
        tree: the cache's tree (nodes locked while their transfer is in flight).
        engine: the cache's transfer engine.
        device, host: the pools' allocators (claims and failed dispatches free pages).
        owners: the cache's device page owners (loaded pages become the tree's).
        events: the cache's event recorder.
        counters: the cache's ``stats()`` counters (updated at each acknowledgement).
        on_backup: called with the nodes of a dispatched backup, leaf first (the L3 tier's
            hook; its reads of their host pages are ordered after the copy).
        cost: the cost model; each acknowledged load-back transfer is a sample of its
            ``l2_l1`` link (bytes, the handle's dispatch-to-observation seconds), but for the
            first of each copy shape on the wall clock: its time holds the copy programs'
            compile (0.4-0.5 s on XLA:CPU, memory/page_copy.py), as the engines skip a
            prefill shape's first run; it still settles the decision that loaded.
        fetched: the host pages an L3 prefetch filled (cache/l3_port.py): a backup into one
            of them removes its tag (the page now holds other data). None: no tags.
    """

    def __init__(
        self,
        spec: KVSpec,
        tree: RadixTree,
        engine: TransferEngine,
        device: PageAllocator,
        host: PageAllocator,
        owners: DevicePageOwners,
        events: NullRecorder | Recorder,
        counters: collections.Counter,
        on_backup: Callable[[list], None],
        cost: CostModel | None = None,
        fetched: FetchedPages | None = None,
    ) -> None:
        self._spec, self._ps, self._cost = spec, spec.page_size, cost
        self._fetched = fetched if fetched is not None else FetchedPages(0)
        self._load_shapes: set = set()  # the copy shapes loads were timed at (their compile)
        self._tree, self._engine, self._owners = tree, engine, owners
        self._device_free, self._host_free = device.free, host.free
        self._host = host
        self._events, self._n, self._on_backup = events, counters, on_backup
        device_pages = device.num_pages
        self._loading = np.zeros(device_pages, np.int64)  # 1 + seq of the load writing a page
        self._parked = np.zeros(host.num_pages, np.bool_)  # given up, freed once not busy
        self._claimed: set[TreeNode] = set()  # claimed, not dispatched yet
        #: window groups: called with a backup's device pages before its dispatch, to make
        #: room on the host tier for the window pages its node ends read (set by the cache)
        self.window_room: Callable[[np.ndarray], None] | None = None
        self.num_parked = 0
        self._ops: dict[int, Op] = {}  # seq -> op, dispatch order
        self._seq = -1

    @property
    def host_allocator(self) -> PageAllocator:
        """The host pool's allocator (what :meth:`free_host` frees into)."""
        return self._host

    def __len__(self) -> int:
        """Operations in flight (backups sharing a transfer count one each)."""
        return len(self._ops)

    def ops(self) -> Iterator[Op]:
        return iter(self._ops.values())

    def _ops_for(self, kind: TransferKind, parts: list) -> tuple[Op, ...]:
        """Ops (seq numbers after the last dispatched) for ``(node, device_ids, host_ids)``
        parts of one transfer: its tag. Registered by :meth:`_register` once dispatched."""
        return tuple(
            Op(self._seq + 1 + i, kind, None, node, d, h) for i, (node, d, h) in enumerate(parts)
        )

    def _register(self, ops: tuple[Op, ...], handle: Any) -> None:
        for op in ops:
            op.handle = handle
            self._ops[op.seq] = op
        self._seq += len(ops)

    # -- backups ------------------------------------------------------------------------------

    def claim_backup(
        self, node: TreeNode, continuous_prefix: bool, take_host: Callable[[int], np.ndarray]
    ) -> Claim | None:
        """Reserve host pages (``take_host``, which may evict host pages) for a backup of
        ``node``, to be dispatched by :meth:`dispatch_backups` before the cache's call returns.
        None when skipped: no device pages, already backed up, a gap above it under
        ``continuous_prefix``, or no host pages."""
        if node.value is None or node.backed_up or node in self._claimed:
            return None
        parent = node.parent
        assert parent is not None  # a node of the tree, not its root
        if continuous_prefix and not (
            parent.parent is None or parent.backed_up or parent in self._claimed
        ):
            return None
        try:
            host_ids = take_host(node.num_pages)
        except OutOfPagesError:
            self._n["backups_skipped"] += 1
            return None
        self._claimed.add(node)
        return node, host_ids

    def claim_backups(
        self, nodes: list[TreeNode], take_host: Callable[[int], np.ndarray]
    ) -> list[Claim]:
        """Claims for the backups of ``nodes`` (distinct; no continuous prefix), their host
        pages taken in ONE ``take_host`` call: one host-room round for a pass whose backups are
        dispatched together, not one a node. When that many pages cannot be had, node by node
        as :meth:`claim_backup` (those that fit, in order)."""
        todo = [
            n for n in nodes if n.value is not None and not n.backed_up and n not in self._claimed
        ]
        if len(todo) > 1:
            try:
                host_ids = take_host(sum(n.num_pages for n in todo))
            except OutOfPagesError:
                pass
            else:
                claims, lo = [], 0
                for node in todo:
                    claims.append((node, host_ids[lo : lo + node.num_pages]))
                    lo += node.num_pages
                self._claimed.update(todo)
                return claims
        each = [self.claim_backup(node, False, take_host) for node in todo]
        return [c for c in each if c is not None]

    def claim_spare(
        self, nodes: list[TreeNode], take: Callable[[int], np.ndarray | None]
    ) -> list[Claim]:
        """Claims for backups of ``nodes`` (in order) while ``take`` finds host pages (None:
        no more); nodes already backed up or claimed, or without device pages, are skipped."""
        claims = []
        for node in nodes:
            if node.value is None or node.backed_up or node in self._claimed:
                continue
            host_ids = take(node.num_pages)
            if host_ids is None:
                break
            self._claimed.add(node)
            claims.append((node, host_ids))
        return claims

    def dispatch_backups(self, claims: list[Claim]) -> Any:
        """Copy every claimed node to host in ONE transfer; one op per node, in claim order
        (root-first), sharing the handle. Each node holds its host pages from now on (see the
        module doc). Returns the handle (None: nothing to do)."""
        if not claims:
            return None
        self._claimed.clear()
        device_ids = []
        for node, _ in claims:
            assert node.value is not None  # a backup claim is of a device-resident node
            device_ids.append(node.value.copy())
        ops = self._ops_for(
            TransferKind.BACKUP, [(node, ids, h) for (node, h), ids in zip(claims, device_ids)]
        )
        hosts, devices = np.concatenate([h for _, h in claims]), np.concatenate(device_ids)
        if self.window_room is not None:  # (host eviction: the claimed nodes are not there yet)
            self.window_room(devices)
        try:
            # the tree's device pages and take_host's fresh host pages: int32, distinct, held
            handle = self._engine.backup(devices, hosts, tag=ops, validated=True)
        except BaseException:  # internal ids: a bug; undo the claims so the tree stays whole
            for _, host_ids in claims:
                self._host_free(host_ids)
            raise
        self._register(ops, handle)
        self._fetched.take(hosts)  # pages L3 filled once hold these nodes' data now
        for node, host_ids in claims:
            self._tree.set_host_value(node, host_ids, validated=True)  # from take_host
            self._events.stored(node, Medium.HOST)
            self._n["backups"] += 1
            self._n["backup_tokens"] += node.num_tokens
        self._on_backup([node for node, _ in reversed(claims)])
        return handle

    def free_host(self, host_ids: np.ndarray) -> None:
        """Host pages a node gave up: free, or parked until the copies using them land (the
        transfer engine's ``busy_host_pages``; none are while no transfer is in flight)."""
        free = self._host.free  # a node's pages: distinct and int32 (its tree's)
        if not self._engine.in_flight:
            free(host_ids, validated=True)
            return
        busy = self._engine.busy_host_pages(host_ids, validated=True)
        if busy.any():
            self._parked[host_ids[busy]] = True
            self.num_parked += int(busy.sum())
            host_ids = host_ids[~busy]
        free(host_ids, validated=True)

    def parked_host_pages(self) -> np.ndarray:
        """Host pages given up while a copy into them is in flight (freed when it lands)."""
        return np.flatnonzero(self._parked).astype(np.int32)

    # -- loads --------------------------------------------------------------------------------

    def load(
        self, chains: list[tuple[TreeNode, list[TreeNode]]], device_ids: np.ndarray, layerwise: bool
    ) -> Any:
        """Load host-only chains back into ``device_ids`` in ONE transfer.

        Args:
            chains: ``(node, chain)`` per match: ``chain`` the host-only nodes ending at
                ``node`` (root-first), ``node`` already locked by the caller (the lock passes
                to the op and is released at the acknowledgement).
            device_ids: int32 ``[sum of chain pages]`` freshly allocated device pages, in order.
            layerwise: one copy per layer (``wait_layer``).

        Returns:
            The transfer handle. A dispatch that raises frees ``device_ids`` and the locks and
            leaves every chain as it was.
        """
        host_ids = [np.concatenate([n.host_value for n in chain]) for _, chain in chains]
        parts, lo = [], 0
        for (node, _), h in zip(chains, host_ids):  # Python offsets: a cumsum costs more here
            parts.append((node, device_ids[lo : lo + h.size], h))
            lo += h.size
        ops = self._ops_for(TransferKind.LOAD, parts)
        try:
            # the chains' host pages (the tree's) and fresh device pages: int32, distinct, held
            handle = self._engine.load(
                np.concatenate(host_ids), device_ids, layerwise=layerwise, tag=ops, validated=True
            )
        except BaseException:  # a dispatch failure (internal ids: a bug, or the runtime): undo
            self._device_free(device_ids)
            for node, _ in chains:
                self._tree.unlock(node)
            raise
        self._register(ops, handle)
        self._owners.to_tree(device_ids)
        for (_, chain), op in zip(chains, ops):
            pos = 0
            for n in chain:  # root-first, as set_value requires
                # pages fresh from the device allocator (take_chains), int32, distinct
                self._tree.set_value(n, op.device_ids[pos : pos + n.num_pages], validated=True)
                self._events.stored(n, Medium.DEVICE)
                pos += n.num_pages
            self._loading[op.device_ids] = op.seq + 1
            self._n["load_backs"] += 1
            self._n["load_back_tokens"] += op.device_ids.size * self._ps
        return handle

    def load_writing(self, ids: np.ndarray) -> Any:
        """The handle of the last load still writing any of ``ids`` (None: none)."""
        seq = int(self._loading[ids].max(initial=0)) - 1
        return None if seq < 0 else self._ops[seq].handle

    # -- acknowledgements ---------------------------------------------------------------------

    def wait(self, upto: Any) -> list:
        """Wait for the transfer ``upto`` (and so every one before it); the handles finished
        since the last poll, in dispatch order (None: all of them)."""
        if upto is None:
            return self._engine.wait_all()
        if not upto.done():
            upto.wait()
        return self._engine.poll(agree=False)  # upto and those before it: seen alike

    def _first_of_shape(self, handle: Any) -> bool:
        """Whether ``handle`` is the first load of its copy shape timed on the wall clock."""
        if not self._engine.wall_clock:
            return False
        n = int(handle.device_ids.size)
        key = (handle.layerwise, index_len(n), tuple(c[2] for c in stage_chunks(n)))
        if key in self._load_shapes:
            return False
        self._load_shapes.add(key)
        return True

    def apply(self, handles: list) -> None:
        """Acknowledge the ops of finished ``handles`` (from the engine, dispatch order)."""
        for handle in handles:
            if self._cost is not None and handle.kind is TransferKind.LOAD and handle.nbytes:
                self._cost.observe_transfer(
                    "l2_l1",
                    handle.nbytes,
                    float(handle.seconds or 0.0),
                    sample=not self._first_of_shape(handle),
                )
            for op in handle.tag or ():
                del self._ops[op.seq]
                self._apply(op)
        if self.num_parked and handles:  # parked pages whose copies have landed come free
            ids = self.parked_host_pages()
            ids = ids[~self._engine.busy_host_pages(ids)]
            self._parked[ids] = False
            self.num_parked -= ids.size
            self._host_free(ids)

    def _apply(self, op: Op) -> None:
        # Backups started together share one handle: each op counts its share of it.
        share = op.device_ids.size / op.handle.device_ids.size
        seconds = float(op.handle.seconds or 0.0) * share
        nbytes = op.device_ids.size * self._spec.page_bytes
        if op.kind is TransferKind.LOAD:
            done = self._loading[op.device_ids] == op.seq + 1
            self._loading[op.device_ids[done]] = 0
            self._n["bytes_to_device"] += nbytes
            self._n["seconds_to_device"] += seconds
            self._tree.unlock(op.node)
        else:
            self._n["bytes_to_host"] += nbytes
            self._n["seconds_to_host"] += seconds
