"""Argument checks shared by every module (pure Python + numpy; no jax, no hicache_jax import).

Each check raises ``TypeError`` (wrong kind of value) or ``ValueError`` (right kind, bad value)
with a message naming the argument, and returns the value in the form the caller keeps (a
Python ``int``, an int32 numpy copy, an enum member). Array checks are whole-array numpy
reductions, never a Python loop over elements (ARCHITECTURE.md: no per-token Python loops).

Token ids are held as int32 by the tree (half the bytes of int64: the tree keeps every cached
token of both tiers): :func:`as_tokens` refuses ids beyond ``2**31 - 1``, which every real
vocabulary is far below.
"""

from __future__ import annotations

import enum
from typing import Any

import numpy as np

_INT32_MAX = int(np.iinfo(np.int32).max)

#: The dtype the tree stores token ids in (see :func:`as_tokens`).
TOKEN_DTYPE = np.dtype(np.int32)


# ----------------------------------------------------------------------------- scalars


def is_int(value: Any) -> bool:
    """A Python or numpy integer, bools (Python's and numpy's) excluded."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_real(value: Any) -> bool:
    """A Python or numpy integer or float, bools excluded (NaN and infinities included)."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
        value, (bool, np.bool_)
    )


def check_int(name: str, value: Any, minimum: int = 0, maximum: int | None = None) -> int:
    """``int(value)``, or TypeError (not an int; bools refused) / ValueError (below minimum or
    above maximum) naming the argument."""
    if not is_int(value):
        raise TypeError(f"{name}={value!r} must be an int")
    if value < minimum:
        raise ValueError(f"{name}={value!r} must be >= {minimum}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name}={value!r} must be <= {maximum}")
    return int(value)


