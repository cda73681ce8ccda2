#!/usr/bin/env python3
"""PyTorch baseline for bench/bench_grouped_gemm.cu: torch._grouped_mm.

Times the three grouped GEMMs of a MoE expert projection on the same problems
as the C++ benchmark (bf16 inputs, one GPU), offs = the cumulative group ends
(int32, on the device), group sizes uniform or skewed by the same formula:

    fwd    y  = _grouped_mm(x, w.transpose(-2, -1), offs)   [rows, Nout] bf16
    dgrad  dx = _grouped_mm(dy, w, offs)                     [rows, K] bf16
    wgrad  dw = _grouped_mm(dy.t(), x, offs, out_dtype=f32)  [E, Nout, K]: the
           2-D x 2-D form with offs along the summed dimension (what autograd
           of _grouped_mm runs); fp32 out where this torch accepts out_dtype
           f32, else bf16 (the row's "out" says which). torch writes dw, slime
           adds into an fp32 dw (reads it too: 4 more bytes per element).

Where torch has no _grouped_mm (before 2.8), every op falls back to a Python
loop of per-group matmuls with host-side sizes (the row's "method": "loop").

FLOP per op = 2 · rows · K · Nout. Method, per problem and op: one correctness
check of 64 sampled outputs against a float64 product, --warmup untimed calls,
then --reps timed batches of --batch calls between two CUDA events on the
current stream; the time of one call is the median over batches of batch time
/ batch. Prints one JSON line per row, {"bench", "us", "tflops", ...}, named as
bench_grouped_gemm's rows ("grouped_gemm/q30b/gate_up/uniform/fwd"), and
writes them all to --out.

    python3 bench/torch_grouped_gemm.py --out torch_grouped_gemm.json
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_util  # noqa: E402  (bench/, beside this script)

# (problem, projection, distribution, experts, rows, in K, out Nout), as in bench_grouped_gemm.cu.
SHAPES = [
    ("q30b", "gate_up", "uniform", 128, 262144, 2048, 768),
    ("q30b", "down", "uniform", 128, 262144, 768, 2048),
    ("q30b", "gate_up", "skewed", 128, 262144, 2048, 768),
    ("q30b", "down", "skewed", 128, 262144, 768, 2048),
    ("e64", "gate_up", "uniform", 64, 65536, 2048, 768),
    ("e64", "gate_up", "skewed", 64, 65536, 2048, 768),
]
OPS = ("fwd", "dgrad", "wgrad")


def group_sizes(dist, experts, rows):
    if dist == "skewed":
        w = [0 if e % 16 == 15 else 8 if e % 8 == 0 else 1 + e % 5 for e in range(experts)]
    else:
        w = [1] * experts
    total = sum(w)
    sizes = [rows * v // total for v in w]
    sizes[0] += rows - sum(sizes)
    return sizes


def has_grouped_mm():
    return hasattr(torch, "_grouped_mm")


def wgrad_out_dtype(device):
    """torch.float32 when _grouped_mm's 2-D x 2-D form accepts out_dtype=f32, else bf16."""
    try:
        a = torch.ones(16, 32, dtype=torch.bfloat16, device=device)
        b = torch.ones(32, 16, dtype=torch.bfloat16, device=device)
        offs = torch.tensor([16, 32], dtype=torch.int32, device=device)
        out = torch._grouped_mm(a, b, offs=offs, out_dtype=torch.float32)
        return torch.float32 if out.dtype == torch.float32 else torch.bfloat16
    except (TypeError, RuntimeError):
        return torch.bfloat16


def make_run(op, x, w, dy, offs, sizes, method, wgrad_dtype):
    if method == "grouped_mm":
        if op == "fwd":
            wt = w.transpose(-2, -1)
            return lambda: torch._grouped_mm(x, wt, offs=offs)
        if op == "dgrad":
            return lambda: torch._grouped_mm(dy, w, offs=offs)
        dyt = dy.t()
        if wgrad_dtype == torch.float32:
            return lambda: torch._grouped_mm(dyt, x, offs=offs, out_dtype=torch.float32)
        return lambda: torch._grouped_mm(dyt, x, offs=offs)
    # Per-group loop with host sizes.
    bounds = []
    r = 0
    for n in sizes:
        bounds.append((r, r + n))
        r += n
    E, No, K = w.shape

    def loop():
        if op == "fwd":
            out = torch.empty(x.shape[0], No, dtype=x.dtype, device=x.device)
            for e, (a, b) in enumerate(bounds):
                torch.mm(x[a:b], w[e].t(), out=out[a:b])
        elif op == "dgrad":
            out = torch.empty(x.shape[0], K, dtype=x.dtype, device=x.device)
            for e, (a, b) in enumerate(bounds):
                torch.mm(dy[a:b], w[e], out=out[a:b])
        else:
            out = torch.zeros(E, No, K, dtype=x.dtype, device=x.device)
            for e, (a, b) in enumerate(bounds):
                if b > a:
                    torch.mm(dy[a:b].t(), x[a:b], out=out[e])
        return out

    return loop


