"""Policy studies in a notebook: load a trace, sweep capacities, policies and L2 sizes, get a
table to sort and filter and a curve on a matplotlib axis, save it and load it back.

    from hicache_jax import study
    trace = study.load_trace("mooncake_synthetic_1000")          # a slice shipped in the repo
    result = study.sweep(trace, capacities=[3e5, 1e6, 3e6], policies=["clean_ahead", "write_back"])
    result.table(); result.plot()

A sliding-window model at equal memory: ``study.sweep(trace, capacities=[3e5, 1e6],
layer_pattern="5:1", window=1024)`` (capacities in the all-full model's bytes, split between the
full-attention and the window pools; see :mod:`hicache_jax.replay.windows`): each record gets
the bytes ratio ``r``, the LRU of ``r x`` the bytes and the LRU of the same bytes.

Every figure comes from :func:`hicache_jax.replay.run` (the replay of ``hicache-jax replay``,
which calls the functions of this module: one code path, the same figures). The replay is
deterministic, so a sweep run twice gives the same table (only :data:`TIMING_FIELDS` vary).

Optional extras: pandas for :meth:`SweepResult.table` as a DataFrame (otherwise a list of
records), matplotlib for :meth:`SweepResult.plot`; ``pip install -e ".[notebook]"`` installs
both, with Jupyter's kernel and tqdm's widgets (progress bars that render in Jupyter).

Trace names: :func:`load_trace` takes a path, or the name of a slice shipped in the repository
(``benchmarks/data/``, ``tests/data/``; with or without ``.jsonl``). Those folders are not part
of the installed package: they are found beside the package when it runs from a checkout (an
editable install), and in the folders of ``$HICACHE_JAX_TRACES`` (``os.pathsep``-separated),
searched first, wherever it is installed.

Threading: everything runs on the calling thread; a result is a plain value.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from hicache_jax.replay import driver as _replay
from hicache_jax.replay import states as _states
from hicache_jax.replay import windows as _windows
from hicache_jax.replay.block_lru import default_device_pages
from hicache_jax.replay.trace import MOONCAKE_BLOCK, Trace
from hicache_jax.replay.trace import load_trace as _load_trace
from hicache_jax.spec import HiCacheConfig, KVSpec
from hicache_jax.validation import check_int, is_real

__all__ = [
    "FORMAT",
    "SweepResult",
    "TIMING_FIELDS",
    "as_table",
    "auto_progress",
    "check_configs",
    "from_json",
    "l1_pages",
    "load_trace",
    "shipped_traces",
    "sweep",
    "trace_dirs",
]

FORMAT = "hicache_jax.study.sweep/1"  # the "format" of :meth:`SweepResult.to_json`
TIMING_FIELDS = _replay.TIMING_FIELDS
TRACES_ENV = "HICACHE_JAX_TRACES"
_REPO = pathlib.Path(__file__).resolve().parent.parent
_SHIPPED = (_REPO / "benchmarks" / "data", _REPO / "tests" / "data")
_LEAD = (
    "trace",
    "host_ratio",
    "config",
    "write_policy",
    "eviction",
    "device_pages",
    "device_tokens",
    "host_pages",
    "hit_ratio",
    "lru_l1_hit_ratio",
    "lru_total_hit_ratio",
    "infinite_hit_ratio",
    "vs_lru_l1",
    "vs_lru_total",
    "vs_infinite",
    "bytes_moved",
)


# ------------------------------------------------------------------------------------ traces


def trace_dirs() -> list[pathlib.Path]:
    """Folders searched for trace names: ``$HICACHE_JAX_TRACES``'s, then the repository's
    ``benchmarks/data`` and ``tests/data`` (those that exist)."""
    extra = [
        pathlib.Path(p).expanduser() for p in os.environ.get(TRACES_ENV, "").split(os.pathsep) if p
    ]
    return [d for d in extra + list(_SHIPPED) if d.is_dir()]


def shipped_traces() -> dict[str, pathlib.Path]:
    """Trace name (file name without ``.jsonl``) -> path, for every JSONL in :func:`trace_dirs`
    (the first folder holding a name wins)."""
    out: dict[str, pathlib.Path] = {}
    for folder in trace_dirs():
        for path in sorted(folder.glob("*.jsonl")):
            out.setdefault(path.stem, path)
    return out


def load_trace(
    source: str | os.PathLike | Trace, *, block_size: int = MOONCAKE_BLOCK, limit: int | None = None
) -> Trace:
    """A trace from a path (Mooncake JSONL or token JSONL, auto-detected) or a shipped name.

    Args:
        source: a file path; or a name of :func:`shipped_traces`, e.g.
            ``"mooncake_synthetic_1000"``; or a :class:`Trace` (returned as is).
        block_size: tokens per Mooncake ``hash_ids`` entry.
        limit: only the first ``limit`` requests.

    Raises:
        FileNotFoundError: neither a file nor a known name (the message lists the names);
        ValueError: a malformed trace (names the file and line) or a bad argument.
    """
    if isinstance(source, Trace):
        return source
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"source={source!r} must be a path, a trace name or a Trace")
    path = os.fspath(source)
    if not os.path.isfile(path):
        names = shipped_traces()
        found = names.get(path.removesuffix(".jsonl")) if os.sep not in path else None
        if found is None:
            raise FileNotFoundError(
                f"trace {path!r}: no such file, nor the name of a trace; names: "
                f"{', '.join(names) or 'none found'} (the repository's benchmarks/data and "
                f"tests/data, and ${TRACES_ENV}'s folders)"
            )
        path = str(found)
    return _load_trace(path, block_size=block_size, limit=limit)


# ------------------------------------------------------------------------------------ sweep


def l1_pages(
    trace: Trace,
    page_size: int,
    *,
    capacities: Iterable[float] | None = None,
    device_pages: Iterable[int] | None = None,
    name: str = "capacities",
) -> list[int]:
    """L1 sizes in pages, distinct, in order: ``capacities`` (tokens, rounded down to whole
    pages), else ``device_pages``, else :func:`~hicache_jax.replay.default_device_pages`.
    ValueError (naming ``name``) for a capacity below one page."""
    if capacities is not None and device_pages is not None:
        raise ValueError("give capacities (tokens) or device_pages, not both")
    if capacities is not None:
        pages = []
        for t in capacities:
            if not is_real(t):
                raise TypeError(f"{name} {t!r} must be a number of tokens")
            if not (np.isfinite(t) and t >= page_size):
                raise ValueError(f"{name} {t:g} must be at least one page ({page_size} tokens)")
            pages.append(int(t // page_size))
    elif device_pages is not None:
        pages = [check_int("device_pages", p, 1) for p in device_pages]
    else:
        pages = [default_device_pages(trace, page_size)]
    if not pages:
        raise ValueError(f"{name}: no L1 size given")
    return list(dict.fromkeys(pages))


def check_configs(
    device_pages: Sequence[int],
    host_ratios: Sequence[float],
    policies: Sequence[str],
    evictions: Sequence[str],
    load_back_threshold: int,
) -> None:
    """ValueError / TypeError naming the first bad setting, before anything is replayed."""
    for ratio in host_ratios:
        if not (is_real(ratio) and np.isfinite(ratio) and ratio >= 0):
            raise ValueError(f"host_ratio {ratio} must be a finite number >= 0")
    for p in device_pages:
        for ratio in host_ratios:
            for w in policies:
                for e in evictions:
                    HiCacheConfig(
                        device_pages=p,
                        host_pages=int(round(ratio * p)),
                        write_policy=w,
                        eviction=e,
                        load_back_threshold=load_back_threshold,
                    )


def auto_progress(total: int, desc: str) -> Any:
    """A ``tqdm.auto`` bar (a widget in Jupyter, text on a terminal): the default progress of
    :func:`sweep`."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="req", leave=False)


