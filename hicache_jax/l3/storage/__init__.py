"""L3 storage backends behind one small batched, asynchronous protocol.

```python
store = open_storage("file:///var/cache/hicache", spec, host_buffer, layout="page_first")
keys = page_keys(spec, prefix_tokens, extra_key)  # 128-bit chained digests -> L3 keys
mask = store.exists(keys)  # bool [n], synchronous, cheap
h = store.get_into(keys, host_ids)  # L3 -> host pages, a StorageHandle
h = store.put_from(keys, host_ids)  # host pages -> L3 (write-once keys)
h.done()
ok = h.wait(timeout)  # ok: bool [n]; h.landed(): so far
store.delete(keys)  # optional: bool [n] removed
store.delete_prefix(namespace_prefix(spec, extra_key))  # optional: entries removed (int)
store.stats()
store.close()
```

``delete`` and ``delete_prefix`` are optional; ``HiCache.invalidate`` uses them where a backend
has them. ``delete_prefix(prefix)`` removes every entry whose key starts with ``prefix`` (a
namespace's keys share ``namespace_prefix``), including those this process never wrote, and
returns how many it removed; the conformance kit checks it where a backend has it. Without
``delete_prefix``, a namespace invalidate reaches only the entries whose keys the cache knows
(its tree's); without ``delete``, none: the store keeps the rest, and the cache moves the
namespace to a new key generation so it never reads them again (this cache only; counted in
``stats()["l3_invalidate_unreached"]``, pages not deleted in ``l3_delete_unsupported_pages``).

An entry is a 64-byte header (spec fingerprint, key digest, length, checksum) and the page in
``page_first`` order; a corrupted or truncated entry is a miss.

``host_buffer`` is a *numpy* array the caller owns for the backend's lifetime, laid out like a
host pool (``page_first`` or ``layer_first``) or as ``ENTRY_ROWS`` (``entry_rows(spec, n)``: one
row per page, a 64-byte header slot then the page, i.e. exactly an entry); ``host_ids`` index its
pages. Backends never touch JAX arrays: their worker threads read and write this buffer, so the
caller must keep a request's pages (neither freed, reused nor read) until its handle is done.
``HostPagePool.buffer`` is a donated ``jax.Array``, so it cannot be this buffer: the cache keeps a
numpy staging pool in ``ENTRY_ROWS`` (each page moved to and from the store in place and checked
there: no copy in the backend; ``entry_pages`` is its page view) and moves pages between it and
the host pool with ``HostPagePool.read`` / ``write`` on its own thread. With a pool layout, a
backend stages each page next to its header (one copy) or, with Mooncake's ``zero_copy``, passes
two buffers per key.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from hicache_jax.l3.storage.base import (
    ENTRY_ROWS,
    HostPages,
    StorageError,
    StorageHandle,
    StorageUnavailableError,
    entry_pages,
    entry_rows,
)
from hicache_jax.l3.storage.format import (
    HEADER_BYTES,
    EntryCodec,
    key_strings,
    namespace,
    namespace_prefix,
    page_keys,
)
from hicache_jax.spec import HostLayout, KVSpec

__all__ = [
    "StorageBackend",
    "StorageHandle",
    "StorageError",
    "StorageUnavailableError",
    "HostPages",
    "open_storage",
    "page_keys",
    "key_strings",
    "namespace",
    "namespace_prefix",
    "EntryCodec",
    "HEADER_BYTES",
    "ENTRY_ROWS",
    "entry_rows",
    "entry_pages",
]


@runtime_checkable
class StorageBackend(Protocol):
    """What the cache uses of an L3 backend (see the module docstring)."""

    url: str
    spec: KVSpec

    def exists(self, keys: Sequence[str]) -> np.ndarray: ...
    def get_into(self, keys: Sequence[str], host_ids: Any) -> StorageHandle: ...
    def put_from(self, keys: Sequence[str], host_ids: Any) -> StorageHandle: ...
    def stats(self) -> dict[str, int]: ...
    def close(self) -> None: ...


def parse_bool(value: str) -> bool:
    """A URL option's boolean: 1/true/yes or 0/false/no/"" (any case); ValueError otherwise."""
    if value.lower() in ("1", "true", "yes"):
        return True
    if value.lower() in ("0", "false", "no", ""):
        return False
    raise ValueError(value)


