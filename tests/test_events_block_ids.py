"""``kv_events={"block_hash": "vllm:..."}``: block ids equal what vLLM computes for the same tokens,
checked against values computed here from vLLM's published definition (hashlib and pickle;
CBOR bytes written out by hand from RFC 8949, and cbor2's canonical encoder where installed),
never by calling the cache's own hash code."""

from __future__ import annotations

import hashlib
import pickle

import numpy as np
import pytest

from helpers import bookkeeping_spec, make_cache
from helpers import serve as put
from hicache_jax import BlockRemoved, BlockStored, HiCacheConfig, Medium
from hicache_jax.events.block_ids import canonical_cbor

PS = 4
SEED = "1234"


# -- vLLM's definition (vllm/utils/hashing.py, vllm/v1/core/kv_cache_utils.py) -----------------


def vllm_sha256(x) -> bytes:
    return hashlib.sha256(pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def cbor_by_hand(parent: bytes, tokens: tuple, extra) -> bytes:
    """RFC 8949 canonical CBOR of ``(parent, tokens, extra)`` for 32-byte ``parent``, tokens in
    [0, 2**16) and ``extra`` None: array(3), bytes(32), array(n) of shortest uints, null."""
    out = bytearray([0x83, 0x58, 32]) + parent
    out.append(0x80 | len(tokens))
    for t in tokens:
        out += (
            bytes([t])
            if t < 24
            else bytes([0x18, t])
            if t < 256
            else bytes([0x19]) + t.to_bytes(2, "big")
        )
    out.append(0xF6)
    return bytes(out)


def cbor_seed_by_hand(seed: str) -> bytes:
    b = seed.encode()
    return bytes([0x60 | len(b)]) + b


def expected(tokens, hash_fn, none_hash, extra=None):
    """vLLM's chain: ``H((parent or NONE_HASH, tuple(tokens), extra_keys))``; on the wire the
    hash as a big-endian int masked to 64 bits."""
    ids, parent = [], none_hash
    for i in range(0, len(tokens), PS):
        parent = hash_fn((parent, tuple(int(t) for t in tokens[i : i + PS]), extra))
        ids.append(int.from_bytes(parent, "big") & ((1 << 64) - 1))
    return ids


def make(block_hash, **kw):
    return make_cache(
        bookkeeping_spec(PS),
        16,
        32,
        write_policy="write_back",
        kv_events={"publisher": "queue", "block_hash": block_hash, "hash_seed": SEED, **kw},
    )


def test_sha256_ids_equal_vllms_for_the_same_tokens():
    cache = make("vllm:sha256")
    toks = np.array([1, 2, 3, 4, 5, 6, 7, 8, 300, 301, 302, 70000])
    put(cache, toks)
    ev = cache.take_events()
    want = expected(toks, vllm_sha256, vllm_sha256(SEED))
    assert [e.block_hash for e in ev] == want
    assert [e.parent_block_hash for e in ev] == [None] + want[:-1]
    # a child inserted later chains from its parent's 32-byte hash, not from the wire id
    put(cache, np.concatenate([toks, [9, 9, 9, 9]]))
    (child,) = cache.take_events()
    assert (
        child.block_hash
        == expected(np.concatenate([toks, [9, 9, 9, 9]]), vllm_sha256, vllm_sha256(SEED))[-1]
    )


def test_a_str_extra_key_is_vllms_lora_name_extra_key():
    cache = make("vllm:sha256")
    put(cache, np.arange(8), extra_key="adapter-a")
    ev = cache.take_events()
    assert [e.block_hash for e in ev] == expected(
        np.arange(8), vllm_sha256, vllm_sha256(SEED), ("adapter-a",)
    )


def test_sha256_cbor_ids_equal_vllms_from_hand_written_cbor():
    cache = make("vllm:sha256_cbor")
    toks = np.array([0, 5, 23, 24, 255, 256, 1000, 65535])
    put(cache, toks)
    ev = cache.take_events()
    by_hand = lambda x: hashlib.sha256(cbor_by_hand(*x)).digest()  # noqa: E731
    none_hash = hashlib.sha256(cbor_seed_by_hand(SEED)).digest()
    assert [e.block_hash for e in ev] == expected(toks, by_hand, none_hash)


def test_canonical_cbor_equals_cbor2_where_installed():
    cbor2 = pytest.importorskip("cbor2")
    for x in [
        None,
        0,
        23,
        24,
        255,
        256,
        65535,
        65536,
        2**32,
        2**64 - 1,
        -1,
        -24,
        -25,
        -(2**63),
        b"",
        b"\x00" * 40,
        "",
        "seed",
        "é" * 30,
        (),
        (1, (2, 3), None, b"x", "y"),
        (b"\x01" * 32, tuple(range(300)), ("lora",)),
    ]:
        assert canonical_cbor(x) == cbor2.dumps(x, canonical=True), x


def test_removals_carry_the_same_ids_and_tiers_share_them():
    cache = make("vllm:sha256")
    put(cache, np.arange(8))
    stored = cache.take_events()
    cache.evict(8)  # write_back: a host copy, then off device
    ev = cache.take_events()
    ids = [e.block_hash for e in stored]
    assert [(type(e), e.medium, e.block_hash) for e in ev] == (
        [(BlockStored, Medium.HOST, h) for h in ids]
        + [(BlockRemoved, Medium.DEVICE, h) for h in ids]
    )
    cache.reset()
    cache.take_events()
    put(cache, np.arange(8))  # the same tokens: the same ids after a reset
    assert [e.block_hash for e in cache.take_events()] == ids


def test_the_default_ids_are_the_trees_and_a_bad_name_is_refused():
    with pytest.raises(ValueError, match="block_hash='md5' is not one of"):
        HiCacheConfig(device_pages=4, kv_events={"publisher": "queue", "block_hash": "md5"})
    with pytest.raises(TypeError, match="hash_seed=5 must be None or a non-empty str"):
        HiCacheConfig(device_pages=4, kv_events={"publisher": "queue", "hash_seed": 5})
