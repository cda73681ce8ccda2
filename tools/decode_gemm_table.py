#!/usr/bin/env python3
"""One table of a Google Benchmark counter over several JSON files.

    python3 tools/decode_gemm_table.py [--counter graph_us] a.json b.json ...

A row per benchmark (its name up to "/iterations" or "/manual_time"), a
column per file (named by the file's stem), the counter of the median
aggregate where the benchmark repeated, else of its one run; "error" where
the benchmark failed, "-" where the file lacks it. tools/gpu-decode-gemm.sh
prints its decode GEMM and mode-cost tables with it.
"""
import argparse
import json
import os
import re
import sys


def rows_of(path, counter):
    """{benchmark name: value or 'error'} of one JSON file."""
    with open(path) as f:
        doc = json.load(f)
    out = {}
    for b in doc.get("benchmarks", []):
        name = re.split(r"/(iterations|manual_time|repeats)", b["name"])[0]
        if b.get("error_occurred"):
            out[name] = "error"
            continue
        if b.get("run_type") == "aggregate":
            if b.get("aggregate_name") != "median":
                continue
        elif b.get("repetitions", 1) > 1:
            continue  # one run of a repeated benchmark: its median row follows
        if counter in b:
            out[name] = f"{b[counter]:.4g}"
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--counter", default="graph_us")
    ap.add_argument("files", nargs="+")
    args = ap.parse_args()
    columns, names = [], []
    for path in args.files:
        label = os.path.splitext(os.path.basename(path))[0]
        try:
            rows = rows_of(path, args.counter)
        except (OSError, ValueError) as e:
            print(f"{path}: unreadable ({e})", file=sys.stderr)
            rows = {}
        columns.append((label, rows))
        names += [n for n in rows if n not in names]
    width = max([len(n) for n in names] + [10])
    print(f"{args.counter:<{width}} " + " ".join(f"{label:>16}" for label, _ in columns))
    for n in names:
        print(f"{n:<{width}} " + " ".join(f"{rows.get(n, '-'):>16}" for _, rows in columns))
    return 0


if __name__ == "__main__":
    sys.exit(main())