def check(op, out, x, w, dy, sizes):
    """Compares 64 sampled outputs with a float64 reference; '' or what went wrong."""
    g = torch.Generator().manual_seed(7)
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + n)
    errs, refs = [], []
    for _ in range(64):
        if op == "wgrad":
            e = int(torch.randint(0, len(sizes), (1,), generator=g))
            while sizes[e] == 0:
                e = (e + 1) % len(sizes)
            n = int(torch.randint(0, w.shape[1], (1,), generator=g))
            k = int(torch.randint(0, w.shape[2], (1,), generator=g))
            a, b = starts[e], starts[e + 1]
            want = (dy[a:b, n].double() * x[a:b, k].double()).sum()
            got = out[e, n, k].double()
        else:
            r = int(torch.randint(0, x.shape[0], (1,), generator=g))
            e = max(i for i in range(len(sizes)) if starts[i] <= r)
            if op == "fwd":
                c = int(torch.randint(0, w.shape[1], (1,), generator=g))
                want = (x[r].double() * w[e, c].double()).sum()
                got = out[r, c].double()
            else:
                c = int(torch.randint(0, w.shape[2], (1,), generator=g))
                want = (dy[r].double() * w[e, :, c].double()).sum()
                got = out[r, c].double()
        errs.append(float(got - want) ** 2)
        refs.append(float(want) ** 2)
    err = (sum(errs) / max(sum(refs), 1e-30)) ** 0.5
    tol = 5e-3 if out.dtype == torch.bfloat16 else 1e-5
    return "" if err <= tol else f"{op}: relative error {err:.3g} > {tol}"


def main():
    p = bench_util.parser(__doc__, out="torch_grouped_gemm.json", warmup=2, reps=10, batch=3)
    args = p.parse_args()

    device = bench_util.cuda_device()
    method = "grouped_mm" if has_grouped_mm() else "loop"
    wgrad_dtype = wgrad_out_dtype(device) if method == "grouped_mm" else torch.bfloat16

    rows_out, failed = [], False
    for problem, proj, dist, E, rows, K, No in SHAPES:
        sizes = group_sizes(dist, E, rows)
        offs = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
        g = torch.Generator(device=device).manual_seed(1)
        x = torch.randn(rows, K, device=device, generator=g).to(torch.bfloat16)
        w = torch.randn(E, No, K, device=device, generator=g).to(torch.bfloat16)
        dy = torch.randn(rows, No, device=device, generator=g).to(torch.bfloat16)
        flop = 2.0 * rows * K * No
        for op in OPS:
            name = f"grouped_gemm/{problem}/{proj}/{dist}/{op}"
            row = {"bench": name, "experts": E, "rows": rows, "in": K, "out_features": No, "method": method}
            if op == "wgrad":
                row["out"] = "f32" if wgrad_dtype == torch.float32 else "bf16"
            try:
                run = make_run(op, x, w, dy, offs, sizes, method, wgrad_dtype)
                error = check(op, run(), x, w, dy, sizes)
                us = bench_util.time_us(run, args.warmup, args.reps, args.batch)
                row.update({"us": us, "tflops": bench_util.tflops(flop, us), "correct": not error})
                if error:
                    row["error"] = error
                    failed = True
            except (RuntimeError, TypeError) as e:
                row["error"] = str(e).splitlines()[0] if str(e) else type(e).__name__
                failed = True
            rows_out.append(row)
            print(json.dumps(row), flush=True)
        del x, w, dy, offs
        torch.cuda.empty_cache()

    bench_util.write_doc(args.out, rows_out, bench_util.context(args, device, method=method))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
