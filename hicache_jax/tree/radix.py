"""Page-granular radix tree of cached token prefixes over two tiers (pure Python + numpy; no jax).

A node's ``key`` is a whole number of pages of tokens. ``value`` holds the node's device page
ids (one int32 per page; ``None`` once evicted from device) and ``host_value`` its host page ids
(``None`` until backed up). Keys are compared with numpy (one ``memcmp`` or vector compare per
node, rounded down to a page boundary), never token by token in Python. Only whole pages are cached:
a trailing partial page is ignored by :meth:`RadixTree.match` and :meth:`RadixTree.insert`.

Keys are int32 (:func:`~hicache_jax.validation.as_tokens`: token ids beyond int32 are refused;
half the bytes of int64, and the tree keeps every cached token of both tiers). Children are
keyed by their first page's tokens (the int32 bytes of the page, an exact and cheaper-to-hash
encoding than a tuple); the root's children by ``(extra_key, first page)``, so
equal tokens under different ``extra_key`` never share a node.

Shape of the two tiers (kept by every method, checked by :meth:`RadixTree.check_invariants`):

* Device residency is prefix-closed: a node with ``value`` has a parent with ``value`` (or the
  root). Evicting from device only takes nodes none of whose children hold device pages, and
  loading back (:meth:`RadixTree.set_value`) or reviving by insert goes root-first.
* ``value`` and ``host_value`` are never both ``None`` (root aside): a node that loses its last
  copy is deleted (:meth:`RadixTree.delete_leaf`).
* A device (host) page id is held by at most one node and one position; :meth:`insert`,
  :meth:`set_value`, :meth:`set_host_value` refuse ids the tree already holds.
* ``evictable_device``, ``evictable_host``, ``redundant`` and the token counts: kept
  incrementally by :class:`~hicache_jax.tree.tiers.TierIndex`, the tree's base class.

Semantics of :meth:`RadixTree.insert` over nodes that already exist:

* positions held on device with the caller's own page: nothing happens;
* positions held on device with a different page: the tree keeps its page and the caller's page
  is returned in ``duplicate_pages`` for the caller to free;
* positions held on host only: the node takes the caller's pages and is device-resident again,
  keeping its host copy (``revived_nodes``), which is how a declined load-back is recomputed;
* every existing node on the path gets ``hit_count += 1`` (not when ``chunked=True``: a chunked
  prefill inserts the same prefix once per chunk and must not count as repeated use), and the
  new leaf starts at ``hit_count = 1``: its creation is its first access, as current SGLang
  counts it (0 for a chunk, whose final insert then counts the access once),
  ``priority = max(old, priority)`` and ``last_access = now``.

A split (in :meth:`match` or :meth:`insert`, always at a page boundary) creates a new parent
holding the first part of key, value, host_value and page_hashes, with lock_ref, hit_count,
last_access, created and priority copied; the original node object keeps the tail, so handles held
elsewhere (a lock, a load-back in flight) still name the node that holds the tail, and lock walks
cover the new parent. :meth:`lock` on a host-only node is allowed: it protects it from host
eviction (e.g. while a load-back is in flight).

Errors: malformed arguments raise ``TypeError`` / ``ValueError``; misuse of state (unlock below
zero, evicting a locked node, page ids the tree already holds) raises ``HiCacheError``. Every
check runs before any change: a call that raises leaves the tree exactly as it was
(:meth:`RadixTree.snapshot` compares equal).

Threading: the tree is not thread-safe; only the thread that owns the cache touches it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import numpy as np

from hicache_jax.errors import HiCacheError
from hicache_jax.tree.node import InsertResult, TreeMatch, TreeNode, chain_hashes, namespace_hash
from hicache_jax.tree.tiers import EMPTY_IDS, TierIndex
from hicache_jax.validation import TOKEN_DTYPE, as_distinct_ids, as_tokens, check_extra_key, is_int

_EMPTY_U64 = np.zeros(0, np.uint64)
_MEMCMP_MAX = 2048  # tokens; see _common_len

__all__ = ["RadixTree"]


class RadixTree(TierIndex):
    """Radix tree of page-aligned token prefixes with device/host page ids per node.

    Args:
        page_size: tokens per page (>= 1).
        clock: returns the current time (float); injected so tests order events without sleep.

    Attributes:
        root: the root node (no key, never evicted).
        evictable_device, evictable_host, redundant, device_tokens, host_tokens, ...: the
            sets and token counts of :class:`~hicache_jax.tree.tiers.TierIndex`.
    """

    def __init__(self, page_size: int, clock: Callable[[], float] = time.monotonic) -> None:
        if not is_int(page_size) or page_size < 1:
            raise ValueError(f"page_size={page_size!r} must be an int >= 1")
        self.page_size = int(page_size)
        self._clock = clock
        self._next_id = 0
        self._epoch = 0  # device_epoch stamps: never reused, not even across reset()
        #: the ``value`` eviction (``tree/eviction.py``): a touched node's worth is
        #: ``worth_clock + pages ** worth_power`` (``pages``: the touching prompt's); None: off
        self.worth_power: float | None = None
        self.reset()

    # -- bookkeeping -------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget every node (the caller frees the pages it knew the tree held)."""
        self.root = self._new_node(np.zeros(0, TOKEN_DTYPE), None, _EMPTY_U64, None, 0.0)
        self.root.value = EMPTY_IDS
        self.root.lock_ref = 1  # the root is never evictable
        #: GreedyDual's clock: the highest worth of a node deleted from the host tier, the
        #: cache's last, or cut (``trim_tail``) while the host tier holds it: what leaves L1
        #: whole moves between tiers, or was judged not worth L2 by the write policy, and
        #: raising the clock by every such node would age every node by L1's churn (on
        #: Mooncake's trace that halved the recurrent hybrid's hits: ``bench_state_replay``);
        #: the cuts of L1's page-granular eviction do raise it (see ``trim_tail``)
        self.worth_clock = 0.0
        self._reset_index()

    def _new_node(self, key, parent, hashes, extra_key, now) -> TreeNode:
        # hashes None: computed on first access of node.page_hashes (events, L3), not here
        node = TreeNode(
            id=self._next_id,
            key=key,
            parent=parent,
            hashes=hashes,
            extra_key=extra_key,
            last_access=now,
            created=now,
            page_size=self.page_size,
            hash_parent=parent,
        )
        self._next_id += 1
        return node

    def _child_key(self, parent: TreeNode, page: np.ndarray, extra_key: Any) -> Hashable:
        # The raw int32 bytes of the page: an exact encoding of its tokens that is ~5x cheaper
        # to build and hash than a tuple of Python ints (it is on the match hot path).
        first = page.tobytes()
        return (extra_key, first) if parent is self.root else first

    # -- walking and splitting ---------------------------------------------------------------

    def peek(self, tokens: np.ndarray, extra_key: Any) -> tuple[int, int]:
        """``(device_tokens, host_tokens)`` of the longest cached prefix of validated whole-page
        ``tokens``, as :meth:`match` counts them, changing nothing (no split, no stamp)."""
        path, pos, start = self._walk(tokens, extra_key)
        device = host = 0
        for i, node in enumerate(path):
            n = (pos - start) if i == len(path) - 1 else node.key.shape[0]
            if host == 0 and node.value is not None:
                device += n
            else:
                host += n
        return device, host

    def peek_path(self, tokens: np.ndarray, extra_key: Any) -> list[tuple[TreeNode, int]]:
        """The nodes of the longest cached prefix of validated whole-page ``tokens``, root
        first, each with how many of its tokens matched (only the last may match partly),
        changing nothing (no split, no stamp)."""
        path, pos, start = self._walk(tokens, extra_key)
        last = len(path) - 1
        return [
            (node, (pos - start) if i == last else node.num_tokens) for i, node in enumerate(path)
        ]

    def node_at(self, tokens: np.ndarray, extra_key: Any) -> TreeNode:
        """The node whose prefix ends exactly where the cached part of validated whole-page
        ``tokens`` ends (split there if it ends inside a node; the root if nothing is cached).
        Stamps nothing: a split changes no node's tiers, locks or eviction keys."""
        path = self._materialize(*self._walk(tokens, extra_key))
        return path[-1] if path else self.root

    def _walk(self, tokens: np.ndarray, extra_key: Any) -> tuple[list, int, int]:
        """Read-only descent: nodes matched (the last may match only partly), tokens matched,
        and where the last node starts. The hot loop of match and insert: kept flat on purpose."""
        ps, n, root = self.page_size, tokens.shape[0], self.root
        path, pos, start, node, children = [], 0, 0, root, root.children
        while pos < n:
            first = tokens[pos : pos + ps].tobytes()  # same encoding as _child_key
            child = children.get((extra_key, first) if node is root else first)
            if child is None:
                break
            key = child.key
            size = key.shape[0]
            m = min(size, n - pos)
            a, b = key[:m], tokens[pos : pos + m]
            if m <= _MEMCMP_MAX and a.tobytes() == b.tobytes():
                matched = m
            else:
                matched = _common_len(a, b) // ps * ps
            path.append(child)
            start, pos = pos, pos + matched
            if matched < size:
                break
            node, children = child, child.children
        return path, pos, start

    def _split(self, node: TreeNode, ntok: int) -> TreeNode:
        """Split ``node`` after ``ntok`` tokens (a page multiple); return the new upper part."""
        p = ntok // self.page_size
        parent = node.parent
        assert parent is not None, "the root is never split"
        hashes = node.hashes  # sliced if computed, else both parts compute theirs on demand
        upper = self._new_node(
            node.key[:ntok],
            parent,
            None if hashes is None else hashes[:p],
            node.extra_key,
            node.last_access,
        )
        upper.created, upper.lock_ref = node.created, node.lock_ref
        upper.host_pins = node.host_pins
        upper.hit_count, upper.priority, upper.worth = node.hit_count, node.priority, node.worth
        upper.device_epoch = node.device_epoch
        if node.value is not None:
            upper.value, node.value = node.value[:p], node.value[p:]
            upper.device_children = 1
        if node.host_value is not None:
            upper.host_value, node.host_value = node.host_value[:p], node.host_value[p:]
        # The first page is unchanged, so the grandparent's dict key is unchanged.
        parent.children[self._child_key(parent, node.key[: self.page_size], node.extra_key)] = upper
        node.key, node.parent, node.hash_parent = node.key[ntok:], upper, upper
        node.hashes = None if hashes is None else hashes[p:]
        upper.children[self._child_key(upper, node.key[: self.page_size], node.extra_key)] = node
        if node.host_only_tokens:  # same total, now in two parts
            upper.host_only_tokens, node.host_only_tokens = upper.num_tokens, node.num_tokens
        if node.redundant_tokens:  # same total, now in two parts
            upper.redundant_tokens, node.redundant_tokens = upper.num_tokens, node.num_tokens
            self.redundant.add(upper)
        return upper  # in neither evictable set: it has a child on its own tier

    def _materialize(self, path: list, pos: int, start: int) -> list:
        """Split the last node of ``path`` where the match ends inside it; return full nodes."""
        # The dict lookup already matched the last node's first page, so at least one page of
        # it matched and a split never produces an empty part.
        if path and pos - start < path[-1].key.shape[0]:
            path[-1] = self._split(path[-1], pos - start)
        return path

    # -- public API ----------------------------------------------------------------------------

    def match(
        self, tokens: Any, extra_key: Hashable = None, *, validated: bool = False
    ) -> TreeMatch:
        """Longest cached whole-page prefix of ``tokens``, on device then on host.

        Args:
            tokens: 1-D non-negative integer sequence; a trailing partial page is ignored.
            extra_key: namespace (hashable).
            validated: the caller already checked ``tokens`` (an int32 numpy array of whole
                pages, values >= 0) and ``extra_key`` (the facade does, once per call): skip
                the checks, a pass over every token.

        Returns:
            A :class:`TreeMatch`. Splits a node where the match ends inside it and sets
            ``last_access`` of every matched node (hit counts are left to :meth:`insert`).
        """
        arr = tokens if validated else self._checked_tokens(tokens, extra_key)
        path = self._materialize(*self._walk(arr, extra_key))
        now = self._clock()
        values, host = [], []
        if self.worth_power is not None:
            self._touch_worth(path, arr.shape[0] // self.page_size)
        for node in path:
            node.last_access = now
            if node.value is not None:  # device residency is prefix-closed: device part first
                values.append(node.value)
            else:
                host.append(node)
        dev_len = sum(v.shape[0] for v in values) * self.page_size
        pages = np.concatenate(values) if values else EMPTY_IDS
        device = path[: len(values)]
        return TreeMatch(
            device_pages=pages,
            device_len=dev_len,
            host_len=sum(n.key.shape[0] for n in host),
            host_nodes=tuple(host),
            last_device_node=device[-1] if device else self.root,
            node=path[-1] if path else self.root,
        )

    def insert(
        self,
        tokens: Any,
        page_ids: Any,
        extra_key: Hashable = None,
        *,
        priority: int = 0,
        chunked: bool = False,
        validated: bool = False,
    ) -> InsertResult:
        """Cache the whole pages of ``tokens`` with the caller's device pages.

        Args:
            tokens: 1-D non-negative integer sequence; a trailing partial page is ignored.
            page_ids: 1-D int ``[len(tokens) // page_size]`` device pages, one per whole page.
                Ownership passes to the tree for new and revived positions; duplicates stay the
                caller's (see module docstring).
            extra_key: namespace (hashable).
            priority: int request priority (``priority`` eviction strategy: lower goes first).
            chunked: do not count a hit on existing nodes (one prefill split into chunks).
            validated: ``tokens`` and ``extra_key`` are already checked (see :meth:`match`),
                and ``page_ids`` is an int32 numpy array of ``len(tokens) // page_size``
                distinct ids (the facade checks them against the pool, once per call).

        Raises:
            TypeError / ValueError: malformed tokens, page_ids or extra_key.
            HiCacheError: a page the tree must take (or hand back as a duplicate) is already held
                by the tree at another position.
        """
        arr = tokens if validated else self._checked_tokens(tokens, extra_key)
        if not is_int(priority):
            raise TypeError(f"priority must be an int, got {type(priority).__name__}")
        priority = int(priority)
        npages = arr.shape[0] // self.page_size
        ids = page_ids if validated else as_distinct_ids(page_ids, npages, "page_ids")
        arr = arr[: npages * self.page_size]
        path, pos, start = self._walk(arr, extra_key)
        dup_mask = self._check_insert_pages(path, pos, ids)
        path = self._materialize(path, pos, start)
        now = self._clock()
        revived = []
        p0 = 0
        for node in path:  # root-first, so a revived node's parent is already resident
            if node.value is None:
                self._attach_value(node, ids[p0 : p0 + node.num_pages].copy())
                revived.append(node)
            p0 += node.num_pages
            if not chunked:
                node.hit_count += 1
            node.priority = max(node.priority, priority)
            node.last_access = now
        last = path[-1] if path else self.root
        if pos < arr.shape[0]:
            last = self._add_leaf(
                last, arr[pos:], ids[pos // self.page_size :], extra_key, priority, now
            )
            last.hit_count = 0 if chunked else 1
        if self.worth_power is not None:
            self._touch_worth((*path, last), npages)
        return InsertResult(
            prefix_len=pos,
            duplicate_pages=ids[dup_mask],
            existing_nodes=path,
            revived_nodes=revived,
            last_node=last,
        )

    def _checked_tokens(self, tokens: Any, extra_key: Any) -> np.ndarray:
        """Validate tokens and extra_key; the whole-page int32 part of the tokens."""
        arr = as_tokens(tokens)
        check_extra_key(extra_key)
        return arr[: arr.shape[0] // self.page_size * self.page_size]

    def _check_insert_pages(self, path: list, pos: int, ids: np.ndarray) -> np.ndarray:
        """Before any change: which caller pages are duplicates; refuse ids the tree holds."""
        tree = np.full(ids.shape[0], -1, np.int32)
        p0 = 0
        for node in path:
            k = min(node.num_pages, pos // self.page_size - p0)
            if node.value is not None:
                tree[p0 : p0 + k] = node.value[:k]
            p0 += k
        dup = (tree >= 0) & (tree != ids)
        if self._device_held.any_held(ids[tree != ids]):
            raise HiCacheError(
                "page_ids has pages the tree already holds at other positions "
                "(pass the tree's own page for a cached position, or a fresh one; "
                "pages of a stale Match, evicted and reused since? match again)"
            )
        return dup

    def _add_leaf(
        self,
        parent: TreeNode,
        key: np.ndarray,
        ids: np.ndarray,
        extra_key: Any,
        priority: int,
        now: float,
    ) -> TreeNode:
        leaf = self._new_node(key.copy(), parent, None, extra_key, now)
        leaf.priority = priority
        parent.children[self._child_key(parent, key[: self.page_size], extra_key)] = leaf
        self._attach_value(leaf, ids.copy())
        return leaf

    def trim_tail(self, node: TreeNode, tail_pages: int) -> TreeNode:
        """Split an unlocked node so that ``node`` keeps only its last ``tail_pages`` pages
        (and its children; its head becomes a new parent, as a split at a match does); returns
        ``node``. What an eviction that needs fewer pages than a leaf holds calls: the head
        stays cached.

        Where L2 holds a copy of ``node``, the cut raises :attr:`worth_clock` to its worth:
        the value order then ages with the cuts L1's page-granular eviction makes, not only
        with what leaves L2 (measured, benchmarks/RESULTS.md, "Layer groups": clocked by L2
        alone, a 5:1 model keeps 4% more hits on Mooncake's synthetic trace and 15% fewer on
        its conversation trace; clocked by every L1 eviction, the recurrent hybrid loses a
        fifth of its hits at a small L1)."""
        if not 0 < tail_pages < node.num_pages or node.lock_ref or node.parent is None:
            raise HiCacheError(
                f"trim_tail({node!r}, {tail_pages}): needs an unlocked node of "
                "more than tail_pages pages"
            )
        self._split(node, node.num_tokens - tail_pages * self.page_size)
        if node.host_value is not None:  # (see above and worth_clock)
            self.worth_clock = max(self.worth_clock, node.worth)
        return node

    def delete_leaf(self, node: TreeNode) -> tuple:
        """Remove a childless unlocked node; return ``(value, host_value)`` for the caller to free.

        Either may be ``None`` (the tier did not hold the node). Ownership passes to the caller.
        """
        if (
            node.children
            or node.host_pins
            or not (node in self.evictable_device or node in self.evictable_host)
        ):
            raise HiCacheError(
                f"{node!r} is not a deletable leaf (has children, locked, "
                "host-pinned, or not in the tree)"
            )
        parent = node.parent
        assert parent is not None, "an evictable node is a non-root node of the tree"
        del parent.children[self._child_key(parent, node.key[: self.page_size], node.extra_key)]
        self._unindex_leaf(node)
        node.parent = None
        self._refresh(parent)
        if node.host_value is not None:  # (see worth_clock)
            self.worth_clock = max(self.worth_clock, node.worth)
        return node.value, node.host_value

    def _touch_worth(self, path: Any, pages: int) -> None:
        """The ``value`` eviction's touch: each node of ``path`` worth at least
        ``worth_clock + pages ** worth_power`` (``pages``: the prompt's whole pages)."""
        assert self.worth_power is not None
        worth = self.worth_clock + float(pages) ** self.worth_power
        for node in path:
            if node.worth < worth:
                node.worth = worth

    def add_host_leaf(
        self, parent: TreeNode, key: Any, host_ids: Any, extra_key: Hashable = None
    ) -> TreeNode:
        """Hang a new host-only leaf under ``parent`` (pages that arrived from a lower tier, L3).

        ``parent``'s prefix must end exactly where ``key`` starts and no child of ``parent`` may
        begin with ``key``'s first page: match the whole prefix first and pass the match's node.

        Args:
            parent: the root or a node of this tree (of namespace ``extra_key``).
            key: 1-D int tokens, a whole (non-zero) number of pages.
            host_ids: 1-D int ``[len(key) // page_size]`` distinct host page ids the tree does
                not hold yet; the tree takes them.
            extra_key: the namespace of the prefix.

        Returns:
            The new leaf (``value`` None, ``host_value`` the ids): evictable from host at once.
        """
        if parent is not self.root:
            self._check_member(parent)
            if parent.extra_key != extra_key:
                raise ValueError(f"extra_key={extra_key!r} is not the namespace of {parent!r}")
        check_extra_key(extra_key)
        tokens = as_tokens(key)
        ps = self.page_size
        if tokens.size == 0 or tokens.size % ps:
            raise ValueError(f"key has {tokens.size} tokens: need a non-zero multiple of {ps}")
        ids = as_distinct_ids(host_ids, tokens.size // ps, "host_ids")
        child_key = self._child_key(parent, tokens[:ps], extra_key)
        if child_key in parent.children:
            raise HiCacheError(f"{parent!r} already has a child starting with key's first page")
        if self._host_held.any_held(ids):
            raise HiCacheError("host_ids has pages the tree already holds")
        leaf = self._new_node(tokens.copy(), parent, None, extra_key, self._clock())
        leaf.worth = self.worth_clock  # (the match that fetched it touches it next)
        parent.children[child_key] = leaf
        self._index_host(leaf, ids)
        self._refresh(parent)
        return leaf

    def nodes(self) -> Iterator[TreeNode]:
        """Every non-root node (depth-first, iterative)."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def path_tokens(self, node: TreeNode) -> np.ndarray:
        """int32 tokens of the whole prefix ending at ``node`` (root-first concatenation)."""
        parts = []
        while node.parent is not None:
            parts.append(node.key)
            node = node.parent
        return np.concatenate(parts[::-1]) if parts else np.zeros(0, TOKEN_DTYPE)

    def snapshot(self) -> frozenset:
        """Hashable plain-value description of the whole tree, for "unchanged" assertions.

        Each node is ``(extra_key, key, value, host_value, lock_ref, hit_count, priority,
        children)`` with tuples of ints and ``children`` a frozenset of the same; timestamps are
        left out (a match moves them).
        """
        order, stack = [], [self.root]
        while stack:  # iterative: paths can be deeper than Python's recursion limit
            node = stack.pop()
            order.append(node)
            stack.extend(node.children.values())
        done: dict[int, tuple] = {}
        tup = lambda a: None if a is None else tuple(a.tolist())  # noqa: E731
        for node in reversed(order):  # children before parents
            kids = frozenset(done.pop(id(c)) for c in node.children.values())
            done[id(node)] = (
                node.extra_key,
                tup(node.key),
                tup(node.value),
                tup(node.host_value),
                node.lock_ref,
                node.hit_count,
                node.priority,
                kids,
            )
        return done[id(self.root)][-1]

    def check_invariants(self) -> None:
        """Full-scan recomputation of every invariant (for tests); raises AssertionError."""
        ps, root = self.page_size, self.root
        assert root.parent is None and root.key.size == 0 and root.lock_ref == 1
        assert root.device_children == sum(c.value is not None for c in root.children.values())
        nodes = list(self.nodes())
        for node in nodes:
            parent, kids = node.parent, list(node.children.values())
            assert parent is not None and not node.is_root
            assert (
                parent.children.get(self._child_key(parent, node.key[:ps], node.extra_key)) is node
            )
            assert node.num_tokens > 0 and node.num_tokens == node.num_pages * ps, "whole pages"
            assert node.key.dtype == TOKEN_DTYPE and node.page_hashes.dtype == np.uint64
            assert parent is root or node.extra_key == parent.extra_key
            assert node.hash_parent is parent and node.page_size == ps
            assert node.value is not None or node.host_value is not None, "no copy left"
            for arr in (node.value, node.host_value):
                assert arr is None or (arr.dtype == np.int32 and arr.shape == (node.num_pages,))
            assert node.value is None or parent.value is not None, "device not prefix-closed"
            assert node.device_children == sum(c.value is not None for c in kids)
            assert node.lock_ref >= sum(c.lock_ref for c in kids) and node.lock_ref >= 0
            assert node.host_pins >= sum(c.host_pins for c in kids) and node.host_pins >= 0
            assert node.host_pins == 0 or node.host_value is not None, "host pin without copy"
            prev = namespace_hash(node.extra_key) if parent is root else int(parent.page_hashes[-1])
            assert np.array_equal(node.page_hashes, chain_hashes(prev, node.key.reshape(-1, ps)))
        self.check_index(nodes)


def _common_len(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two equal-length token arrays (no Python loop)."""
    # Short runs: one memcmp of the bytes is cheapest. Long runs: an elementwise compare, since
    # copying hundreds of KiB out with tobytes() can cost page faults on every call.
    if a.shape[0] <= _MEMCMP_MAX:
        if a.tobytes() == b.tobytes():
            return a.shape[0]
        return int(np.argmax(a != b))
    diff = a != b
    k = int(np.argmax(diff))
    return k if diff[k] else a.shape[0]
