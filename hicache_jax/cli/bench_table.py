"""The reference engine's configurations (no cache / device radix / hicache) as a table, for a
notebook: ``hicache-jax bench`` with keyword arguments for its flags.

:func:`bench_table` runs the command itself (:func:`hicache_jax.cli.main.main`, reading back
its ``--json``), so a notebook's table holds exactly the figures the command prints. Threading:
runs on the calling thread.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
from typing import Any

import hicache_jax.study as study
from hicache_jax.cli.main import main

__all__ = ["bench_table", "bench_argv"]

_RESERVED = ("json", "plot", "quiet", "command")  # set by bench_table itself


def bench_argv(flags: dict[str, Any]) -> list[str]:
    """``hicache-jax bench``'s arguments for keyword ``flags``: ``sessions=2`` is
    ``--sessions 2``, ``no_warmup=True`` is ``--no-warmup`` (False and None: left out).
    TypeError for a flag this function sets itself (json, plot, quiet)."""
    argv = []
    for key, value in flags.items():
        if key in _RESERVED:
            raise TypeError(f"{key}= is set by bench_table; drop it")
        opt = "--" + key.replace("_", "-")
        if value is True:
            argv.append(opt)
        elif value is not False and value is not None:
            argv += [opt, str(value)]
    return argv


def bench_table(*, quiet: bool = True, **flags: Any) -> Any:
    """Run ``hicache-jax bench`` (a workload through no cache, device radix and HiCache on the
    same model) and return one record per configuration: every figure of its ``summary``
    (TTFT p50/p90 in ms, tokens recomputed, hit tokens by tier, tokens/s, bytes moved), with
    ``hit_ratio`` (prompt tokens hit), ``infinite_hit_ratio`` and ``outputs_identical`` (all
    configurations generated the same tokens).

    Args:
        quiet: no progress bars and no printed table (the text goes nowhere).
        flags: ``hicache-jax bench``'s flags as keywords (see :func:`bench_argv`), e.g.
            ``workload="chat", sessions=2, layers=1, d_model=32, no_warmup=True``.

    Returns:
        :func:`hicache_jax.study.as_table` of the records: a ``pandas.DataFrame`` when pandas is
        installed, else a list of dicts.

    Raises:
        ValueError: the command refused the flags (its message); TypeError: a reserved flag.
    """
    argv = bench_argv(flags)
    err = io.StringIO()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.json")
        full = ["bench", *argv, "--json", path] + (["--quiet"] if quiet else [])
        # quiet: the command's text (and its messages) captured; else printed as it runs
        out = contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext()
        errs = contextlib.redirect_stderr(err) if quiet else contextlib.nullcontext()
        try:
            with out, errs:
                main(full)
        except SystemExit as exc:
            lines = err.getvalue().strip().splitlines()
            raise ValueError(
                f"hicache-jax bench {' '.join(argv)}: "
                f"{lines[-1] if lines else f'exit {exc.code} (see above)'}"
            ) from None
        with open(path) as f:
            data = json.load(f)
    return study.as_table(_records(data))


def _records(data: dict[str, Any]) -> list[dict[str, Any]]:
    """One record per configuration of a ``hicache-jax bench --json`` payload."""
    out = []
    for name, s in data["summary"].items():
        hit = (
            (s["l1_hit_tokens"] + s["l2_hit_tokens"]) / s["prompt_tokens"]
            if s["prompt_tokens"]
            else 0.0
        )
        out.append(
            {
                "config": name,
                "ttft_p50_ms": s["ttft_p50_ms"],
                "ttft_p90_ms": s["ttft_p90_ms"],
                "hit_ratio": hit,
            }
            | s
            | {
                "infinite_hit_ratio": data["infinite_cache_hit_ratio"],
                "outputs_identical": data["outputs_identical"],
            }
        )
    return out
