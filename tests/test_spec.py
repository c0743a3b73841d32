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
    GroupKind,
    HiCacheConfig,
    HostLayout,
    KVSpec,
    LayerGroup,
    PrefetchPolicy,
    StateArray,
    WritePolicy,
    parse_pattern,
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
    assert cfg.eviction is None  # the cache's default for its spec (lru, value with states)
    assert HiCacheConfig(device_pages=100, eviction="default").eviction is None
    assert HiCacheConfig(device_pages=100, eviction="value").eviction is EvictionPolicy.VALUE
    assert cfg.checkpoint_every_pages is None and cfg.checkpoint_tail_pages == 4
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


# ------------------------------------------------------------------------- layer groups


def _g(kind, layers, **kw):
    kw.setdefault("num_kv_heads", 8)
    kw.setdefault("head_dim", 128)
    return LayerGroup(kind, layers, **kw)


GEMMA = KVSpec.from_pattern("5:1", num_layers=12, num_kv_heads=8, head_dim=128, window=1024)


def test_a_plain_spec_has_no_groups():
    spec = KVSpec(32, 8, 128)
    assert spec.groups == () and spec.window_groups == ()
    assert spec.total_layers == 32 and spec.model_page_bytes == spec.page_bytes
    assert spec.full_group == LayerGroup("full", range(32), 8, 128)
    assert spec.full_group.spec(16) == spec
    assert KVSpec(4, 1, 576, mla=True).full_group.mla is True


def test_from_pattern_5_1_over_12_layers():
    assert [g.kind for g in GEMMA.groups] == [GroupKind.WINDOW, GroupKind.FULL]
    (win,) = GEMMA.window_groups
    assert win.layers == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10) and win.window == 1024
    assert win.chunk is None
    assert GEMMA.full_group.layers == (5, 11)
    assert (GEMMA.num_layers, GEMMA.total_layers) == (2, 12)
    assert GEMMA.kv_shape(3) == (2, 2, 3, 16, 8, 128)  # the pools hold the full group's pages
    assert GEMMA.model_page_bytes == 6 * GEMMA.page_bytes


def test_from_pattern_cut_short_and_chunked():
    spec = KVSpec.from_pattern("5:1", num_layers=8, num_kv_heads=4, head_dim=64, window=512)
    assert spec.window_groups[0].layers == (0, 1, 2, 3, 4, 6, 7)
    assert spec.full_group.layers == (5,)
    llama4 = KVSpec.from_pattern(
        "3:1", num_layers=8, num_kv_heads=8, head_dim=128, chunk=8192, dtype="float16"
    )
    (local,) = llama4.window_groups
    assert local.kind is GroupKind.CHUNK and local.chunk == 8192 and local.window is None
    assert local.layers == (0, 1, 2, 4, 5, 6) and llama4.full_group.layers == (3, 7)
    assert llama4.dtype == local.dtype == "float16"


@pytest.mark.parametrize("pattern", ["0:1", "", "full", " FULL ", "0:3"])
def test_an_all_full_pattern_is_the_plain_spec(pattern):
    spec = KVSpec.from_pattern(pattern, num_layers=6, num_kv_heads=8, head_dim=128)
    assert spec == KVSpec(6, 8, 128) and spec.groups == ()
    assert spec.fingerprint() == KVSpec(6, 8, 128).fingerprint()


def test_from_groups_fills_the_top_level_fields():
    spec = KVSpec.from_groups(
        [
            _g("window", [1, 3], window=4, num_kv_heads=2, head_dim=32, dtype="float32"),
            _g("full", (2, 0), num_kv_heads=1, head_dim=64, mla=True),
        ],
        page_size=8,
        shard="",
    )
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.mla) == (2, 1, 64, True)
    assert spec.page_size == 8 and spec.total_layers == 4
    assert [g.layers for g in spec.groups] == [(0, 2), (1, 3)]  # by first layer
    assert isinstance(spec.groups, tuple)
    win = spec.window_groups[0]
    assert spec.model_page_bytes == spec.page_bytes + win.spec(8).page_bytes
    assert win.spec(8) == KVSpec(2, 2, 32, dtype="float32", page_size=8)
    assert spec == KVSpec(2, 1, 64, page_size=8, mla=True, groups=list(spec.groups))


