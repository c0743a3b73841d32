"""What both pools share about their one array: the donated ``run`` step and the kv check.

Each pool holds the only reference to its array and rebinds it after every update (ARCHITECTURE.md:
donate, and hold the only reference). :class:`DonatedArray` is the one implementation of "run a
donated step on the array and check what comes back" that ``DevicePagePool.run`` and
``HostPagePool.run`` (and through them every transfer) use; :func:`check_kv` is the one check of a
caller's ``kv`` argument.

What a step's result is held to, in order:

1. ``(new_array, out)`` with the array's shape and dtype: checked with ``eval_shape`` before
   dispatch when the step is a ``jax.jit`` function (a mismatch raises ``ValueError`` and the
   pool is untouched), and again on the result. A step's result shape depends only on its
   arguments' shapes and dtypes, so a function that passed is not traced again for the same
   argument shapes (when every argument is an array: remembered per function and shapes, at
   most ``EVAL_CACHE_SIZE`` of them); a function or argument shapes never seen before are
   checked before their first dispatch.
2. The array's sharding (memory kind included). Found only after the step ran: the pool keeps
   the step's result, moved back to its own placement, and ``ValueError`` says to set
   ``out_shardings``. (Keeping the old array instead is not possible: it was donated.)
3. The donation: if the old array is still alive the step copied the whole pool; the pool keeps
   the result and ``ValueError`` says to jit with ``donate_argnums=0``.

Threading: called on the pool owner's thread only (ARCHITECTURE.md: one dispatching thread).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from hicache_jax.spec import KVSpec

#: Steps (function, argument shapes and dtypes) whose ``eval_shape`` check passed, remembered
#: per pool; cleared when full (a pool's own copies use a handful: padded plan lengths).
EVAL_CACHE_SIZE = 256


def check_kv(spec: KVSpec, kv: Any, n: int) -> None:
    """Check that ``kv`` holds ``n`` pages: ``spec.kv_shape(n)`` in ``spec.dtype`` or its bits.

    Raises:
        TypeError: not a jax or numpy array, or another dtype.
        ValueError: another shape.
    """
    if not isinstance(kv, (jax.Array, np.ndarray)):
        raise TypeError(f"kv must be a jax.Array or numpy array, got {type(kv).__name__}")
    want = spec.kv_shape(n)
    if tuple(kv.shape) != want:
        raise ValueError(
            f"kv.shape={tuple(kv.shape)} must be spec.kv_shape({n})={want} "
            "[layers, kv, pages, page_size, heads, dim]"
        )
    if kv.dtype != spec.jnp_dtype and kv.dtype != spec.bits_dtype:
        raise TypeError(
            f"kv.dtype={kv.dtype} must be {spec.jnp_dtype} (spec dtype) "
            f"or {spec.bits_dtype} (raw bits)"
        )


class DonatedArray:
    """The shape, dtype and sharding a pool's array keeps across donated steps.

    Args:
        name: what the array is called in errors ("pool", "host buffer").
        array: the freshly allocated array; its shape, dtype and sharding are the reference.
    """

    __slots__ = ("name", "shape", "dtype", "sharding", "_sharding_ok", "_checked")

    def __init__(self, name: str, array: jax.Array) -> None:
        self.name = name
        self.shape = tuple(array.shape)
        self.dtype = array.dtype
        self.sharding = array.sharding
        # An executable returns the same sharding object every call: a result sharding found
        # equivalent once is remembered (is_equivalent_to costs ~50-65 us on a cold cache).
        self._sharding_ok = array.sharding
        # (fn, arg shapes / dtypes) whose eval_shape passed: eval_shape costs ~30 us a call
        self._checked: set = set()

    def run(
        self,
        array: jax.Array,
        rebind: Callable[[jax.Array], None],
        fn: Callable[..., tuple[jax.Array, Any]],
        args: tuple,
    ) -> Any:
        """``new, out = fn(array, *args)`` with ``array`` donated; ``rebind(new)``; return ``out``.

        Raises:
            ValueError: see the module docstring (shape / dtype before dispatch when ``fn`` is
                a ``jax.jit`` function; sharding and donation after, the result kept).
        """
        if hasattr(fn, "eval_shape"):
            self._check_before(fn, array, args)
        new, out = self._check_result(fn(array, *args))
        if new.sharding is not self._sharding_ok:
            if not new.sharding.is_equivalent_to(self.sharding, len(self.shape)):
                rebind(jax.device_put(new, self.sharding))
                raise ValueError(
                    f"fn returned the {self.name} with sharding {new.sharding}, "
                    f"expected {self.sharding}: set out_shardings (the "
                    f"{self.name} was moved back to its placement)"
                )
            self._sharding_ok = new.sharding
        rebind(new)
        if not array.is_deleted():
            raise ValueError(
                f"fn did not donate the {self.name} (jit it with donate_argnums=0): "
                f"the step ran but copied the whole {self.name}"
            )
        return out

    def _check_before(self, fn: Any, array: jax.Array, args: tuple) -> None:
        """``eval_shape`` check of a jitted ``fn``, skipped when the same function passed it
        with arguments of the same shapes and dtypes (arrays only: anything else, e.g. a
        static Python argument or a pytree, is checked every call)."""
        key = None
        if all(isinstance(a, (jax.Array, np.ndarray)) for a in args):
            try:
                key = (
                    fn,
                    tuple(
                        (a.shape, a.dtype, getattr(a, "weak_type", False)) for a in (array, *args)
                    ),
                )
                if key in self._checked:
                    return
            except TypeError:  # an unhashable function: no memo
                key = None
        self._check_result(fn.eval_shape(array, *args))
        if key is not None:
            if len(self._checked) >= EVAL_CACHE_SIZE:
                self._checked.clear()
            self._checked.add(key)

    def _check_result(self, result: Any) -> tuple[Any, Any]:
        if not (isinstance(result, tuple) and len(result) == 2):
            raise ValueError(f"fn must return (new_{self.name.replace(' ', '_')}, out)")
        new, out = result
        if tuple(new.shape) != self.shape or new.dtype != self.dtype:
            raise ValueError(
                f"fn returned a {self.name} of shape {tuple(new.shape)} dtype "
                f"{new.dtype}, expected {self.shape} {self.dtype}"
            )
        return new, out


#: Steps over several pools (:func:`run_pools`) whose ``eval_shape`` check passed: (function,
#: argument shapes and dtypes), cleared when full.
_CHECKED_POOLS: set = set()


def run_pools(
    pools: Sequence[Any],
    rebinds: Sequence[Callable[[jax.Array], None]],
    fn: Callable[..., Any],
    args: tuple,
) -> Any:
    """``new, new_others, out = fn(pools[0]'s array, the others' arrays, *args)``: the step of
    ``DevicePagePool.run_with`` / ``HostPagePool.run_with`` (``fn`` jitted with
    ``donate_argnums=(0, 1)``). Each pool gives ``array_ref()``, ``shape`` and ``spec``; the
    results are checked against them (a jitted ``fn``: before dispatch, with ``eval_shape``,
    the first time it meets these argument shapes, which then fix its results'; any other
    ``fn``: after the step) and each pool's ``rebinds`` callback takes its new array. Returns
    ``out``.

    Raises:
        ValueError: a returned pool of another shape or dtype (before dispatch when checkable:
            nothing changed), or a pool not donated (after the step: the pools keep its results).
    """
    arrays = tuple(p.array_ref() for p in pools)
    if hasattr(fn, "eval_shape"):
        leaves = jax.tree.leaves((arrays, args))
        key: Any = (fn, tuple((getattr(x, "shape", x), getattr(x, "dtype", None)) for x in leaves))
        try:
            seen = key in _CHECKED_POOLS
        except TypeError:  # an unhashable argument: checked every call
            key, seen = None, False
        if not seen:
            shaped = fn.eval_shape(arrays[0], arrays[1:], *args)
            _check_pools(pools, (shaped[0], *shaped[1]))
            if key is not None:
                if len(_CHECKED_POOLS) >= EVAL_CACHE_SIZE:
                    _CHECKED_POOLS.clear()
                _CHECKED_POOLS.add(key)
    new, new_others, out = fn(arrays[0], arrays[1:], *args)
    results = (new, *new_others)
    if not hasattr(fn, "eval_shape"):  # (a jitted fn's results have the shapes it checked)
        _check_pools(pools, results)
    for rebind, array in zip(rebinds, results):
        rebind(array)
    if not all(a.is_deleted() for a in arrays):
        raise ValueError(
            "fn did not donate every pool (jit it with donate_argnums=(0, 1)): the step "
            "ran but copied a whole pool"
        )
    return out


def _check_pools(pools: Sequence[Any], results: Sequence[Any]) -> None:
    if len(results) != len(pools):
        raise ValueError(f"fn returned {len(results)} pools for {len(pools)}")
    for i, (pool, r) in enumerate(zip(pools, results)):
        if tuple(r.shape) != tuple(pool.shape) or r.dtype != pool.spec.bits_dtype:
            raise ValueError(
                f"fn returned pool {i} as {r.dtype}{list(r.shape)}, expected "
                f"{pool.spec.bits_dtype}{list(pool.shape)}"
            )
