"""Trace replay: production request traces through the real cache, beside exact LRU references
(:mod:`~hicache_jax.replay.driver`), the trace formats (:mod:`~hicache_jax.replay.trace`), the
exact block-LRU (:mod:`~hicache_jax.replay.block_lru`), the what-if TTFT simulator
(:mod:`~hicache_jax.replay.simulate`, imported by name) and the replay of a sliding-window model
at the all-full model's bytes (:mod:`~hicache_jax.replay.windows`, imported by name) and of a
hybrid recurrent model at its bytes (:mod:`~hicache_jax.replay.states`, imported by name), and
of a model with all three layer kinds at the all-full model's bytes
(:mod:`~hicache_jax.replay.mixed`, imported by name)."""

from hicache_jax.replay.block_lru import BlockLRU, PageKeys, default_device_pages, reference_hits
from hicache_jax.replay.driver import (
    TIMING_FIELDS,
    TINY_SPEC,
    environment,
    format_table,
    plot,
    replay,
    run,
    sweep_table,
    tables,
)
from hicache_jax.replay.trace import MOONCAKE_BLOCK, TOKEN_PAGE_SIZE, Request, Trace, load_trace

__all__ = [
    "BlockLRU",
    "MOONCAKE_BLOCK",
    "PageKeys",
    "Request",
    "TIMING_FIELDS",
    "TINY_SPEC",
    "TOKEN_PAGE_SIZE",
    "Trace",
    "default_device_pages",
    "environment",
    "format_table",
    "load_trace",
    "plot",
    "reference_hits",
    "replay",
    "run",
    "sweep_table",
    "tables",
]