def test_model_page_bytes_is_the_sum_over_groups():
    spec = KVSpec.from_groups(
        [
            _g("full", [0, 3]),
            _g("window", [1], window=16, num_kv_heads=4, dtype="float8_e4m3fn"),
            _g("window", [2, 4], window=32, head_dim=64),
        ]
    )
    assert spec.model_page_bytes == sum(g.spec(16).page_bytes for g in spec.groups)
    assert spec.model_page_bytes == 16 * (
        2 * 2 * 8 * 128 * 2 + 1 * 2 * 4 * 128 + 2 * 2 * 8 * 64 * 2
    )


def test_one_full_group_over_every_layer_is_the_plain_spec():
    spec = KVSpec.from_groups([_g("full", range(4), page_size=16)])
    assert spec == KVSpec(4, 8, 128) and spec.groups == ()
    assert spec.fingerprint() == KVSpec(4, 8, 128).fingerprint()
    assert KVSpec(4, 8, 128, groups=[_g(GroupKind.FULL, [0, 1, 2, 3])]) == KVSpec(4, 8, 128)


@pytest.mark.parametrize(
    "kind, n, start",
    [
        ("full", 0, 0),
        ("full", 1000, 0),
        ("window", 0, 0),
        ("window", 100, 0),
        ("window", 128, 0),
        ("window", 129, 1),
        ("window", 1000, 872),
        ("chunk", 0, 0),
        ("chunk", 99, 0),
        ("chunk", 100, 100),
        ("chunk", 250, 200),
    ],
)
def test_need_start(kind, n, start):
    extra = {"window": {"window": 128}, "chunk": {"chunk": 100}}.get(kind, {})
    assert _g(kind, [0], **extra).need_start(n) == start


def test_need_start_checks_n():
    with pytest.raises(ValueError, match=r"^n=-1"):
        _g("full", [0]).need_start(-1)
    with pytest.raises(TypeError, match=r"^n=1.5"):
        _g("window", [0], window=2).need_start(1.5)


def test_groups_change_the_fingerprint():
    fps = {
        GEMMA.fingerprint(),
        KVSpec(2, 8, 128).fingerprint(),
        KVSpec.from_pattern(
            "5:1", num_layers=12, num_kv_heads=8, head_dim=128, window=512
        ).fingerprint(),
        KVSpec.from_pattern(
            "5:1", num_layers=12, num_kv_heads=8, head_dim=128, chunk=1024
        ).fingerprint(),
        KVSpec.from_pattern(
            "4:2", num_layers=12, num_kv_heads=8, head_dim=128, window=1024
        ).fingerprint(),
        KVSpec.from_groups(
            [
                _g("full", [5, 11]),
                _g("window", [0, 1, 2, 3, 4, 6, 7, 8, 9, 10], window=1024, head_dim=64),
            ]
        ).fingerprint(),
    }
    assert len(fps) == 6
    same = KVSpec.from_groups(
        [_g("full", [11, 5]), _g("window", [10, 9, 8, 7, 6, 4, 3, 2, 1, 0], window=1024)]
    )
    assert same == GEMMA and same.fingerprint() == GEMMA.fingerprint() and hash(same) == hash(GEMMA)