_FILE_OPTIONS = {"capacity_bytes": int, "fsync": parse_bool, "batch_pages": int, "checksum": str}
_THROTTLE_OPTIONS = {"gbps": float, "latency_ms": float}
_MOONCAKE_OPTIONS = {
    "local_hostname": str,
    "protocol": str,
    "device_names": str,
    "setup_timeout_s": float,
    "exists_timeout_s": float,
    "batch_pages": int,
    "checksum": str,
    "zero_copy": parse_bool,
}


def open_storage(
    url: str,
    spec: KVSpec,
    host_buffer: np.ndarray,
    layout: HostLayout | str = HostLayout.PAGE_FIRST,
    **options: Any,
) -> StorageBackend:
    """Open the L3 backend named by ``url`` over the numpy page buffer ``host_buffer``.

    Args:
        url: ``file:///dir``, ``mooncake://host:port`` or ``python://module:Class`` (a
            deployment's own backend, see ``plugin``), or ``throttle+file:///dir?gbps=G&
            latency_ms=L`` (tests and benchmarks: a file store throttled, ``throttle``); options may
            also come as a query string (``file:///dir?capacity_bytes=1000000000``); keyword
            ``options`` win.
        spec: KV spec (its fingerprint namespaces and checks every entry).
        host_buffer: a numpy buffer of pages in ``layout`` (a staging pool the caller owns),
            borrowed for the backend's lifetime.
        layout: layout of ``host_buffer``.
        **options: backend options (``FileStorage`` / ``MooncakeStorage`` keyword arguments).

    Raises:
        ValueError / TypeError: malformed URL, option or buffer (nothing opened).
        StorageUnavailableError: the store cannot be reached (message names the address).
    """
    if not isinstance(url, str):
        raise TypeError(f"storage url={url!r} must be a string")
    parsed = urllib.parse.urlsplit(url)
    scheme = parsed.scheme
    if scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"storage url={url!r}: file URLs name a local path (file:///dir)")
        if not parsed.path:
            raise ValueError(f"storage url={url!r} has no directory")
        kwargs = _query_options(url, parsed.query, _FILE_OPTIONS) | options
        from hicache_jax.l3.storage.file import FileStorage

        return FileStorage(spec, host_buffer, layout, urllib.parse.unquote(parsed.path), **kwargs)
    if scheme == "throttle+file":  # tests and benchmarks: a throttled file store (throttle.py)
        if parsed.netloc not in ("", "localhost") or not parsed.path:
            raise ValueError(f"storage url={url!r} must be throttle+file:///dir?gbps=G")
        kwargs = _query_options(url, parsed.query, _FILE_OPTIONS | _THROTTLE_OPTIONS) | options
        if "gbps" not in kwargs:
            raise ValueError(f"storage url={url!r} has no gbps (throttle+file:///dir?gbps=G)")
        from hicache_jax.l3.storage.throttle import ThrottledFileStorage

        return ThrottledFileStorage(
            spec, host_buffer, layout, urllib.parse.unquote(parsed.path), **kwargs
        )
    if scheme == "mooncake":
        if not parsed.netloc or parsed.path not in ("", "/"):
            raise ValueError(f"storage url={url!r} must be mooncake://host:port")
        kwargs = _query_options(url, parsed.query, _MOONCAKE_OPTIONS) | options
        from hicache_jax.l3.storage.mooncake import MooncakeStorage

        return MooncakeStorage(spec, host_buffer, layout, parsed.netloc, **kwargs)
    if scheme == "python":
        from hicache_jax.l3.storage.plugin import open_plugin

        return open_plugin(url, spec, host_buffer, layout, **options)
    raise ValueError(
        f"storage url={url!r}: scheme must be file://, mooncake://, python:// or throttle+file://"
    )


def _query_options(url: str, query: str, allowed: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for name, value in urllib.parse.parse_qsl(query, keep_blank_values=True, strict_parsing=False):
        if name not in allowed:
            raise ValueError(
                f"storage url={url!r}: unknown option {name!r} "
                f"(known: {', '.join(sorted(allowed))})"
            )
        try:
            out[name] = allowed[name](value)
        except ValueError:
            raise ValueError(f"storage url={url!r}: bad value {value!r} for {name}") from None
    return out
