"""KVSpec and HiCacheConfig: validation naming the field, dtypes, MLA, enum resolution."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from helpers import BITS
from hicache_jax.spec import (
    SUPPORTED_DTYPES,
    CopyBackend,
    HiCacheConfig,
    HostLayout,
    KVSpec,
    PrefetchPolicy,
    WritePolicy,
)
from hicache_jax.tree.eviction import EvictionPolicy


def test_supported_dtypes():
    assert set(SUPPORTED_DTYPES) == set(BITS)


@pytest.mark.parametrize("dtype", sorted(BITS))
def test_every_dtype(dtype):
    spec = KVSpec(num_layers=4, num_kv_heads=8, head_dim=128, dtype=dtype, page_size=16)
    assert spec.jnp_dtype == jnp.dtype(dtype)
    assert spec.bits_dtype == np.dtype(BITS[dtype])
    assert spec.itemsize == spec.jnp_dtype.itemsize == spec.bits_dtype.itemsize
    assert spec.kv_factor == 2
    assert spec.kv_shape(3) == (4, 2, 3, 16, 8, 128)
    assert spec.page_major_shape(3) == (3, 4, 2, 16, 8, 128)
    assert spec.page_elems == 4 * 2 * 16 * 8 * 128
    assert spec.page_bytes == spec.page_elems * spec.itemsize
    assert spec.chunk_bytes == 16 * 8 * 128 * spec.itemsize
    assert spec.page_bytes == spec.chunk_bytes * 4 * 2


@pytest.mark.parametrize(
    "dtype, name",
    [
        (jnp.bfloat16, "bfloat16"),
        (np.float16, "float16"),
        (np.dtype("float32"), "float32"),
        (jnp.float8_e4m3fn, "float8_e4m3fn"),
        (np.int8, "int8"),
    ],
)
def test_dtype_objects_are_normalised(dtype, name):
    assert KVSpec(1, 1, 1, dtype=dtype).dtype == name


def test_mla():
    spec = KVSpec(num_layers=2, num_kv_heads=1, head_dim=576, page_size=64, mla=True)
    assert spec.kv_factor == 1
    assert spec.kv_shape(5) == (2, 1, 5, 64, 1, 576)
    assert spec.page_bytes == 2 * 64 * 576 * 2
    with pytest.raises(ValueError, match="mla=True needs num_kv_heads=1"):
        KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, mla=True)
    with pytest.raises(TypeError, match="mla=1 must be a bool"):
        KVSpec(num_layers=2, num_kv_heads=1, head_dim=8, mla=1)


@pytest.mark.parametrize("field", ["num_layers", "num_kv_heads", "head_dim", "page_size"])
@pytest.mark.parametrize(
    "value, err",
    [
        (0, ValueError),
        (-3, ValueError),
        (True, TypeError),
        (2.0, TypeError),
        ("4", TypeError),
        (None, TypeError),
    ],
)
def test_kvspec_int_fields(field, value, err):
    kw = dict(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4)
    kw[field] = value
    with pytest.raises(err, match=f"^{field}="):
        KVSpec(**kw)


def test_kvspec_accepts_numpy_ints():
    spec = KVSpec(np.int64(2), np.int32(2), np.int16(8), page_size=np.uint8(4))
    assert spec.kv_shape(1) == (2, 2, 1, 4, 2, 8)
    # stored as Python ints (a uint8 page size would overflow arithmetic on it)
    assert all(
        type(getattr(spec, f)) is int
        for f in ("num_layers", "num_kv_heads", "head_dim", "page_size")
    )
    assert spec.page_bytes == KVSpec(2, 2, 8, page_size=4).page_bytes
    cfg = HiCacheConfig(
        device_pages=np.int64(8),
        host_pages=np.uint16(16),
        load_back_threshold=np.int8(4),
        load_back_quota=np.int32(64),
    )
    assert all(
        type(getattr(cfg, f)) is int
        for f in (
            "device_pages",
            "host_pages",
            "write_through_threshold",
            "load_back_threshold",
            "load_back_quota",
        )
    )


@pytest.mark.parametrize("dtype", ["float64", "uint16", "fp8", "bf16", "float8_e5m2", 5])
def test_kvspec_bad_dtype_names_the_field(dtype):
    with pytest.raises((ValueError, TypeError), match=r"^dtype="):
        KVSpec(1, 1, 1, dtype=dtype)


def test_kvspec_frozen_hashable_and_fingerprint():
    a = KVSpec(4, 8, 128)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.page_size = 32
    assert a == KVSpec(4, 8, 128, "bfloat16", 16) and hash(a) == hash(KVSpec(4, 8, 128))
    fp = a.fingerprint()
    assert fp == KVSpec(4, 8, 128, dtype=jnp.bfloat16).fingerprint() and len(fp) == 16
    others = [
        KVSpec(5, 8, 128),
        KVSpec(4, 4, 128),
        KVSpec(4, 8, 64),
        KVSpec(4, 8, 128, "float16"),
        KVSpec(4, 8, 128, page_size=32),
        KVSpec(4, 1, 128, mla=True),
        KVSpec(4, 1, 128),
    ]
    assert len({fp, *(o.fingerprint() for o in others)}) == len(others) + 1


def test_config_defaults_and_enums():
    cfg = HiCacheConfig(device_pages=100)
    assert cfg.host_pages == 400
    assert cfg.write_policy is WritePolicy.CLEAN_AHEAD and cfg.write_through_threshold == 1
    assert cfg.clean_ahead_pages is None  # auto: follows the largest allocation
    assert cfg.eviction is EvictionPolicy.LRU
    assert cfg.host_layout is HostLayout.LAYER_FIRST
    assert cfg.copy_backend is CopyBackend.AUTO
    assert cfg.prefetch_policy is PrefetchPolicy.BEST_EFFORT
    assert cfg.storage_write_policy is WritePolicy.WRITE_THROUGH
    assert cfg.write_policy == "clean_ahead"  # str enums still compare to their strings


@pytest.mark.parametrize(
    "field, value, member",
    [
        ("write_policy", "write_back", WritePolicy.WRITE_BACK),
        ("write_policy", WritePolicy.WRITE_THROUGH_SELECTIVE, WritePolicy.WRITE_THROUGH_SELECTIVE),
        ("eviction", "slru", EvictionPolicy.SLRU),
        ("eviction", "priority", EvictionPolicy.PRIORITY),
        ("host_layout", "page_first", HostLayout.PAGE_FIRST),
        ("copy_backend", "pallas", CopyBackend.PALLAS),
        ("prefetch_policy", "timeout", PrefetchPolicy.TIMEOUT),
        ("storage_write_policy", "write_back", WritePolicy.WRITE_BACK),
    ],
)
def test_config_enum_fields_resolved_once(field, value, member):
    cfg = HiCacheConfig(device_pages=8, **{field: value})
    assert getattr(cfg, field) is member


@pytest.mark.parametrize(
    "field",
    [
        "write_policy",
        "eviction",
        "host_layout",
        "copy_backend",
        "prefetch_policy",
        "storage_write_policy",
    ],
)
def test_config_bad_enum_names_field_and_choices(field):
    with pytest.raises(ValueError, match=f"^{field}='nope' is not one of: .*'?[a-z_]+'?"):
        HiCacheConfig(device_pages=8, **{field: "nope"})


def test_config_write_through_threshold_defaults():
    assert HiCacheConfig(8, write_policy="write_through_selective").write_through_threshold == 2
    assert HiCacheConfig(8, write_policy="write_back").write_through_threshold == 1
    assert HiCacheConfig(8, write_through_threshold=5).write_through_threshold == 5


def test_config_host_pages():
    assert HiCacheConfig(10, host_ratio=2.5).host_pages == 25
    assert HiCacheConfig(10, host_pages=7, host_ratio=100).host_pages == 7
    assert HiCacheConfig(10, host_pages=0).host_pages == 0
    assert HiCacheConfig(10, host_ratio=0).host_pages == 0


@pytest.mark.parametrize(
    "kw, err, match",
    [
        (dict(device_pages=0), ValueError, "^device_pages=0"),
        (dict(device_pages=1.5), TypeError, "^device_pages="),
        (dict(device_pages=4, host_pages=-1), ValueError, "^host_pages=-1"),
        (dict(device_pages=4, host_pages=True), TypeError, "^host_pages="),
        (dict(device_pages=4, host_ratio=-1.0), ValueError, "^host_ratio="),
        (dict(device_pages=4, host_ratio="4"), ValueError, "^host_ratio="),
        (dict(device_pages=4, host_ratio=True), ValueError, "^host_ratio="),
        (dict(device_pages=4, host_ratio=float("nan")), ValueError, "^host_ratio="),
        (dict(device_pages=4, host_ratio=float("inf")), ValueError, "^host_ratio="),
        (dict(device_pages=4, write_through_threshold=0), ValueError, "^write_through_threshold=0"),
        (dict(device_pages=4, load_back_threshold=-1), ValueError, "^load_back_threshold=-1"),
        (dict(device_pages=4, load_back_quota=-2), ValueError, "^load_back_quota=-2"),
        (dict(device_pages=4, load_back_quota=1.0), TypeError, "^load_back_quota="),
        (dict(device_pages=4, storage=3), TypeError, "^storage=3"),
        (dict(device_pages=4, prefetch_timeout_s=0), ValueError, "^prefetch_timeout_s=0"),
        (dict(device_pages=4, prefetch_timeout_s="1"), ValueError, "^prefetch_timeout_s="),
        (dict(device_pages=4, prefetch_timeout_s=float("nan")), ValueError, "^prefetch_timeout_s="),
        (
            dict(device_pages=4, shard_axis="tp"),
            ValueError,
            "^shard_axis='tp' given without a mesh",
        ),
    ],
)
def test_config_validation_names_the_field(kw, err, match):
    with pytest.raises(err, match=match):
        HiCacheConfig(**kw)


def test_config_mesh_axis():
    mesh = jax.make_mesh((2, 2), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)
    assert HiCacheConfig(4, mesh=mesh).shard_axis == "dp"
    assert HiCacheConfig(4, mesh=mesh, shard_axis="tp").shard_axis == "tp"
    with pytest.raises(
        ValueError, match=r"^shard_axis='x' is not an axis of the mesh \('dp', 'tp'\)"
    ):
        HiCacheConfig(4, mesh=mesh, shard_axis="x")


def test_config_frozen():
    cfg = HiCacheConfig(4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.device_pages = 5


# ------------------------------------------------------------------------- KVSpec.parse (--spec)

LLAMA = KVSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", page_size=16)
TINY = KVSpec(num_layers=1, num_kv_heads=1, head_dim=1, dtype="float32")


def test_parse_fills_missing_keys_from_the_default():
    assert KVSpec.parse(None, LLAMA) == LLAMA
    assert KVSpec.parse("", LLAMA) == LLAMA
    spec = KVSpec.parse(" layers = 2 ,head_dim=64,,dtype=float16,page_size=4", LLAMA)
    assert spec == dataclasses.replace(
        LLAMA, num_layers=2, head_dim=64, dtype="float16", page_size=4
    )
    mla = KVSpec.parse("kv_heads=1,mla=yes", LLAMA)
    assert mla.mla and mla.num_kv_heads == 1
    assert KVSpec.parse("mla=0", LLAMA).mla is False


def test_parse_with_the_page_size_set_by_the_caller():
    assert KVSpec.parse(None, TINY, page_size=512) == dataclasses.replace(TINY, page_size=512)
    assert KVSpec.parse("layers=3", TINY, page_size=8).page_size == 8
    with pytest.raises(ValueError, match=r"key one of layers, kv_heads, head_dim, dtype, mla$"):
        KVSpec.parse("page_size=4", TINY, page_size=8)  # not a key then


@pytest.mark.parametrize(
    "text, match",
    [
        (
            "heads=8",
            (
                r"--spec item 'heads=8': expected key=value with key one of layers, kv_heads, "
                r"head_dim, dtype, page_size, mla"
            ),
        ),
        ("layers", r"--spec item 'layers': expected key=value"),
        ("layers=x", r"--spec 'layers=x': 'x' is not an int"),
        ("page_size=1.5", r"--spec 'page_size=1.5': '1.5' is not an int"),
        ("layers=0", r"num_layers"),
        ("dtype=float64", r"dtype='float64'"),
        ("mla=1", r"mla=True needs num_kv_heads=1"),
    ],
)
def test_parse_bad_field_names_it(text, match):
    with pytest.raises(ValueError, match=match):
        KVSpec.parse(text, LLAMA)


def test_parse_names_the_flag():
    with pytest.raises(ValueError, match=r"^--model-spec item 'x=1'"):
        KVSpec.parse("x=1", TINY, page_size=1, flag="--model-spec")


# ------------------------------------------------------------------------- fingerprints pinned


@pytest.mark.parametrize(
    "spec, fingerprint",
    [
        (KVSpec(32, 8, 128), "60aa4ee70c250121"),
        (KVSpec(1, 1, 1, dtype="float32", page_size=4), "e3eb5ea8c94f55f4"),
        (KVSpec(61, 1, 576, page_size=64, mla=True), "c573b2d4cfdc9e5d"),
        (KVSpec(4, 8, 64, shard="2:4/8"), "e06427d7148b7a8d"),
    ],
)
def test_fingerprint_is_pinned(spec, fingerprint):
    """L3 keys carry the fingerprint: a store written before a change to KVSpec must stay
    readable, so a plain spec's fingerprint never changes (values computed at the commit
    before layer groups)."""
    assert spec.fingerprint() == fingerprint