def check_bool(name: str, value: Any) -> bool:
    """``bool(value)``, or TypeError naming the argument (ints and other truthy values refused)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}={value!r} must be a bool")
    return bool(value)


def parse_enum(cls: type[enum.Enum], field: str, value: Any) -> Any:
    """``cls(value)`` (a member or its value), or ValueError listing the choices."""
    try:
        return cls(value)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"{field}={value!r} is not one of: {choices}") from None


# ----------------------------------------------------------------------------- integer arrays


def nonnegative_ints(arr: np.ndarray, name: str, what: str = "values") -> bool:
    """Check that ``arr`` is 1-D and, unless empty, holds integers >= 0; returns ``arr.size > 0``.

    Raises:
        ValueError: not 1-D, or a negative value ("{name} has negative {what} (min ...)").
        TypeError: a non-empty array of another dtype (bools refused).
    """
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return False
    kind = arr.dtype.kind  # "b" (bool), "f", "O"... refused; cheaper than np.issubdtype
    if kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    if kind == "i" and arr.min() < 0:
        raise ValueError(f"{name} has negative {what} (min {arr.min()}); they must be >= 0")
    return True


def _beyond_int32(arr: np.ndarray) -> bool:
    """Whether a non-negative integer array holds a value above int32's maximum (one pass;
    int32 and narrower cannot, and np.iinfo per call costs more than this test)."""
    return arr.dtype.itemsize * 8 - (arr.dtype.kind == "i") > 31 and arr.max() > _INT32_MAX


def as_page_ids(ids: Any, name: str = "page_ids") -> np.ndarray:
    """Validate a 1-D integer sequence of page ids and return it as int32 numpy (a copy).

    Raises:
        TypeError: not integers.
        ValueError: not 1-D, negative, or beyond int32.
    """
    arr = np.asarray(ids)
    if not nonnegative_ints(arr, name, "ids"):
        return np.zeros(0, np.int32)
    if _beyond_int32(arr):
        raise ValueError(f"{name} has ids beyond int32 (max {arr.max()})")
    return arr.astype(np.int32, copy=True)


def as_distinct_ids(ids: Any, n: int, name: str) -> np.ndarray:
    """1-D distinct non-negative integer page ids, exactly ``n`` of them -> int32 copy."""
    out = as_page_ids(ids, name)
    if out.shape[0] != n:
        raise ValueError(f"{name} has {out.shape[0]} ids, expected {n} (one per whole page)")
    srt = np.sort(out)  # sort + neighbour compare: numpy 2's hash-based unique is ~20x slower
    if (srt[1:] == srt[:-1]).any():
        raise ValueError(f"{name} has duplicate ids")
    return out


def check_ids_in_range(
    ids: Any, n: int, num_pages: int, name: str = "host_ids", count_name: str = "len(keys)"
) -> np.ndarray:
    """Validate ``n`` unique 1-D integer ids in ``[0, num_pages)`` -> int64 copy (ValueError)."""
    arr = np.asarray(ids)
    if arr.ndim != 1 or not (arr.size == 0 or np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"{name} must be 1-D integers, got shape {arr.shape} dtype {arr.dtype}")
    if arr.shape[0] != n:
        raise ValueError(f"len({name})={arr.shape[0]} must equal {count_name}={n}")
    arr = arr.astype(np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= num_pages):
        raise ValueError(f"{name} must be in [0, {num_pages}), got [{arr.min()}, {arr.max()}]")
    if np.unique(arr).size != arr.size:
        raise ValueError(f"{name} must be unique")
    return arr


def as_tokens(tokens: Any) -> np.ndarray:
    """1-D non-negative integer token ids -> int32 numpy (no copy when already int32).

    Raises:
        TypeError: not integers (bools and floats refused).
        ValueError: not 1-D, negative, or an id beyond int32 (``>= 2**31``): the tree stores
            token ids as int32, not int64, to halve its memory; real vocabularies fit.
    """
    arr = np.asarray(tokens)
    if (
        arr.ndim == 1
        and arr.size
        and arr.dtype.kind in "iu"
        and arr.dtype.itemsize == 8
        and arr.view(np.uint64).max() <= _INT32_MAX
    ):
        # The common case (a list, or an int64 prompt): one pass checks both bounds, since a
        # negative int64 reads as a huge uint64. Anything else takes the precise checks below.
        return arr.astype(TOKEN_DTYPE)
    if not nonnegative_ints(arr, "tokens"):
        return np.zeros(0, TOKEN_DTYPE)
    if _beyond_int32(arr):
        raise ValueError(
            f"tokens has values beyond int32 (max {arr.max()}): token ids must "
            "be < 2**31 (the tree stores them as int32, not int64)"
        )
    return arr.astype(TOKEN_DTYPE, copy=False)


# ----------------------------------------------------------------------------- namespaces


def _has_nan(key: Any) -> bool:
    """Whether ``key`` is, or (in a tuple / frozenset) holds, a value unequal to itself."""
    if isinstance(key, (tuple, frozenset)):
        return any(_has_nan(k) for k in key)
    try:
        return bool(key != key)
    except Exception:  # an __ne__ that raises or returns an array: not a NaN-like scalar
        return False


def check_extra_key(extra_key: Any) -> None:
    """Refuse unhashable keys and keys unequal to themselves (NaN): each insert under
    ``float("nan")`` would make a namespace that no later match finds."""
    if extra_key is None:
        return
    try:
        hash(extra_key)
    except TypeError:
        raise TypeError(f"extra_key must be hashable, got {type(extra_key).__name__}") from None
    if _has_nan(extra_key):
        raise ValueError(
            f"extra_key={extra_key!r} is not equal to itself (NaN): no later match "
            "could find its namespace"
        )


def page_tokens(tokens: Any, extra_key: Any, page_size: int) -> np.ndarray:
    """Validate tokens (:func:`as_tokens`) and ``extra_key`` (:func:`check_extra_key`); return
    the whole-page int32 part of the tokens (what the tree stores)."""
    arr = as_tokens(tokens)
    check_extra_key(extra_key)
    return arr[: arr.shape[0] // page_size * page_size]