def sweep(
    trace: str | os.PathLike | Trace,
    capacities: Iterable[float] | None = None,
    *,
    device_pages: Iterable[int] | None = None,
    policies: Sequence[str] = ("clean_ahead",),
    evictions: Sequence[str] = ("default",),
    host_ratios: Sequence[float] = (4.0,),
    page_size: int | None = None,
    spec: KVSpec | str | None = None,
    load_back_threshold: int = 16,
    progress: bool | Callable[[int, str], Any] = auto_progress,
    diagnose: bool = False,
    layer_pattern: str | None = None,
    window: int | None = None,
    window_share: float | None = None,
    state_share: float | None = None,
    checkpoint_every: int | str | None = None,
) -> SweepResult:
    """Replay ``trace`` at every (L2 ratio, L1 size, write policy, eviction), beside the exact
    LRU references of L1's and L1 + L2's capacity and the infinite cache.

    Args:
        trace: a :class:`Trace`, or what :func:`load_trace` takes.
        capacities: L1 sizes in tokens (rounded down to pages); or ``device_pages`` (pages);
            neither: 1/8 of the trace's distinct pages. One number or several.
        policies, evictions: write policies and eviction strategies (any string
            :class:`HiCacheConfig` takes).
        host_ratios: L2 = ``round(ratio * L1)`` pages (0: L1 only); one number or several.
        page_size: tokens a page; None: the trace's block size (Mooncake) or 16 (tokens).
        spec: page shape: a :class:`KVSpec` (its page size wins), ``"layers=32,kv_heads=8,
            head_dim=128,dtype=bfloat16"`` or None (8 bytes a token).
        progress: a factory ``(total, desc) -> bar`` (default: :func:`auto_progress`), True
            (text bars on a terminal's stderr only) or False.
        diagnose: add where each replay loses against LRU(L1+L2) (the ``diag_*`` figures of
            :func:`hicache_jax.replay.replay`).
        layer_pattern: ``"a:b"`` (e.g. ``"5:1"``): replay a model of ``a`` sliding-window
            layers of ``window`` tokens then ``b`` full ones, repeating
            (:func:`hicache_jax.replay.windows.pattern_spec`; ``spec`` then gives the per-layer
            shape and the layers, default one period of 1 head of dim 1, float32). The
            capacities stay the all-full model's bytes, split between the full-attention and
            the window pools, and each record gets the bytes ratio ``r``, the LRU of ``r x``
            the bytes and the LRU of the same bytes (see :func:`hicache_jax.replay.run`).
            ``"Ra:Fb"`` (e.g. ``"R3:F1"``): a hybrid recurrent model
            (:func:`hicache_jax.replay.states.state_spec`); ``"Ra:Sb:Fc"`` (e.g.
            ``"R2:S1:F1"``, letters in layer order): recurrent, sliding-window (of ``window``
            tokens) and full layers, at the all-full model's bytes split between pages,
            window pages and state slots (:mod:`hicache_jax.replay.mixed`), each record with
            both kinds' figures. ``spec`` is not taken with recurrent layers.
        window: the sliding window in tokens (with ``layer_pattern`` only).
        window_share: the fraction of each tier's bytes in window pages, in (0, 1); None:
            the default rule of :mod:`hicache_jax.replay.windows` (with ``layer_pattern``, or a
            ``spec`` with window groups).
        state_share, checkpoint_every: with a spec of a state group (a hybrid recurrent model,
            e.g. :func:`hicache_jax.replay.states.state_spec`), the fraction of each tier's
            bytes in state slots (None: the default rule of :mod:`hicache_jax.replay.states`)
            and the checkpoint interval in pages (see :func:`hicache_jax.replay.run`).

    Raises:
        ValueError / TypeError naming a bad setting, before anything is replayed.
    """
    trace = load_trace(trace)
    spec = _pattern_spec(layer_pattern, window, window_share, spec, page_size, trace)
    pages = l1_pages(
        trace, spec.page_size, capacities=_listed(capacities), device_pages=_listed(device_pages)
    )
    policies, evictions = _names(policies, "policies"), _names(evictions, "evictions")
    ratios = _listed(host_ratios)
    if not ratios:
        raise ValueError("host_ratios: no ratio given")
    check_configs(pages, ratios, policies, evictions, load_back_threshold)
    reports = [
        _replay.run(
            trace,
            spec,
            device_pages=pages,
            host_ratio=float(ratio),
            write_policies=policies,
            evictions=evictions,
            load_back_threshold=load_back_threshold,
            progress=progress,
            diagnose=diagnose,
            window_share=window_share,
            state_share=state_share,
            checkpoint_every=checkpoint_every,
        )
        for ratio in ratios
    ]
    return SweepResult(reports)


