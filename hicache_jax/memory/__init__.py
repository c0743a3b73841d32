"""Page memory: the allocator, the device pool (one donated jax.Array of raw bits), the host
pool, the page-copy core both pools share, placement (mesh, memory kinds) and the transfer
engine (queued device<->host copies, polled completion, per-layer readiness). Knows nothing
of the tree.
"""

from hicache_jax.memory.device_pool import DevicePagePool
from hicache_jax.memory.host_pool import HostPagePool
from hicache_jax.memory.transfer import TransferEngine

__all__ = ["DevicePagePool", "HostPagePool", "TransferEngine"]
