"""Helpers shared by the L3 backend tests (test_storage_file.py, test_storage_mooncake.py) and the
interpreters they start (no tests here): a small spec, random host buffers in every layout, page
views to compare them, page keys, and backends opened over a fresh buffer.

Import them as ``from storage_helpers import ...`` (pytest puts ``tests/`` on ``sys.path``; a
subprocess inserts the directory itself).
"""

import numpy as np

from hicache_jax.l3.storage import (
    ENTRY_ROWS,
    HEADER_BYTES,
    entry_pages,
    entry_rows,
    open_storage,
    page_keys,
)
from hicache_jax.spec import KVSpec

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16", page_size=4)
NUM_PAGES = 16


def host_buffer(spec, layout, num_pages=NUM_PAGES, seed=0):
    """Random pages (never zeros) in a host-pool layout or in ``entry_rows``."""
    if layout == ENTRY_ROWS:
        rows = entry_rows(spec, num_pages)
        entry_pages(spec, rows)[:] = host_buffer(spec, "page_first", num_pages, seed)
        return rows
    if layout == "page_first":
        shape = spec.page_major_shape(num_pages)
    else:
        shape = (
            spec.num_layers,
            spec.kv_factor,
            num_pages,
            spec.page_size,
            spec.num_kv_heads,
            spec.head_dim,
        )
    info = np.iinfo(spec.bits_dtype)
    return np.random.default_rng(seed).integers(
        0, info.max, shape, dtype=spec.bits_dtype, endpoint=True
    )


def pages(buf, layout, ids):
    """Pages ``ids`` of a host buffer as [n, L, kvf, ps, H, D] (a copy); entry rows: their
    page bytes, uint8 [n, page_bytes] (compare across layouts with :func:`page_bytes`)."""
    ids = np.asarray(ids)
    if layout == ENTRY_ROWS:
        return buf[ids, HEADER_BYTES:].copy()
    return buf[ids].copy() if layout == "page_first" else np.moveaxis(buf[:, :, ids], 2, 0).copy()


def page_bytes(buf, layout, ids):
    """Pages ``ids`` as uint8 [n, page_bytes] in page_first byte order, for any layout."""
    out = pages(buf, layout, ids)
    return out.view(np.uint8).reshape(len(ids), -1)


def keys_for(n, start=0, spec=SPEC, extra_key=None):
    """Keys of the first n pages of a prompt; another ``start``, another prompt."""
    tokens = np.arange(start * spec.page_size, (start + n) * spec.page_size) * 7919 + 1
    return page_keys(spec, tokens, extra_key)


def open_file(root, layout="page_first", seed=0, spec=SPEC, **kw):
    """A file backend at ``root`` over a fresh random host buffer; returns (backend, buffer)."""
    buf = host_buffer(spec, layout, seed=seed)
    return open_storage(f"file://{root}", spec, buf, layout, **kw), buf


def open_mc(servers, layout="page_first", seed=0, spec=SPEC, **kw):
    """A Mooncake backend on ``servers`` (a :class:`storage_servers.MooncakeServers`) over a
    fresh random host buffer; returns (backend, buffer)."""
    buf = host_buffer(spec, layout, seed=seed)
    return open_storage(servers.url, spec, buf, layout, **kw), buf
