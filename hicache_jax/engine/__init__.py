"""Reference serving integration: a small paged decoder, a request loop over HiCache, workloads,
and the ``hicache-jax bench`` command. Nothing else in hicache_jax imports this package."""

from hicache_jax.engine.engine import CacheMode, Engine, Generation, RequestRecord
from hicache_jax.engine.model import DecoderModel, ModelConfig, init_params, load_params
from hicache_jax.engine.workloads import (Workload, agent_loop, document_qa, multiturn_chat)

__all__ = ["CacheMode", "DecoderModel", "Engine", "Generation", "ModelConfig", "RequestRecord",
           "Workload", "agent_loop", "document_qa", "init_params", "load_params",
           "multiturn_chat"]