@pytest.mark.parametrize(
    "kw, error, match",
    [
        (
            {"kind": "sliding"},
            ValueError,
            r"^kind='sliding' is not one of: 'full', 'window', 'chunk'",
        ),
        ({"layers": [0, 1, 0]}, ValueError, r"^layers=\(0, 1, 0\) has duplicate layer\(s\) \[0\]"),
        ({"layers": []}, ValueError, r"^layers="),
        ({"layers": "01"}, TypeError, r"^layers='01'"),
        ({"layers": [0, -1]}, ValueError, r"^layers\[1\]=-1"),
        ({"layers": [0, True]}, TypeError, r"^layers\[1\]=True"),
        ({"num_kv_heads": 0}, ValueError, r"^num_kv_heads=0"),
        ({"head_dim": 2.0}, TypeError, r"^head_dim=2.0"),
        ({"dtype": "float64"}, ValueError, r"^dtype='float64'"),
        ({"kind": "window", "window": 0}, ValueError, r"^window=0 must be a positive int"),
        ({"kind": "window", "window": -1}, ValueError, r"^window=-1 must be a positive int"),
        ({"kind": "window", "window": 1.5}, TypeError, r"^window=1.5 must be a positive int"),
        ({"kind": "window", "window": True}, TypeError, r"^window=True must be a positive int"),
        ({"kind": "window"}, TypeError, r"^window=None must be a positive int"),
        ({"kind": "chunk"}, TypeError, r"^chunk=None must be a positive int"),
        ({"kind": "chunk", "chunk": 0}, ValueError, r"^chunk=0 must be a positive int"),
        ({"window": 4}, ValueError, r"^window=4 must be None for a 'full' group"),
        ({"kind": "window", "window": 4, "chunk": 4}, ValueError, r"^chunk=4 must be None"),
        ({"kind": "chunk", "chunk": 4, "window": 4}, ValueError, r"^window=4 must be None"),
        ({"mla": 1}, TypeError, r"^mla=1 must be a bool"),
        ({"mla": True}, ValueError, r"^mla=True needs num_kv_heads=1"),
        (
            {"kind": "window", "window": 4, "mla": True, "num_kv_heads": 1},
            ValueError,
            r"^mla=True is for full groups only",
        ),
        ({"page_size": 0}, ValueError, r"^page_size=0 must be a positive int"),
    ],
)
def test_a_bad_group_names_the_field(kw, error, match):
    fields = {"kind": "full", "layers": [0, 1], "num_kv_heads": 8, "head_dim": 128} | kw
    with pytest.raises(error, match=match):
        LayerGroup(**fields)
    # the same group inside a spec: prefixed by groups[i].
    bad = fields | {"layers": [1, 2]} if "layers" not in kw else fields
    other = {"kind": "window", "layers": [0], "num_kv_heads": 8, "head_dim": 128, "window": 2}
    if fields["kind"] != "full":
        other = {"kind": "full", "layers": [0], "num_kv_heads": 8, "head_dim": 128}
    prefixed = "^groups\\[1\\]\\." + match.lstrip("^")
    with pytest.raises(error, match=prefixed):
        KVSpec.from_groups([other, bad])
    with pytest.raises(error, match=prefixed):
        KVSpec(1, 8, 128, groups=[other, bad])


def test_the_group_kinds_are_str_enums():
    assert GroupKind("window") is GroupKind.WINDOW and GroupKind.CHUNK == "chunk"
    assert _g("chunk", [0], chunk=3).kind is GroupKind.CHUNK
    assert _g(GroupKind.FULL, (3, 1, 2)).layers == (1, 2, 3)


@pytest.mark.parametrize(
    "groups, error, match",
    [
        (
            [_g("full", [0]), _g("window", [1], window=4, page_size=8)],
            ValueError,
            r"^groups\[1\]\.page_size=8 differs from page_size=16",
        ),
        (
            [_g("full", [0, 1]), _g("window", [1, 2], window=4)],
            ValueError,
            r"^groups: layer 1 is in both groups\[0\] and groups\[1\]",
        ),
        (
            [_g("full", [0, 1]), _g("window", [3], window=4)],
            ValueError,
            r"^groups: layer 2 is in no group .*beyond: \[3\]",
        ),
        (
            [_g("full", [0]), _g("full", [1])],
            ValueError,
            r"^groups \(kinds \['full', 'full'\]\) needs exactly one full-attention group",
        ),
        (
            [_g("window", [0], window=4), _g("chunk", [1], chunk=4)],
            ValueError,
            r"^groups \(kinds \['window', 'chunk'\]\) needs exactly one full-attention group",
        ),
        ("full", TypeError, r"^groups='full' must be a sequence of LayerGroup"),
        ([_g("full", [0]), 3], TypeError, r"^groups\[1\]=3 must be a LayerGroup or a dict"),
        (
            [_g("full", [0]), {"kind": "window", "layers": [1], "num_kv_heads": 8}],
            ValueError,
            r"^groups\[1\] lacks field\(s\) \['head_dim'\]",
        ),
        (
            [{"kind": "full", "layers": [0], "num_kv_heads": 8, "head_dim": 128, "heads": 2}],
            ValueError,
            r"^groups\[0\] has unknown field\(s\) \['heads'\]",
        ),
    ],
)
def test_a_bad_group_set_names_the_field(groups, error, match):
    with pytest.raises(error, match=match):
        KVSpec.from_groups(groups)
    with pytest.raises(error, match=match):
        KVSpec(1, 8, 128, groups=groups)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"num_layers": 3}, r"^num_layers=3 differs from the full group's \(groups\[1\]: 2\)"),
        ({"num_kv_heads": 4}, r"^num_kv_heads=4 differs from the full group's"),
        ({"head_dim": 64}, r"^head_dim=64 differs from the full group's"),
        ({"dtype": "float16"}, r"^dtype='float16' differs from the full group's"),
        ({"num_kv_heads": 1, "mla": True}, r"^num_kv_heads=1 differs from the full group's"),
    ],
)
def test_the_top_level_fields_must_match_the_full_group(kw, match):
    fields = {"num_layers": 2, "num_kv_heads": 8, "head_dim": 128} | kw
    with pytest.raises(ValueError, match=match):
        KVSpec(**fields, groups=GEMMA.groups)


