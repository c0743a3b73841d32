"""DigestRecords: the L3 keys of the host pages a cache's tree holds; KeyNames: the key strings
of digests, with the namespaces' generations.

Keys are 128-bit chained digests of the pages' tokens (:mod:`hicache_jax.tree.hashing`, namespaced
by ``extra_key`` and the spec fingerprint, as :func:`hicache_jax.l3.storage.page_keys`), so
instances sharing a store share entries and a collision between prefixes is a 128-bit one. Each host
page the tree holds has the digest of its prefix recorded here when it gets there (backup
dispatched, prefetch attached), so a put or a prefetch hashes only its own pages, starting from the
digest of the page before (a record is used only if the tree's 64-bit hash of that page is the one
it was recorded for); without a record the chain is hashed from the root. Write_back puts (at host
eviction, after the tree unlinked the node) take their keys from these records.

Generations (:class:`KeyNames`): ``HiCache.invalidate`` of a namespace on a store without
``delete_prefix`` (or of a prefix on one without ``delete``) cannot remove every entry it
should, so the namespace moves to its next generation: this tier names its keys
``<namespace>-g<k>`` from then on and never asks for the earlier ones again. The generation lives
in this tier only (not in the store): another process sharing the store, this process after a
restart, or an ``attach_storage`` later, still reads generation 0.

Threading: the cache's thread only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from hicache_jax.l3.storage.format import key_strings, namespace
from hicache_jax.spec import KVSpec
from hicache_jax.tree.hashing import DIGEST_BYTES, chain_digests, namespace_seed
from hicache_jax.tree.node import TreeNode


class DigestRecords:
    """Per host page: the chain digest of the prefix ending with it, the tree's 64-bit hash of
    that page when it was recorded, and whether the record is live.

    Args:
        host_pages: host pool size.
        page_size: tokens per page.
        fingerprint: the spec's fingerprint (namespaces the digests).
        path_tokens: tokens of the prefix ending with a node (the cache's tree).
    """

    def __init__(
        self,
        host_pages: int,
        page_size: int,
        fingerprint: str,
        path_tokens: Callable[[TreeNode], np.ndarray],
    ) -> None:
        self._ps, self._fingerprint, self._path_tokens = page_size, fingerprint, path_tokens
        self._digest = np.zeros((host_pages, DIGEST_BYTES), np.uint8)
        self._digest_of = np.zeros(host_pages, np.uint64)
        self._ok = np.zeros(host_pages, np.bool_)

    def seed(self, extra_key: Any) -> bytes | None:
        try:
            return namespace_seed(self._fingerprint, extra_key)
        except TypeError:  # an extra_key without a process-stable encoding: not shareable
            return None

    def record(self, host_ids: np.ndarray, digests: np.ndarray, hashes: np.ndarray) -> None:
        self._digest[host_ids] = digests
        self._digest_of[host_ids] = hashes
        self._ok[host_ids] = True

    def take(self, host_ids: np.ndarray, hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Forget the records of ``host_ids`` (being freed); returns ``(ok, digests)``: which
        had a live record for ``hashes`` and their digests (uint8 ``[ok.sum(), 16]``)."""
        ok = self._ok[host_ids] & (self._digest_of[host_ids] == hashes)
        self._ok[host_ids] = False
        return ok, self._digest[host_ids[ok]]

    def clear(self) -> None:
        self._ok[:] = False

    def prefix_digest(
        self, node: TreeNode, extra_key: Any, tokens: np.ndarray | None = None
    ) -> bytes | None:
        """Chain digest of the prefix ending with ``node`` (the namespace seed at the root).

        Args:
            tokens: that prefix's tokens when the caller has them (else read from the tree).

        Returns:
            16 bytes, or None for an unkeyable ``extra_key``.
        """
        if node.parent is None:  # the root
            return self.seed(extra_key)
        if node.host_value is not None:
            last = int(node.host_value[-1])
            if self._ok[last] and self._digest_of[last] == node.page_hashes[-1]:
                return self._digest[last].tobytes()
        seed = self.seed(extra_key)
        if seed is None:
            return None
        if tokens is None:
            tokens = self._path_tokens(node)
        return chain_digests(seed, tokens.reshape(-1, self._ps))[-1].tobytes()

    def node_digests(self, node: TreeNode) -> np.ndarray | None:
        """uint8 ``[node.num_pages, 16]`` chain digests of a node in the tree (None: unkeyable)."""
        assert node.parent is not None, "a node in the tree, not the root"
        prev = self.prefix_digest(node.parent, node.extra_key)
        if prev is None:
            return None
        return chain_digests(prev, node.key.reshape(-1, self._ps))


class KeyNames:
    """Key strings of chain digests for one tier's spec, each namespace in its generation
    (see the module docstring)."""

    def __init__(self, spec: KVSpec) -> None:
        self.spec = spec
        self._generation: dict[str, int] = {}  # namespace (16 hex) -> generation > 0

    def keys(self, extra_key: Any, digests: np.ndarray) -> list[str]:
        gen = self._generation.get(namespace(self.spec, extra_key), 0) if self._generation else 0
        return key_strings(self.spec, extra_key, digests, gen)

    def advance(self, extra_key: Any) -> int:
        """Move ``extra_key``'s namespace to its next generation; returns it."""
        ns = namespace(self.spec, extra_key)
        self._generation[ns] = self._generation.get(ns, 0) + 1
        return self._generation[ns]
