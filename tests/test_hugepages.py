"""Transparent huge pages for CPU pools: the kernel really backs the buffer, content survives."""

from __future__ import annotations

import os
import platform

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from hicache_jax import HiCacheConfig
from hicache_jax.memory.device_pool import DevicePagePool
from hicache_jax.memory.host_pool import HostPagePool
from hicache_jax.memory.hugepages import advise_huge_pages, huge_page_size
from hicache_jax.spec import KVSpec

# 4 layers x 2 x 16 tokens x 8 heads x 64 dims x 2 bytes = 128 KiB per page.
SPEC = KVSpec(num_layers=4, num_kv_heads=8, head_dim=64, dtype="bfloat16", page_size=16)


def _kernel_version() -> tuple[int, ...]:
    parts = platform.release().split("-")[0].split(".")
    return tuple(int(p) for p in parts[:2] if p.isdigit())


# MADV_COLLAPSE is Linux >= 6.1; without it the advice only lets khugepaged act later.
needs_collapse = pytest.mark.skipif(
    not huge_page_size() or _kernel_version() < (6, 1),
    reason="needs Linux >= 6.1 with transparent huge pages enabled",
)


def _check_huge(array: jax.Array, reported: int) -> None:
    """Check ``reported`` (bytes the pool says are on huge pages) against /proc/self/smaps.

    It must be whole huge pages, at least one, within the buffers' whole-huge-page interiors;
    every mapping overlapping an interior must carry the "hg" (MADV_HUGEPAGE) flag, and those
    mappings must hold at least ``reported`` bytes of huge pages. (smaps counts per mapping, and
    madvise splits mappings at the advised range and merges neighbouring advised ranges, so
    per-buffer figures are bounds, not equalities. The kernel may refuse to collapse a page of
    the range -- seen for one page of a buffer in the heap -- so not every interior page is
    required.)
    """
    huge = huge_page_size()
    assert reported >= huge and reported % huge == 0
    interior = huge_bytes = 0
    for shard in array.addressable_shards:
        address = shard.data.unsafe_buffer_pointer()
        start = -(-address // huge) * huge
        end = (address + shard.data.nbytes) // huge * huge
        interior += end - start
        maps = []
        with open(f"/proc/{os.getpid()}/smaps") as f:
            for line in f:
                head = line.split()[0]
                if "-" in head and ":" not in head:
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    maps.append({"overlaps": lo < end and start < hi, "huge": 0, "flags": ""})
                elif line.startswith("AnonHugePages:"):
                    maps[-1]["huge"] = int(line.split()[1]) * 1024
                elif line.startswith("VmFlags:"):
                    maps[-1]["flags"] = line.split()[1:]
        mine = [m for m in maps if m["overlaps"]]
        assert mine and all("hg" in m["flags"] for m in mine), mine
        huge_bytes += sum(m["huge"] for m in mine)
    assert reported <= interior
    assert huge_bytes >= reported


@needs_collapse
def test_device_pool_is_backed_by_huge_pages():
    pool = DevicePagePool(SPEC, 64)  # 8.1 MiB: at least 3 whole 2 MiB pages inside
    _check_huge(pool.array, pool.huge_page_bytes)


@needs_collapse
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_host_pool_is_backed_by_huge_pages(layout):
    pool = HostPagePool(SPEC, 64, layout)
    _check_huge(pool.buffer, pool.huge_page_bytes)


@needs_collapse
def test_collapse_preserves_content_and_donation_keeps_the_buffer():
    rng = np.random.default_rng(0)
    pool = DevicePagePool(SPEC, 64, huge_pages=False)
    assert pool.huge_page_bytes == 0
    ids = rng.permutation(64)[:40]
    bits = rng.integers(0, 1 << 16, size=SPEC.kv_shape(40), dtype=np.uint16)
    pool.write(ids, bits.view(SPEC.jnp_dtype))
    address = pool.array.unsafe_buffer_pointer()
    content = np.asarray(pool.array).copy()
    _check_huge(pool.array, advise_huge_pages(pool.array))
    np.testing.assert_array_equal(np.asarray(pool.array), content)
    # Later donated updates reuse the same (now huge-page) buffer on XLA:CPU.
    pool.write(ids[:3], bits[:, :, :3].view(SPEC.jnp_dtype))
    assert pool.array.unsafe_buffer_pointer() == address
    np.testing.assert_array_equal(np.asarray(pool.read_bits(ids)), bits)


@needs_collapse
def test_sharded_pool_advises_every_shard():
    mesh = Mesh(np.array(jax.devices()[:4]), ("heads",))
    pool = DevicePagePool(SPEC, 256, mesh=mesh, huge_pages=False)  # 8 MiB per shard
    _check_huge(pool.array, advise_huge_pages(pool.array))


def test_small_or_disabled_pools_are_left_alone():
    assert DevicePagePool(SPEC, 4).huge_page_bytes == 0  # 640 KiB: no whole huge page inside
    assert HostPagePool(SPEC, 64, huge_pages=False).huge_page_bytes == 0
    assert DevicePagePool(SPEC, 64, huge_pages=False).huge_page_bytes == 0


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_huge_pages_must_be_a_bool(bad):
    with pytest.raises(TypeError, match="huge_pages"):
        DevicePagePool(SPEC, 4, huge_pages=bad)
    with pytest.raises(TypeError, match="huge_pages"):
        HostPagePool(SPEC, 4, huge_pages=bad)
    with pytest.raises(TypeError, match="huge_pages"):
        HiCacheConfig(device_pages=4, huge_pages=bad)
