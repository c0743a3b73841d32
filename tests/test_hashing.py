"""hicache_jax.tree.hashing: the tree's / events' 64-bit page hashes and the 128-bit chained page
digests L3 keys are made of."""

import hashlib

import numpy as np
import pytest
import xxhash

from hicache_jax.l3.storage import page_keys
from hicache_jax.spec import KVSpec
from hicache_jax.tree.hashing import (
    DIGEST_BYTES,
    chain_digests,
    chain_hashes,
    namespace_hash,
    namespace_seed,
    namespace_tag,
)

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", page_size=4)


def test_digest_is_blake2b_128_of_the_previous_digest_and_the_page():
    pages = np.arange(12).reshape(3, 4)
    seed = namespace_seed(SPEC.fingerprint(), None)
    got = chain_digests(seed, pages)
    assert got.shape == (3, DIGEST_BYTES) and got.dtype == np.uint8 and DIGEST_BYTES * 8 >= 128
    prev = seed
    for row, page in zip(got, pages):
        prev = hashlib.blake2b(prev + page.astype("<i8").tobytes(), digest_size=16).digest()
        assert row.tobytes() == prev


def test_each_digest_covers_the_whole_prefix():
    seed = namespace_seed(SPEC.fingerprint(), None)
    a = np.arange(16).reshape(4, 4)
    b = a.copy()
    b[0, 0] += 1  # the first page differs: every later digest differs too
    da, db = chain_digests(seed, a), chain_digests(seed, b)
    assert all(x.tobytes() != y.tobytes() for x, y in zip(da, db))
    # a prefix's digests are the first digests of a longer prompt; a chain resumes from a digest
    np.testing.assert_array_equal(chain_digests(seed, a[:2]), da[:2])
    np.testing.assert_array_equal(chain_digests(da[1].tobytes(), a[2:]), da[2:])


def test_seed_names_layout_and_namespace_and_input_types_agree():
    fp = SPEC.fingerprint()
    seeds = {namespace_seed(fp, k) for k in (None, "5", b"5", 5)}
    assert len(seeds) == 4
    assert namespace_seed(fp, np.int64(5)) == namespace_seed(fp, 5)
    other = KVSpec(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float32", page_size=4)
    assert namespace_seed(other.fingerprint(), None) != namespace_seed(fp, None)
    toks = np.arange(8)
    assert (
        page_keys(SPEC, toks)
        == page_keys(SPEC, toks.tolist())
        == page_keys(SPEC, toks.astype(np.int32))
        == page_keys(SPEC, toks.astype(np.uint64))
    )
    for bad in ((1, 2), 1.5, True, [1]):
        with pytest.raises(TypeError, match="extra_key"):
            namespace_tag(bad)


def test_bad_input_is_a_typed_error():
    seed = namespace_seed(SPEC.fingerprint(), None)
    with pytest.raises(ValueError, match="prev"):
        chain_digests(b"short", np.zeros((1, 4), np.int64))
    with pytest.raises(ValueError, match="num_pages, page_size"):
        chain_digests(seed, np.zeros(4, np.int64))
    with pytest.raises(ValueError, match="1-D"):
        page_keys(SPEC, np.zeros((2, 4), np.int64))
    with pytest.raises(TypeError, match="integers"):
        page_keys(SPEC, [1.5] * 4)
    with pytest.raises(ValueError, match="multiple of page_size"):
        page_keys(SPEC, np.arange(6))
    with pytest.raises(ValueError, match=r"\[0, 2\*\*63\)"):
        page_keys(SPEC, np.array([-1, 0, 0, 0]))
    with pytest.raises(TypeError, match="extra_key"):
        page_keys(SPEC, np.arange(4), extra_key=("a", 1))
    assert page_keys(SPEC, np.zeros(0, np.int64)) == []


def test_page_hashes_are_the_xxh3_chain_of_the_int64_tokens_whatever_their_dtype():
    pages = np.arange(12).reshape(3, 4) * 70_001
    seed = namespace_hash(None)
    got = chain_hashes(seed, pages)
    assert got.dtype == np.uint64 and got.shape == (3,)
    h, want = seed, []
    for page in pages:
        h = xxhash.xxh3_64_intdigest(page.astype("<i8").tobytes(), seed=h)
        want.append(h)
    assert got.tolist() == want
    for same in (
        pages.astype(np.int32),
        pages.astype(np.uint64),
        pages.astype(">i8"),
        np.asfortranarray(pages),
    ):
        assert chain_hashes(seed, same).tolist() == want
    assert chain_hashes(want[0], pages[1:]).tolist() == want[1:]  # a chain resumes from a hash
    assert chain_hashes(seed, pages[:0]).shape == (0,)


def test_page_hashes_are_the_same_in_every_process():
    # Pinned values: a router and other instances must compute the same ids (no fallback hash).
    assert namespace_hash(None) == 8524524440615632006
    assert chain_hashes(namespace_hash(None), np.arange(8).reshape(2, 4)).tolist() == [
        15584011130774456836,
        8159706860537819701,
    ]
    assert namespace_hash(5) == namespace_hash(np.int64(5)) == namespace_hash(5.0)
    assert namespace_hash(("a", np.int32(2))) == namespace_hash(("a", 2)) != namespace_hash("a")


def test_page_hash_bad_input_is_a_typed_error():
    with pytest.raises(ValueError, match="num_pages, page_size"):
        chain_hashes(0, np.zeros(4, np.int64))
    for bad in (-1, 1 << 64):
        with pytest.raises(ValueError, match="prev"):
            chain_hashes(bad, np.zeros((1, 4), np.int64))
