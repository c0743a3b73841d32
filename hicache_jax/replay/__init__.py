"""Trace replay: production request traces through the real cache, beside exact LRU references
(:mod:`~hicache_jax.replay.driver`), the trace formats (:mod:`~hicache_jax.replay.trace`) and the
exact block-LRU (:mod:`~hicache_jax.replay.block_lru`)."""

from hicache_jax.replay.driver import (
    BlockLRU, MOONCAKE_BLOCK, PageKeys, Request, TIMING_FIELDS, TINY_SPEC, TOKEN_PAGE_SIZE, Trace, default_device_pages, environment, format_table, load_trace, parse_spec, plot, reference_hits, replay, require_matplotlib, run, sweep_table, tables)

__all__ = ['BlockLRU', 'MOONCAKE_BLOCK', 'PageKeys', 'Request', 'TIMING_FIELDS', 'TINY_SPEC', 'TOKEN_PAGE_SIZE', 'Trace', 'default_device_pages', 'environment', 'format_table', 'load_trace', 'parse_spec', 'plot', 'reference_hits', 'replay', 'require_matplotlib', 'run', 'sweep_table', 'tables']
