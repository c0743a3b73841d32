"""hicache_jax: a hierarchical KV page cache (device pool L1, pinned host pool L2) for JAX."""

from hicache_jax.errors import HiCacheError, OutOfPagesError
from hicache_jax.spec import HiCacheConfig, KVSpec

__all__ = ["HiCacheConfig", "HiCacheError", "KVSpec", "OutOfPagesError"]
