"""``hicache-jax compare A.json B.json [--plot out.png]``: two benchmark runs side by side.

Each file is a results document of :mod:`hicache_jax.cli.results` (what
``benchmarks/run_gpu_all.sh`` and ``benchmarks/run_tpu_all.sh`` write: one per device run) or a
single benchmark script's JSON. The table has one row per figure in either run: its unit, then
for A and for B the figure, its limit (measured in the same run) and its share of the limit
(1.00 = at the limit, oriented so higher is better for times too), and B's figure over A's.
The plot shows the two runs' shares of their limits as bars, figure by figure (needs
matplotlib: ``pip install -e ".[plot]"``).
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
    """One row per figure name in A or B (A's order, then B's new ones): ``name, unit`` and
    ``a`` / ``b`` (the figure dicts or None), ``b_over_a`` (B's value / A's, None when either
    is missing)."""
    fa = {f["name"]: f for f in a.get("figures", [])}
    fb = {f["name"]: f for f in b.get("figures", [])}
    out = []
    for name in list(fa) + [n for n in fb if n not in fa]:
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


def table(a: dict, b: dict) -> str:
    """The side-by-side table as text (A and B described in the two header lines)."""
    header = ("figure", "unit", "A", "A limit", "A/limit", "B", "B limit", "B/limit", "B/A")
    body = []
    for r in rows(a, b):
        x, y = r["a"] or {}, r["b"] or {}
        body.append(
            (
                r["name"],
                r["unit"],
                _num(x.get("value")),
                _num(x.get("limit")),
                _num(x.get("ratio")),
                _num(y.get("value")),
                _num(y.get("limit")),
                _num(y.get("ratio")),
                _num(r["b_over_a"]),
            )
        )
    widths = [max(len(str(c[i])) for c in [header, *body]) for i in range(len(header))]
    fmt = lambda cells: "  ".join(  # noqa: E731
        str(c).ljust(w) if i < 2 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
    )
    limits = {f["name"]: f["limit_name"] for f in a.get("figures", []) + b.get("figures", [])}
    lines = [f"A: {_label(a)}", f"B: {_label(b)}", "", fmt(header), fmt(["-" * w for w in widths])]
    lines += [fmt(c) for c in body]
    lines += [
        "",
        "limits (each measured in its own run): "
        + "; ".join(sorted({f"{n.split(' ')[0]}: {v}" for n, v in limits.items()})),
    ]
    lines.append(
        "X/limit: share of the limit, 1.00 = at it (limit/X for times); B/A: B's figure over A's"
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
        v = (r[k] or {}).get("ratio", float("nan"))
        return v if v > 0 else float("nan")

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
