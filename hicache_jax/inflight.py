"""InFlight: the cache's transfers in flight, from claim to acknowledgement.

A backup of a node is *claimed* (host pages reserved, node locked, its device pages marked
backing up), *dispatched* with the other claims of the same call in ONE transfer, and
*acknowledged* when the engine reports it complete: the node (and the parts split off it
meanwhile) gets its host pages, root-first. A load-back of host-only chains is dispatched in one
transfer and acknowledged the same way (the chains' device pages stop being "loading").

Order comes from the transfer engine's own queue: it completes transfers in dispatch order and
``poll()`` returns them in that order, so a parent's backup is acknowledged before its child's.
Each handle's ``tag`` holds the operations it carries (several backups share one handle); this
class keeps them by sequence number only to find one (``read_kv`` of a page being loaded) and
to state what is in flight (:meth:`HiCache.check_invariants`).

Threading: the cache's thread only.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

from hicache_jax.allocator import PageAllocator
from hicache_jax.errors import OutOfPagesError
from hicache_jax.events import Medium, NullRecorder, Recorder
from hicache_jax.ownership import DevicePageOwners
from hicache_jax.radix import RadixTree
from hicache_jax.spec import KVSpec
from hicache_jax.transfer import TransferEngine, TransferKind
from hicache_jax.tree_node import TreeNode

Claim = tuple[TreeNode, np.ndarray]  # (node, host pages reserved for its backup)


@dataclass(eq=False)
class Op:
    """One acknowledgement to apply: a backup of ``node`` or a load-back ending at ``node``
    (locked until then)."""

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
        on_backup: called with the parts of a landed backup, leaf first (the L3 tier's hook).
    """

    def __init__(self, spec: KVSpec, tree: RadixTree, engine: TransferEngine,
                 device: PageAllocator, host: PageAllocator, owners: DevicePageOwners,
                 events: NullRecorder | Recorder, counters: collections.Counter,
                 on_backup: Callable[[list], None]) -> None:
        self._spec, self._ps = spec, spec.page_size
        self._tree, self._engine, self._owners = tree, engine, owners
        self._device_free, self._host_free = device.free, host.free
        self._events, self._n, self._on_backup = events, counters, on_backup
        device_pages = device.num_pages
        self._backing = np.zeros(device_pages, np.bool_)   # pages of backups in flight
        self._loading = np.zeros(device_pages, np.int64)   # 1 + seq of the load writing a page
        self._slot = np.full(device_pages, -1, np.int64)   # scratch of _finish_backup
        self._ops: dict[int, Op] = {}                      # seq -> op, dispatch order
        self._seq = -1

    def __len__(self) -> int:
        """Operations in flight (backups sharing a transfer count one each)."""
        return len(self._ops)

    def ops(self) -> Iterator[Op]:
        return iter(self._ops.values())

    def _ops_for(self, kind: TransferKind, parts: list) -> tuple[Op, ...]:
        """Ops (seq numbers after the last dispatched) for ``(node, device_ids, host_ids)``
        parts of one transfer: its tag. Registered by :meth:`_register` once dispatched."""
        return tuple(Op(self._seq + 1 + i, kind, None, node, d, h)
                     for i, (node, d, h) in enumerate(parts))

    def _register(self, ops: tuple[Op, ...], handle: Any) -> None:
        for op in ops:
            op.handle = handle
            self._ops[op.seq] = op
        self._seq += len(ops)

    # -- backups ------------------------------------------------------------------------------

    def is_backing(self, node: TreeNode) -> bool:
        """Whether a backup of ``node``'s device pages is in flight."""
        return node.value is not None and bool(self._backing[node.value].any())

    def claim_backup(self, node: TreeNode, continuous_prefix: bool,
                     take_host: Callable[[int], np.ndarray]) -> Claim | None:
        """Reserve host pages (``take_host``, which may evict) for a backup of ``node``: lock it,
        mark its pages backing up. None when skipped: no device pages, already backed up or
        backing up, a gap above it under ``continuous_prefix``, or no host pages."""
        if node.value is None or node.backed_up or self._backing[node.value].any():
            return None
        if continuous_prefix:
            parent = node.parent
            if not (parent.parent is None or parent.backed_up or self.is_backing(parent)):
                return None
        try:
            host_ids = take_host(node.num_pages)
        except OutOfPagesError:
            self._n["backups_skipped"] += 1
            return None
        self._tree.lock(node)
        self._backing[node.value] = True
        return node, host_ids

    def dispatch_backups(self, claims: list[Claim]) -> Any:
        """Copy every claimed node to host in ONE transfer; one op per node, in claim order
        (root-first), sharing the handle. Returns the handle (None: nothing to do)."""
        if not claims:
            return None
        device_ids = [node.value.copy() for node, _ in claims]
        ops = self._ops_for(TransferKind.BACKUP,
                            [(node, ids, h) for (node, h), ids in zip(claims, device_ids)])
        try:
            handle = self._engine.backup(np.concatenate(device_ids),
                                         np.concatenate([h for _, h in claims]), tag=ops)
        except BaseException:  # internal ids: a bug; undo the claims so the tree stays whole
            for (node, host_ids), ids in zip(claims, device_ids):
                self._backing[ids] = False
                self._tree.unlock(node)
                self._host_free(host_ids)
            raise
        self._register(ops, handle)
        return handle

    # -- loads --------------------------------------------------------------------------------

    def load(self, chains: list[tuple[TreeNode, list[TreeNode]]], device_ids: np.ndarray,
             layerwise: bool) -> Any:
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
            parts.append((node, device_ids[lo:lo + h.size], h))
            lo += h.size
        ops = self._ops_for(TransferKind.LOAD, parts)
        try:
            handle = self._engine.load(np.concatenate(host_ids), device_ids,
                                       layerwise=layerwise, tag=ops)
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
                self._tree.set_value(n, op.device_ids[pos:pos + n.num_pages])
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
        return self._engine.poll()

    def apply(self, handles: list) -> None:
        """Acknowledge the ops of finished ``handles`` (from the engine, dispatch order)."""
        for handle in handles:
            for op in handle.tag or ():
                del self._ops[op.seq]
                self._apply(op)

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
        else:
            self._finish_backup(op)
            self._n["bytes_to_host"] += nbytes
            self._n["seconds_to_host"] += seconds
        self._tree.unlock(op.node)

    def _finish_backup(self, op: Op) -> None:
        """Record host pages on ``op.node`` and on the parents split off it meanwhile."""
        pos = self._slot  # device page -> its index in op.device_ids (-1: not in the op)
        pos[op.device_ids] = np.arange(op.device_ids.size)
        parts, node = [], op.node
        while (node.parent is not None and node.value is not None and node.host_value is None
               and (pos[node.value] >= 0).all()):
            parts.append((node, pos[node.value]))
            node = node.parent
        pos[op.device_ids] = -1
        used = np.zeros(op.host_ids.size, np.bool_)
        for part, idx in reversed(parts):  # root-first: a parent is backed up before its child
            self._tree.set_host_value(part, op.host_ids[idx])
            self._events.stored(part, Medium.HOST)
            used[idx] = True
        self._on_backup([part for part, _ in parts])
        if not used.all():  # an L3 fetch gave a part its host copy first: free ours
            self._host_free(op.host_ids[~used])
        self._backing[op.device_ids] = False
        self._n["backups"] += 1
        self._n["backup_tokens"] += int(used.sum()) * self._ps
