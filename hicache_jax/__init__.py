"""hicache_jax: a hierarchical KV page cache (device pool L1, pinned host pool L2) for JAX."""

from hicache_jax.cache.hicache import HiCache
from hicache_jax.cache.match import Match, NodeRef
from hicache_jax.cache.request import Request
from hicache_jax.errors import HiCacheError, OutOfPagesError
from hicache_jax.events.records import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, Medium
from hicache_jax.l3.prefetch import PrefetchHandle
from hicache_jax.l3.storage import StorageError, StorageUnavailableError
from hicache_jax.sizing import PoolSizes, size_pools
from hicache_jax.spec import GroupKind, HiCacheConfig, KVSpec, LayerGroup, StateArray

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "GroupKind",
    "HiCache",
    "HiCacheConfig",
    "HiCacheError",
    "KVEvent",
    "KVSpec",
    "LayerGroup",
    "Match",
    "Medium",
    "NodeRef",
    "OutOfPagesError",
    "PoolSizes",
    "PrefetchHandle",
    "Request",
    "StateArray",
    "StorageError",
    "StorageUnavailableError",
    "size_pools",
]