def _listed(values: Any) -> list | None:
    """One number as a list of one (``host_ratios=4``); None stays None."""
    return None if values is None else [values] if is_real(values) else list(values)


def _spec(spec: KVSpec | str | None, page_size: int | None, trace: Trace) -> KVSpec:
    if isinstance(spec, KVSpec):
        if page_size is not None and page_size != spec.page_size:
            raise ValueError(
                f"page_size={page_size} differs from spec.page_size={spec.page_size}; give one"
            )
        return spec
    if spec is not None and not isinstance(spec, str):
        raise TypeError(f"spec={spec!r} must be a KVSpec, a string or None")
    return KVSpec.parse(
        spec,
        _replay.TINY_SPEC,
        page_size=page_size if page_size is not None else trace.default_page_size(),
    )


def _pattern_spec(
    layer_pattern: str | None,
    window: int | None,
    window_share: float | None,
    spec: KVSpec | str | None,
    page_size: int | None,
    trace: Trace,
) -> KVSpec:
    """The sweep's spec: ``spec``'s (:func:`_spec`), or with ``layer_pattern`` the pattern's
    over ``spec``'s per-layer shape. ValueError / TypeError naming the argument."""
    if layer_pattern is None:
        windowed = isinstance(spec, KVSpec) and bool(spec.window_groups)
        for name, value in (("window", window), ("window_share", window_share)):
            if value is not None and not (windowed and name == "window_share"):
                raise ValueError(
                    f"{name}={value!r} needs layer_pattern= (e.g. '5:1')"
                    + ("" if name == "window" else " or a spec with window groups")
                )
        return _spec(spec, page_size, trace)
    kind = _windows.pattern_kind(layer_pattern, "layer_pattern")
    if kind == "state":  # a hybrid recurrent model: "R3:F1"
        given = {"window": window, "window_share": window_share, "spec": spec}
        for name in (n for n, v in given.items() if v is not None):
            raise ValueError(f"{name}= is not taken with a recurrent layer_pattern")
    if kind in ("state", "mixed"):  # all three kinds: "R2:S1:F1", with window=
        if spec is not None:
            raise ValueError(f"spec= is not taken with a recurrent layer_pattern={layer_pattern!r}")
        _windows.check_share(window_share, "window_share")
        ps = page_size if page_size is not None else trace.default_page_size()
        return _states.state_spec(
            layer_pattern, ps, window=window, flag="layer_pattern", window_flag="window"
        )
    _windows.check_share(window_share, "window_share")
    period = _windows.pattern_period(layer_pattern, "layer_pattern")
    ps = page_size if page_size is not None else trace.default_page_size()
    base: KVSpec | None = None
    if isinstance(spec, KVSpec):
        base = _spec(spec, page_size, trace)
        ps = base.page_size
    elif isinstance(spec, str):
        one_period = dataclasses.replace(_replay.TINY_SPEC, num_layers=period)
        base = KVSpec.parse(spec, one_period, page_size=ps, flag="spec")
    elif spec is not None:
        raise TypeError(f"spec={spec!r} must be a KVSpec, a string or None")
    return _windows.pattern_spec(
        layer_pattern, window, ps, base=base, flag="layer_pattern", window_flag="window"
    )


