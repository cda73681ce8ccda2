"""The harness shared by the PyTorch baselines (bench/torch_*.py) and the
comparison scripts (bench/compare_*.py).

    parser(doc, out, warmup, reps, batch)   argparse with --out, --warmup,
                                            --reps, --batch
    cuda_device()                           cuda:0, or exit "no CUDA device"
    time_us(run, warmup, reps, batch)       CUDA-event timing: the median over
                                            batches of batch time / batch, in us
    tflops(flop, us), gbps(nbytes, us)      rates of one call
    copy_timer(device, warmup, reps, batch) copy_time(nbytes): time_us of a
                                            device-to-device copy, cached
    copy_bound_row(name, nbytes, us, copy_us, err, tol, **extra)
                                            a JSON row with gbps, copy_gbps,
                                            frac_of_copy and the check verdict
    run_copy_bound_cases(cases, copy_time, args, tol)
                                            times (name, nbytes, setup) cases
                                            against a copy of nbytes // 2
    context(args, device, ...)              the "context" block of the JSON
    write_doc(path, rows, ctx)              {"context": ctx, "results": rows}
    gbench_name(run_name), gbench_results(path or doc)
                                            Google Benchmark JSON (bench_<family>
                                            --benchmark_out_format=json) read
                                            back: medians by benchmark name

The scripts run from the repository root (python3 bench/torch_x.py) and put
their own directory on sys.path to import this module. Standard library only
at import time: torch is imported where it is needed, so the comparison
scripts run without it and torch_collectives.py can set its environment
before torch loads.
"""

import argparse
import json
import statistics

TIME_SCALE_US = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}