def test_the_top_level_mla_must_match_the_full_group():
    mla = KVSpec.from_groups(
        [_g("full", [0], num_kv_heads=1, mla=True), _g("window", [1], window=2)]
    )
    with pytest.raises(ValueError, match=r"^mla=False differs from the full group's"):
        KVSpec(1, 1, 128, groups=mla.groups)


def test_a_group_spec_page_size_must_agree():
    g = _g("window", [0], window=2, page_size=8)
    assert g.spec(8).page_size == 8
    with pytest.raises(ValueError, match=r"^page_size=16 differs from the group's 8"):
        g.spec(16)


@pytest.mark.parametrize(
    "pattern, kw, error, match",
    [
        (5, {"window": 4}, TypeError, r"^pattern=5 must be a str"),
        ("5", {"window": 4}, ValueError, r"^pattern='5' must be 'a:b'"),
        ("5:1:2", {"window": 4}, ValueError, r"^pattern='5:1:2' must be 'a:b'"),
        ("-1:1", {"window": 4}, ValueError, r"^pattern='-1:1' must be 'a:b'"),
        ("a:1", {"window": 4}, ValueError, r"^pattern='a:1' must be 'a:b'"),
        ("0:0", {}, ValueError, r"^pattern='0:0' has no layers"),
        ("1:0", {"window": 4}, ValueError, r"^pattern='1:0' over num_layers=6 leaves no full"),
        ("6:1", {"window": 4}, ValueError, r"^pattern='6:1' over num_layers=6 leaves no full"),
        ("5:1", {}, ValueError, r"^pattern='5:1' has local layers: give window="),
        ("5:1", {"window": 4, "chunk": 4}, ValueError, r"^window=4 and chunk=4: give one"),
        ("0:1", {"window": 4}, ValueError, r"^window=4 given, but pattern='0:1'"),
        ("full", {"chunk": 4}, ValueError, r"^chunk=4 given, but pattern='full'"),
        ("5:1", {"window": 0}, ValueError, r"^window=0 must be a positive int"),
        ("5:1", {"window": True}, TypeError, r"^window=True must be a positive int"),
        ("5:1", {"chunk": 1.5}, TypeError, r"^chunk=1.5 must be a positive int"),
        ("5:1", {"window": 4, "mla": True}, ValueError, r"^mla=True: only the full layers"),
        ("5:1", {"window": 4, "num_layers": 0}, ValueError, r"^num_layers=0"),
        ("5:1", {"window": 4, "page_size": 0}, ValueError, r"^page_size=0"),
    ],
)
def test_from_pattern_bad_input_names_the_field(pattern, kw, error, match):
    fields = {"num_layers": 6, "num_kv_heads": 8, "head_dim": 128} | kw
    with pytest.raises(error, match=match):
        KVSpec.from_pattern(pattern, **fields)


@pytest.mark.parametrize(
    "pattern, runs",
    [
        ("5:1", (("s", 5), ("f", 1))),
        ("S5:F1", (("s", 5), ("f", 1))),
        ("R3:F1", (("r", 3), ("f", 1))),
        (" r2 : S1 : f1 ", (("r", 2), ("s", 1), ("f", 1))),
        ("F1:S2:R1", (("f", 1), ("s", 2), ("r", 1))),
        ("full", (("f", 1),)),
        ("", (("f", 1),)),
    ],
)
def test_parse_pattern_runs_in_layer_order(pattern, runs):
    assert parse_pattern(pattern) == runs


@pytest.mark.parametrize("pattern", ["R3", "R1:R2:F1", "R1:S1:F1:F1", "R3:1", "3:F1", "x1:f1"])
def test_parse_pattern_refuses_a_bad_pattern(pattern):
    with pytest.raises(ValueError, match=rf"^layer_pattern={pattern!r} must be 'a:b'"):
        parse_pattern(pattern, "layer_pattern")