def _names(values: Sequence[str] | str, arg: str) -> list[str]:
    if isinstance(values, str):
        values = [values]
    out = [v.strip() if isinstance(v, str) else v for v in values]
    if not out:
        raise ValueError(f"{arg}: none given")
    return out


# ------------------------------------------------------------------------------------ result


def as_table(records: list[dict[str, Any]]) -> Any:
    """A ``pandas.DataFrame`` of ``records`` when pandas is installed, else the records."""
    try:
        import pandas
    except ImportError:
        return [dict(r) for r in records]
    return pandas.DataFrame.from_records(records)


@dataclasses.dataclass(eq=True)
class SweepResult:
    """What :func:`sweep` returns: one :func:`hicache_jax.replay.run` report per L2 ratio.

    Attributes:
        reports: the reports, in the order of ``host_ratios`` (plain JSON values: ``trace``,
            ``spec``, ``host_ratio``, ``references``, ``results``; see ``replay.run``).
    """

    reports: list[dict[str, Any]]

    def records(self, timing: bool = True) -> list[dict[str, Any]]:
        """One flat record per replay: the settings (``config`` is "policy/eviction",
        ``device_tokens`` L1's size in tokens), then every figure of the replay
        (``bytes_moved`` = bytes to host + bytes to device). ``timing=False`` leaves out
        :data:`TIMING_FIELDS`, the only figures that differ between two runs."""
        out = []
        for rep in self.reports:
            name = os.path.basename(rep["trace"]["path"])
            for r in rep["results"]:
                rec = dict(
                    r,
                    trace=name,
                    host_ratio=rep["host_ratio"],
                    config=f"{r['write_policy']}/{r['eviction']}",
                    device_tokens=r["device_pages"] * r["page_size"],
                    bytes_moved=r["bytes_to_host"] + r["bytes_to_device"],
                )
                rec = {k: rec[k] for k in _LEAD} | rec
                out.append({k: v for k, v in rec.items() if timing or k not in TIMING_FIELDS})
        return out

    def table(self) -> Any:
        """:meth:`records` as a ``pandas.DataFrame`` (pandas installed), else as the list."""
        return as_table(self.records())

    def plot(self, ax: Any = None, y: str = "hit_ratio") -> Any:
        """Draw ``y`` against L1 capacity (tokens, log scale) on ``ax`` (None: a new figure),
        one line per configuration and L2 ratio; for ``hit_ratio`` also the LRU references and
        the infinite cache; ``bytes_*`` figures in MiB. Returns ``ax``.

        Raises:
            ImportError naming the extra to install when matplotlib is missing;
            ValueError for a ``y`` that is not a numeric figure of the records.
        """
        try:
            import matplotlib.pyplot as plt
        except ImportError:
            raise ImportError(
                'SweepResult.plot needs matplotlib: pip install -e ".[notebook]" '
                '(or ".[plot]", or pip install matplotlib)'
            ) from None
        recs = self.records()
        if not recs or not all(_is_number(r.get(y)) for r in recs):
            raise ValueError(
                f"y={y!r} must be a numeric figure of the records, e.g. "
                "hit_ratio, bytes_moved, bytes_to_host, evicted_pages"
            )
        if ax is None:
            _, ax = plt.subplots(figsize=(7, 4.5))
        scale = 2.0**-20 if y.startswith("bytes") else 1.0
        ratios = list(dict.fromkeys(r["host_ratio"] for r in recs))
        for key in dict.fromkeys((r["config"], r["host_ratio"]) for r in recs):
            pts = sorted(
                (r["device_tokens"], r[y] * scale)
                for r in recs
                if (r["config"], r["host_ratio"]) == key
            )
            label = key[0] if len(ratios) == 1 else f"{key[0]}, L2 {key[1]:g}x"
            ax.plot(*zip(*pts), marker="o", label=label)
        if y == "hit_ratio":
            _draw_references(ax, recs, ratios)
        title = recs[0]["trace"].removesuffix(".jsonl")
        ax.set(
            xscale="log",
            xlabel="L1 capacity (tokens)",
            ylabel=y.replace("_", " ") + (" (MiB)" if scale != 1.0 else ""),
            title=title + (f": L2 = {ratios[0]:g} x L1" if len(ratios) == 1 else ""),
        )
        ax.set_ylim(bottom=0)
        ax.legend(fontsize="small")
        return ax

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        """The result as JSON text (written to ``path`` too when given); :func:`from_json`
        reads it back equal."""
        text = json.dumps({"format": FORMAT, "reports": self.reports}, indent=1)
        if path is not None:
            pathlib.Path(path).write_text(text + "\n")
        return text

    @classmethod
    def from_json(cls, source: str | os.PathLike) -> SweepResult:
        """Read :meth:`to_json`'s text, or a file holding it (or a ``hicache-jax replay --json``
        file: one report)."""
        return from_json(source)

    def __repr__(self) -> str:
        n = sum(len(r["results"]) for r in self.reports)
        names = ", ".join(dict.fromkeys(os.path.basename(r["trace"]["path"]) for r in self.reports))
        return f"SweepResult({n} replays of {names or 'no trace'})"


