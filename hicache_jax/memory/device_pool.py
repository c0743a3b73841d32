"""DevicePagePool: every layer's K and V pages in one preallocated ``jax.Array`` (L1).

Layout (fixed; the public contract of docs/guides/scheduler.md, "Writing K/V from your own
forward")::

    pool: bits[num_layers, kv_factor, num_pages + 1, page_size, num_kv_heads, head_dim]

* **Raw bits** (``spec.bits_dtype``: uint16 for bf16/fp16, uint8 for fp8/int8, uint32 for f32).
  A donated scatter into a uint16 pool costs about a memcpy of the bytes moved, while the same
  scatter into a bfloat16 pool was measured O(pool) on XLA:CPU (ARCHITECTURE.md: the pool is stored
  as raw bits). Consumers view pages with ``lax.bitcast_convert_type`` inside their own jit, after
  gathering.
* **Layer first**: attention of layer ``l`` reads ``pool[l, 0]`` (K) and ``pool[l, 1]`` (V) as
  ``[pages, page_size, heads, dim]``, the shape paged-attention kernels take, without a transpose.
  One page of one layer and one of K/V (``spec.chunk_bytes``) is contiguous.
* **Scratch page** ``num_pages``: never allocated. Index arrays are padded to power-of-two
  buckets with this id so the pool-sized scatter/gather compiles once per bucket, not once per
  batch size (ARCHITECTURE.md: bounded compiles); padded rows write to and read from the scratch
  page only.
* **Sharding** (optional mesh + axis): ``PartitionSpec(None, None, None, None, axis, None)``;
  each device holds its heads' slice of every page, so page movement is local to each device.
  An MLA latent cache (one "head") is replicated over the mesh instead.

Every update is a module-level jitted function with the pool donated; the pool object holds the
only reference and rebinds it after each call (ARCHITECTURE.md: donate, and hold the only
reference). Page ids are validated in numpy before dispatch, because JAX silently drops out-of-range
scatter updates and clamps gathers (ARCHITECTURE.md: validate on the host, before dispatch).

Threading: a pool is touched by one thread only (the cache's dispatching thread, ARCHITECTURE.md:
one dispatching thread).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hicache_jax.memory.allocator import PageAllocator, PageIdChecker
from hicache_jax.memory.donated import DonatedArray, check_kv, run_pools
from hicache_jax.memory.hugepages import advise_huge_pages
from hicache_jax.memory.page_copy import bucket_size
from hicache_jax.memory.placement import constrain, head_sharding, placed, zeros_placed
from hicache_jax.spec import CopyBackend, KVSpec
from hicache_jax.validation import check_bool, check_int, parse_enum

if TYPE_CHECKING:  # jaxtyping is a dev dependency only; the annotations stay strings.
    from jaxtyping import Array, Shaped

    #: ``n`` pages, ``spec.kv_shape(n)``, in ``spec.dtype`` or its bits.
    KV = Shaped[Array, "num_layers kv_factor n page_size num_kv_heads head_dim"]
    KVHost = Shaped[np.ndarray, "num_layers kv_factor n page_size num_kv_heads head_dim"]

#: Axis of the page id in the pool and in every ``kv_shape(n)`` array.
PAGE_AXIS = 2
#: Axis of the kv heads (the sharded one).
HEAD_AXIS = 4

# A copy backend: ``scatter(pool, page_ids, pages) -> pool`` and ``gather(pool, page_ids) -> pages``
# over the layout above. ``pages`` given to a scatter is in the pool's bits dtype or a KV dtype of
# the same width, which the scatter views as bits (``_as_bits``) where it is cheapest. Gather
# returns bits. They are traced inside this module's jits, so they need not be jitted themselves;
# page ids are already validated (plus scratch padding).
ScatterFn = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]
GatherFn = Callable[[jax.Array, jax.Array], jax.Array]


def _as_bits(x: jax.Array, bits_dtype: np.dtype) -> jax.Array:
    return x if x.dtype == bits_dtype else lax.bitcast_convert_type(x, bits_dtype)


def _xla_scatter(pool: jax.Array, page_ids: jax.Array, pages: jax.Array) -> jax.Array:
    # Ids were range-checked on the host; padding repeats the scratch id, so not unique.
    return pool.at[:, :, page_ids].set(_as_bits(pages, pool.dtype), mode="promise_in_bounds")


def _xla_scatter_loop(pool: jax.Array, page_ids: jax.Array, pages: jax.Array) -> jax.Array:
    """One in-place ``dynamic_update_slice`` per page.

    XLA:CPU runs a scatter with page-sized windows as an element loop: measured 3-7x a memcpy
    of the bytes moved (jax 0.10.2), where this loop runs at about memcpy speed. On GPU/TPU a
    sequential loop would serialize k small copies, so the native scatter is used there.
    """

    def body(j, pool):  # pool: [L, kvf, P + 1, ps, H, D]
        # The bitcast is inside the body so it fuses into the per-page copy; up front it would
        # materialize a fresh k-page buffer. It comes before the slice: XLA:CPU runs a bfloat16
        # dynamic-slice through float32 (a whole-array convert).
        src, _ = lax.optimization_barrier((pages, j))  # keeps the bitcast in the loop
        page = lax.dynamic_slice_in_dim(_as_bits(src, pool.dtype), j, 1, axis=PAGE_AXIS)
        return lax.dynamic_update_slice_in_dim(pool, page, page_ids[j], axis=PAGE_AXIS)

    return lax.fori_loop(0, page_ids.shape[0], body, pool)


def _xla_gather(pool: jax.Array, page_ids: jax.Array) -> jax.Array:
    return pool.at[:, :, page_ids].get(mode="promise_in_bounds")


#: Platforms where copy_backend="auto" picks the Pallas kernels. Empty until
#: benchmarks/gpu_kernels.py (and a TPU run) show them beating XLA on real hardware.
_AUTO_PALLAS_PLATFORMS: frozenset[str] = frozenset()


@functools.cache
def _pallas_copy_fns(impl: Any, sharding: NamedSharding | None) -> tuple[ScatterFn, GatherFn]:
    """pallas_kernels scatter/gather for ``impl``; per device shard (shard_map) when sharded.

    Cached so every pool with the same impl and sharding passes the same static functions to
    the jitted helpers (one compile, not one per pool).
    """
    import pallas_kernels as pk  # optional top-level package, imported only when chosen

    def scatter(pool, page_ids, pages):
        return pk.scatter_pages(pool, page_ids, _as_bits(pages, pool.dtype), impl=impl)

    def gather(pool, page_ids):
        return pk.gather_pages(pool, page_ids, impl=impl)

    if sharding is None:
        return scatter, gather
    # A kernel is opaque to the partitioner: run it on each device's heads, ids replicated.
    spec, ids = sharding.spec, PartitionSpec()
    shard = functools.partial(jax.shard_map, mesh=sharding.mesh, check_vma=False)
    return (
        shard(scatter, in_specs=(spec, ids, spec), out_specs=spec),
        shard(gather, in_specs=(spec, ids), out_specs=spec),
    )


def _resolve_backend(
    copy_backend: CopyBackend | str, platform: str, sharding: NamedSharding | None = None
) -> tuple[CopyBackend, ScatterFn, GatherFn]:
    """Map a backend choice (and the pool's platform) to its copy functions, once."""
    backend = parse_enum(CopyBackend, "copy_backend", copy_backend)
    if backend is CopyBackend.AUTO:
        backend = CopyBackend.PALLAS if platform in _AUTO_PALLAS_PLATFORMS else CopyBackend.XLA
    if backend is CopyBackend.PALLAS:
        import pallas_kernels as pk

        device = sharding.mesh.devices.flat[0] if sharding is not None else jax.devices()[0]
        impl = pk.compiled_impl(device)
        if impl is None and platform != "cpu":
            raise ValueError(
                f"copy_backend='pallas' has no kernels for {device.device_kind} "
                f"(needs a TPU or an sm_90+ GPU); use 'xla'"
            )
        # On CPU: the generic kernels in Pallas' interpreter (correct, slow: for tests).
        return (CopyBackend.PALLAS, *_pallas_copy_fns(impl or pk.Impl.INTERPRET, sharding))
    return (CopyBackend.XLA, *platform_copy_fns(CopyBackend.XLA, platform))


def platform_copy_fns(backend: CopyBackend | str, platform: str) -> tuple[ScatterFn, GatherFn]:
    """The scatter and gather an unsharded pool on ``platform`` ("cpu", "cuda"/"gpu", "tpu")
    passes to :data:`PROGRAMS` for ``backend`` ("xla" or "pallas"), found without a device of
    that platform: what ``lowering/checks.py`` lowers for a platform this machine lacks.

    Raises:
        ValueError: "auto" (it depends on the device), or "pallas" for a platform with no
            compiled kernels.
    """
    backend = parse_enum(CopyBackend, "copy_backend", backend)
    if backend is CopyBackend.XLA:
        return (_xla_scatter_loop if platform == "cpu" else _xla_scatter), _xla_gather
    if backend is CopyBackend.PALLAS:
        import pallas_kernels as pk

        impls = {"tpu": pk.Impl.TPU, "cuda": pk.Impl.MOSAIC_GPU, "gpu": pk.Impl.MOSAIC_GPU}
        if platform not in impls:
            raise ValueError(f"copy_backend='pallas' has no compiled kernels for {platform!r}")
        return _pallas_copy_fns(impls[platform], None)
    raise ValueError("copy_backend='auto' depends on the device: give 'xla' or 'pallas'")


@functools.partial(jax.jit, donate_argnums=0, static_argnames=("scatter", "sharding"))
def _write_pages(
    pool: jax.Array,
    page_ids: jax.Array,
    pages: jax.Array,
    *,
    scatter: ScatterFn,
    sharding: NamedSharding | None,
) -> jax.Array:
    """Scatter ``pages`` into ``pool`` at ``page_ids`` (pool donated).

    Args:
        pool: bits[L, kvf, P + 1, ps, H, D], donated.
        page_ids: int32[B], validated, padded with the scratch id.
        pages: [L, kvf, B, ps, H, D] in the bits dtype or a same-width KV dtype (the scatter
            views it as bits).
        scatter: the backend's scatter function (static).
        sharding: the pool's NamedSharding or None (static).

    Returns:
        The updated pool, same shape, dtype and sharding.
    """
    # Heads of the new pages on the devices that hold those heads of the pool: a local copy.
    pages = constrain(pages, sharding)
    return constrain(scatter(pool, page_ids, pages), sharding)


@functools.partial(jax.jit, static_argnames=("gather", "dtype", "sharding"))
def _read_pages(
    pool: jax.Array,
    page_ids: jax.Array,
    *,
    gather: GatherFn,
    dtype: np.dtype,
    sharding: NamedSharding | None,
) -> jax.Array:
    """Gather pages (bits) then view them as ``dtype``: [L, kvf, B, ps, H, D]."""
    pages = constrain(gather(pool, page_ids), sharding)
    # View after gathering: bitcasting the whole pool first was measured 1.5-2x slower.
    return lax.bitcast_convert_type(pages, dtype)


# The two helpers below move only the pages of one call (never the pool). Their output has n
# pages, so they compile once per distinct n (small compiles; the pool-sized ones stay bounded):
# numpy input is padded on the host instead, and a caller that writes jax arrays of power-of-two
# page counts never needs them. They work on bits: XLA:CPU pads and slices bfloat16 through
# float32 and canonicalizes NaN payloads, which would break bit-exact round trips.
@functools.partial(jax.jit, static_argnames=("n", "dtype"))
def _take_first(pages: jax.Array, n: int, dtype: np.dtype) -> jax.Array:
    """First ``n`` pages (drops the bucket padding of a read), viewed as ``dtype``."""
    return lax.bitcast_convert_type(lax.slice_in_dim(pages, 0, n, axis=PAGE_AXIS), dtype)


@functools.partial(jax.jit, static_argnames=("size", "bits_dtype"))
def _pad_pages(pages: jax.Array, size: int, bits_dtype: np.dtype) -> jax.Array:
    """Bits of a jax KV array padded to ``size`` pages (padding goes to the scratch page)."""
    pages = lax.bitcast_convert_type(pages, bits_dtype)
    pad = [(0, 0)] * pages.ndim
    pad[PAGE_AXIS] = (0, size - pages.shape[PAGE_AXIS])
    return jnp.pad(pages, pad)


#: The pool's jitted programs by operation: ``write`` (donated scatter) and ``read`` (gather)
#: run on the whole pool at power-of-two page buckets; ``take_first`` / ``pad`` move one call's
#: pages only. For tools that lower them for a platform without its device.
PROGRAMS: dict[str, Callable[..., Any]] = {
    "write": _write_pages,
    "read": _read_pages,
    "take_first": _take_first,
    "pad": _pad_pages,
}


class DevicePagePool:
    """The device (L1) page pool: one preallocated array plus its page allocator.

    Args:
        spec: what one page holds.
        num_pages: allocatable pages (the array holds one more: the scratch page).
        mesh: optional ``jax.sharding.Mesh`` (Auto or Explicit axes); the pool is then sharded
            over kv heads (replicated for MLA). num_kv_heads must divide by the axis size.
        axis: mesh axis name to shard heads over (default: the mesh's first axis).
        copy_backend: "auto" | "xla" | "pallas", resolved once here.
        huge_pages: on the CPU backend, back the pool with transparent huge pages (a
            construction-time cost that makes scattered page copies faster; see hugepages.py).

    Attributes:
        array: ``spec.bits_dtype[L, kvf, num_pages + 1, ps, H, D]``; this object holds the only
            reference. Do not keep it across a ``write`` or ``run``: it is donated there.
        allocator: ``PageAllocator(num_pages, "device")``; the pool itself never allocates.
        sharding: the ``NamedSharding`` of ``array``, or None without a mesh.
        copy_backend: the resolved ``CopyBackend`` (never AUTO).
        huge_page_bytes: bytes of ``array`` on transparent huge pages (0 off the CPU backend).
    """

    def __init__(
        self,
        spec: KVSpec,
        num_pages: int,
        *,
        mesh: Mesh | None = None,
        axis: str | None = None,
        copy_backend: CopyBackend | str = "auto",
        huge_pages: bool = True,
    ) -> None:
        if not isinstance(spec, KVSpec):
            raise TypeError(f"spec must be a KVSpec, got {type(spec).__name__}")
        check_int("num_pages", num_pages, 1)
        check_bool("huge_pages", huge_pages)
        self.spec = spec
        self.num_pages = int(num_pages)
        self.sharding = head_sharding(spec, mesh, axis)
        platform = (mesh.devices.flat[0] if mesh is not None else jax.devices()[0]).platform
        self.copy_backend, self._scatter, self._gather = _resolve_backend(
            copy_backend, platform, self.sharding
        )
        self.shape = spec.kv_shape(self.num_pages + 1)
        self.scratch_page = self.num_pages
        # Resolved once: these sit on the per-call path (write of one page is ~20 us of dispatch).
        self._dtypes = (spec.jnp_dtype, spec.bits_dtype)
        self._bits = spec.bits_dtype
        self._check_ids = PageIdChecker(self.num_pages, "device")
        self.allocator = PageAllocator(self.num_pages, "device")
        self.array: jax.Array = zeros_placed(self.shape, spec.bits_dtype, placed(self.sharding))
        #: Bytes of the pool backed by transparent huge pages (CPU backend; see hugepages.py).
        self.huge_page_bytes = advise_huge_pages(self.array) if huge_pages else 0
        self._donated = DonatedArray("pool", self.array)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole array, scratch page included."""
        return int(np.prod(self.shape)) * self.spec.itemsize

    def validate_ids(self, page_ids: Any, name: str = "page_ids") -> np.ndarray:
        """Check ids are 1-D ints in ``[0, num_pages)`` and distinct; return an int32 copy.

        Raises:
            TypeError: not integers.
            ValueError: not 1-D, out of range, or repeated.
        """
        return self._check_ids(page_ids, name)

    def _padded_ids(self, ids: np.ndarray) -> tuple[np.ndarray, int]:
        size = bucket_size(ids.size)
        padded = np.full(size, self.scratch_page, np.int32)
        padded[: ids.size] = ids
        return padded, size

    def write(self, page_ids: Any, kv: KV | KVHost) -> None:
        """Write the KV of ``n`` pages to ``page_ids`` (donated scatter; the pool rebinds).

        Args:
            page_ids: n distinct ids in ``[0, num_pages)`` (any 1-D int sequence).
            kv: ``spec.kv_shape(n)``, in ``spec.dtype`` or ``spec.bits_dtype``; jax or numpy.
                Not consumed: the caller keeps it.

        Raises:
            TypeError / ValueError: bad ids, shape or dtype; raised before dispatch, the pool is
                unchanged.
        """
        ids = self.validate_ids(page_ids)
        check_kv(self.spec, kv, ids.size)
        if ids.size == 0:
            return
        padded, size = self._padded_ids(ids)
        pages: np.ndarray | jax.Array
        if isinstance(kv, np.ndarray):
            # Host data: view as bits for free (one compile per bucket, not per dtype) and pad
            # in the same host copy the transfer to the device makes anyway.
            bits = kv.view(self._bits)
            if size != ids.size:
                buf = np.empty(self.spec.kv_shape(size), self._bits)
                buf[:, :, : ids.size] = bits
                pages = buf  # ours: the device may alias it
            else:
                # The caller's array: on CPU the transfer may alias it (and device_put's copy,
                # even with may_alias=False, may run after the call), and the scatter runs after
                # write() returns, so a caller reusing its buffer would change the pool. A host
                # copy made here is ours alone.
                pages = bits.copy()
        else:
            if size != ids.size:
                pages = _pad_pages(kv, size, self._bits)
            elif (
                self.sharding is not None
                and kv.dtype != self._bits
                and kv.sharding is not self.sharding  # (identity first: the check is slow)
                and not kv.sharding.is_equivalent_to(self.sharding, kv.ndim)
            ):
                # Resharding inside the scatter would move bfloat16 / float16 values, and
                # XLA:CPU canonicalizes NaN payloads when it does: view as bits first.
                pages = _pad_pages(kv, size, self._bits)
            else:
                pages = kv
        self.array = _write_pages(
            self.array, padded, pages, scatter=self._scatter, sharding=self.sharding
        )

    def read(self, page_ids: Any) -> KV:
        """Return the KV of ``page_ids``: ``spec.kv_shape(n)`` in ``spec.jnp_dtype`` (a new array).

        Raises:
            TypeError / ValueError: bad ids (before dispatch).
        """
        return self._read(page_ids, self._dtypes[0])

    def read_bits(self, page_ids: Any) -> KV:
        """Like :meth:`read`, in ``spec.bits_dtype`` (what the host tier stores)."""
        return self._read(page_ids, self._bits)

    def _read(self, page_ids: Any, dtype: np.dtype) -> jax.Array:
        ids = self.validate_ids(page_ids)
        if ids.size == 0:
            return jnp.zeros(self.spec.kv_shape(0), dtype)
        padded, size = self._padded_ids(ids)
        if size == ids.size:
            return _read_pages(
                self.array, padded, gather=self._gather, dtype=dtype, sharding=self.sharding
            )
        bits = _read_pages(
            self.array, padded, gather=self._gather, dtype=self._bits, sharding=self.sharding
        )
        return _take_first(bits, ids.size, dtype)

    def run(self, fn: Callable[..., tuple[jax.Array, Any]], *args: Any) -> Any:
        """Run a caller's jitted step on the pool: ``new_array, out = fn(self.array, *args)``.

        ``fn`` must be jitted with the pool donated (``donate_argnums=0``) and return the pool
        with the same shape, dtype and sharding (e.g. a forward that writes its new KV in place).
        When ``fn`` is a ``jax.jit`` function its output is checked with ``eval_shape`` before
        dispatch, so a mismatching step raises without touching the pool. ``args`` go to ``fn``
        as given: the step runs after ``run`` returns, and on CPU jax may use a numpy argument's
        memory in place, so do not modify numpy arguments until the step is done (pass jax
        arrays, or copies; ``write`` copies its numpy input for this reason).

        Returns:
            ``out``, the step's other result.

        Raises:
            ValueError: the step returns a pool of another shape/dtype (before dispatch when
                checkable), or another sharding, or did not donate the pool. In the last two
                cases the step has run: the pool keeps its result (resharded when needed).
        """
        return self._donated.run(self.array, self._rebind, fn, args)

    def run_with(
        self,
        others: Sequence[DevicePagePool],
        fn: Callable[..., tuple[jax.Array, tuple[jax.Array, ...], Any]],
        *args: Any,
    ) -> Any:
        """A caller's jitted step on this pool and ``others`` at once (a forward over a model
        with window groups writes the full-attention pool and each window group's pool):
        ``new, new_others, out = fn(self.array, tuple(o.array for o in others), *args)``,
        jitted with ``donate_argnums=(0, 1)``; every pool rebinds its new array.

        Returns:
            ``out``.

        Raises:
            ValueError: a returned pool of another shape or dtype (before dispatch when ``fn``
                is a ``jax.jit`` function: nothing changed), or a pool not donated (after the
                step: the pools keep its results).
        """
        pools = (self, *others)
        return run_pools(pools, [p._rebind for p in pools], fn, args)

    def array_ref(self) -> jax.Array:
        """The pool's array (what :func:`~hicache_jax.memory.donated.run_pools` donates)."""
        return self.array

    def _rebind(self, array: jax.Array) -> None:
        self.array = array
