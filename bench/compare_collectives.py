#!/usr/bin/env python3
"""Puts bench_collectives (Google Benchmark JSON) beside torch_collectives.py's JSON.

    compare_collectives.py --slime bench_collectives.json --torch torch_collectives.json

Prints one row per op and size: slime's bus bandwidth (the median over
repetitions, Google Benchmark's "median" aggregate; the mean of the runs when
there are no aggregates), torch's (median over batches), and slime / torch.
Bus bandwidth is nccl-tests' busbw, in GB/s: algbw * (n - 1) / n with
algbw = size / time, size being the bytes of the larger buffer of one rank.

Exit status: 0 when every row has both numbers and both correctness checks
passed, 1 otherwise (the table is printed either way). Standard library only.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_util  # noqa: E402  (bench/, beside this script)


def human_bytes(n):
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def load_slime(path):
    """{(op, bytes): {"busbw": float | None, "error": str | None}} from Google Benchmark's JSON."""
    with open(path) as f:
        doc = json.load(f)
    out = {}
    # Only the runs and their median (the stddev and cv aggregates carry
    # counters that are statistics too): bench_util.gbench_results.
    for name, row in bench_util.gbench_results(doc).items():
        parts = name.split("/")  # "all_gather/1048576"
        try:
            size = int(parts[1])
        except (IndexError, ValueError):
            if row.get("bytes") is None:
                continue
            size = int(row["bytes"])
        busbw = row.get("busbw_GBps")
        out[(parts[0], size)] = {"busbw": None if busbw is None else float(busbw), "error": row.get("error")}
    return out, doc.get("context", {})


def load_torch(path):
    with open(path) as f:
        doc = json.load(f)
    out = {}
    for r in doc.get("results", []):
        error = r.get("error") or (None if r.get("correct", True) else "wrong result")
        out[(r["op"], int(r["bytes"]))] = {"busbw": r.get("busbw_GBps"), "error": error}
    return out, doc.get("context", {})


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--slime", required=True, help="bench_collectives --benchmark_out=... --benchmark_out_format=json")
    p.add_argument("--torch", required=True, help="torch_collectives.py --out ...")
    args = p.parse_args()

    problems = []
    try:
        slime, slime_ctx = load_slime(args.slime)
    except (OSError, ValueError) as e:
        slime, slime_ctx = {}, {}
        problems.append(f"cannot read {args.slime}: {e}")
    try:
        torch, torch_ctx = load_torch(args.torch)
    except (OSError, ValueError, KeyError) as e:
        torch, torch_ctx = {}, {}
        problems.append(f"cannot read {args.torch}: {e}")

    order = {"all_gather": 0, "reduce_scatter": 1, "all_to_all": 2}
    keys = sorted(set(slime) | set(torch), key=lambda k: (order.get(k[0], 99), k[0], k[1]))
    header = f"{'op':<15} {'size':>8} {'slime busbw':>12} {'torch busbw':>12} {'ratio':>7}"
    print("bus bandwidth, GB/s (nccl-tests busbw; ratio = slime / torch)")
    print(f"slime: NCCL {slime_ctx.get('nccl_version', '?')}; torch: {torch_ctx.get('torch', '?')}, "
          f"NCCL {torch_ctx.get('nccl', '?')}, {torch_ctx.get('world_size', '?')} ranks")
    print(header)
    print("-" * len(header))
    for key in keys:
        s, t = slime.get(key, {}), torch.get(key, {})
        sb, tb = s.get("busbw"), t.get("busbw")
        cell = lambda v: f"{v:12.2f}" if isinstance(v, (int, float)) else f"{'-':>12}"  # noqa: E731
        ratio = f"{sb / tb:7.3f}" if sb and tb else f"{'-':>7}"
        notes = []
        if s.get("error"):
            notes.append(f"slime: {s['error']}")
        if t.get("error"):
            notes.append(f"torch: {t['error']}")
        if sb is None and not s.get("error"):
            notes.append("slime: missing")
        if tb is None and not t.get("error"):
            notes.append("torch: missing")
        print(f"{key[0]:<15} {human_bytes(key[1]):>8} {cell(sb)} {cell(tb)} {ratio}" +
              (f"  ({'; '.join(notes)})" if notes else ""))
        if notes:
            problems.append(f"{key[0]} {human_bytes(key[1])}: {'; '.join(notes)}")
    if not keys:
        problems.append("no results in either file")
    for msg in problems:
        print(f"problem: {msg}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