def from_json(source: str | os.PathLike) -> SweepResult:
    """A :class:`SweepResult` from :meth:`SweepResult.to_json`'s text or file, or from a
    ``hicache-jax replay --json`` file. ValueError when it is neither."""
    text = os.fspath(source)
    if not text.lstrip().startswith("{"):
        text = pathlib.Path(text).read_text()
    data = json.loads(text)
    if isinstance(data, dict) and data.get("format") == FORMAT:
        reports = data["reports"]
    elif isinstance(data, dict) and data.get("benchmark") == "hicache-jax replay":
        reports = [{k: data[k] for k in ("trace", "spec", "host_ratio", "references", "results")}]
    else:
        raise ValueError(f"source: not a {FORMAT} result nor a hicache-jax replay --json file")
    return SweepResult(reports)


def _draw_references(ax: Any, recs: list[dict[str, Any]], ratios: list[float]) -> None:
    """LRU(L1) (one curve: it does not depend on L2), LRU(L1+L2) per ratio, the infinite cache."""

    def curve(sel: list[dict[str, Any]], key: str) -> tuple:
        return tuple(zip(*sorted({(r["device_tokens"], r[key]) for r in sel})))

    ax.plot(*curve(recs, "lru_l1_hit_ratio"), "k--", label="LRU(L1)")
    for ratio in ratios:
        sel = [r for r in recs if r["host_ratio"] == ratio]
        label = "LRU(L1+L2)" if len(ratios) == 1 else f"LRU(L1+L2), L2 {ratio:g}x"
        ax.plot(*curve(sel, "lru_total_hit_ratio"), "k-.", label=label)
    ax.axhline(recs[0]["infinite_hit_ratio"], color="grey", ls=":", label="infinite")


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
