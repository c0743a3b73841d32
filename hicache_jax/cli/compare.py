"""``hicache-jax compare A.json B.json [--plot out.png]``: two benchmark runs side by side.

Each file is a results document of :mod:`hicache_jax.cli.results` (what
``benchmarks/run_gpu_all.sh`` and ``benchmarks/run_tpu_all.sh`` write: one per device run) or a
single writer's JSON (``hicache-jax bench --json``, ``hicache-jax replay --json``, a benchmark
script's), mapped to that schema on the fly. The table has one row per figure in either run:
its unit, then for A and for B the figure (with its interval where it has one), its limit
(measured in the same run) and its share of the limit (1.00 = at the limit, oriented so
higher is better for times too), and B's figure over A's. The figures the two share come
first; after the table, the figures only one of them has are listed by name. The plot shows
the two runs' shares of their limits as bars, figure by figure (needs matplotlib: ``pip
install -e ".[plot]"``).
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from hicache_jax.cli.results import as_results

__all__ = ["add_parser", "compare_command", "load", "plot", "rows", "table"]


def load(path: str) -> dict[str, Any]:
    """The results document in ``path`` (a script's own JSON is collected on the fly).

    Raises:
        OSError: unreadable.  ValueError: not JSON, or not a benchmark result.
    """
    with open(path) as f:
        try:
            doc = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
    try:
        return as_results(doc)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def _label(doc: dict) -> str:
    env = doc.get("env", {})
    return (
        f"{env.get('backend', '?')} {env.get('device_kind', '?')} x"
        f"{env.get('device_count', '?')}, jax {env.get('jax', '?')}, {env.get('date', '?')}"
    )


def rows(a: dict, b: dict) -> list[dict[str, Any]]:
    """One row per figure name in A or B: the names both have (A's order), then A's own, then
    B's own; each ``name, unit`` and ``a`` / ``b`` (the figure dicts or None), ``b_over_a``
    (B's value / A's, None when either is missing)."""
    fa = {f["name"]: f for f in a.get("figures", [])}
    fb = {f["name"]: f for f in b.get("figures", [])}
    shared = [n for n in fa if n in fb]
    out = []
    for name in shared + [n for n in fa if n not in fb] + [n for n in fb if n not in fa]:
        x, y = fa.get(name), fb.get(name)
        first = x or y
        assert first is not None  # the name is one of A's or B's figures
        unit = first["unit"]
        ratio = y["value"] / x["value"] if x and y and x["value"] else None
        out.append(dict(name=name, unit=unit, a=x, b=y, b_over_a=ratio))
    return out


def _num(v: float | None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"


def _value(f: dict) -> str:
    """A figure's value, with its interval where it has one (``0.38 [0.32-0.58]``)."""
    text = _num(f.get("value"))
    if f.get("interval"):
        low, high = f["interval"]
        text += f" [{_num(low)}-{_num(high)}]"
    return text


def only_in(a: dict, b: dict) -> tuple[list[str], list[str]]:
    """The figure names only A has, and those only B has (each in its file's order)."""
    na = [f["name"] for f in a.get("figures", [])]
    nb = [f["name"] for f in b.get("figures", [])]
    return [n for n in na if n not in set(nb)], [n for n in nb if n not in set(na)]


#: Settings that say where a run wrote its output (or its command line), not how it ran.
_OUTPUT_FLAGS = ("argv", "json", "plot", "quiet", "metrics_port")


def config_differences(a: dict, b: dict) -> list[str]:
    """``name: A's value vs B's`` for each setting of a writer both files ran (their
    ``sources``) that differs, output flags aside."""
    out = []
    sa, sb = a.get("sources") or {}, b.get("sources") or {}
    for src in [s for s in sa if s in sb]:
        ca, cb = sa[src] or {}, sb[src] or {}
        for key in [k for k in ca if k in cb and k not in _OUTPUT_FLAGS]:
            if ca[key] != cb[key]:
                out.append(f"{key}: {ca[key]!r} vs {cb[key]!r}")
    return out


def table(a: dict, b: dict) -> str:
    """The side-by-side table as text (A and B described in the two header lines; then the
    figures only one file has, listed)."""
    header = ("figure", "unit", "A", "A limit", "A/limit", "B", "B limit", "B/limit", "B/A")
    body = []
    for r in rows(a, b):
        x, y = r["a"] or {}, r["b"] or {}
        body.append(
            (
                r["name"],
                r["unit"],
                _value(x) if x else "-",
                _num(x.get("limit")),
                _num(x.get("ratio")),
                _value(y) if y else "-",
                _num(y.get("limit")),
                _num(y.get("ratio")),
                _num(r["b_over_a"]),
            )
        )
    widths = [max(len(str(c[i])) for c in [header, *body]) for i in range(len(header))]
    fmt = lambda cells: "  ".join(  # noqa: E731
        str(c).ljust(w) if i < 2 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
    )
    limits = {
        f["name"]: f["limit_name"]
        for f in a.get("figures", []) + b.get("figures", [])
        if f.get("limit_name")
    }
    lines = [f"A: {_label(a)}", f"B: {_label(b)}"]
    diffs = config_differences(a, b)
    if diffs:
        lines.append("settings that differ (A vs B): " + "; ".join(diffs))
    lines += ["", fmt(header), fmt(["-" * w for w in widths])]
    lines += [fmt(c) for c in body]
    just_a, just_b = only_in(a, b)
    n_shared = len(body) - len(just_a) - len(just_b)
    lines += ["", f"figures in both: {n_shared}"]
    for who, names in (("A", just_a), ("B", just_b)):
        lines.append(f"only in {who} ({len(names)}): " + ("; ".join(names) if names else "none"))
    if limits:
        lines.append(
            "limits (each measured in its own run): "
            + "; ".join(sorted({f"{n.split(' ')[0]}: {v}" for n, v in limits.items()}))
        )
    lines.append(
        "X/limit: share of the limit, 1.00 = at it (limit/X for times); B/A: B's figure over "
        "A's; '-': no such figure or limit"
    )
    return "\n".join(lines)


def plot(a: dict, b: dict, path: str) -> None:
    """Bars of A's and B's share of their limits, one pair per figure, written to ``path``.

    Raises:
        ImportError: matplotlib is not installed (``pip install -e ".[plot]"``).
    """
    try:
        import matplotlib
    except ImportError:
        raise ImportError('--plot needs matplotlib: pip install -e ".[plot]"') from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rs = rows(a, b)
    names = [r["name"] for r in rs]
    ys = range(len(rs))

    def get(r: dict, k: str) -> float:  # log axis: a missing or non-positive share is not drawn
        v = (r[k] or {}).get("ratio")
        return v if v is not None and v > 0 else float("nan")

    fig, ax = plt.subplots(figsize=(9, 0.32 * len(rs) + 1.6))
    ax.barh([y - 0.2 for y in ys], [get(r, "a") for r in rs], 0.4, label="A: " + _label(a))
    ax.barh([y + 0.2 for y in ys], [get(r, "b") for r in rs], 0.4, label="B: " + _label(b))
    ax.axvline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xscale("log")  # shares span decades (a kernel in an interpreter, a cached serve)
    ax.set_yticks(list(ys), names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("share of the limit measured in the same run (1 = at the limit; log scale)")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_parser(sub: Any) -> None:
    """The ``compare`` subcommand (``hicache-jax compare``)."""
    p = sub.add_parser(
        "compare",
        help="two benchmark result files side by side",
        description=__doc__.split("\n")[0],
    )
    p.add_argument("a", metavar="A.json")
    p.add_argument("b", metavar="B.json")
    p.add_argument("--plot", metavar="PATH", help="bars of each figure's share of its limit")
    p.set_defaults(func=compare_command)


def compare_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Print the table (and write the plot)."""
    try:
        a, b = load(args.a), load(args.b)
        if not a["figures"] and not b["figures"]:
            raise ValueError("neither file has a figure to compare")
        text = table(a, b)
        if args.plot:
            plot(a, b, args.plot)
    except (OSError, ValueError, ImportError) as exc:
        parser.exit(2, f"hicache-jax compare: error: {exc}\n")
    print(text)
    if args.plot:
        print(f"wrote {args.plot}")
    return 0
