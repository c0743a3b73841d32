"""Collect one device run's benchmark JSONs into one results file (``hicache_jax.cli.results``).

``benchmarks/run_gpu_all.sh`` and ``benchmarks/run_tpu_all.sh`` end with it: every ``*.json`` in
the run's folder (each script's own) becomes one document of the schema ``hicache-jax compare``
reads, each figure beside its limit measured in the same run. Prints the figures.

Usage: python -m benchmarks.collect DIR [--json DIR/results.json]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

from hicache_jax.cli.results import collect


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", help="folder of the run's JSON files")
    ap.add_argument("--json", help="the results file to write (default DIR/results.json)")
    args = ap.parse_args(argv)
    out = args.json or os.path.join(args.dir, "results.json")
    docs = []
    for path in sorted(glob.glob(os.path.join(args.dir, "*.json"))):
        if os.path.abspath(path) == os.path.abspath(out):
            continue
        try:
            with open(path) as f:
                docs.append(json.load(f))
        except (OSError, ValueError) as e:  # a step killed mid-write: say so, keep the rest
            print(f"skipped {path}: {e}", file=sys.stderr)
    if not docs:
        print(f"no JSON results in {args.dir}", file=sys.stderr)
        return 2
    doc = collect(docs)
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    for fig in doc["figures"]:
        limit = (
            "(no limit)"
            if fig["limit"] is None
            else f"limit {fig['limit']:>10.4g} ({fig['limit_name']}): {fig['ratio']:.2f}"
        )
        print(f"{fig['name']:<48} {fig['value']:>10.4g} {fig['unit']:<5} {limit}")
    if doc["skipped"]:
        print(f"not collected (no figure in them): {doc['skipped']}")
    print(f"wrote {out}: {len(doc['figures'])} figures")
    return 0


if __name__ == "__main__":
    sys.exit(main())
