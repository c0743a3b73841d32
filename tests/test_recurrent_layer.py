"""The recurrent layer (hicache_jax/engine/recurrent.py): the chunked prefill form agrees with
the token-by-token decode form, a sequence split at a chunk boundary continues exactly from the
returned state (a cache hit), the boundary states are the states after those prefixes, padding
leaves the state alone, and a jitted chunked call compiles once for every ``length``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hicache_jax.engine.recurrent import (
    init_recurrent_params,
    recurrent_chunked,
    recurrent_step,
    state_shapes,
)

D, H, DK, DV, W = 32, 2, 16, 16, 4
AGREE = 1e-5  # chunked vs step: different summation orders
SPLIT = 1e-6  # the same chunked computation, split at a chunk boundary

STEP = jax.jit(recurrent_step)
CHUNKED = jax.jit(recurrent_chunked, static_argnames=("chunk",))


def _maxdiff(a: jax.Array, b: jax.Array) -> float:
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def _inputs(seed: int, t_len: int, width: int = W, zero_state: bool = False):
    """Parameters, inputs ``[t_len, D]`` and a random (or zero) starting state."""
    kp, kx, kc, ks = jax.random.split(jax.random.key(seed), 4)
    params = init_recurrent_params(kp, D, H, DK, DV, width)
    shapes = state_shapes(D, H, DK, DV, width)
    x = jax.random.normal(kx, (t_len, D), jnp.float32)
    if zero_state:
        conv = jnp.zeros(shapes["conv"], jnp.float32)
        ssm = jnp.zeros(shapes["ssm"], jnp.float32)
    else:
        conv = jax.random.normal(kc, shapes["conv"], jnp.float32)
        ssm = jax.random.normal(ks, shapes["ssm"], jnp.float32)
    return params, x, conv, ssm


def test_params_and_state_shapes():
    params = init_recurrent_params(jax.random.key(0), D, H, DK, DV, W)
    assert {n: a.shape for n, a in params.items()} == {
        "conv_w": (W, D),
        "wq": (D, H * DK),
        "wk": (D, H * DK),
        "wv": (D, H * DV),
        "wa": (D, H),
        "wo": (H * DV, D),
    }
    again = init_recurrent_params(jax.random.key(0), D, H, DK, DV, W)
    assert all(np.array_equal(params[n], again[n]) for n in params)
    assert state_shapes(D, H, DK, DV, W) == {"conv": (W - 1, D), "ssm": (H, DK, DV)}
    assert state_shapes(D, H, DK, DV, 1) == {"conv": (0, D), "ssm": (H, DK, DV)}
    with pytest.raises(ValueError, match="conv_width"):
        state_shapes(D, H, DK, DV, 0)
    params, x, conv, ssm = _inputs(0, 12)
    with pytest.raises(ValueError, match="multiple of chunk"):
        recurrent_chunked(params, x, conv, ssm, 12, 8)


@pytest.mark.parametrize("chunk", [4, 8, 16])
@pytest.mark.parametrize("t_len", [16, 64])
def test_chunked_agrees_with_step(t_len: int, chunk: int):
    """y and the final state of the chunked form match the step form within 1e-5, for
    ``length == T`` and ``length < T`` (mid-chunk), from non-zero and zero states."""
    for seed, length, zero in [(1, t_len, False), (2, t_len - 3, False), (3, t_len - 3, True)]:
        params, x, conv, ssm = _inputs(seed, t_len, zero_state=zero)
        y_s, conv_s, ssm_s = STEP(params, x[:length], conv, ssm)
        y_c, conv_c, ssm_c, _, _ = CHUNKED(params, x, conv, ssm, jnp.int32(length), chunk=chunk)
        assert _maxdiff(y_c[:length], y_s) <= AGREE
        assert _maxdiff(conv_c, conv_s) <= AGREE
        assert _maxdiff(ssm_c, ssm_s) <= AGREE
        assert float(jnp.max(jnp.abs(y_s))) < 50.0  # the parameters keep outputs O(1)


@pytest.mark.parametrize("width", [1, 2])
def test_narrow_convolutions(width: int):
    """conv_width 1 (a [0, D] conv state) and 2 work in both forms."""
    params, x, conv, ssm = _inputs(4, 16, width=width)
    y_s, conv_s, ssm_s = STEP(params, x[:13], conv, ssm)
    y_c, conv_c, ssm_c, bconv, _ = CHUNKED(params, x, conv, ssm, jnp.int32(13), chunk=8)
    assert conv_c.shape == (width - 1, D) and bconv.shape == (2, width - 1, D)
    assert _maxdiff(y_c[:13], y_s) <= AGREE
    assert _maxdiff(conv_c, conv_s) <= AGREE
    assert _maxdiff(ssm_c, ssm_s) <= AGREE


def test_single_token_steps_continue_the_state():
    """Decoding one token at a time (T = 1 per call) equals one scan over all of them."""
    params, x, conv, ssm = _inputs(5, 6)
    y_all, conv_all, ssm_all = STEP(params, x, conv, ssm)
    ys = []
    for t in range(6):
        y, conv, ssm = STEP(params, x[t : t + 1], conv, ssm)
        ys.append(y)
    assert _maxdiff(jnp.concatenate(ys), y_all) <= SPLIT
    assert _maxdiff(conv, conv_all) <= SPLIT
    assert _maxdiff(ssm, ssm_all) <= SPLIT


@pytest.mark.parametrize(("chunk", "t_len"), [(4, 24), (8, 16)])
def test_split_at_a_chunk_boundary_equals_one_run(chunk: int, t_len: int):
    """Running [0, p) and then [p, T) from the returned state (a cache hit at p) gives the
    outputs and state of running [0, T) at once, within 1e-6."""
    params, x, conv, ssm = _inputs(6, t_len)
    y, conv_t, ssm_t, _, _ = CHUNKED(params, x, conv, ssm, jnp.int32(t_len), chunk=chunk)
    p = t_len // 2
    y1, conv_p, ssm_p, _, _ = CHUNKED(params, x[:p], conv, ssm, jnp.int32(p), chunk=chunk)
    y2, conv2, ssm2, _, _ = CHUNKED(params, x[p:], conv_p, ssm_p, jnp.int32(p), chunk=chunk)
    assert _maxdiff(jnp.concatenate([y1, y2]), y) <= SPLIT
    assert _maxdiff(conv2, conv_t) <= SPLIT
    assert _maxdiff(ssm2, ssm_t) <= SPLIT
    # The continuation by the decode form agrees too (within the forms' tolerance).
    y3, conv3, ssm3 = STEP(params, x[p:], conv_p, ssm_p)
    assert _maxdiff(y3, y[p:]) <= AGREE
    assert _maxdiff(conv3, conv_t) <= AGREE
    assert _maxdiff(ssm3, ssm_t) <= AGREE


def test_boundary_states_are_prefix_states():
    """Boundary i is the state after min((i + 1) * chunk, length) tokens: equal to running
    that prefix by the step form (1e-5) and by the chunked form (1e-6); boundaries past
    ``length`` equal the final state exactly."""
    t_len, chunk, length = 32, 8, 19
    params, x, conv, ssm = _inputs(7, t_len)
    _, conv_f, ssm_f, bconv, bssm = CHUNKED(params, x, conv, ssm, jnp.int32(length), chunk=chunk)
    assert bconv.shape == (t_len // chunk, W - 1, D)
    assert bssm.shape == (t_len // chunk, H, DK, DV)
    for i in range(t_len // chunk):
        n = min((i + 1) * chunk, length)
        _, conv_s, ssm_s = STEP(params, x[:n], conv, ssm)
        assert _maxdiff(bconv[i], conv_s) <= AGREE
        assert _maxdiff(bssm[i], ssm_s) <= AGREE
        if n % chunk == 0:
            _, conv_c, ssm_c, _, _ = CHUNKED(params, x[:n], conv, ssm, jnp.int32(n), chunk=chunk)
            assert _maxdiff(bconv[i], conv_c) <= SPLIT
            assert _maxdiff(bssm[i], ssm_c) <= SPLIT
        else:
            assert np.array_equal(bconv[i], conv_f)
            assert np.array_equal(bssm[i], ssm_f)


def test_padding_leaves_the_state_unchanged():
    """Whatever the padding holds (large values included), the state after ``length`` tokens
    and the outputs before ``length`` do not change; length 0 returns the starting state."""
    t_len, chunk, length = 16, 8, 10
    params, x, conv, ssm = _inputs(8, t_len)
    y, conv_f, ssm_f, bconv, bssm = CHUNKED(params, x, conv, ssm, jnp.int32(length), chunk=chunk)
    junk = x.at[length:].set(1e4 * jax.random.normal(jax.random.key(9), (t_len - length, D)))
    y_j, conv_j, ssm_j, bconv_j, bssm_j = CHUNKED(
        params, junk, conv, ssm, jnp.int32(length), chunk=chunk
    )
    assert np.array_equal(y_j[:length], y[:length])
    assert np.array_equal(conv_j, conv_f) and np.array_equal(ssm_j, ssm_f)
    assert np.array_equal(bconv_j, bconv) and np.array_equal(bssm_j, bssm)
    assert np.all(np.isfinite(np.asarray(y_j)))
    _, conv_0, ssm_0, bconv_0, bssm_0 = CHUNKED(params, junk, conv, ssm, jnp.int32(0), chunk=chunk)
    assert np.array_equal(conv_0, conv) and np.array_equal(ssm_0, ssm)
    assert np.array_equal(bconv_0[1], conv) and np.array_equal(bssm_0[1], ssm)


def test_jitted_chunked_compiles_once_for_every_length():
    traces = []

    def counted(params, x, conv, ssm, length, chunk):
        traces.append(chunk)
        return recurrent_chunked(params, x, conv, ssm, length, chunk)

    fn = jax.jit(counted, static_argnames=("chunk",))
    params, x, conv, ssm = _inputs(10, 16)
    for length in (16, 3, 9, 0):
        _, _, ssm_l, _, _ = fn(params, x, conv, ssm, jnp.int32(length), chunk=4)
        _, _, ssm_s = STEP(params, x[:length], conv, ssm)
        assert _maxdiff(ssm_l, ssm_s) <= AGREE
    assert len(traces) == 1
    assert fn._cache_size() == 1
