"""Tests of hicache_jax/validation.py: scalar checks, enum parsing, integer arrays, tokens."""

import enum

import numpy as np
import pytest

from hicache_jax.validation import (
    TOKEN_DTYPE,
    as_distinct_ids,
    as_page_ids,
    as_tokens,
    check_bool,
    check_extra_key,
    check_ids_in_range,
    check_int,
    is_int,
    is_real,
    nonnegative_ints,
    parse_enum,
)


@pytest.mark.parametrize(
    "value, int_, real",
    [
        (3, True, True),
        (np.int64(3), True, True),
        (np.uint8(0), True, True),
        (True, False, False),
        (np.bool_(False), False, False),
        (2.5, False, True),
        (np.float32(1.0), False, True),
        ("3", False, False),
        (None, False, False),
    ],
)
def test_is_int_and_is_real_refuse_bools(value, int_, real):
    assert is_int(value) is int_ and is_real(value) is real


def test_check_int_and_check_bool():
    assert check_int("n", np.int32(4), 1) == 4 and type(check_int("n", np.int32(4))) is int
    with pytest.raises(TypeError, match="n=True must be an int"):
        check_int("n", True)
    with pytest.raises(TypeError, match=r"n=2\.0 must be an int"):
        check_int("n", 2.0)
    with pytest.raises(ValueError, match="n=0 must be >= 1"):
        check_int("n", 0, 1)
    with pytest.raises(ValueError, match="n=9 must be <= 8"):
        check_int("n", 9, 0, 8)
    assert check_bool("b", np.bool_(True)) is True
    with pytest.raises(TypeError, match="b=1 must be a bool"):
        check_bool("b", 1)


class _Color(str, enum.Enum):
    RED = "red"
    BLUE = "blue"


def test_parse_enum():
    assert parse_enum(_Color, "color", "red") is _Color.RED
    assert parse_enum(_Color, "color", _Color.BLUE) is _Color.BLUE
    with pytest.raises(ValueError, match=r"^color='green' is not one of: 'red', 'blue'$"):
        parse_enum(_Color, "color", "green")


def test_integer_arrays():
    assert nonnegative_ints(np.zeros(0, np.float32), "x") is False  # empty: any dtype
    with pytest.raises(TypeError, match="x must hold integers"):
        nonnegative_ints(np.array([True]), "x")
    with pytest.raises(ValueError, match="x has negative ids"):
        nonnegative_ints(np.array([1, -1]), "x", "ids")
    assert as_page_ids(np.array([3, 2], np.uint64)).dtype == np.int32
    with pytest.raises(ValueError, match="beyond int32"):
        as_page_ids([2**31])
    assert as_distinct_ids([4, 1], 2, "ids").tolist() == [4, 1]
    with pytest.raises(ValueError, match="ids has duplicate ids"):
        as_distinct_ids([4, 4], 2, "ids")
    with pytest.raises(ValueError, match="ids has 1 ids, expected 2"):
        as_distinct_ids([4], 2, "ids")
    assert check_ids_in_range([2, 0], 2, 3).dtype == np.int64
    for ids, msg in (
        ([0], "len.host_ids.=1 must equal len.keys.=2"),
        ([0, 3], r"in \[0, 3\)"),
        ([1, 1], "unique"),
        ([0.5, 1.0], "1-D integers"),
    ):
        with pytest.raises(ValueError, match=msg):
            check_ids_in_range(ids, 2, 3)


@pytest.mark.parametrize(
    "arg",
    [
        [5, 0, 2**31 - 1],
        np.array([5, 0, 2**31 - 1], np.uint64),
        np.array([5, 0, 2**31 - 1], np.int64)[::1],
        np.array([9, 5, 9, 0, 9, 2**31 - 1], np.int64)[1::2],
    ],
)
def test_as_tokens_int32_from_any_integer_input(arg):
    out = as_tokens(arg)
    assert out.dtype == TOKEN_DTYPE and out.tolist() == [5, 0, 2**31 - 1]


def test_as_tokens_no_copy_of_int32_and_errors():
    a = np.arange(4, dtype=np.int32)
    assert as_tokens(a) is a and as_tokens([]).dtype == TOKEN_DTYPE
    for bad, exc, msg in (
        ([1, -2], ValueError, "negative"),  # the one-pass check sees it
        (np.array([-(2**62)], np.int64), ValueError, "negative"),
        ([2**31], ValueError, r"beyond int32 \(max 2147483648\)"),
        (np.array([2**64 - 1], np.uint64), ValueError, "beyond int32"),
        ([1.0], TypeError, "integers"),
        ([[1]], ValueError, "1-D"),
    ):
        with pytest.raises(exc, match=msg):
            as_tokens(bad)


def test_check_extra_key():
    for ok in (None, 3, "lora", ("a", 1)):
        check_extra_key(ok)
    with pytest.raises(TypeError, match="hashable"):
        check_extra_key([1])
    with pytest.raises(ValueError, match="NaN"):
        check_extra_key(("x", float("nan")))
