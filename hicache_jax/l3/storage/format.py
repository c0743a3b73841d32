"""L3 keys and the on-store entry format (header + page bytes). Pure Python + numpy.

Key: ``hcj2_<spec fingerprint>_<namespace>_<page digest>`` (``<namespace>-g<k>`` in a
namespace's generation k, see :func:`key_strings`) where the page digest (32 hex chars)
is the 128-bit chained digest of :mod:`hicache_jax.tree.hashing` (it covers every token of the
prefix ending with the page, seeded by the fingerprint and ``extra_key``), the namespace is a short
digest of ``extra_key`` and the fingerprint (it lets a store be listed by namespace), and the
fingerprint is :meth:`KVSpec.fingerprint`. Two models, two ``extra_key`` namespaces, or two
prefixes never share an entry (short of a 128-bit collision). A window group's entry of a page
is keyed ``hcj2_<fingerprint>_<namespace>_w<g>_<page digest>`` (:mod:`hicache_jax.l3.windows`).
Keys of the earlier ``hcj1`` scheme (64-bit tree hashes) are never asked for: such entries are
misses.

Entry: a 64-byte header followed by one page in ``page_first`` order
(``[num_layers, kv_factor, page_size, num_kv_heads, head_dim]`` of the bits dtype)::

    magic "HCKV" | version u16 | header bytes u16 | fingerprint 8 B | key digest 8 B |
    payload bytes u64 | checksum algorithm u16 | reserved u16 | checksum of payload u64 | zeros

A value whose header, length, key digest or checksum does not match is a miss (never data). The
header's key digest (of the key string) catches an entry stored under another key (a renamed or
mixed-up object); which prefix a key names is the key's own 128-bit digest.
Checksums: ``xxh3`` (64-bit XXH3 from the ``xxhash`` package, several times cheaper per byte;
the default when it is installed) or ``crc32`` (zlib; the default without it). Readers check
whichever algorithm the header names; an entry whose algorithm this process cannot compute is a
miss.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import re
import struct
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from hicache_jax.spec import KVSpec
from hicache_jax.tree.hashing import chain_digests, namespace_seed, namespace_tag

KEY_PREFIX = "hcj2"
HEADER_BYTES = 64
_MAGIC = b"HCKV"
_VERSION = 1
# magic, version, header bytes, fingerprint, key digest, payload bytes, checksum algorithm,
# reserved, checksum; zero-padded to 64 bytes.
_HEADER = struct.Struct("<4sHH8s8sQHHQ")


def _crc32(parts: Sequence[Any]) -> int:
    crc = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
    return crc


def _xxh3(parts: Sequence[Any]) -> int:
    import xxhash

    if len(parts) == 1:
        return xxhash.xxh3_64_intdigest(parts[0])
    h = xxhash.xxh3_64()
    for part in parts:
        h.update(part)
    return h.intdigest()


#: checksum name -> (id stored in the header, function of the payload parts)
CHECKSUMS = {"crc32": (1, _crc32), "xxh3": (2, _xxh3)}
_BY_ID = dict(CHECKSUMS.values())


@functools.cache
def xxhash_available() -> bool:
    try:
        import xxhash  # noqa: F401
    except ImportError:
        return False
    return True


_KEY_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,200}$")


def namespace(spec: KVSpec, extra_key: Any = None) -> str:
    """16 hex chars naming (spec, extra_key); ``extra_key`` is None, str, bytes or int."""
    tag = namespace_tag(extra_key)
    return hashlib.blake2b(spec.fingerprint().encode() + b"|" + tag, digest_size=8).hexdigest()


def page_keys(spec: KVSpec, tokens: Any, extra_key: Any = None) -> list[str]:
    """L3 keys of the pages of a prefix, one per whole page, root first.

    Args:
        spec: the KV spec (its fingerprint namespaces the keys).
        tokens: 1-D non-negative ints, the prefix from its first token, a whole number of pages.
        extra_key: the tree namespace (None, str, bytes or int).

    Returns:
        ``len(tokens) // spec.page_size`` key strings.

    Raises:
        TypeError: non-integer tokens, or an ``extra_key`` with no process-stable encoding.
        ValueError: tokens not 1-D, negative, or not a whole number of pages.
    """
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"tokens must be integers, got dtype {arr.dtype}")
    if arr.size and (arr.min() < 0 or (arr.dtype == np.uint64 and arr.max() >= 2**63)):
        raise ValueError("tokens must be in [0, 2**63)")
    if arr.size % spec.page_size:
        raise ValueError(
            f"tokens has {arr.size} tokens: need a multiple of page_size={spec.page_size}"
        )
    seed = namespace_seed(spec.fingerprint(), extra_key)
    digests = chain_digests(seed, arr.astype(np.int64).reshape(-1, spec.page_size))
    return key_strings(spec, extra_key, digests)


def namespace_prefix(spec: KVSpec, extra_key: Any = None) -> str:
    """What every key of the namespace (spec, ``extra_key``) starts with, in any generation:
    ``hcj2_<fingerprint>_<namespace>`` (the namespace is fixed-width, so no other namespace's
    keys start with it); what ``delete_prefix`` is given for ``HiCache.invalidate``."""
    return f"{KEY_PREFIX}_{spec.fingerprint()}_{namespace(spec, extra_key)}"


def key_strings(
    spec: KVSpec, extra_key: Any, digests: np.ndarray, generation: int = 0
) -> list[str]:
    """Key strings of page digests (uint8 ``[n, 16]`` from :func:`hashing.chain_digests`);
    ``generation`` > 0 (a namespace invalidated on a store that could not delete it) names the
    keys ``<namespace>-g<generation>``, so the earlier generation's entries are never asked for."""
    tail = f"-g{generation}_" if generation else "_"
    prefix = namespace_prefix(spec, extra_key) + tail
    hexed = digests.tobytes().hex()
    width = 2 * digests.shape[1]
    return [prefix + hexed[i : i + width] for i in range(0, len(hexed), width)]