def parser(doc, out, warmup, reps, batch, out_help=None, warmup_help=None, batch_help="calls per timed batch"):
    """The options every baseline takes; callers add their own."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--out", default=out, help=out_help)
    p.add_argument("--warmup", type=int, default=warmup, help=warmup_help)
    p.add_argument("--reps", type=int, default=reps, help="timed batches; the median is reported")
    p.add_argument("--batch", type=int, default=batch, help=batch_help)
    return p


def cuda_device():
    """torch.device("cuda", 0); exits with "no CUDA device" when there is none."""
    import sys

    import torch

    if not torch.cuda.is_available():
        sys.exit("no CUDA device")
    return torch.device("cuda", 0)


def time_us(run, warmup, reps, batch, device=None):
    """warmup untimed calls of run(), then reps batches of batch calls between two
    CUDA events on the current stream; the median over batches of batch time /
    batch, in microseconds."""
    import torch

    for _ in range(warmup):
        run()
    torch.cuda.synchronize(device)
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    times_ms = []
    for _ in range(reps):
        start.record()
        for _ in range(batch):
            run()
        end.record()
        end.synchronize()
        times_ms.append(start.elapsed_time(end) / batch)
    return statistics.median(times_ms) * 1e3


def tflops(flop, us):
    return flop / (us * 1e-6) / 1e12


def gbps(nbytes, us):
    return nbytes / (us * 1e-6) / 1e9


def copy_timer(device, warmup, reps, batch, empty_cache=False):
    """copy_time(nbytes): time_us of one device-to-device copy of nbytes bytes
    (uint8 tensors made for it and freed after; torch.cuda.empty_cache() after
    when empty_cache), cached per size."""
    import torch

    cache = {}

    def copy_time(nbytes):
        if nbytes not in cache:
            src = torch.empty(nbytes, dtype=torch.uint8, device=device)
            dst = torch.empty_like(src)
            cache[nbytes] = time_us(lambda: dst.copy_(src), warmup, reps, batch)
            del src, dst
            if empty_cache:
                torch.cuda.empty_cache()
        return cache[nbytes]

    return copy_time


def copy_bound_row(name, nbytes, us, copy_us, err, tol, **extra):
    """The JSON row of a memory-bound case timed beside a copy of the same
    traffic (copy_us: the copy of nbytes // 2); extra keys go after "bytes";
    "error" is set when err > tol."""
    rate = gbps(nbytes, us)
    copy_rate = gbps(nbytes, copy_us)
    row = {
        "bench": name,
        "us": us,
        "gbps": rate,
        "copy_gbps": copy_rate,
        "frac_of_copy": rate / copy_rate,
        "bytes": nbytes,
        **extra,
        "correct": err <= tol,
    }
    if err > tol:
        row["error"] = f"relative error {err:.3g} > {tol}"
    return row


def run_copy_bound_cases(cases, copy_time, args, tol):
    """For each (name, nbytes, setup) of cases: run, check = setup(); err =
    check(); time run() (args.warmup, args.reps, args.batch) and a copy of
    nbytes // 2; print and keep copy_bound_row(.., tol(name)); free the case
    (torch.cuda.empty_cache()). Returns (rows, failed)."""
    import torch

    rows, failed = [], False
    for name, nbytes, setup in cases:
        run, check = setup()
        err = check()
        us = time_us(run, args.warmup, args.reps, args.batch)
        row = copy_bound_row(name, nbytes, us, copy_time(nbytes // 2), err, tol(name))
        failed = failed or "error" in row
        rows.append(row)
        print(json.dumps(row), flush=True)
        del run, check
        torch.cuda.empty_cache()
    return rows, failed


def context(args, device, cuda=True, **fields):
    """{"torch", "cuda" (unless cuda=False), "device", "dtype": "bf16", fields...,
    "warmup", "reps", "batch"}."""
    import torch

    ctx = {"torch": torch.__version__}
    if cuda:
        ctx["cuda"] = torch.version.cuda
    ctx["device"] = torch.cuda.get_device_name(device)
    ctx["dtype"] = "bf16"
    ctx.update(fields)
    ctx.update({"warmup": args.warmup, "reps": args.reps, "batch": args.batch})
    return ctx


def write_doc(path, rows, ctx):
    """Writes {"context": ctx, "results": rows} (indented) and says so."""
    with open(path, "w") as f:
        json.dump({"context": ctx, "results": rows}, f, indent=2)
    print(f"wrote {path}", flush=True)


def gbench_name(run_name):
    """"linear/h4096/qo/fwd/iterations:10/repeats:5/manual_time" -> "linear/h4096/qo/fwd"."""
    return "/".join(q for q in run_name.split("/")
                    if ":" not in q and q not in ("manual_time", "real_time", "process_time"))


_NOT_COUNTERS = ("real_time", "cpu_time", "iterations", "repetitions", "repetition_index", "threads",
                 "family_index", "per_family_instance_index")


def gbench_results(source):
    """{benchmark name: row} from Google Benchmark's JSON (a path or the loaded
    document). A row holds "us" (real time of one iteration, microseconds) and
    the numeric counters of the "median" aggregate, or their mean over the runs
    where there are no aggregates; "error" when a run failed or was skipped.
    The other aggregates (mean, stddev, cv) are ignored."""
    if isinstance(source, dict):
        doc = source
    else:
        with open(source) as f:
            doc = json.load(f)
    medians, runs, errors = {}, {}, {}
    for b in doc.get("benchmarks", []):
        if b.get("run_type") == "aggregate" and b.get("aggregate_name") != "median":
            continue
        name = gbench_name(b.get("run_name") or b.get("name", ""))
        if b.get("error_occurred") or b.get("skipped"):
            errors[name] = b.get("error_message") or b.get("skip_message") or "error"
            continue
        row = {"us": b["real_time"] * TIME_SCALE_US[b.get("time_unit", "ns")]}
        for k, v in b.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in _NOT_COUNTERS:
                row[k] = v
        if b.get("run_type") == "aggregate":
            medians[name] = row
        else:
            runs.setdefault(name, []).append(row)
    out = {}
    for name in dict.fromkeys([*medians, *runs, *errors]):
        if name in medians:
            row = dict(medians[name])
        elif name in runs:
            keys = {k for r in runs[name] for k in r}
            row = {k: statistics.mean(r[k] for r in runs[name] if k in r) for k in keys}
        else:
            row = {}
        if name in errors:
            row["error"] = errors[name]
        out[name] = row
    return out
