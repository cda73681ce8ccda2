#!/usr/bin/env python3
"""PyTorch baseline for bench/bench_linear.cu, and the side-by-side table.

Times the GEMMs of nn.Linear (no bias) on the same Qwen3-like shapes as the
C++ benchmark (T = 8192 tokens, bf16, one GPU):

    fwd          y  = F.linear(x, w)                        [T, N] bf16
    dgrad        dx = dy @ w        (autograd's grad_input)  [T, K] bf16
    wgrad        dW = dy.t() @ x    (autograd's grad_weight) [N, K] bf16
    wgrad_f32    dW32 = addmm(dW32, dy.t(), x, out_dtype=f32) [N, K] fp32, the
                 same fp32-accumulating product as slime's wgrad (only where
                 this torch has out_dtype; otherwise left out)

FLOP per GEMM = 2 T K N. Method, per shape and op: one correctness check
against a float64 matmul of sampled rows, --warmup untimed calls, then --reps
timed batches of --batch calls between two CUDA events on the current stream;
the time of one call is the median over batches of batch time / batch. Prints
one JSON line per row, {"bench", "us", "tflops", ...}, names matching
bench_linear's ("linear/h4096/up/fwd"), and writes them all to --out.

With --slime BENCH_JSON (bench_linear's --benchmark_out, JSON format) it also
prints slime's TFLOP/s beside PyTorch's and the ratio slime / torch (wgrad is
compared with wgrad_f32 where that exists, else with the bf16 wgrad).

    python3 bench/torch_linear.py --out torch_linear.json --slime bench_linear.json

Standard library and torch only. TF32 stays off (bf16 GEMMs do not use it).
"""

import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_util  # noqa: E402  (bench/, beside this script)

TOKENS = 8192
# (model, projection, in_features K, out_features N), as in bench_linear.cu.
SHAPES = [
    ("h4096", "qo", 4096, 4096),
    ("h4096", "kv", 4096, 1024),
    ("h4096", "up", 4096, 12288),
    ("h4096", "down", 12288, 4096),
    ("h2048", "qo", 2048, 2048),
    ("h2048", "kv", 2048, 1024),
    ("h2048", "up", 2048, 6144),
    ("h2048", "down", 6144, 2048),
]
OPS = ("fwd", "dgrad", "wgrad", "wgrad_f32")


def has_out_dtype(device):
    try:
        a = torch.ones(8, 8, dtype=torch.bfloat16, device=device)
        c = torch.zeros(8, 8, dtype=torch.float32, device=device)
        return torch.addmm(c, a, a, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError):
        return False


def make_run(op, x, w, dy, dw32):
    if op == "fwd":
        return lambda: F.linear(x, w)
    if op == "dgrad":
        return lambda: torch.mm(dy, w)
    if op == "wgrad":
        return lambda: torch.mm(dy.t(), x)
    if op == "wgrad_f32":
        return lambda: torch.addmm(dw32, dy.t(), x, out_dtype=torch.float32)
    raise ValueError(op)


def check(op, out, x, w, dy, dw32):
    """Compares 64 sampled rows of `out` with a float64 reference; '' or what went wrong."""
    g = torch.Generator().manual_seed(7)
    rows = torch.randint(0, out.shape[0], (64,), generator=g).to(out.device)
    xd, wd, dyd = x.double(), w.double(), dy.double()
    if op == "fwd":
        want = xd[rows] @ wd.t()
    elif op == "dgrad":
        want = dyd[rows] @ wd
    else:
        want = dyd.t()[rows] @ xd
        if op == "wgrad_f32":
            want = want + dw32.double()[rows]
    got = out[rows].double()
    err = ((got - want).norm() / want.norm()).item()
    tol = 5e-3 if out.dtype == torch.bfloat16 else 1e-5
    return "" if err <= tol else f"{op}: relative error {err:.3g} > {tol}"


def main():
    p = bench_util.parser(__doc__, out="torch_linear.json", warmup=3, reps=20, batch=5)
    p.add_argument("--slime", help="bench_linear JSON to compare with")
    args = p.parse_args()

    device = bench_util.cuda_device()
    torch.backends.cuda.matmul.allow_tf32 = False
    ops = [o for o in OPS if o != "wgrad_f32" or has_out_dtype(device)]

    rows, failed = [], False
    for model, proj, K, N in SHAPES:
        g = torch.Generator(device=device).manual_seed(1)
        x = torch.randn(TOKENS, K, device=device, generator=g).to(torch.bfloat16)
        w = torch.randn(N, K, device=device, generator=g).to(torch.bfloat16)
        dy = torch.randn(TOKENS, N, device=device, generator=g).to(torch.bfloat16)
        dw32 = torch.zeros(N, K, device=device, dtype=torch.float32)
        flop = 2.0 * TOKENS * K * N
        for op in ops:
            run = make_run(op, x, w, dy, dw32)
            error = check(op, run(), x, w, dy, dw32)
            us = bench_util.time_us(run, args.warmup, args.reps, args.batch)
            row = {
                "bench": f"linear/{model}/{proj}/{op}",
                "us": us,
                "tflops": bench_util.tflops(flop, us),
                "tokens": TOKENS,
                "in": K,
                "out": N,
                "correct": not error,
            }
            if error:
                row["error"] = error
                failed = True
            rows.append(row)
            print(json.dumps(row), flush=True)
        del x, w, dy, dw32
        torch.cuda.empty_cache()

    bench_util.write_doc(args.out, rows, bench_util.context(args, device))

    if args.slime:
        ours = {n: r["TFLOPs"] for n, r in bench_util.gbench_results(args.slime).items() if "TFLOPs" in r}
        torch_tf = {r["bench"]: r["tflops"] for r in rows}
        print(f"{'benchmark':<28} {'slime TFLOP/s':>14} {'torch TFLOP/s':>14} {'ratio':>7}  (torch op)")
        for model, proj, _, _ in SHAPES:
            for op in ("fwd", "dgrad", "wgrad"):
                name = f"linear/{model}/{proj}/{op}"
                ref = f"{name}_f32" if op == "wgrad" and f"{name}_f32" in torch_tf else name
                s, t = ours.get(name), torch_tf.get(ref)
                ratio = f"{s / t:7.3f}" if s and t else "      -"
                s_txt = f"{s:14.1f}" if s else f"{'-':>14}"
                t_txt = f"{t:14.1f}" if t else f"{'-':>14}"
                print(f"{name:<28} {s_txt} {t_txt} {ratio}  ({ref.rsplit('/', 1)[1]})", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
