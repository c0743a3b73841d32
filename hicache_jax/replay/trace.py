"""Request traces for replay: Mooncake JSONL and token JSONL (pure Python + numpy; no jax).

Input (one request a line, format auto-detected from the first record):

* **Mooncake JSONL** (``timestamp``, ``input_length``, ``output_length``, ``hash_ids``; FAST'25
  release): block ``h`` becomes ``block_size`` tokens unique to it, ``h * block_size +
  arange(block_size)``; a prompt is ``input_length`` tokens made of its blocks in order, the
  last one possibly partial. A prompt with fewer ids than blocks gets fresh ids (never shared)
  for the rest.
* **token JSONL**: a JSON list of ints, or ``{"tokens": [...]}``, per line.

Token ids must be below ``2**31`` (the cache stores them as int32; see
:func:`hicache_jax.validation.as_tokens`), so a block id whose tokens would not fit is refused
at load. Bad input raises ``ValueError`` naming the file and the line.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import numpy as np

from hicache_jax.validation import is_real

MOONCAKE_BLOCK = 512
TOKEN_PAGE_SIZE = 16  # default page size of token traces
_INT64_MAX = np.iinfo(np.int64).max
_TOKEN_MAX = np.iinfo(np.int32).max


@dataclasses.dataclass(frozen=True, eq=False)
class Request:
    """One prompt of a trace.

    Attributes:
        line: 1-based line of the trace file.
        num_tokens: prompt length.
        hash_ids: Mooncake block ids (int64 ``[ceil(num_tokens / block_size)]``), or None.
        block_size: tokens per Mooncake block.
        token_ids: int64 ``[num_tokens]`` of a token trace, or None.
        timestamp_ms: arrival in milliseconds (Mooncake's ``timestamp``; 0 for a token trace).
    """

    line: int
    num_tokens: int
    hash_ids: np.ndarray | None = None
    block_size: int = MOONCAKE_BLOCK
    token_ids: np.ndarray | None = None
    timestamp_ms: float = 0.0

    def tokens(self) -> np.ndarray:
        """The prompt: int64 ``[num_tokens]`` (made on demand for Mooncake records)."""
        if self.token_ids is not None:
            return self.token_ids
        bs = self.block_size
        blocks = _hash_ids(self)[:, None] * bs + np.arange(bs, dtype=np.int64)
        return blocks.reshape(-1)[: self.num_tokens]


@dataclasses.dataclass(frozen=True, eq=False)
class Trace:
    """Requests of one trace file, in order. ``format`` is "mooncake" or "tokens"."""

    path: str
    format: str
    block_size: int
    requests: tuple[Request, ...]

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.requests)

    def default_page_size(self) -> int:
        return self.block_size if self.format == "mooncake" else TOKEN_PAGE_SIZE

    def describe(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "format": self.format,
            "block_size": self.block_size,
            "requests": len(self.requests),
            "prompt_tokens": self.num_tokens,
        }


# ------------------------------------------------------------------------------------ parsing


def _int_list(
    values: Any, field: str, where: str, high: int = _INT64_MAX, high_text: str = "2**63"
) -> np.ndarray:
    if not isinstance(values, list):
        raise ValueError(f"{where}: {field} must be a list of ints, got {type(values).__name__}")
    bad = next((v for v in values if type(v) is not int), None)  # bools and floats refused
    if bad is not None:
        raise ValueError(f"{where}: {field} holds {bad!r}, not an int")
    if values and (min(values) < 0 or max(values) > high):
        raise ValueError(f"{where}: {field} must hold ints in [0, {high_text})")
    return np.array(values, dtype=np.int64)


def _length(obj: dict, field: str, where: str, required: bool) -> int:
    if field not in obj and not required:
        return 0
    value = obj.get(field)
    if type(value) is not int or value < 0:
        raise ValueError(f"{where}: {field}={value!r} must be an int >= 0")
    return value


def _parse_record(obj: Any, where: str, block_size: int, line: int) -> tuple[str, Request]:
    if isinstance(obj, list) or (isinstance(obj, dict) and "tokens" in obj):
        ids = _int_list(
            obj if isinstance(obj, list) else obj["tokens"], "tokens", where, _TOKEN_MAX, "2**31"
        )
        return "tokens", Request(line, ids.size, token_ids=ids)
    if not isinstance(obj, dict) or "hash_ids" not in obj or "input_length" not in obj:
        raise ValueError(
            f"{where}: expected a Mooncake record (input_length, hash_ids), a "
            'JSON list of token ids or {"tokens": [...]}'
        )
    n = _length(obj, "input_length", where, True)
    _length(obj, "output_length", where, False)
    ts = obj.get("timestamp", 0)
    if not is_real(ts) or not math.isfinite(ts):
        raise ValueError(f"{where}: timestamp={ts!r} must be a number")
    ids = _int_list(obj["hash_ids"], "hash_ids", where)
    blocks = -(-n // block_size)
    if ids.size > blocks:
        raise ValueError(
            f"{where}: {ids.size} hash_ids but input_length={n} has only {blocks} "
            f"blocks of {block_size} tokens"
        )
    if ids.size and int(ids.max()) > (_TOKEN_MAX + 1) // block_size - 1:  # its last token id
        raise ValueError(
            f"{where}: hash id {int(ids.max())} too large for block size "
            f"{block_size} (token ids must be < 2**31)"
        )
    return "mooncake", Request(line, n, hash_ids=ids, block_size=block_size, timestamp_ms=float(ts))


def load_trace(
    path: str | os.PathLike, *, block_size: int = MOONCAKE_BLOCK, limit: int | None = None
) -> Trace:
    """Read a Mooncake or token JSONL trace (blank lines skipped).

    Args:
        path: the file.
        block_size: tokens per Mooncake block (``hash_ids`` entry).
        limit: read only the first ``limit`` requests.

    Raises:
        ValueError: malformed line (names the file and line); OSError: unreadable file.
    """
    if type(block_size) is not int or block_size < 1:
        raise ValueError(f"block_size={block_size!r} must be an int >= 1")
    if limit is not None and (type(limit) is not int or limit < 1):
        raise ValueError(f"limit={limit!r} must be an int >= 1")
    path = os.fspath(path)
    fmt: str | None = None
    requests: list[Request] = []
    with open(path) as f:
        for lineno, text in enumerate(f, 1):
            if limit is not None and len(requests) >= limit:
                break
            if not text.strip():
                continue
            where = f"{path}, line {lineno}"
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"{where}: malformed JSON ({exc.msg} at column {exc.colno})"
                ) from None
            kind, req = _parse_record(obj, where, block_size, lineno)
            if fmt is not None and kind != fmt:
                raise ValueError(f"{where}: a {kind} record in a {fmt} trace")
            fmt = kind
            requests.append(req)
    if not requests or fmt is None:
        raise ValueError(f"{path}: no requests in the trace")
    if fmt == "mooncake":
        requests = _fill_missing_blocks(requests, block_size)
    return Trace(path, fmt, block_size, tuple(requests))


def _hash_ids(r: Request) -> np.ndarray:
    """The block ids of a Mooncake record (set on every one; a token record has token_ids)."""
    assert r.hash_ids is not None, f"line {r.line}: a Mooncake record without hash_ids"
    return r.hash_ids


def _fill_missing_blocks(requests: list[Request], bs: int) -> list[Request]:
    """Prompts with fewer ids than blocks get fresh ids past the trace's largest: never shared."""
    fresh = 1 + max((int(_hash_ids(r).max()) for r in requests if _hash_ids(r).size), default=-1)
    out = []
    for r in requests:
        missing = -(-r.num_tokens // bs) - _hash_ids(r).size
        if missing:
            ids = np.concatenate([_hash_ids(r), np.arange(fresh, fresh + missing, dtype=np.int64)])
            fresh += missing
            r = dataclasses.replace(r, hash_ids=ids)
        out.append(r)
    return out