def check_key_prefix(prefix: Any) -> str:
    """Validate the argument of ``delete_prefix``: a non-empty string of key characters."""
    if not isinstance(prefix, str):
        raise TypeError(f"key prefix must be a str, got {type(prefix).__name__}")
    if not _KEY_RE.fullmatch(prefix):
        raise ValueError(f"key prefix {prefix!r} must be 1-200 chars of [A-Za-z0-9_.-]")
    return prefix


def check_keys(keys: Any) -> tuple[str, ...]:
    """Validate a batch of keys: a sequence of unique, filename-safe strings."""
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
        raise TypeError(f"keys must be a list/tuple of str, got {type(keys).__name__}")
    out = tuple(keys)
    for k in out:
        # fullmatch: "$" alone lets a trailing newline through; "." / ".." name no file
        if not isinstance(k, str) or not _KEY_RE.fullmatch(k) or k in (".", ".."):
            raise ValueError(
                f"key {k!r} must be 1-200 chars of [A-Za-z0-9_.-] naming one file (not '.' or '..')"
            )
    if len(set(out)) != len(out):
        raise ValueError("keys must be unique within one call")
    return out


def _key_digest(key: str) -> bytes:
    return hashlib.blake2b(key.encode(), digest_size=8).digest()


class Verdict(enum.Enum):
    """Outcome of checking an entry read from a store."""

    VALID = "valid"
    INVALID = "invalid"
    UNCHECKABLE = "uncheckable"


class EntryCodec:
    """Packs and checks entry headers for one spec.

    ``payload`` arguments are sequences of uint8 numpy arrays (or buffers) whose concatenation is
    the page in ``page_first`` order: one part for a page_first buffer, ``L * kv_factor``
    chunks for a layer_first one. The checksum is computed over the parts in order, so no
    contiguous copy is needed.
    """

    def __init__(self, spec: KVSpec, checksum: str = "auto") -> None:
        if checksum == "auto":
            # xxh3 measured ~4.5x cheaper than crc32 per byte (benchmarks/RESULTS.md, L3):
            # the checksum is most of what an entry costs over a raw page.
            checksum = "xxh3" if xxhash_available() else "crc32"
        if checksum not in CHECKSUMS:
            raise ValueError(f"checksum={checksum!r} is not one of: {', '.join(CHECKSUMS)}")
        if checksum == "xxh3" and not xxhash_available():
            raise ValueError("checksum='xxh3' needs the xxhash package (pip install xxhash)")
        self.spec = spec
        self.checksum = checksum
        self._algo, self._fn = CHECKSUMS[checksum]
        self.payload_bytes = spec.page_bytes
        self.entry_bytes = HEADER_BYTES + spec.page_bytes
        self._fp = bytes.fromhex(spec.fingerprint())[:8]

    def pack_into(self, header: np.ndarray, key: str, payload: Sequence[Any]) -> None:
        """Write the header of ``key`` / ``payload`` into ``header`` (uint8[64], the caller's)."""
        header[:] = 0
        # An ndarray is a buffer; numpy's stubs declare __buffer__ only for Python >= 3.12.
        _HEADER.pack_into(
            header,  # type: ignore[arg-type]
            0,
            _MAGIC,
            _VERSION,
            HEADER_BYTES,
            self._fp,
            _key_digest(key),
            self.payload_bytes,
            self._algo,
            0,
            self._fn(payload),
        )

    def verify(
        self, header: np.ndarray, key: str, payload: Sequence[Any], nbytes: int | None = None
    ) -> Verdict:
        """Whether ``header`` + ``payload`` are a valid entry of ``key`` for this spec.

        Args:
            header: uint8[64] as read from the store.
            key: the key it was read under.
            payload: the parts the page was read into.
            nbytes: total bytes the store returned (None: not known to the caller).

        Returns:
            ``VALID``; ``INVALID`` (damaged: the caller may remove it); ``UNCHECKABLE`` (written
            with a checksum this process cannot compute: a miss, but leave it for others).
        """
        if nbytes is not None and nbytes != self.entry_bytes:
            return Verdict.INVALID
        # header is a buffer (see pack_into)
        magic, version, hbytes, fp, kd, length, algo, _, checksum = _HEADER.unpack_from(header, 0)  # type: ignore[arg-type]
        if (
            magic != _MAGIC
            or version != _VERSION
            or hbytes != HEADER_BYTES
            or fp != self._fp
            or kd != _key_digest(key)
            or length != self.payload_bytes
        ):
            return Verdict.INVALID
        fn = self._fn if algo == self._algo else _BY_ID.get(algo)
        if fn is None:
            return Verdict.INVALID
        if fn is _xxh3 and not xxhash_available():
            return Verdict.UNCHECKABLE
        return Verdict.VALID if fn(payload) == checksum else Verdict.INVALID
