"""Chained page hashes: one definition for the tree, the KV events and the L3 keys. No jax.

Two chains, both over the int64 little-endian bytes of each page's tokens (whatever dtype the
tree keeps its keys in), each seeded by a namespace digest:

* **Page hashes** (64-bit, :func:`chain_hashes`): the tree's ``TreeNode.page_hashes`` and the
  ``block_hashes`` of the KV events. ``h_i = xxh3_64(page i, seed=h_{i-1})``, the chain of a
  namespace seeded by :func:`namespace_hash` of its ``extra_key``. XXH3 (the ``xxhash``
  package, a core dependency: every process must compute the same ids, so there is no
  fallback) is ~13x cheaper than a blake2b call per page (7 vs 98 us for 28 pages of 512
  tokens): it was the whole cost of recording events. Ids, not keys: a 64-bit collision could
  at worst make a router's guess wrong, never serve wrong bytes.
* **L3 digests** (128-bit, :func:`chain_digests`): what L3 keys are made of; persisted by the
  stores, so their format does not change (below).

A page's digest covers every token of the prefix that ends with it::

    d_0 = seed(fingerprint, extra_key)         16 bytes (blake2b)
    d_i = blake2b(d_{i-1} || int64 LE bytes of page i's tokens, digest_size=16)

so two prefixes share a digest only by a 128-bit collision, whichever instances wrote them into
a shared store. The seed namespaces the chain by the KV layout (``KVSpec.fingerprint()``) and by
``extra_key`` (None, str, bytes or int: the types with one encoding in every process).

Cost: one blake2b call over ``16 + 8 * page_size`` bytes per page, about 0.6 us per 16-token page
on the project's machine (``benchmarks/bench_storage.py`` prints it beside an entry's checksum).
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable
from typing import Any

import numpy as np
import xxhash

DIGEST_BYTES = 16


# -- 64-bit page hashes (tree, KV events) ------------------------------------------------------


def canonical_key(key: Any) -> Any:
    """``key`` with numbers and strings of numpy types as Python ones (bool -> int, an integral
    float -> int), so keys the tree treats as one namespace (``==`` and ``hash``: ``5``,
    ``np.int64(5)``, ``5.0``, ``True`` vs ``1``) have one ``repr`` too."""
    if isinstance(key, (bool, np.bool_, int, np.integer)):
        return int(key)
    if isinstance(key, (float, np.floating)):
        return int(key) if float(key).is_integer() else float(key)
    if isinstance(key, np.str_):
        return str(key)
    if isinstance(key, np.bytes_):
        return bytes(key)
    if isinstance(key, tuple):
        return tuple(canonical_key(k) for k in key)
    return key


def namespace_hash(extra_key: Hashable) -> int:
    """Seed of the page-hash chain of a namespace: 8-byte blake2b (little-endian) of the
    ``repr`` of ``extra_key`` made canonical (stable for None, str, bytes, numbers and tuples of
    those, whatever their Python or numpy type; not Python's salted ``hash()``). One call per
    node under the root, so blake2b's cost does not matter here."""
    digest = hashlib.blake2b(
        b"hicache-ns:" + repr(canonical_key(extra_key)).encode(), digest_size=8
    ).digest()
    return int.from_bytes(digest, "little")


def chain_hashes(prev: int, pages: np.ndarray) -> np.ndarray:
    """``h_i = xxh3_64(int64 LE bytes of page i, seed=h_{i-1})``, one per row of ``pages``.

    Args:
        prev: hash of the page before the first row (or :func:`namespace_hash`), 0 <= prev < 2**64.
        pages: int ``[num_pages, page_size]`` tokens (any int dtype: hashed as int64 LE).

    Returns:
        uint64 ``[num_pages]`` (a new array).
    """
    if pages.ndim != 2:
        raise ValueError(f"pages must be [num_pages, page_size], got shape {pages.shape}")
    h = int(prev)
    if not 0 <= h < 1 << 64:
        raise ValueError(f"prev={prev!r} must be a uint64 page hash (0 <= prev < 2**64)")
    rows = np.ascontiguousarray(pages, dtype="<i8")
    digest, out = xxhash.xxh3_64_intdigest, []
    for row in rows:  # one call per page, not per token; a row is hashed through its buffer
        h = digest(row, seed=h)
        out.append(h)
    return np.array(out, dtype=np.uint64)


# -- 128-bit L3 digests ------------------------------------------------------------------------


def namespace_tag(extra_key: Any) -> bytes:
    """The process-stable encoding of ``extra_key``.

    Raises:
        TypeError: ``extra_key`` is not None, str, bytes or int (no stable encoding).
    """
    if extra_key is None:
        return b"n:"
    if isinstance(extra_key, str):
        return b"s:" + extra_key.encode()
    if isinstance(extra_key, bytes):
        return b"b:" + extra_key
    if isinstance(extra_key, (int, np.integer)) and not isinstance(extra_key, (bool, np.bool_)):
        return b"i:" + str(int(extra_key)).encode()
    raise TypeError(
        f"extra_key={extra_key!r} must be None, str, bytes or int "
        "(it must hash the same in every process)"
    )


def namespace_seed(fingerprint: str, extra_key: Any) -> bytes:
    """``d_0`` of the chain: 16 bytes naming (KV layout, extra_key). TypeError as
    :func:`namespace_tag`."""
    text = b"hicache-l3|" + fingerprint.encode() + b"|" + namespace_tag(extra_key)
    return hashlib.blake2b(text, digest_size=DIGEST_BYTES).digest()


def chain_digests(prev: bytes, pages: np.ndarray) -> np.ndarray:
    """``d_i = blake2b(d_{i-1} || page i)``, one per row of ``pages``.

    Args:
        prev: the digest of the page before the first row, or :func:`namespace_seed`.
        pages: int ``[num_pages, page_size]`` tokens (hashed as int64 little-endian).

    Returns:
        uint8 ``[num_pages, 16]``.
    """
    if not isinstance(prev, bytes) or len(prev) != DIGEST_BYTES:
        raise ValueError(f"prev must be {DIGEST_BYTES} bytes (a digest or a namespace seed)")
    if pages.ndim != 2:
        raise ValueError(f"pages must be [num_pages, page_size], got shape {pages.shape}")
    out = _chain_blake2b(prev, pages)
    return np.frombuffer(out, np.uint8).reshape(pages.shape[0], DIGEST_BYTES).copy()


def _chain_blake2b(prev: bytes, pages: np.ndarray) -> bytes:
    """``d_i = blake2b(d_{i-1} || int64 LE bytes of row i, digest_size=16)``, all digests
    concatenated.

    Args:
        prev: ``d_{-1}``, ``digest_size`` bytes.
        pages: int ``[num_pages, page_size]`` tokens.
    """
    rows = np.ascontiguousarray(pages, dtype="<i8")
    data, step = rows.tobytes(), rows.shape[1] * 8
    blake2b, digest, out = hashlib.blake2b, prev, []
    for start in range(0, len(data), step):  # one call per page, not per token
        digest = blake2b(digest + data[start : start + step], digest_size=DIGEST_BYTES).digest()
        out.append(digest)
    return b"".join(out)
