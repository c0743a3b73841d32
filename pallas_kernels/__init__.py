"""Pallas page-copy kernels over the device pool layout of hicache_jax (no dependency on it).

Layout::

    pool: bits[num_layers, kv_factor, num_pool_pages, page_size, num_kv_heads, head_dim]
    pages: bits[num_layers, kv_factor, n, page_size, num_kv_heads, head_dim]

with ``bits`` one of uint8/uint16/uint32. Three operations, each with a pure-jnp reference:

* ``scatter_pages(pool, page_ids, pages) -> pool`` (pool aliased in and out: donate it),
* ``scatter_layer_pages(pool, layer, page_ids, layer_pages) -> pool`` (one layer, for
  layer-by-layer loads that overlap with compute),
* ``gather_pages(pool, page_ids) -> pages`` (the staging side of a device-to-host backup).

Implementations (:class:`Impl`), chosen once by the caller (``default_impl`` picks the compiled
one for a device, or the generic interpreter where there is none):

* ``TPU``: HBM-to-HBM DMAs, page ids scalar-prefetched (:mod:`pallas_kernels.tpu`);
* ``MOSAIC_GPU``: TMA bulk copies through an SMEM ring, Hopper or newer (:mod:`pallas_kernels.gpu`);
* ``INTERPRET``: backend-neutral kernels in Pallas' generic interpreter
  (:mod:`pallas_kernels.generic`);
* ``TPU_INTERPRET`` / ``MOSAIC_GPU_INTERPRET``: the device kernels in JAX's TPU / GPU
  interpreters on any platform (tests; the GPU interpreter is a private JAX API).

Zero-copy host-to-device loads (a kernel reading pinned host memory, SGLang's "kernel" IO
backend) are not provided; see ``HOST_KERNEL_NOTE`` for why.
"""

from __future__ import annotations

import enum
from typing import Any

import jax

from pallas_kernels import generic, gpu, tpu
from pallas_kernels.reference import (
    BITS_DTYPES,
    ref_gather_pages,
    ref_scatter_layer_pages,
    ref_scatter_pages,
)

__all__ = [
    "BITS_DTYPES",
    "HOST_KERNEL_NOTE",
    "Impl",
    "compiled_impl",
    "default_impl",
    "gather_pages",
    "interpret_params",
    "ref_gather_pages",
    "ref_scatter_layer_pages",
    "ref_scatter_pages",
    "scatter_layer_pages",
    "scatter_pages",
]


class Impl(str, enum.Enum):
    """Which kernels run, and how."""

    INTERPRET = "interpret"  # generic kernels, generic interpreter
    TPU = "tpu"  # DMA kernels, compiled (TPU only)
    TPU_INTERPRET = "tpu_interpret"  # DMA kernels, TPU interpreter (any platform)
    MOSAIC_GPU = "mosaic_gpu"  # TMA kernels, compiled (sm_90+ only)
    MOSAIC_GPU_INTERPRET = "mosaic_gpu_interpret"  # TMA kernels, GPU interpreter (any platform)


def compiled_impl(device: Any = None) -> Impl | None:
    """The compiled implementation for ``device`` (default: the first device), or None.

    TPUs get the DMA kernels; NVIDIA GPUs of compute capability 9.0 or newer (Hopper, Blackwell)
    the TMA kernels (``cp.async.bulk`` needs sm_90). Everything else has none.
    """
    device = jax.devices()[0] if device is None else device
    if device.platform == "tpu":
        return Impl.TPU
    if device.platform == "gpu" and gpu.plgpu is not None:
        major = str(getattr(device, "compute_capability", "0")).split(".")[0]
        if major.isdigit() and int(major) >= 9:
            return Impl.MOSAIC_GPU
    return None


def default_impl(device: Any = None) -> Impl:
    """``compiled_impl(device)``, else the generic interpreter (correct everywhere, slow)."""
    return compiled_impl(device) or Impl.INTERPRET


def interpret_params(impl: Impl | str) -> Any:
    """The ``interpret=`` argument an implementation passes to its backend module."""
    impl = Impl(impl)
    if impl is Impl.TPU_INTERPRET:
        # Out-of-bounds reads raise and fresh buffers are NaN-filled, so stray reads show.
        return tpu.pltpu.InterpretParams(out_of_bounds_reads="raise", uninitialized_memory="nan")
    if impl is Impl.MOSAIC_GPU_INTERPRET:
        try:
            from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
        except ImportError as e:  # private API: present in jax 0.10/0.11, may move
            raise RuntimeError(f"this jax has no Mosaic GPU interpreter ({e})") from None
        return InterpretGPUParams()
    return None


