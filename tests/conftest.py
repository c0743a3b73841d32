"""Test-wide settings: 4 CPU devices, strict rank promotion, warnings as errors.

XLA_FLAGS must be set before jax is imported anywhere, hence at the top of conftest.
"""

import os

_flag = "--xla_force_host_platform_device_count=4"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")

# Hypothesis profiles: "ci" (default) runs a bounded number of examples; set
# HICACHE_HYPOTHESIS_PROFILE=long for a soak run.
settings.register_profile(
    "ci", deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile(
    "long", deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=2000
)
settings.load_profile(os.environ.get("HICACHE_HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def clock():
    """A manual clock: ``clock()`` reads it, ``clock.tick(dt)`` advances it."""

    class _Clock:
        def __init__(self) -> None:
            self.now = 0.0

        def __call__(self) -> float:
            return self.now

        def tick(self, dt: float = 1.0) -> float:
            self.now += dt
            return self.now

    return _Clock()
