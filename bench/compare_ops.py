#!/usr/bin/env python3
"""Prints slime's op benchmarks beside their PyTorch baselines.

--slime: Google Benchmark JSON (--benchmark_out_format=json) of bench_<family>.
--torch: the baseline's results: a JSON list, or JSON lines, of objects with
         "name" (or "bench") and "us" (median microseconds), plus any rates.
Benchmarks are matched by name after dropping Google Benchmark's suffixes
(/manual_time, /iterations:N, /real_time, aggregate names). Ratio = torch time
/ slime time, so > 1 means slime is faster.
"""
import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_util  # noqa: E402  (bench/, beside this script)


def load_torch(path):
    text = open(path).read().strip()
    if not text:
        return {}
    try:
        data = json.loads(text)
        rows = data if isinstance(data, list) else data.get("results", [data])
    except json.JSONDecodeError:
        rows = [json.loads(line) for line in text.splitlines() if line.strip().startswith("{")]
    out = {}
    for r in rows:
        name = r.get("name") or r.get("bench")
        if name is not None and "us" in r:
            out[name] = r
    return out


def rate(row):
    # Prefer a FLOP rate (matrix work), then a byte rate (memory-bound work).
    for want in ("tflops", "tflop/s", "gbps", "gb/s", "busbw_gbps"):
        for key, value in row.items():
            if key.lower() == want and isinstance(value, (int, float)):
                return f"{value:.1f} {key}"
    return ""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--slime", required=True)
    ap.add_argument("--torch", required=True)
    args = ap.parse_args()
    slime = bench_util.gbench_results(args.slime)
    torch = load_torch(args.torch)
    family = re.sub(r"^bench_|\.json$", "", args.slime.split("/")[-1])
    print(f"{family}: slime vs PyTorch (ratio = torch time / slime time; > 1: slime faster)")
    print(f"{'benchmark':<44} {'slime us':>10} {'torch us':>10} {'ratio':>7}  slime rate / torch rate")
    for name in sorted(set(slime) | set(torch)):
        s, t = slime.get(name), torch.get(name)
        if s and "error" in s:
            print(f"{name:<44} error: {s['error']}")
            continue
        su = f"{s['us']:.1f}" if s else "-"
        tu = f"{t['us']:.1f}" if t else "-"
        ratio = f"{t['us'] / s['us']:.2f}" if s and t and s["us"] > 0 else "-"
        rates = " / ".join(x for x in (rate(s) if s else "", rate(t) if t else "") if x)
        print(f"{name:<44} {su:>10} {tu:>10} {ratio:>7}  {rates}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