def _module_and_kwargs(impl: Impl | str | None) -> tuple[Any, dict[str, Any]]:
    impl = default_impl() if impl is None else Impl(impl)
    if impl is Impl.INTERPRET:
        return generic, {}
    if impl in (Impl.TPU, Impl.TPU_INTERPRET):
        return tpu, {"interpret": interpret_params(impl)}
    return gpu, {"interpret": interpret_params(impl)}


def scatter_pages(pool, page_ids, pages, *, impl: Impl | str | None = None):
    """``pool`` with ``pages[:, :, i]`` at page ``page_ids[i]``; pool aliased (donate it).

    Args:
        pool: bits[L, kvf, P, ps, H, D].
        page_ids: int32[n] in [0, P) (range-checked here only when concrete).
        pages: bits[L, kvf, n, ps, H, D], the pool's dtype.
        impl: an :class:`Impl` (default ``default_impl()``).
    """
    module, kwargs = _module_and_kwargs(impl)
    return module.scatter_pages(pool, page_ids, pages, **kwargs)


def scatter_layer_pages(pool, layer, page_ids, layer_pages, *, impl: Impl | str | None = None):
    """``pool`` with ``pool[layer, :, page_ids[i]] = layer_pages[:, i]``; pool aliased.

    Args:
        pool: bits[L, kvf, P, ps, H, D].
        layer: int or int32 scalar (may be traced).
        page_ids: int32[n] in [0, P).
        layer_pages: bits[kvf, n, ps, H, D], the pool's dtype.
        impl: an :class:`Impl` (default ``default_impl()``).
    """
    module, kwargs = _module_and_kwargs(impl)
    return module.scatter_layer_pages(pool, layer, page_ids, layer_pages, **kwargs)


def gather_pages(pool, page_ids, *, impl: Impl | str | None = None):
    """``pool[:, :, page_ids]`` as a new bits[L, kvf, n, ps, H, D] array.

    Args:
        pool: bits[L, kvf, P, ps, H, D] (read only).
        page_ids: int32[n] in [0, P); repeats allowed.
        impl: an :class:`Impl` (default ``default_impl()``).
    """
    module, kwargs = _module_and_kwargs(impl)
    return module.gather_pages(pool, page_ids, **kwargs)


HOST_KERNEL_NOTE = """\
No zero-copy host->device kernel (a kernel reading pinned host memory, SGLang's "kernel" IO
backend). What was found (jax 0.10.2 installed here; jax main of 2026-08 read for 0.11):
* Mosaic GPU: memory spaces are GMEM, SMEM, TMEM, REGS (jax/_src/pallas/mosaic_gpu/core.py);
  there is no host space and no API maps pinned host memory into a kernel's address space. A
  "pinned_host" jax.Array passed to the kernel: in the GPU interpreter it becomes a Host-space
  Ref that the TMA copies reject ("src must be a GMEM reference", _check_ref in
  jax/_src/pallas/mosaic_gpu/primitives.py, same at jax main); compiled, it lowers (for CUDA,
  checked here) as a plain operand of the mosaic_gpu custom call. What XLA:GPU then does (refuse
  it, copy the whole host pool to the device, or hand the kernel a host pointer) needs a GPU to
  tell: benchmarks/gpu_kernels.py (host_operand_probe) records it, a gather of 16 pages that
  takes about as long as a device_put of the whole pool meaning a copy. Not measured yet.
* Pallas TPU: pl.HOST operands do lower (#tpu.memory_space<host>; a pinned_host pool DMA'd
  straight into the pool lowers for TPU here), but the TPU interpreter cannot run a pinned_host
  operand in jax 0.10.2 (lowering fails in mlir.lower_jaxpr_to_fun, safe_zip of memory kinds),
  so such a kernel could not be tested on CPU; and tpu-inference moved its host offload from
  Pallas DMA kernels back to jax.device_put after crashes on TPU
  (/work/shared/notes/transfer-paths.md). Not shipped untested.
Host->device loads therefore stay on jax.device_put of pinned_host rows plus scatter_pages.
"""
