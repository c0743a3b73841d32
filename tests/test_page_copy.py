"""The page copy core on its own: plan packing, layer plans, copies between layouts."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from hicache_jax.memory.page_copy import (
    MIN_INDEX_LEN,
    PLAN_DST,
    PLAN_META,
    PLAN_SRC,
    UNROLL,
    bucket_size,
    copy_fn,
    copy_plan,
    gather_pages,
    index_len,
    layer_plans,
)
from hicache_jax.spec import HostLayout, KVSpec

SPEC = KVSpec(num_layers=3, num_kv_heads=2, head_dim=4, dtype="float16", page_size=2)


def test_copy_plan_packs_and_pads_with_the_last_pair():
    plan = copy_plan(np.array([5, 1, 7], np.int32), np.array([0, 2, 4], np.int32), layer=2)
    assert plan.shape == (3, MIN_INDEX_LEN) and plan.dtype == np.int32
    assert plan[PLAN_DST, :4].tolist() == [5, 1, 7, 7] and (plan[PLAN_DST, 3:] == 7).all()
    assert plan[PLAN_SRC, :4].tolist() == [0, 2, 4, 4] and (plan[PLAN_SRC, 3:] == 4).all()
    assert plan[PLAN_META, :2].tolist() == [1, 2]  # one trip of UNROLL pages, from layer 2
    assert copy_plan(np.arange(9, dtype=np.int32), np.arange(9, dtype=np.int32))[PLAN_META, 0] == -(
        -9 // UNROLL
    )
    assert index_len(1) == MIN_INDEX_LEN and index_len(3000) == bucket_size(3000) == 4096
    assert [bucket_size(n) for n in (0, 1, 2, 3, 5)] == [1, 1, 2, 4, 8]


def test_layer_plans_differ_only_in_their_layer():
    plan = copy_plan(np.array([3], np.int32), np.array([1], np.int32))
    plans = layer_plans(plan, SPEC.num_layers)
    assert [p[PLAN_META, 1] for p in plans] == [0, 1, 2]
    for p in plans:
        np.testing.assert_array_equal(p[:PLAN_META], plan[:PLAN_META])
    assert plan[PLAN_META, 1] == 0  # the input plan is not modified


@pytest.mark.parametrize(
    "dst_layout, src_layout",
    [
        (HostLayout.PAGE_FIRST, HostLayout.LAYER_FIRST),
        (HostLayout.LAYER_FIRST, HostLayout.PAGE_FIRST),
    ],
)
def test_copy_between_layouts_and_per_layer(dst_layout, src_layout):
    rng = np.random.default_rng(0)
    shape = {
        HostLayout.LAYER_FIRST: SPEC.kv_shape(6),
        HostLayout.PAGE_FIRST: SPEC.page_major_shape(6),
    }
    page_axis = {HostLayout.LAYER_FIRST: 2, HostLayout.PAGE_FIRST: 0}
    src_np = rng.integers(1, 2**16, size=shape[src_layout], dtype=np.uint16)
    dst_ids, src_ids = np.array([4, 0, 2], np.int32), np.array([1, 5, 3], np.int32)
    dst = jax.numpy.zeros(shape[dst_layout], np.uint16)
    fn = copy_fn(dst_layout=dst_layout, src_layout=src_layout, num_layers=SPEC.num_layers)
    dst, token = fn(dst, jax.numpy.asarray(src_np), copy_plan(dst_ids, src_ids))
    token.block_until_ready()
    got = np.moveaxis(np.asarray(dst), page_axis[dst_layout], 0)  # page-major views
    want = np.moveaxis(src_np, page_axis[src_layout], 0)
    np.testing.assert_array_equal(got[dst_ids], want[src_ids])
    assert not got[[1, 3, 5]].any()
    # One layer only (a layer-wise load's step): layer 1 of page 1 -> page 3.
    one = copy_fn(dst_layout=dst_layout, src_layout=src_layout, num_layers=1)
    plan = layer_plans(copy_plan(np.array([3], np.int32), np.array([1], np.int32)), 3)[1]
    dst, _ = one(dst, jax.numpy.asarray(src_np), plan)
    got = np.moveaxis(np.asarray(dst), page_axis[dst_layout], 0)
    np.testing.assert_array_equal(got[3, 1], want[1, 1])
    assert not got[3, [0, 2]].any()


def test_gather_pages_into_a_new_array():
    src = np.random.default_rng(1).integers(
        1, 2**16, size=SPEC.page_major_shape(5), dtype=np.uint16
    )
    ids = np.array([4, 1], np.int32)
    out, _ = gather_pages(
        jax.numpy.asarray(src),
        copy_plan(np.arange(2, dtype=np.int32), ids),
        size=8,
        out_sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]),
        src_layout=HostLayout.PAGE_FIRST,
        num_layers=SPEC.num_layers,
        src_put=None,
    )
    out = np.asarray(out)
    assert out.shape == SPEC.kv_shape(8)
    np.testing.assert_array_equal(np.moveaxis(out[:, :, :2], 2, 0), src[ids])
    assert not out[:, :, 2:].any()  # rows past the plan stay 0
