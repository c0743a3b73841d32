"""Block ids on the wire: the tree's own page hashes (the default) or the ids vLLM computes for
the same tokens (``kv_events={"block_hash": "vllm:sha256" | "vllm:sha256_cbor"}``), so that a
consumer that mixes vLLM and hicache_jax instances compares like with like.

vLLM's definition (``vllm/v1/core/kv_cache_utils.py``, ``vllm/utils/hashing.py``):

* a block's hash is ``H((parent, tuple(token_ids), extra_keys))``, 32 bytes, where ``parent`` is
  the previous block's 32-byte hash, or ``NONE_HASH`` for the first block;
* ``H`` is SHA-256 over ``pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL)`` (``sha256``) or
  over canonical CBOR (``sha256_cbor``: ``cbor2.dumps(x, canonical=True)``);
* ``NONE_HASH = H(seed)`` for the string ``PYTHONHASHSEED`` when set, else 32 random bytes;
  here the seed is ``hash_seed`` (``PYTHONHASHSEED`` when None; random when neither is set);
* on the wire (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, vLLM's default): the hash as a
  big-endian int masked to 64 bits, i.e. its last 8 bytes.

``extra_keys``: ``None`` for ``extra_key=None``; a str ``extra_key`` is taken as vLLM takes a LoRA
name, ``(name,)`` on every block; any other ``extra_key`` (an int) as ``(extra_key,)``, a
namespace vLLM does not produce.

Canonical CBOR is written here for the few types the tuple holds (ints, bytes, str, tuples,
None; RFC 8949 section 4.2.1: shortest heads, definite lengths): no dependency for ~20 lines.

:class:`VllmIds` keeps, per tree page hash that is announced on some tier, its 32-byte hash
and how many tiers announce it (an entry goes when the last tier drops it; all at a clear),
so a child continues from its parent's hash without hashing the prefix again.

Threading: the cache's owning thread only (called by the recorder).
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable
from typing import Any

import numpy as np

MASK64 = (1 << 64) - 1


def _head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes((major << 5 | n,))
    for extra, width in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if n < 1 << (8 * width):
            return bytes((major << 5 | extra,)) + n.to_bytes(width, "big")
    raise ValueError(f"CBOR int {n} does not fit 64 bits")


def canonical_cbor(x: Any) -> bytes:
    """Canonical CBOR of ``x`` (None, bool, int within 64 bits, bytes, str, tuple / list)."""
    if x is None:
        return b"\xf6"
    if x is True or x is False:
        return b"\xf5" if x else b"\xf4"
    if isinstance(x, int):
        return _head(0, x) if x >= 0 else _head(1, -1 - x)
    if isinstance(x, bytes):
        return _head(2, len(x)) + x
    if isinstance(x, str):
        b = x.encode()
        return _head(3, len(b)) + b
    if isinstance(x, (tuple, list)):
        return _head(4, len(x)) + b"".join(canonical_cbor(v) for v in x)
    raise TypeError(f"canonical_cbor: {type(x).__name__} is not supported")


def sha256_pickle(x: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sha256_cbor(x: Any) -> bytes:
    return hashlib.sha256(canonical_cbor(x)).digest()


HASH_FNS: dict[str, Callable[[Any], bytes]] = {
    "vllm:sha256": sha256_pickle,
    "vllm:sha256_cbor": sha256_cbor,
}


def extra_keys(extra_key: Any) -> tuple | None:
    """vLLM's ``extra_keys`` of a block of namespace ``extra_key`` (see the module doc)."""
    if extra_key is None:
        return None
    if isinstance(extra_key, (np.integer, np.str_)):
        extra_key = extra_key.item()
    return (extra_key,)


class VllmIds:
    """vLLM block hashes of the tree's pages (see the module doc).

    Args:
        name: ``"vllm:sha256"`` or ``"vllm:sha256_cbor"``.
        seed: ``NONE_HASH``'s seed string; None: ``PYTHONHASHSEED``, else 32 random bytes.
    """

    def __init__(self, name: str, seed: str | None) -> None:
        self._fn = HASH_FNS[name]
        seed = os.environ.get("PYTHONHASHSEED") if seed is None else seed
        self.none_hash = os.urandom(32) if seed is None else self._fn(seed)
        self._known: dict[int, list] = {}  # tree page hash -> [32-byte hash, tiers announcing]

    def digests(self, node: Any, first: int, stop: int) -> tuple[bytes | None, list[bytes]]:
        """32-byte hashes of ``node``'s pages ``[first, stop)`` and of the page before them
        (None: ``first`` is its namespace's first page); nothing counted."""
        hashes = node.page_hashes
        known = self._known
        if first > 0:
            parent_d: bytes | None = self._digest_of(node, first - 1)
        else:
            parent = node.hash_parent  # kept once the node is deleted
            parent_d = (
                self._digest_of(parent, parent.num_pages - 1)
                if parent is not None and parent.num_pages
                else None
            )
        prev = self.none_hash if parent_d is None else parent_d
        ps = node.num_tokens // node.num_pages
        tokens = node.key[first * ps : stop * ps].tolist()
        extra = extra_keys(node.extra_key)
        out = []
        for i in range(first, stop):
            entry = known.get(int(hashes[i]))
            prev = (
                entry[0]
                if entry is not None
                else self._fn((prev, tuple(tokens[(i - first) * ps : (i - first + 1) * ps]), extra))
            )
            out.append(prev)
        return parent_d, out

    def _digest_of(self, node: Any, i: int) -> bytes:
        entry = self._known.get(int(node.page_hashes[i]))
        if entry is not None:
            return entry[0]
        return self.digests(node, 0, i + 1)[1][-1]  # not announced: hash the path (rare)

    def acquire(self, tree_hashes: np.ndarray, digests: list[bytes]) -> np.ndarray:
        """One more tier announces these pages: their uint64 wire ids."""
        known = self._known
        for h, d in zip(tree_hashes.tolist(), digests):
            entry = known.get(h)
            if entry is None:
                known[h] = [d, 1]
            else:
                entry[1] += 1
        return wire_ids(digests)

    def release(self, tree_hashes: np.ndarray) -> np.ndarray:
        """One tier fewer announces these pages: their uint64 wire ids."""
        known = self._known
        out = np.empty(tree_hashes.shape[0], np.uint64)
        for i, h in enumerate(tree_hashes.tolist()):
            entry = known[h]
            out[i] = int.from_bytes(entry[0][-8:], "big")
            entry[1] -= 1
            if not entry[1]:
                del known[h]
        return out

    def clear(self) -> None:
        self._known.clear()


def wire_ids(digests: list[bytes]) -> np.ndarray:
    """uint64 ids of 32-byte hashes: the last 8 bytes, big-endian."""
    return np.array([int.from_bytes(d[-8:], "big") for d in digests], np.uint64)
