"""128-bit chained page digests: what L3 keys are made of. Pure Python + numpy (hashlib).

A page's digest covers every token of the prefix that ends with it::

    d_0 = seed(fingerprint, extra_key)         16 bytes (blake2b)
    d_i = blake2b(d_{i-1} || int64 LE bytes of page i's tokens, digest_size=16)

so two prefixes share a digest only by a 128-bit collision, whichever instances wrote them into
a shared store (the tree's 64-bit ``page_hashes`` stay the ids of the KV events; they are not
keys). The seed namespaces the chain by the KV layout (``KVSpec.fingerprint()``) and by
``extra_key`` (None, str, bytes or int: the types with one encoding in every process).

Cost: one blake2b call over ``16 + 8 * page_size`` bytes per page, about 0.6 us per 16-token page
on the project's machine (``benchmarks/bench_storage.py`` prints it beside an entry's checksum).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

DIGEST_BYTES = 16


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
    raise TypeError(f"extra_key={extra_key!r} must be None, str, bytes or int "
                    "(it must hash the same in every process)")


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
    out = chain_blake2b(prev, pages, DIGEST_BYTES)
    return np.frombuffer(out, np.uint8).reshape(pages.shape[0], DIGEST_BYTES).copy()


def chain_blake2b(prev: bytes, pages: np.ndarray, digest_size: int) -> bytes:
    """The chain both hashes use (the tree's 8-byte page hashes, L3's 16-byte digests):
    ``d_i = blake2b(d_{i-1} || int64 LE bytes of row i)``, all digests concatenated.

    Args:
        prev: ``d_{-1}``, ``digest_size`` bytes.
        pages: int ``[num_pages, page_size]`` tokens.
    """
    rows = np.ascontiguousarray(pages, dtype="<i8")
    data, step = rows.tobytes(), rows.shape[1] * 8
    blake2b, digest, out = hashlib.blake2b, prev, []
    for start in range(0, len(data), step):  # one call per page, not per token
        digest = blake2b(digest + data[start:start + step], digest_size=digest_size).digest()
        out.append(digest)
    return b"".join(out)
