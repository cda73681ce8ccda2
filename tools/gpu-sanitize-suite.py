#!/usr/bin/env python3
"""compute-sanitizer over every test case of ctest labels (default: gpu).

Run on the GPU machine after tools/gpu-test.sh has built build/gpu:

    tools/gpu-sanitize-suite.py --tool memcheck [--label '^gpu$'] [--jobs 4]
                                [--timeout 300] [--budget 540] [--regex R]

Each ctest test (one Catch2 test case) runs as ctest would run it, with its
command prefixed by `compute-sanitizer --tool T --error-exitcode 9`, several at
a time. A test passes when it exits 0 or skips (Catch2's exit 4, as ctest's
SKIP_RETURN_CODE), and fails on any other exit, a sanitizer report or its
timeout. Tests left when the overall budget runs out are reported as "not run"
(and fail the script), never silently dropped. Logs go to
$OUT/sanitize-suite-<tool>/<test>.log (only the failures' logs are kept unless
--keep-clean-logs); the last lines printed are each failure's report (the
sanitizer's error lines, the test's failed assertions) and a summary.
"""
import argparse
import concurrent.futures as futures
import json
import os
import re
import shutil
import subprocess
import sys
import time


def ctest_tests(build, label, regex):
    cmd = ["ctest", "--test-dir", build, "-N", "--show-only=json-v1", "-L", label]
    if regex:
        cmd += ["-R", regex]
    info = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    tests = []
    for t in info.get("tests", []):
        if "command" not in t:
            continue
        props = {p["name"]: p["value"] for p in t.get("properties", [])}
        if props.get("DISABLED"):
            continue
        env = dict(os.environ)
        for kv in props.get("ENVIRONMENT", []):
            k, _, v = kv.partition("=")
            env[k] = v
        tests.append({"name": t["name"], "command": t["command"],
                      "cwd": props.get("WORKING_DIRECTORY"), "env": env})
    return tests


def log_path(out_dir, name):
    return os.path.join(out_dir, re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:150] + ".log")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.environ.get("BUILD", "build/gpu"))
    ap.add_argument("--tool", default="memcheck", choices=["memcheck", "racecheck", "synccheck", "initcheck"])
    ap.add_argument("--label", default="^gpu$")
    ap.add_argument("--regex", default="")
    ap.add_argument("--kernels", default="",
                    help="only check kernels whose name contains this (compute-sanitizer --kernel-name kns=...), "
                         "e.g. 'slime' for the project's own kernels (namespace slime) and not cuBLAS's")
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--timeout", type=int, default=300, help="seconds per test")
    ap.add_argument("--budget", type=int, default=540, help="seconds for the whole run")
    # NCCL's communicator setup probes its kernels with cudaFuncGetAttributes and
    # gets cudaErrorNoKernelImageForDevice for the architectures it was not built
    # for (it expects and handles that); memcheck reports each probe as an API
    # error. `--api-errors no` leaves those out and keeps every memory error;
    # slime's own CUDA calls are all checked (SLIME_CUDA_CHECK throws), so an API
    # error of slime's fails the test anyway.
    ap.add_argument("--api-errors", default="all", choices=["all", "explicit", "no"])
    ap.add_argument("--keep-clean-logs", action="store_true",
                    help="keep the logs of clean tests too (default: only failures' logs are kept)")
    ap.add_argument("--report-lines", type=int, default=8,
                    help="lines of each failure's sanitizer report (and test failure) printed at the end")
    args = ap.parse_args()

    sanitizer = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    out_dir = os.path.join(os.environ.get("OUT", os.path.join(args.build, "out")), f"sanitize-suite-{args.tool}")
    os.makedirs(out_dir, exist_ok=True)
    tests = ctest_tests(args.build, args.label, args.regex)
    if not tests:
        print(f"gpu-sanitize-suite: no tests match label {args.label!r} regex {args.regex!r}", file=sys.stderr)
        return 2
    start = time.monotonic()

    def run(test):
        left = args.budget - (time.monotonic() - start)
        if left < 10:
            return test["name"], "NOT RUN (out of time)", 0.0, ""
        limit = min(args.timeout, left)
        log = log_path(out_dir, test["name"])
        cmd = [sanitizer, "--tool", args.tool, "--error-exitcode", "9"]
        if args.kernels:
            cmd += ["--kernel-name", "kns=" + args.kernels]
        if args.tool == "memcheck":
            cmd += ["--leak-check", "no", "--report-api-errors", args.api_errors]
        cmd += test["command"]
        t0 = time.monotonic()
        with open(log, "w") as f:
            try:
                rc = subprocess.run(cmd, cwd=test["cwd"], env=test["env"], stdout=f, stderr=subprocess.STDOUT,
                                    timeout=limit).returncode
            except subprocess.TimeoutExpired:
                rc = None
        took = time.monotonic() - t0
        with open(log, errors="replace") as f:
            text = f.read()
        summary = next((line.strip() for line in text.splitlines() if "SUMMARY:" in line), "no summary")
        if rc is None:
            result = f"FAILED (timed out after {limit:.0f}s)"
        elif rc == 0:
            result = "ok"
        elif rc == 4:
            result = "skipped"
        else:
            result = f"FAILED (exit {rc})"
        return test["name"], result, took, summary

    results = []
    failed_logs = []
    with futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for name, result, took, summary in pool.map(run, tests):
            print(f"{result:<28} {took:6.1f}s  {name}  [{summary}]", flush=True)
            results.append(result)
            if result not in ("ok", "skipped"):
                failed_logs.append((name, log_path(out_dir, name)))
            elif not args.keep_clean_logs:
                # Only the logs that show something are kept: the GPU machine
                # returns a limited number of files from $OUT.
                try:
                    os.remove(log_path(out_dir, name))
                except OSError:
                    pass
    # What each failure reported, so the summary names the kernel and the
    # source line even when the logs cannot be fetched.
    for name, log in failed_logs:
        try:
            with open(log, errors="replace") as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        report = [l.rstrip() for l in lines if l.startswith("=========") and
                  re.search(r"Race reported|Error|error|at 0x|in .*:\d+|FAILED|Saved host backtrace", l)]
        test_fail = [l.rstrip() for l in lines if re.search(r"FAILED:|REQUIRE|CHECK\(|with expansion|due to unexpected exception", l)]
        print(f"--- {name}: {log}")
        for l in (report[:args.report_lines] + test_fail[:args.report_lines]):
            print("    " + l[:300])
    ok = sum(r == "ok" for r in results)
    skipped = sum(r == "skipped" for r in results)
    bad = len(results) - ok - skipped
    print(f"gpu-sanitize-suite {args.tool}: {len(results)} tests, {ok} clean, {skipped} skipped, {bad} failed "
          f"or not run, {time.monotonic() - start:.0f}s")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
