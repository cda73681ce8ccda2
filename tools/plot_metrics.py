#!/usr/bin/env python3
"""Plot a slime metrics JSONL file (slime/io/metrics_log.hpp) to a PNG.

One panel per quantity found in the file: reward, loss, KL, TIS weight,
tokens/s and the step phases, each holding every key that matches it (e.g. reward and reward_std),
plotted against step. Keys are matched case-insensitively:

  reward      keys containing "reward"
  loss        keys containing "loss"
  KL          keys equal to "kl" or starting with "kl_"/"kl/" or ending with "_kl"/"/kl"
  TIS weight  keys containing "tis" or "importance"
  tokens/s    keys containing "tok" and "/s" or "per_s" or "per_sec", or "throughput"
  phases      rollout_seconds, train_seconds, sync_seconds (the RL example's step split)

--keys a,b,c plots those keys instead, one panel each. Null values (NaN or inf
when written) are gaps. A resumed run's repeated steps keep the last line.

Needs matplotlib (not a dependency of slime's build or tests):
    python3 -m pip install matplotlib

Usage: tools/plot_metrics.py metrics.jsonl [-o metrics.png] [--keys reward,loss] [--smooth 10]
"""

import argparse
import json
import math
import re
import sys

PANELS = [
    ("reward", lambda k: "reward" in k),
    ("loss", lambda k: "loss" in k),
    ("KL", lambda k: re.search(r"(^|[_/])kl($|[_/])", k) is not None),
    ("TIS weight", lambda k: "tis" in k or "importance" in k),
    ("tokens/s", lambda k: "throughput" in k or ("tok" in k and re.search(r"(/s|per_s|per_sec)$", k) is not None)),
    ("step phases (s)", lambda k: k in ("rollout_seconds", "train_seconds", "sync_seconds")),
]


def read_jsonl(path):
    """Returns {step: {key: float or None}} (last line of a step wins) and the keys in first-seen order."""
    rows, keys = {}, []
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(lines):  # a torn last line (no newline): the writer crashed mid-line
                break
            raise SystemExit(f"{path}:{i}: not JSON: {e}")
        if not isinstance(obj, dict) or not isinstance(obj.get("step"), int):
            raise SystemExit(f'{path}:{i}: expected an object with an integer "step"')
        values = {}
        for k, v in obj.items():
            if k in ("step", "time"):
                continue
            if v is not None and not isinstance(v, (int, float)):
                continue  # not a scalar: not plotted
            values[k] = None if v is None else float(v)
            if k not in keys:
                keys.append(k)
        rows[obj["step"]] = values
    return rows, keys


def smooth(ys, window):
    """Trailing moving average over the finite values; gaps stay gaps."""
    out, buf = [], []
    for y in ys:
        if y is None or not math.isfinite(y):
            out.append(float("nan"))
            continue
        buf.append(y)
        if len(buf) > window:
            buf.pop(0)
        out.append(sum(buf) / len(buf))
    return out


def choose_panels(keys, explicit):
    if explicit:
        missing = [k for k in explicit if k not in keys]
        if missing:
            raise SystemExit(f"keys not in the file: {', '.join(missing)} (present: {', '.join(keys)})")
        return [(k, [k]) for k in explicit]
    panels = []
    for title, match in PANELS:
        ks = [k for k in keys if match(k.lower())]
        if ks:
            panels.append((title, ks))
    if not panels:
        raise SystemExit("no reward, loss, KL, TIS weight or tokens/s keys in the file "
                         f"(present: {', '.join(keys) or 'none'}); choose some with --keys")
    return panels


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("jsonl", help="metrics JSONL file")
    ap.add_argument("-o", "--output", help="PNG to write (default: the JSONL path with .png)")
    ap.add_argument("--keys", help="comma-separated keys, one panel each (default: the standard panels)")
    ap.add_argument("--smooth", type=int, default=0, help="overlay a trailing moving average over N steps")
    ap.add_argument("--title", help="figure title (default: the file name)")
    args = ap.parse_args(argv)

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("plot_metrics.py needs matplotlib, which is not installed: python3 -m pip install matplotlib")

    try:
        rows, keys = read_jsonl(args.jsonl)
    except OSError as e:
        sys.exit(f"cannot read {args.jsonl}: {e.strerror}")
    if not rows:
        sys.exit(f"{args.jsonl}: no metrics lines")
    if args.smooth < 0:
        sys.exit("--smooth must be >= 0")
    panels = choose_panels(keys, [k.strip() for k in args.keys.split(",") if k.strip()] if args.keys else None)

    steps = sorted(rows)
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.4 * len(panels) + 0.6), sharex=True, squeeze=False)
    for ax, (title, ks) in zip(axes[:, 0], panels):
        for k in ks:
            ys = [rows[s].get(k) for s in steps]
            ys = [float("nan") if y is None else y for y in ys]
            if args.smooth > 1:
                line, = ax.plot(steps, ys, alpha=0.3, linewidth=1)
                ax.plot(steps, smooth(ys, args.smooth), color=line.get_color(), linewidth=1.5, label=k)
            else:
                ax.plot(steps, ys, linewidth=1.5, marker="." if len(steps) <= 50 else None, label=k)
        ax.set_ylabel(title)
        ax.grid(True, alpha=0.3)
        if len(ks) > 1 or args.keys:
            ax.legend(fontsize="small", loc="best")
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(args.title or args.jsonl, fontsize="medium")
    fig.tight_layout()
    out = args.output or re.sub(r"\.jsonl?$", "", args.jsonl) + ".png"
    fig.savefig(out, dpi=110)
    print(f"wrote {out} ({len(panels)} panels, {len(steps)} steps)")


if __name__ == "__main__":
    main()