def test_from_pattern_three_kinds():
    state = [StateArray("conv", (3, 4)), StateArray("ssm", (2, 4, 4))]
    kw = {"num_kv_heads": 2, "head_dim": 8, "window": 64, "state": state}
    spec = KVSpec.from_pattern("R2:S1:F1", num_layers=10, **kw)
    by_kind = {GroupKind(g.kind): g.layers for g in spec.groups}
    assert by_kind == {
        GroupKind.STATE: (0, 1, 4, 5, 8, 9),
        GroupKind.WINDOW: (2, 6),
        GroupKind.FULL: (3, 7),
    }
    (s,) = spec.state_groups
    assert spec.window_groups[s].state == tuple(state)
    # the attention layers' pages only: a checkpoint's bytes are state_bytes
    assert spec.model_page_bytes == 2 * spec.page_bytes
    assert spec.state_bytes == 6 * (3 * 4 + 2 * 4 * 4) * 4
    # letters in any order lay the period out as written
    other = KVSpec.from_pattern("F1:S1:R2", num_layers=4, **kw)
    assert {GroupKind(g.kind): g.layers for g in other.groups}[GroupKind.FULL] == (0,)
    # a two-kind pattern in letters is the two-kind spec
    gemma = KVSpec.from_pattern("S5:F1", num_layers=12, num_kv_heads=8, head_dim=128, window=1024)
    assert gemma == GEMMA


@pytest.mark.parametrize(
    "pattern, kw, match",
    [
        ("R2:S1:F1", {"window": 4}, r"^pattern='R2:S1:F1' has recurrent layers: give state="),
        ("R2:S1:F1", {"state": [("s", (4,))]}, r"^pattern='R2:S1:F1' has local layers: give"),
        ("R2:S1", {"window": 4, "state": [("s", (4,))]}, r"leaves no full-attention layer"),
        ("F1:S1:R2", {"window": 4, "state": [("s", (4,))], "num_layers": 2}, r"no recurrent"),
        ("R2:S1:F1", {"window": 4, "state": [("s", (4,))], "mla": True}, r"^mla=True"),
        ("S1:F1", {"window": 4, "state": [("s", (4,))]}, r"^state= is for a recurrent"),
    ],
)
def test_from_pattern_three_kinds_bad_input_names_the_field(pattern, kw, match):
    fields = {"num_layers": 8, "num_kv_heads": 2, "head_dim": 8} | kw
    with pytest.raises(ValueError, match=match):
        KVSpec.from_pattern(pattern, **fields)


def test_parse_keeps_the_groups():
    spec = KVSpec.parse("page_size=4", GEMMA)
    assert spec.groups == GEMMA.groups and spec.page_size == 4
    assert all(isinstance(g, LayerGroup) for g in spec.groups)
    assert KVSpec.parse(None, GEMMA) == GEMMA
    with pytest.raises(ValueError, match=r"^num_kv_heads=4 differs from the full group's"):
        KVSpec.parse("kv_heads=4", GEMMA)


def test_as_json_and_describe():
    import json

    data = json.loads(json.dumps(GEMMA.as_json()))
    assert data["num_layers"] == 2 and data["groups"][0]["kind"] == "window"
    assert data["groups"][1] == {
        "kind": "full",
        "layers": [5, 11],
        "num_kv_heads": 8,
        "head_dim": 128,
        "dtype": "bfloat16",
        "window": None,
        "chunk": None,
        "mla": False,
        "page_size": None,
    }
    assert KVSpec(1, 1, 1).as_json()["groups"] == []
    assert GEMMA.describe_groups() == (
        "window(1024) layers 0-4,6-10: 8x128 bfloat16; full layers 5,11: 8x128 bfloat16"
    )
    assert KVSpec(1, 1, 1).describe_groups() == "()"


def test_shard_spec_of_a_grouped_spec_gives_its_full_group_the_shard():
    """A process's share of a grouped spec's heads: the top level and the full group both hold
    them (they describe the same pages), the other groups are left to their own pools, and the
    fingerprint names the shard; all heads give the spec back."""
    from hicache_jax.memory.placement import shard_spec

    spec = KVSpec.from_pattern(
        "2:1", num_layers=3, num_kv_heads=4, head_dim=8, page_size=4, window=8
    )
    half = shard_spec(spec, slice(2, 4))
    assert half.num_kv_heads == half.full_group.num_kv_heads == 2
    assert half.window_groups[0].num_kv_heads == 4 and half.shard == "2:4/4"
    assert half.fingerprint() != spec.fingerprint()
    assert shard_spec(spec, slice(0, 4)) is spec
