"""Reference serving integration: a small paged decoder, a serial request loop and a
continuous-batching engine over HiCache, workloads and arrival processes, and the
``hicache-jax bench`` command. Nothing else in hicache_jax imports this package."""

from hicache_jax.engine.batched import BatchedEngine, BatchedRecord, EngineStalledError
from hicache_jax.engine.engine import CacheMode, Engine, Generation, RequestRecord
from hicache_jax.engine.model import DecoderModel, ModelConfig, init_params, load_params
from hicache_jax.engine.workloads import (ClosedLoop, PoissonArrivals, TraceArrivals, Workload,
                                          agent_loop, document_qa, multiturn_chat)

__all__ = ["BatchedEngine", "BatchedRecord", "CacheMode", "ClosedLoop", "DecoderModel", "Engine",
           "EngineStalledError", "Generation", "ModelConfig", "PoissonArrivals",
           "RequestRecord", "TraceArrivals", "Workload", "agent_loop", "document_qa",
           "init_params", "load_params", "multiturn_chat"]
