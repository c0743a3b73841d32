"""Lowering checks: every device program the cache and the reference engine compile
(:mod:`~hicache_jax.lowering.catalogue`), lowered for TPU or CUDA on a machine without either and
held to what the cache relies on (:mod:`~hicache_jax.lowering.checks`). It imports the engine for
the engine's programs; only the command line (``hicache-jax lower``) imports it."""

from hicache_jax.lowering.catalogue import (
    LLAMA3_8B,
    LLAMA3_8B_KV,
    PLATFORMS,
    Program,
    ProgramSet,
    engine_model,
    programs,
)
from hicache_jax.lowering.checks import (
    Lowered,
    LoweringCheckError,
    Report,
    check,
    check_bounds,
    check_program,
    format_table,
    lower,
    report_json,
)

__all__ = [
    "LLAMA3_8B",
    "LLAMA3_8B_KV",
    "LoweringCheckError",
    "Lowered",
    "PLATFORMS",
    "Program",
    "ProgramSet",
    "Report",
    "check",
    "check_bounds",
    "check_program",
    "engine_model",
    "format_table",
    "lower",
    "programs",
    "report_json",
]
