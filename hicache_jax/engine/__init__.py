"""Reference serving integration: a small paged decoder (model, layers, weights, packing), a
serial request loop and a continuous-batching engine over HiCache, workloads and arrival
processes. In hicache_jax only the layers above it import it: the lowering checks
(:mod:`hicache_jax.lowering`) and the command line (:mod:`hicache_jax.cli`)."""

from hicache_jax.engine.batch_state import BatchedRecord, EngineStalledError
from hicache_jax.engine.batched import BatchedEngine
from hicache_jax.engine.engine import CacheMode, Engine, Generation, RequestRecord
from hicache_jax.engine.model import DecoderModel
from hicache_jax.engine.weights import ModelConfig, init_params, load_params
from hicache_jax.engine.workloads import (
    ClosedLoop,
    PoissonArrivals,
    TraceArrivals,
    Workload,
    agent_loop,
    document_qa,
    multiturn_chat,
)

__all__ = [
    "BatchedEngine",
    "BatchedRecord",
    "CacheMode",
    "ClosedLoop",
    "DecoderModel",
    "Engine",
    "EngineStalledError",
    "Generation",
    "ModelConfig",
    "PoissonArrivals",
    "RequestRecord",
    "TraceArrivals",
    "Workload",
    "agent_loop",
    "document_qa",
    "init_params",
    "load_params",
    "multiturn_chat",
]
